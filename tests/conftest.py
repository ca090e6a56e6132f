"""The `gpus(n)` marker: `@pytest.mark.gpus(2)` skips a test unless at least n CUDA GPUs are visible
(the reason names how many it needs and how many there are), and marks it `gpu` as well, so
`pytest -m gpu` (run on the device) selects exactly the GPU tests and the default CPU run skips them."""
import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "gpus(n): needs n CUDA GPUs and NCCL; also marks the test `gpu`; skipped "
                            "when fewer GPUs are visible")


def _needed(marker):
    n = marker.args[0] if marker.args else marker.kwargs.get("n")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise pytest.UsageError(f"@pytest.mark.gpus(n) needs a positive int n, got {marker.args} {marker.kwargs}")
    return n


# tryfirst: the `gpu` marker must be on the items before `-m gpu` deselects by marker.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    available = None
    for item in items:
        marker = item.get_closest_marker("gpus")
        if marker is None:
            continue
        n = _needed(marker)
        if item.get_closest_marker("gpu") is None:
            item.add_marker(pytest.mark.gpu)
        if available is None:
            import torch
            from tests.harness import ranks_on_one_gpu
            available = torch.cuda.device_count()
            if available and ranks_on_one_gpu():  # [Note: ranks on one GPU] in tests/harness.py
                available = max(available, ranks_on_one_gpu())
        if available < n:
            item.add_marker(pytest.mark.skip(reason=f"needs {n} CUDA GPU{'s' if n > 1 else ''}, {available} visible "
                                             f"(run on the device: pytest -m gpu)"))
