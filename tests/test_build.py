"""The op builder in fresh processes: no Dynamo and no CUDA context at import, a stale lock left by a
killed build (both kinds of torch lock), a missing ninja named in the error, one build folder per
environment (announced when it builds) and none per ninja on PATH."""
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest


def _python(code, env=None, timeout=300):
    full_env = dict(os.environ, DS_ACCELERATOR="cpu", **(env or {}))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=full_env, timeout=timeout)


def _build_dir():
    r = _python("""
        import deepspeed_z3ext
        from deepspeed_z3ext._ops import _builder_class  # the builder the import used
        print(_builder_class()().build_dir())""")
    assert r.returncode == 0, r.stderr[-2000:]
    return Path(r.stdout.strip().splitlines()[-1])


def test_import_loads_no_dynamo_and_creates_no_cuda_context():
    """`import deepspeed_z3ext` (ops cached) in a fresh process adds neither `torch._dynamo` to sys.modules
    (about a second of import; hooks.py resolves it at the first hook registration) nor a CUDA context.
    `import torch, deepspeed` comes first and must not load Dynamo itself (DeepSpeed 0.19.8 does not):
    the check is then exactly that z3ext's own modules do not add it. A finder records the stack of the
    first import of `torch._dynamo`, so a failure names z3ext's line that imported it."""
    _build_dir()  # makes sure the cache is built
    r = _python("""
        import sys, traceback, torch, deepspeed
        print("DEEPSPEED_LOADS_DYNAMO", "torch._dynamo" in sys.modules)
        first = []
        class Recorder:
            @staticmethod
            def find_spec(name, path=None, target=None):
                if name == "torch._dynamo" and not first:
                    first.append("".join(traceback.format_stack()))
                return None
        sys.meta_path.insert(0, Recorder)
        import deepspeed_z3ext
        print("Z3EXT_LOADS_DYNAMO", "torch._dynamo" in sys.modules)
        print("CUDA_CONTEXT", torch.cuda.is_initialized())
        print("".join(first), file=sys.stderr)""")
    assert r.returncode == 0, r.stderr[-2000:]
    keys = ("DEEPSPEED_LOADS_DYNAMO", "Z3EXT_LOADS_DYNAMO", "CUDA_CONTEXT")
    out = dict(line.split(" ", 1) for line in r.stdout.splitlines() if line.split(" ")[0] in keys)
    assert out["DEEPSPEED_LOADS_DYNAMO"] == "False", "deepspeed imports torch._dynamo: this test checks nothing"
    assert out["Z3EXT_LOADS_DYNAMO"] == "False", r.stderr[-3000:]
    assert out["CUDA_CONTEXT"] == "False"


ROOT = Path(__file__).resolve().parent.parent


def _lock_outlives_its_holder():
    """Which lock the installed torch's JIT build takes ([Note: stale build lock])."""
    r = _python(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        from op_builder.z3ext import torch_lock_outlives_its_holder
        print(torch_lock_outlives_its_holder())""")
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.split()[-1] == "True"


def _mentions_a_lock(r):
    out = r.stderr + r.stdout
    return "stale build lock" in out or "lock file" in out  # z3ext's warning, FileBaton's wait warning


def test_torch_lock_kind_follows_the_torch_version():
    """torch <= 2.13 waits while `lock` exists (FileBaton); torch >= 2.14 flocks it (filelock)."""
    import types
    import torch
    from packaging.version import Version
    baton = Version(torch.__version__).release < (2, 14)
    assert _lock_outlives_its_holder() == baton, torch.__version__
    import sys
    sys.path.insert(0, str(ROOT))
    from op_builder.z3ext import torch_lock_outlives_its_holder
    assert torch_lock_outlives_its_holder(types.SimpleNamespace(FileBaton=object)) is True
    assert torch_lock_outlives_its_holder(types.SimpleNamespace(FileLock=object)) is False


def test_a_lock_left_by_a_killed_build_never_blocks_a_load():
    """The `lock` a killed build leaves: removed with a warning where torch would wait on it forever,
    left alone and unmentioned where torch takes a kernel lock on it (which its holder's death freed)."""
    lock = _build_dir() / "lock"
    lock.write_text("")  # what a killed build leaves behind
    t = time.time()
    r = _python("import deepspeed_z3ext", timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert time.time() - t < 120
    if _lock_outlives_its_holder():
        assert not lock.exists()
        assert "stale build lock" in r.stderr + r.stdout
    else:
        assert not _mentions_a_lock(r)


def test_a_clean_load_says_nothing_about_locks():
    """After a normal build (torch >= 2.14 leaves its unlocked `lock` file behind) a load warns of nothing."""
    _build_dir()
    r = _python("import deepspeed_z3ext")
    assert r.returncode == 0, r.stderr[-2000:]
    assert not _mentions_a_lock(r), r.stderr[-2000:]


def test_the_clean_up_where_torch_waits_on_the_lock():
    """The FileBaton branch under any torch: forced on, the builder removes a leftover `lock` (with the
    warning) before the build, which then succeeds (on torch >= 2.14 its filelock recreates the file)."""
    lock = _build_dir() / "lock"
    lock.write_text("")
    r = _python(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        import op_builder.z3ext as z
        z.torch_lock_outlives_its_holder = lambda cpp_extension=None: True
        print("LOADED", z.Z3extOpBuilder().load().__name__)""", timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "LOADED" in r.stdout
    assert "removing stale build lock" in r.stderr + r.stdout


def test_missing_ninja_says_what_to_install(tmp_path):
    r = _python("import deepspeed_z3ext", env={"PATH": str(tmp_path), "CXX": "/usr/bin/g++",
                                                "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}, timeout=120)
    assert r.returncode != 0
    assert "pip install ninja" in r.stderr


def test_two_environments_never_rebuild_each_others_ops(tmp_path):
    """Two venvs (two sys.prefix) over one torch, one TORCH_EXTENSIONS_DIR: each builds once into its own
    folder ([Note: build cache key]), saying so on stderr as it starts and ends; switching between them
    twice rebuilds nothing and says nothing.

    Both see the packages of the interpreter running the tests through a .pth, not through
    `--system-site-packages`: a venv made from a venv's python is based on the base interpreter, whose
    site-packages need not hold torch (`/path/venv/bin/python -m pytest` without activating the venv)."""
    import site
    import torch
    venvs = []
    for name in ("env_a", "env_b"):
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / name)], check=True, timeout=120)
        python = tmp_path / name / "bin" / "python"
        child_site = subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"],
                                    check=True, capture_output=True, text=True, timeout=120).stdout.strip()
        Path(child_site, "_tests_parent_env.pth").write_text(
            "".join(f"import site; site.addsitedir({d!r})\n" for d in site.getsitepackages()))
        venvs.append(python)
    env = dict(os.environ, DS_ACCELERATOR="cpu", TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"),
               PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH", "")]))
    probe = textwrap.dedent("""
        import sys
        from deepspeed_z3ext._ops import ops
        import torch
        print("PREFIX", sys.prefix)
        print("TORCH", torch.__file__)
        print("SO", ops().__file__)""")

    def load(python, builds):
        r = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, env=env, timeout=900)
        assert r.returncode == 0, r.stderr[-3000:]
        lines = dict(line.split(" ", 1) for line in r.stdout.splitlines() if line[:3] in ("PRE", "TOR", "SO "))
        assert Path(lines["TORCH"]).resolve() == Path(torch.__file__).resolve()  # the tests interpreter's torch
        so = Path(lines["SO"])
        said = [line for line in r.stderr.splitlines() if line.startswith("z3ext: buil")]
        if builds:  # one line as the build starts (naming the folder), one as it ends (with its seconds)
            assert len(said) == 2, r.stderr[-3000:]
            assert re.fullmatch(rf"z3ext: building the \w+ ops in {re.escape(str(so.parent))} \(first use: 1-3 "
                                r"minutes, cached afterwards\)", said[0]), said
            assert re.fullmatch(rf"z3ext: built the \w+ ops in \d+ s \({re.escape(str(so))}\)", said[1]), said
        else:
            assert said == [], said
        return lines["PREFIX"], so, so.stat().st_mtime_ns, (so.parent / ".ninja_log").read_text()

    first = [load(p, builds=True) for p in venvs]
    assert first[0][0] != first[1][0]  # two environments really
    assert first[0][1].parent != first[1][1].parent  # each its own build folder
    assert all(f[1].parent.parent == tmp_path / "ext" for f in first)
    for _ in range(2):  # switch back and forth twice
        again = [load(p, builds=False) for p in venvs]
        assert [a[1:] for a in again] == [f[1:] for f in first], "a switch rebuilt the ops"


def test_another_ninja_on_path_rebuilds_nothing(tmp_path):
    """ninja 1.11 and 1.13 discard each other's build log, so a PATH switch between a venv's ninja and the
    system's used to rebuild the ops ([Note: one ninja per build folder]). Loads of the built folder with
    PATH as the tests have it, with a ninja 1.11.1 first on PATH, and again as before use the same .so
    unrebuilt (path, mtime, build log) and never run that other ninja to build (it records and fails)."""
    build = _build_dir()
    other = tmp_path / "bin"
    other.mkdir()
    ran = tmp_path / "other-ninja-ran"
    (other / "ninja").write_text(f'#!/bin/sh\nif [ "$1" = --version ]; then echo 1.11.1; exit 0; fi\n'
                                 f'echo "$@" >> {ran}\nexit 1\n')
    (other / "ninja").chmod(0o755)

    def load(path):
        r = _python("""
            from deepspeed_z3ext._ops import ops
            print("SO", ops().__file__)""", env={"PATH": path})
        assert r.returncode == 0, r.stderr[-3000:]
        so = Path(r.stdout.split("SO ", 1)[1].strip())
        assert "z3ext: build" not in r.stderr, r.stderr[-2000:]  # neither announced nor done
        return so, so.stat().st_mtime_ns, (so.parent / ".ninja_log").read_text()

    path = os.environ["PATH"]
    with_other = os.pathsep.join([str(other), path])
    r = subprocess.run(["sh", "-c", "ninja --version"], env=dict(os.environ, PATH=with_other), capture_output=True,
                       text=True)
    assert r.stdout.strip() == "1.11.1"  # PATH's ninja really is the other one
    first = load(path)
    assert first[0].parent == build
    assert load(with_other) == first, "a PATH with another ninja rebuilt the ops"
    assert load(path) == first
    assert not ran.exists(), ran.read_text()


def test_every_spelling_of_one_interpreter_shares_one_build(tmp_path):
    """A venv's `python`, `python3` and `python3.X` are links to one interpreter, and a launcher runs its
    shebang's spelling (torchrun's is `python3`): each chooses the same build name and folder, so the ops
    are built once, not once per spelling ([Note: build cache key]). The key is computed without building
    (the builder's name and folder); TORCH_EXTENSIONS_DIR is a fresh one, so nothing is built or touched."""
    import site
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    major_minor = f"python{sys.version_info.major}.{sys.version_info.minor}"
    spellings = [venv / "bin" / name for name in ("python", "python3", major_minor)]
    assert all(p.is_symlink() or p.exists() for p in spellings), sorted(os.listdir(venv / "bin"))
    child_site = subprocess.run([str(spellings[0]), "-c", "import site; print(site.getsitepackages()[0])"],
                                check=True, capture_output=True, text=True, timeout=120).stdout.strip()
    Path(child_site, "_tests_parent_env.pth").write_text(
        "".join(f"import site; site.addsitedir({d!r})\n" for d in site.getsitepackages()))
    probe = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        from op_builder.z3ext import Z3extOpBuilder
        b = Z3extOpBuilder()
        print("EXE", sys.executable)
        print("KEY", b.name, b.build_dir())""")
    launcher = tmp_path / "launcher"  # a console script as pip writes it: the venv's python3 in its shebang
    launcher.write_text(f"#!{venv / 'bin' / 'python3'}\n{probe}")
    launcher.chmod(0o755)
    env = dict(os.environ, DS_ACCELERATOR="cpu", TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    seen = []
    for command in [[str(p), "-c", probe] for p in spellings] + [[str(launcher)]]:
        r = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        out = dict(line.split(" ", 1) for line in r.stdout.splitlines() if line[:4] in ("EXE ", "KEY "))
        seen.append((command[0], out["EXE"], out["KEY"]))
    assert len({exe for _, exe, _ in seen[:3]}) == 3, seen  # three spellings of sys.executable really
    assert seen[3][1] == str(spellings[1]), seen  # the launcher's: its shebang's
    assert len({key for _, _, key in seen}) == 1, seen
    assert not list((tmp_path / "ext").glob("*/*.so"))  # nothing was built


def _report(tmp_path, *args, env=None):
    """`python -m deepspeed_z3ext [args]` in a fresh process whose TORCH_EXTENSIONS_DIR is empty: (result, its
    rows as {key: value})."""
    full_env = dict(os.environ, DS_ACCELERATOR="cpu", TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"),
                    PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **(env or {}))
    r = subprocess.run([sys.executable, "-m", "deepspeed_z3ext", *args], capture_output=True, text=True,
                       env=full_env, timeout=300, cwd=tmp_path)
    rows = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in r.stdout.splitlines() if re.search(r"\S\s{2,}\S", line))
    return r, rows


def _nothing_built(tmp_path):
    """No build file in the fresh TORCH_EXTENSIONS_DIR (--build leaves its lock file and pinned ninja)."""
    return not [p for p in (tmp_path / "ext").rglob("*") if p.name == "build.ninja" or p.suffix in (".so", ".o")]


def test_the_report_builds_nothing_and_says_where_a_build_would_go(tmp_path):
    """`python -m deepspeed_z3ext` imports the package without loading the ops ([Note: lazy claim vocabulary]):
    with no build in TORCH_EXTENSIONS_DIR it reports "not built", the folder a build would use and what a
    build does, names the compiler, and leaves that folder without a file."""
    r, rows = _report(tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert rows["ops"].startswith(("cpu flavour, not built.", "cuda flavour, not built.")), rows
    assert "compiles csrc/" in rows["ops"] and "--build" in rows["ops"], rows["ops"]
    assert Path(rows["ops folder"]).parent == tmp_path / "ext", rows
    assert not rows["compiler"].startswith("PROBLEM"), rows["compiler"]
    assert "z3ext: build" not in r.stderr, r.stderr[-2000:]
    assert _nothing_built(tmp_path)


@pytest.mark.parametrize("broken", ["cxx-false", "no-compiler-on-path"])
@pytest.mark.parametrize("build", [False, True], ids=["report", "build"])
def test_a_broken_compiler_gets_the_report_and_names_the_problem(tmp_path, broken, build):
    """With a compiler that does not run (`CXX=/bin/false`) or none on PATH, the report is printed whole and
    its compiler line names the problem; with --build its last line is the build's error naming the
    compiler too (exit status 1). Never a traceback, never a file in the build folder."""
    if broken == "cxx-false":
        env, named = {"CXX": "/bin/false"}, "the C++ compiler '/bin/false' (/bin/false) does not run"
    else:
        (tmp_path / "bin").mkdir()
        env, named = {"PATH": str(tmp_path / "bin")}, "no C++ compiler 'c++' on PATH"
    r, rows = _report(tmp_path, *(["--build"] if build else []), env=env)
    assert "Traceback" not in r.stdout + r.stderr, r.stderr[-3000:]
    assert {"deepspeed_z3ext", "python", "torch", "deepspeed", "compiler", "ops", "ops folder",
            "activation"} <= set(rows), r.stdout
    assert rows["compiler"].startswith("PROBLEM: " + named), rows["compiler"]
    assert "not built." in rows["ops"], rows["ops"]
    if build:
        assert r.returncode == 1, r.stdout + r.stderr[-2000:]
        assert r.stdout.splitlines()[-1].startswith("build"), r.stdout
        assert rows["build"].startswith("FAILED: OpBuildError: z3ext:") and named in rows["build"], rows["build"]
    else:
        assert r.returncode == 0, r.stderr[-3000:]
        assert "build" not in rows
    assert _nothing_built(tmp_path)
