"""Where a bench run's results go: one file per run, named so that runs never overwrite each other.

    bench/out/<what>-<commit>[-dirty]-<YYYYmmddTHHMMSS>.json   (UTC; the PNG beside it)
"""
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = ROOT / "bench" / "out"  # git-ignored, so a run leaves the checkout clean


def commit():
    """`git rev-parse --short HEAD` of this checkout, `-dirty` when tracked files changed (as `git describe
    --dirty`); "nogit" outside a checkout."""
    try:
        def git(*args):
            return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True,
                                  timeout=30).stdout.strip()
        return git("rev-parse", "--short", "HEAD") + ("-dirty" if git("status", "--porcelain", "--untracked-files=no")
                                                      else "")
    except (OSError, subprocess.SubprocessError):
        return "nogit"


def utc():
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime())


def stamped(what, rev=None, when=None):
    """A new path under bench/out for this run's JSON."""
    return OUT_DIR / f"{what}-{rev or commit()}-{when or utc()}.json"


def shown(path):
    """`path` relative to the working directory when under it (what a user types next), else absolute."""
    p = Path(path).resolve()
    try:
        return str(p.relative_to(Path.cwd()))
    except ValueError:
        return str(p)
