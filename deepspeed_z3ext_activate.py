"""Activation without an import: `deepspeed_z3ext.pth` (installed with the package) runs
`import deepspeed_z3ext_activate` at interpreter start ([Note: activation]).

[Note: activation] DeepSpeed ignores unknown top-level config keys, so a `"z3ext": true` config in a
program that never imports deepspeed_z3ext (HF Trainer, Accelerate, the `deepspeed` launcher) would
run stock ZeRO-3 without a word. Installed, this module puts a finder first on `sys.meta_path` that
waits for `deepspeed` to be loaded (and removes itself then); once DeepSpeed has loaded, it replaces
`DeepSpeedConfig._do_sanity_check` (every DeepSpeedConfig runs it: `zero.Init`'s and
`deepspeed.initialize`'s) with a check that only reads the config dict (and `_initialize_params` with
the key check, [Note: section key]). A config that does not enable z3ext goes straight to DeepSpeed's
check. One that does, while z3ext is not attached, imports
deepspeed_z3ext there (the ops are built or loaded and the seams of seams.py installed, which then
validate the section as with an explicit import); with `DEEPSPEED_Z3EXT_AUTO=0`, or when the import
fails (a build error), or after `deepspeed_z3ext.uninstall()`, it raises `Z3extActivationError`
naming why instead: a config that enables z3ext never runs stock silently.
Why a module outside the package: importing anything inside `deepspeed_z3ext` runs its `__init__`,
which builds the ops and installs every seam; this file imports nothing but `os` and `sys` at
interpreter start, so neither start nor `import deepspeed` pays for z3ext (README "Activation").
It is the one place besides seams.py that changes DeepSpeed attributes, and only this check, the
key check and the launcher hint below (tests/test_seams.py checks both); `import deepspeed_z3ext` installs them too, so the
checks (and the refusal after `uninstall()`) are the same whether or not the package was installed
with the .pth.

[Note: section key] The section is found by its exact key, so a near miss (`"Z3EXT"`, `"z3_ext"`,
`"zero3_ext"`) would run stock ZeRO-3 silently, and `"z3ext"` under `"zero_optimization"` fails in
DeepSpeed's own parse of that block ("Extra inputs are not permitted") without saying where the key
goes. `DeepSpeedConfig._initialize_params` (which every DeepSpeedConfig runs on its dict before any
of DeepSpeed's parsing, before `_do_sanity_check`) is therefore replaced too, by `check_section_key`
and then DeepSpeed's own: either mistake raises `Z3extConfigError` naming the key found and the right
one, whether z3ext is imported, activated or switched off, and without building the ops first.

[Note: launcher hint] `python script.py` with a z3ext config and no launcher reaches DeepSpeed's
`init_distributed` without RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and LOCAL_RANK, which then looks for an
MPI environment and fails with `No module named 'mpi4py'` (or an MPI error), saying nothing of launchers.
`deepspeed.initialize` is therefore wrapped here (the third and last DeepSpeed attribute this module
replaces, for the same reason as the others: it works without an import): when the call raises from that MPI
discovery, no launcher's variables were set and no process group existed before the call, and the config
enables z3ext, it raises `Z3extLauncherError` naming `torchrun --nproc_per_node=1 <script>`, the original
error chained. Anything else (another error, a launcher, a config without z3ext) goes through unchanged.
"""
import os
import sys

SWITCH = "DEEPSPEED_Z3EXT_AUTO"
SECTION = "z3ext"
_installed_check = None  # the check, once it replaced DeepSpeed's _do_sanity_check
_stock_check = None      # DeepSpeed's _do_sanity_check, called by the check
_stock_initialize = None  # DeepSpeed's _initialize_params, called after the key check
_stock_ds_initialize = None  # deepspeed.initialize, called by the wrapper ([Note: launcher hint])
# What DeepSpeed's init_distributed needs from a launcher; without all of them it looks for MPI.
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")


class Z3extError(Exception):
    """Base of every error z3ext raises on purpose; the message names the key, parameter or file.
    Defined here, not in deepspeed_z3ext/errors.py (which re-exports it), so that the activation error
    below is one too without importing the package."""


class Z3extActivationError(Z3extError, RuntimeError):
    """A config enables z3ext but z3ext cannot attach; the message says why and what to do."""


class Z3extConfigError(Z3extError, ValueError):
    """A `z3ext` config problem; the message names the key. Here, not in errors.py, so that the key check
    ([Note: section key]) raises it without importing the package."""


class Z3extLauncherError(Z3extError, RuntimeError):
    """`deepspeed.initialize` of a z3ext config ran without a launcher and DeepSpeed's MPI discovery failed; the
    message names the launcher command ([Note: launcher hint])."""


def _looks_like_section(key) -> bool:
    """A key that is meant as the section but is not exactly it: other case or separators, `zero3` for
    `z3`, `extension` for `ext`, a `deepspeed`/`ds` prefix, or within a typo of it."""
    if not isinstance(key, str) or key == SECTION:
        return False
    k = "".join(c for c in key.lower() if c.isalnum()).replace("zero3", "z3").replace("extension", "ext")
    for prefix in ("deepspeed", "ds"):
        if k.startswith(prefix) and k != prefix:
            k = k[len(prefix):]
    if k == SECTION:
        return True
    import difflib
    return bool(difflib.get_close_matches(k, [SECTION], n=1, cutoff=0.8))


def check_section_key(param_dict):
    """Raises Z3extConfigError naming each key of the config dict that is meant as the `"z3ext"` section
    but would be ignored: a look-alike at the top level, or the section under `"zero_optimization"`."""
    if not isinstance(param_dict, dict):
        return
    problems = [f'"{key}" is not z3ext\'s key: write "{SECTION}" (exactly, at the top level); DeepSpeed ignores '
                "the key as written" for key in param_dict if _looks_like_section(key)]
    zero = param_dict.get("zero_optimization")
    if isinstance(zero, dict):
        problems += [f'"zero_optimization.{key}": the z3ext section is "{SECTION}" at the top level of the config, '
                     'next to "zero_optimization", not inside it' for key in zero
                     if key == SECTION or _looks_like_section(key)]
    if problems:
        raise Z3extConfigError("invalid z3ext config: " + "; ".join(problems))


def auto_enabled() -> bool:
    """Whether a z3ext config attaches z3ext without an import (the switch, default on)."""
    return os.environ.get(SWITCH, "1").strip().lower() not in ("0", "false", "off", "no")


def enables_z3ext(param_dict) -> bool:
    """Whether a config dict asks for z3ext: anything but an absent section, false or enabled false
    (a malformed section counts, so that z3ext's own validation names what is wrong)."""
    if not isinstance(param_dict, dict) or SECTION not in param_dict:
        return False
    raw = param_dict[SECTION]
    if raw is False or raw is None:
        return False
    if isinstance(raw, dict):
        return raw.get("enabled", False) is not False
    return True


def _attached() -> bool:
    pkg = sys.modules.get("deepspeed_z3ext")
    return pkg is not None and getattr(pkg, "installed", None) is not None and bool(pkg.installed())


def _attach(why_needed: str):
    """Imports deepspeed_z3ext (ops built or loaded, seams installed), or raises naming why not."""
    if not auto_enabled():
        raise Z3extActivationError(
            f'{why_needed}, but {SWITCH}={os.environ.get(SWITCH)!r} turns activation without an import off and '
            'deepspeed_z3ext was not imported: `import deepspeed_z3ext` before deepspeed.initialize (and zero.Init), '
            f'unset {SWITCH}, or remove "{SECTION}" from the config')
    if "deepspeed_z3ext" in sys.modules and getattr(sys.modules["deepspeed_z3ext"], "installed", None) is not None:
        raise Z3extActivationError(
            f"{why_needed}, but deepspeed_z3ext.uninstall() gave DeepSpeed back in this process: call "
            f'deepspeed_z3ext.install() first, or remove "{SECTION}" from the config')
    try:
        import deepspeed_z3ext  # noqa: F401  (installs the seams, which wrap this check)
    except Exception as e:
        raise Z3extActivationError(f"{why_needed}, but deepspeed_z3ext could not be imported: "
                                   f"{type(e).__name__}: {e}") from e


def _check(self):
    """DeepSpeedConfig._do_sanity_check while installed: DeepSpeed's own, after attaching z3ext when
    this config enables it. Once attached, seams.py's check wraps this one, so it only falls through."""
    if enables_z3ext(getattr(self, "_param_dict", None)) and not _attached():
        _attach(f'the DeepSpeed config enables z3ext ("{SECTION}": {self._param_dict[SECTION]!r})')
        return type(self)._do_sanity_check(self)  # seams.py's check now: DeepSpeed's, then the section's
    return _stock_check(self)


def _initialize_params(self, param_dict):
    """DeepSpeedConfig._initialize_params while installed: the key check, then DeepSpeed's own."""
    check_section_key(param_dict)
    return _stock_initialize(self, param_dict)


def _config_of(arguments):
    """The config dict a `deepspeed.initialize` call was given (a dict, a JSON/HJSON path, or
    `args.deepspeed_config`), or None."""
    config = arguments.get("config")
    if config is None:
        config = arguments.get("config_params")
    if config is None:
        config = getattr(arguments.get("args"), "deepspeed_config", None)
    if isinstance(config, (str, os.PathLike)):
        try:
            with open(config) as f:
                text = f.read()
            try:
                import json
                return json.loads(text)
            except ValueError:
                import hjson
                return hjson.loads(text)
        except Exception:  # noqa: BLE001 (no hint; DeepSpeed's own error stands)
            return None
    return config if isinstance(config, dict) else None


def _from_mpi_discovery(error) -> bool:
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_name == "mpi_discovery":
            return True
        tb = tb.tb_next
    return False


def _launcher_hint(error) -> str:
    script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] not in ("", "-c", "-m") else "script.py"
    missing = [k for k in LAUNCHER_ENV if k not in os.environ]
    return (f"z3ext: deepspeed.initialize ran without a launcher ({', '.join(missing)} not set), so DeepSpeed looked "
            f"for an MPI environment and failed ({type(error).__name__}: {error}). Start the program with a launcher: "
            f"`torchrun --nproc_per_node=1 {script}` runs it as one process (N processes: --nproc_per_node=N), "
            f"`deepspeed {script}` on every GPU; with MPI, install mpi4py and use mpirun")


def _ds_initialize(*args, **kwargs):
    """deepspeed.initialize while installed: DeepSpeed's own, with the launcher hint ([Note: launcher hint])."""
    torch_dist = sys.modules.get("torch.distributed")
    without_launcher = (not all(k in os.environ for k in LAUNCHER_ENV)
                        and not (torch_dist is not None and torch_dist.is_available() and torch_dist.is_initialized()))
    try:
        return _stock_ds_initialize(*args, **kwargs)
    except Exception as e:
        if without_launcher and _from_mpi_discovery(e):
            import inspect
            try:
                arguments = inspect.signature(_stock_ds_initialize).bind_partial(*args, **kwargs).arguments
            except TypeError:
                arguments = {}
            if enables_z3ext(_config_of(arguments)):
                raise Z3extLauncherError(_launcher_hint(e)) from e
        raise


def install_check():
    """Replaces DeepSpeedConfig._do_sanity_check by the check, `_initialize_params` by the key check and
    `deepspeed.initialize` by its wrapper with the launcher hint (idempotent; imports DeepSpeed's config)."""
    global _installed_check, _stock_check, _stock_initialize, _stock_ds_initialize
    if _installed_check is not None:
        return
    import functools

    import deepspeed
    from deepspeed.runtime.config import DeepSpeedConfig
    _stock_check = DeepSpeedConfig._do_sanity_check
    _stock_initialize = DeepSpeedConfig._initialize_params
    _stock_ds_initialize = deepspeed.initialize
    DeepSpeedConfig._initialize_params = _initialize_params
    DeepSpeedConfig._do_sanity_check = _check
    deepspeed.initialize = functools.wraps(_stock_ds_initialize)(_ds_initialize)
    _installed_check = _check


def check_installed() -> bool:
    return _installed_check is not None


class _AfterDeepSpeed:
    """The loader of `deepspeed`, wrapped: once DeepSpeed's own `__init__` has run, the check goes in."""

    def __init__(self, loader):
        self._loader = loader

    def __getattr__(self, name):  # everything else (get_resource_reader, is_package, ...) is the loader's
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _remove_finder()
        install_check()


class _Finder:
    """First on sys.meta_path until `deepspeed` is loaded; answers only for it, with the spec the
    finders after it give and the loader wrapped. It stays until the load, not the first lookup:
    `importlib.util.find_spec("deepspeed")` (transformers' is_deepspeed_available) looks up without
    loading."""
    _looking = False

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name != "deepspeed" or cls._looking:
            return None
        cls._looking = True
        try:
            from importlib.util import find_spec
            spec = find_spec(name)  # the finders after this one (this one answers None meanwhile)
        finally:
            cls._looking = False
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _AfterDeepSpeed(spec.loader)
        return spec


def _remove_finder():
    try:
        sys.meta_path.remove(_Finder)
    except ValueError:
        pass


def finder_active() -> bool:
    return _Finder in sys.meta_path


def _start():
    """At interpreter start (the .pth): the check goes in when deepspeed is imported (at once if it
    already was). Installed whatever the switch says: with it off the check refuses z3ext configs."""
    if "deepspeed" in sys.modules:
        install_check()
    elif _Finder not in sys.meta_path:
        sys.meta_path.insert(0, _Finder)


STARTED_BY_PTH = False  # set by the .pth line; `python -m deepspeed_z3ext` reports it


def start_from_pth():
    global STARTED_BY_PTH
    STARTED_BY_PTH = True
    _start()
