"""z3ext as a drop-in ([Note: activation], [Note: comms logger]): installed with pip, a DeepSpeed config
that says `"z3ext": true` attaches z3ext in a program that never imports it.

Real clients, real launchers: HF Trainer on a tiny Llama (tests/scripts/hf_train.py), 2 gloo ranks,
launched by `torchrun` and by `accelerate launch`, the script not importing deepspeed_z3ext: z3ext
engaged (its stats, read from the module the activation check imported), per-step losses bitwise
equal to a `torchrun` run of the same script with the explicit import. The torchrun run also enables
DeepSpeed's comms logger, whose records must count z3ext's collectives. Then `DEEPSPEED_Z3EXT_AUTO=0`
refuses a z3ext config at its DeepSpeedConfig check, and `python -m deepspeed_z3ext` reports.
These need the package installed (`pip install -e .`: the .pth in site-packages), as CI does.
"""
import json
import os
import pathlib
import site
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "scripts" / "hf_train.py"


def _env(**extra):
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    env.setdefault("PYTHONFAULTHANDLER", "1")  # an abort prints every thread's Python stack
    env.pop("DEEPSPEED_Z3EXT_AUTO", None)
    env.update(extra)
    return env


def _require_pth():
    found = [d for d in site.getsitepackages() if pathlib.Path(d, "deepspeed_z3ext.pth").is_file()]
    assert found, (f"deepspeed_z3ext.pth is not in site-packages ({site.getsitepackages()}): install the package "
                   "(`pip install --no-build-isolation --no-deps -e .`) to test activation without an import")


def _launch(launcher, out_dir, *flags, timeout=420):
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    else:  # accelerate's CLI; its multi-process launcher is torchrun (`--cpu` would mean 1 process or MPI)
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines",
               "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0"]
    out_dir.mkdir()
    p = subprocess.run(cmd + [str(SCRIPT), str(out_dir), *flags], env=_env(), capture_output=True, text=True,
                       timeout=timeout, cwd=out_dir)
    assert p.returncode == 0, f"{launcher} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(2)]


def test_hf_trainer_without_import_torchrun_accelerate_and_comms_logger(tmp_path):
    _require_pth()
    reference = _launch("torchrun", tmp_path / "explicit", "--explicit-import")
    runs = {"torchrun": _launch("torchrun", tmp_path / "torchrun", "--comms-logger"),
            "accelerate launch": _launch("accelerate", tmp_path / "accelerate")}
    for rank, ref in enumerate(reference):
        assert ref["z3ext_imported"] and ref["gather_collectives"] > 0 and ref["grad_flushes"] > 0, ref
        assert ref["losses"][0] != ref["losses"][-1], "training did not move the loss"
    for launcher, results in runs.items():
        for rank, (r, ref) in enumerate(zip(results, reference)):
            assert not r["explicit"] and r["z3ext_imported"], f"{launcher} rank {rank}: z3ext did not attach: {r}"
            assert r["gather_collectives"] > 0 and r["grad_flushes"] > 0, f"{launcher} rank {rank}: z3ext idle: {r}"
            assert r["losses"] == ref["losses"], (f"{launcher} rank {rank}: losses differ from the explicit import's:"
                                                  f"\n {r['losses']}\n {ref['losses']}")
            assert (r["gather_collectives"], r["grad_flushes"]) == (ref["gather_collectives"], ref["grad_flushes"])

    for rank, r in enumerate(runs["torchrun"]):  # DeepSpeed's comms logger counted z3ext's collectives
        comms = r["comms"]
        gathers = sum(comms.get("all_gather_into_tensor", {}).values())
        scatters = sum(comms.get("reduce_scatter_tensor", {}).values())
        assert scatters == r["grad_reduce_scatters"] > 0, \
            f"rank {rank}: {scatters} reduce-scatters logged, {r['grad_reduce_scatters']} issued"
        assert gathers == r["gather_collectives"] > 0, f"rank {rank}: {gathers} all-gathers logged: {comms}"
        assert all(int(size) > 0 for size in comms["reduce_scatter_tensor"]), comms


_CONFIG_CHECK = """
import sys
import deepspeed
from deepspeed.runtime.config import DeepSpeedConfig
try:
    DeepSpeedConfig({"train_batch_size": 2, "zero_optimization": {"stage": 3}, "z3ext": True})
    print("ATTACHED" if "deepspeed_z3ext" in sys.modules and sys.modules["deepspeed_z3ext"].installed() else "STOCK")
except Exception as e:
    print("RAISED", type(e).__name__, e)
"""


def test_switch_off_refuses_a_z3ext_config_and_on_attaches(tmp_path):
    _require_pth()
    off = subprocess.run([sys.executable, "-c", _CONFIG_CHECK], env=_env(DEEPSPEED_Z3EXT_AUTO="0"),
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    line = off.stdout.strip().splitlines()[-1]
    assert line.startswith("RAISED Z3extActivationError") and "DEEPSPEED_Z3EXT_AUTO" in line and \
        "import deepspeed_z3ext" in line, off.stdout + off.stderr
    on = subprocess.run([sys.executable, "-c", _CONFIG_CHECK], env=_env(), capture_output=True, text=True,
                        timeout=300, cwd=tmp_path)
    assert on.stdout.strip().splitlines()[-1] == "ATTACHED", on.stdout + on.stderr


def test_report_runs(tmp_path):
    p = subprocess.run([sys.executable, "-m", "deepspeed_z3ext"], env=_env(), capture_output=True, text=True,
                       timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    import re
    rows = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in p.stdout.splitlines() if re.search(r"\s{2,}", line))
    import deepspeed
    import torch
    assert rows["deepspeed"].startswith(deepspeed.__version__) and rows["torch"].startswith(torch.__version__), rows
    assert "0.19.8" in rows["deepspeed tested"].split(", "), rows
    assert "flavour" in rows["ops"] and rows["ops folder"] and rows["activation"].startswith("on"), rows
