"""One table from several bench/gather_release.py results (e.g. simulated worlds of 8 and 64, two shapes):

    python bench/simworld/summarize.py OUT.json RESULT.json... > summary.md

ms per step (fwd / bwd / opt) and peak MiB per system, and each z3ext variant's step and peak over
FSDP2's of the same run. OUT.json gets the results merged, keyed by file name.
"""
import json
import sys
from pathlib import Path


def shape(args):
    return (f"{args['model']} {args['layers']}x{args['hidden']}, {args['micro_batch']}x{args['seq']} tokens, "
            f"{args['dtype']}")


def main(argv):
    out, paths = Path(argv[0]), [Path(p) for p in argv[1:]]
    merged, lines = {}, []
    for p in paths:
        if not p.exists():
            lines.append(f"- {p.name}: no result (the run failed or ran out of time; see its log)")
            continue
        res = json.loads(p.read_text())
        merged[p.stem] = res
        s, sim = res["systems"], res.get("simulated_world")
        where = sim["note"] if sim else f"world {res['world']}"
        lines.append(f"\n### {shape(res['args'])}, {res['n_params'] / 1e9:.2f}B params: {where}")
        lines.append(f"(`{p.name}`, rounds {res['args']['rounds']} x steps {res['args']['steps']}, medians)\n")
        lines.append("| system | step ms (fwd / bwd / opt) | tiny fwd ms | peak MiB | params per rank | step / FSDP2 | "
                     "peak / FSDP2 |")
        lines.append("|---|---|---|---|---|---|---|")
        f = s.get("fsdp2")
        for n, m in s.items():
            peak = f"{m['peak'] / 2**20:.0f}" if "peak" in m else "-"
            rs = rp = ""
            if f and n != "fsdp2":
                rs = f"{m['step'] / f['step']:.2f}"
                rp = f"{m['peak'] / f['peak']:.2f}" if "peak" in m and "peak" in f else ""
            tiny = f"{m['tiny']:.2f}" if "tiny" in m else "-"
            lines.append(f"| {n} | {m['step']:.1f} ({m['fwd']:.1f} / {m['bwd']:.1f} / {m['opt']:.1f}) | {tiny} | {peak} | "
                         f"{m.get('params_per_rank', 0) / 1e6:.2f}M | {rs} | {rp} |")
        for n, why in res.get("skipped", {}).items():
            lines.append(f"| {n} | skipped: {why} | | | | | |")
    out.write_text(json.dumps(merged, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1:])
