"""`python script.py` without a launcher ([Note: launcher hint] in deepspeed_z3ext_activate.py): a z3ext config
gets `Z3extLauncherError` naming `torchrun --nproc_per_node=1 script.py` instead of DeepSpeed's bare MPI error,
whether the script imports deepspeed_z3ext or relies on the installed .pth; a config without z3ext gets
DeepSpeed's error unchanged. Real scripts in fresh processes, no launcher variable in their environment."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = """
    import sys
    import deepspeed_z3ext_activate
    print("PTH", deepspeed_z3ext_activate.STARTED_BY_PTH, flush=True)
    import torch, deepspeed
    if "import" in sys.argv:
        import deepspeed_z3ext
    cfg = {"train_batch_size": 1, "zero_optimization": {"stage": 3},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    if "off" not in sys.argv:
        cfg["z3ext"] = True
    model = torch.nn.Linear(4, 4)
    deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    print("INITIALIZED")
"""


@pytest.mark.parametrize("how", ["pth", "import", "off"])
def test_no_launcher_gets_the_torchrun_hint(tmp_path, how):
    (tmp_path / "script.py").write_text(textwrap.dedent(SCRIPT))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT", "LOCAL_WORLD_SIZE", "DEEPSPEED_Z3EXT_AUTO")}
    env.update(DS_ACCELERATOR="cpu", PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    args = [] if how == "pth" else [how]
    r = subprocess.run([sys.executable, "script.py", *args], env=env, capture_output=True, text=True, timeout=300,
                       cwd=tmp_path)
    assert r.stdout.startswith("PTH True"), ("deepspeed_z3ext.pth is not in site-packages: install the package "
                                             "(`pip install --no-build-isolation --no-deps -e .`) to test this")
    if "INITIALIZED" in r.stdout:
        pytest.skip("this machine has an MPI environment DeepSpeed discovers: no launcher is needed here")
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    if how == "off":
        assert "Z3extLauncherError" not in r.stderr and "torchrun" not in r.stderr, r.stderr[-2000:]
        return
    assert last.startswith("deepspeed_z3ext_activate.Z3extLauncherError: z3ext: deepspeed.initialize ran without a "
                           "launcher"), r.stderr[-3000:]
    assert "`torchrun --nproc_per_node=1 script.py`" in last, last
    assert "RANK" in last and "WORLD_SIZE" in last, last
    assert "mpi_discovery" in r.stderr  # DeepSpeed's own error is chained, not lost
