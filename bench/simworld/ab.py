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
        if "z3ext" in s and "unsharded" in s:
            runs[m["shape"], int(m["world"]), m["pkg"]].append(s)
    print("| shape | world | package | processes | z3ext / unsharded: step | fwd | bwd | z3ext step ms | unsharded step ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (shape, world, pkg), ss in sorted(runs.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] != "before")):
        r = {ph: [x["z3ext"][ph] / x["unsharded"][ph] for x in ss] for ph in ("step", "fwd", "bwd")}
        print(f"| {shape} | {world} | {pkg} | {len(ss)} | {spread(r['step'], '{:.3f}')} | {spread(r['fwd'], '{:.3f}')} "
              f"| {spread(r['bwd'], '{:.3f}')} | {spread([x['z3ext']['step'] for x in ss], '{:.1f}')} "
              f"| {spread([x['unsharded']['step'] for x in ss], '{:.1f}')} |")


if __name__ == "__main__":
    main(sys.argv[1:])
