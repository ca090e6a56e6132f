"""The benchmark's CPU run, as a new user's first run (`python bench/gather_release.py`, here its `--smoke` size):
its targets are labelled as device targets and judged only on a device, so a CPU run never prints "MISSED" (nor
"met") for what host-bound gloo ranks cannot show; and nothing it prints points a user to a source [Note]."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _env():
    return dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))


def test_a_cpu_run_labels_device_targets_and_judges_none(tmp_path):
    out = tmp_path / "smoke.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "gather_release.py"), "--smoke", "--out", str(out)],
                       env=_env(), capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = r.stdout.splitlines()
    head = [i for i, line in enumerate(lines) if line.startswith("# device targets (set for GPU runs")]
    assert len(head) == 1, r.stdout[-4000:]
    rows = lines[head[0] + 1:]
    rows = rows[:next(i for i, line in enumerate(rows) if not line.startswith("  "))]
    assert len(rows) >= 3 and all(row.endswith("(device target: not judged on CPU)") for row in rows), rows
    assert "MISSED" not in r.stdout and "within noise" not in r.stdout, r.stdout[-4000:]
    assert "# targets:" not in r.stdout
    assert "[Note" not in r.stdout + r.stderr, [line for line in (r.stdout + r.stderr).splitlines() if "[Note" in line]
    h = subprocess.run([sys.executable, str(ROOT / "bench" / "gather_release.py"), "--help"], env=_env(),
                       capture_output=True, text=True, timeout=300)
    assert h.returncode == 0 and "[Note" not in h.stdout, h.stdout

    # The same result as a device would have measured it: judged, with the verdicts' legend.
    res = json.loads(out.read_text())
    assert res["memory"] != "cuda"
    probe = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(ROOT / "bench")!r})
        import gather_release
        res = json.loads(open({str(out)!r}).read())
        res["memory"] = "cuda"
        print("\\n".join(gather_release.targets(res)))
        print("\\n".join(gather_release.legend(res)))""")
    d = subprocess.run([sys.executable, "-c", probe], env=_env(), capture_output=True, text=True, timeout=300)
    assert d.returncode == 0, d.stderr[-3000:]
    judged = [line for line in d.stdout.splitlines() if "want <=" in line]
    assert d.stdout.startswith("# targets: z3ext against") and len(judged) == len(rows), d.stdout
    assert all(line.endswith(("met", "MISSED", "within noise")) for line in judged), judged
    assert "MISSED: even the best round is over it" in d.stdout
