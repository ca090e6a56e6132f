"""deepspeed_z3ext: `pip install -e .` (ops JIT-built on first use) or
`Z3EXT_BUILD_OPS=1 pip install --no-build-isolation .` (ops built now).

Both install `deepspeed_z3ext.pth` into site-packages: at interpreter start it runs
`import deepspeed_z3ext_activate`, so that a DeepSpeed config with `"z3ext": true` attaches z3ext in
any process ([Note: activation] in deepspeed_z3ext_activate.py). setuptools has no option for a file at
the top of site-packages: a regular wheel gets it through build_py (build_lib is the wheel's root), an
editable wheel (which holds no build_lib files) has it appended.
"""
import os
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "deepspeed_z3ext.pth"
HERE = os.path.dirname(os.path.abspath(__file__))


class build_py_with_pth(build_py):
    """A regular (not editable) build also gets the ops' sources where the installed op_builder looks
    for them (`deepspeed_z3ext/csrc`, beside `deepspeed_z3ext/op_builder`)."""

    def run(self):
        super().run()
        if not getattr(self, "editable_mode", False):
            self.copy_file(os.path.join(HERE, PTH), os.path.join(self.build_lib, PTH), preserve_mode=0)
            csrc = os.path.join(self.build_lib, "deepspeed_z3ext", "csrc")
            self.mkpath(csrc)
            for name in sorted(os.listdir(os.path.join(HERE, "csrc"))):
                if name.endswith((".h", ".cpp")):
                    self.copy_file(os.path.join(HERE, "csrc", name), os.path.join(csrc, name), preserve_mode=0)


cmdclass = {"build_py": build_py_with_pth}
try:
    from setuptools.command.editable_wheel import editable_wheel
except ImportError:  # setuptools < 64: `pip install -e .` runs `develop`, which puts no file in site-packages
    editable_wheel = None
if editable_wheel is not None:
    class editable_wheel_with_pth(editable_wheel):
        def _create_wheel_file(self, bdist_wheel):
            wheel_path = super()._create_wheel_file(bdist_wheel)
            _add_to_wheel(str(wheel_path), PTH, open(os.path.join(HERE, PTH), "rb").read())
            return wheel_path

    cmdclass["editable_wheel"] = editable_wheel_with_pth


def _add_to_wheel(wheel_path, name, data):
    """Rewrites the wheel with `name` at its root, listed in its RECORD (sha256, size) as pip expects."""
    import base64
    import hashlib
    import shutil
    import zipfile
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    tmp = wheel_path + ".tmp"
    with zipfile.ZipFile(wheel_path) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            content = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                content = content.rstrip(b"\n") + f"\n{name},sha256={digest},{len(data)}\n".encode()
            dst.writestr(info, content)
        dst.writestr(name, data)
    shutil.move(tmp, wheel_path)


ext_modules = []
if os.environ.get("Z3EXT_BUILD_OPS", "0") == "1":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from op_builder.z3ext import Z3extOpBuilder
    from torch.utils.cpp_extension import BuildExtension
    ext_modules = [Z3extOpBuilder().builder()]
    cmdclass["build_ext"] = BuildExtension

setup(
    name="deepspeed_z3ext",
    version="0.1.0",
    description="DeepSpeed extension that owns ZeRO-3 parameter gather and release",
    packages=["deepspeed_z3ext", "deepspeed_z3ext.op_builder"],
    py_modules=["deepspeed_z3ext_activate"],
    package_dir={"deepspeed_z3ext.op_builder": "op_builder"},
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
