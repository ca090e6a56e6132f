"""Fault injection for tests: `allocator()` builds (once, under TORCH_EXTENSIONS_DIR) and returns the
CPU allocator of fault_allocator.cpp."""
import pathlib
import warnings

_ext = None


def allocator():
    global _ext
    if _ext is None:
        from torch.utils.cpp_extension import load
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _ext = load(name="z3ext_test_fault_allocator", extra_cflags=["-O1"], with_cuda=False,
                        sources=[str(pathlib.Path(__file__).with_name("fault_allocator.cpp"))])
    return _ext
