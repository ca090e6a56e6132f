"""examples/train.py, the README's snippet as a script, runs as its docstring says: `torchrun
--nproc_per_node 2` on CPU (DS_ACCELERATOR=cpu, gloo), exits 0, and prints a loss per step, z3ext's stats
(all-gathers issued) and the full weights' size."""
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 300  # the ops are built by then in a test run; a first build takes 1-3 minutes of it


def test_train_example_runs_under_torchrun_on_two_cpu_ranks(tmp_path):
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    # `--standalone` (a free port) rather than the docstring's default port 29500, which another run on
    # the machine may hold; everything else as written.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "examples" / "train.py")]
    # Its own process group, so that a hang kills torchrun and both ranks, not torchrun alone.
    p = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        raise AssertionError(f"examples/train.py did not finish in {TIMEOUT} s:\n{out[-3000:]}\n{err[-3000:]}")
    assert p.returncode == 0, f"exit {p.returncode}:\n{out[-3000:]}\n{err[-6000:]}"

    losses = [float(v) for v in re.findall(r"^step \d+ loss (\S+)$", out, re.M)]
    assert len(losses) == 5 and all(math.isfinite(v) for v in losses), out
    assert losses[-1] < losses[0], losses  # it trains
    collectives = re.search(r"^Z3extStats\(.*\bcollectives=(\d+)", out, re.M)
    assert collectives and int(collectives.group(1)) > 0, out  # a z3ext engine, which gathered
    assert re.search(r"^GradReduceStats\(.*\breduce_scatters=[1-9]", out, re.M), out
    assert re.search(r"^full weights: \d+ elements$", out, re.M), out
