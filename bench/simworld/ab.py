"""One table from bench/device_run.sh simworld-ab's processes (two packages, alternated):

    python bench/simworld/ab.py bench/out/simab-SHAPE-wWORLD-PACKAGE-K.json... > table.md

Each process ran the unsharded model and z3ext side by side (interleaved rounds), so z3ext's step over the
unsharded model's of the same process is the figure least moved by the host's speed from one minute to the next
([Note: alternated worlds] in summarize.py). Per shape, world and package: the median over processes of that
ratio (step, forward, backward) with its range, and the medians of the ms themselves.
"""
import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

NAME = re.compile(r"simab-(?P<shape>[^-]+)-w(?P<world>\d+)-(?P<pkg>before|after)-(?P<k>\d+)\.json$")


def spread(xs, fmt):
    xs = sorted(xs)
    med = statistics.median(xs)
    return f"{fmt.format(med)} [{fmt.format(xs[0])}-{fmt.format(xs[-1])}]" if len(xs) > 1 else fmt.format(med)


def main(paths):
    runs = defaultdict(list)
    for p in map(Path, paths):
        m = NAME.search(p.name)
        if not m:
            continue
        s = json.loads(p.read_text())["systems"]
        for name in s:  # z3ext, or the variant SIMAB_SYSTEM named (z3ext-mel)
            if name != "unsharded" and "unsharded" in s:
                runs[m["shape"], int(m["world"]), name, m["pkg"]].append((s[name], s["unsharded"]))
    print("| shape | world | system | package | processes | system / unsharded: step | fwd | bwd | system step ms "
          "| unsharded step ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (shape, world, name, pkg), ss in sorted(runs.items(), key=lambda kv: (*kv[0][:3], kv[0][3] != "before")):
        r = {ph: [x[ph] / u[ph] for x, u in ss] for ph in ("step", "fwd", "bwd")}
        print(f"| {shape} | {world} | {name} | {pkg} | {len(ss)} | {spread(r['step'], '{:.3f}')} "
              f"| {spread(r['fwd'], '{:.3f}')} | {spread(r['bwd'], '{:.3f}')} "
              f"| {spread([x['step'] for x, _ in ss], '{:.1f}')} | {spread([u['step'] for _, u in ss], '{:.1f}')} |")


if __name__ == "__main__":
    main(sys.argv[1:])
