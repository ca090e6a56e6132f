"""deepspeed_z3ext: `pip install -e .` (ops JIT-built on first import) or
`Z3EXT_BUILD_OPS=1 pip install --no-build-isolation .` (ops built now)."""
import os
import sys

from setuptools import setup

ext_modules, cmdclass = [], {}
if os.environ.get("Z3EXT_BUILD_OPS", "0") == "1":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from op_builder.z3ext import Z3extOpBuilder
    from torch.utils.cpp_extension import BuildExtension
    ext_modules = [Z3extOpBuilder().builder()]
    cmdclass = {"build_ext": BuildExtension}

setup(
    name="deepspeed_z3ext",
    version="0.1.0",
    description="DeepSpeed extension that owns ZeRO-3 parameter gather and release",
    packages=["deepspeed_z3ext", "deepspeed_z3ext.op_builder"],
    package_dir={"deepspeed_z3ext.op_builder": "op_builder"},
    package_data={"deepspeed_z3ext": ["../csrc/*.h", "../csrc/*.cpp"]},
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.11",
        "deepspeed>=0.19.8,<0.20",
        "ninja",
        "pybind11",
        "nvidia-ml-py",
        "hjson",
    ],
    extras_require={"test": ["pytest>=8"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
