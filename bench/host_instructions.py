"""Host work as a count: instructions per tiny forward, training forward and backward, per system.

    python bench/host_instructions.py                       # unsharded and z3ext, GPT 16x64, simulated world 8
    python bench/host_instructions.py --systems unsharded,stock,z3ext --phases tiny,fwd --sim-world 64
    python bench/host_instructions.py --model llama --phases token --hidden 256    # a generated token (HF generate)

[Note: host instructions] Host time on the 2-core CPU VM moves by 10-15 % between runs and processes, more
than most host-work changes. valgrind's callgrind counts the instructions a process executes, the same
for the same binary, inputs and environment whatever else the machine does (bench/NOTES.md v21). Each
(system, phase) runs in its own process under callgrind with instrumentation off until the measured
calls (client requests from a small C shim built here with gcc), on one OpenMP thread (spinning
worker threads would count), as rank 0 of a simulated world ([Note: simulated world]). On a GPU host
the model's ops are kernel launches; on the CPU their arithmetic counts too, so compare systems on the
same shape, and keep the shape small (the default: 16 layers of 64, 8 tokens) so that host work dominates.
Needs valgrind and its headers (Debian: valgrind). A run takes about 2.5 minutes per (system, phase).
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHIM = r"""
#include <valgrind/callgrind.h>
void cg_start(void) { CALLGRIND_START_INSTRUMENTATION; CALLGRIND_TOGGLE_COLLECT; }
void cg_stop(void) { CALLGRIND_TOGGLE_COLLECT; CALLGRIND_STOP_INSTRUMENTATION; }
"""
PHASES = ("tiny", "fwd", "bwd", "token")  # token: --model llama only


def _shim(out_dir: Path) -> Path:
    lib = out_dir / "libcallgrind_shim.so"
    if not lib.exists():
        src = out_dir / "callgrind_shim.c"
        src.write_text(SHIM)
        subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    return lib


def _child(a):
    """Inside valgrind: build the system, warm it up, count `a.iters` calls of the phase."""
    import ctypes
    import gc
    sys.path.insert(0, str(HERE))
    import simworld
    simworld.init(a.sim_world)
    import deepspeed
    import torch
    import gather_release as gr
    torch.set_num_threads(1)
    if a.model == "llama":
        return _child_token(a)
    ga = gr.parse(["--model", a.model, "--layers", str(a.layers), "--hidden", str(a.hidden), "--seq", str(a.seq),
                   "--micro-batch", "1", "--sim-world", str(a.sim_world), "--dtype", a.dtype,
                   "--experts", str(a.experts)])
    device = torch.device("cpu")
    deepspeed.init_distributed()
    s = gr.build_system(a.child, ga, device)
    torch.nn.functional.linear = s.linear  # the system's own linear ([Note: bench linear]): "-mel", DeepSpeed's
    tiny, x = gr.make_input(ga, device, tiny=True), gr.make_input(ga, device)
    cg = ctypes.CDLL(a.shim)
    for _ in range(3):
        s.backward(s.forward(x))
        s.step()
        with torch.no_grad():
            s.forward(tiny)
    gc.collect()
    gc.disable()
    for _ in range(a.iters):
        if a.phase == "tiny":
            with torch.no_grad():
                cg.cg_start()
                s.forward(tiny)
                cg.cg_stop()
            continue
        if a.phase == "fwd":
            cg.cg_start()
        loss = s.forward(x)
        if a.phase == "fwd":
            cg.cg_stop()
        if a.phase == "bwd":
            cg.cg_start()
        s.backward(loss)
        if a.phase == "bwd":
            cg.cg_stop()
        s.step()


def _child_token(a):
    """A generated token: HF generate on a Llama (bench/generate.py's systems), one forward per new token after
    the prompt's counted (the root module's call: z3ext's hooks and DeepSpeed's forward included), `a.iters`
    tokens per generate call after a warm-up call."""
    import ctypes
    import gc
    import deepspeed
    import torch
    import generate as gen
    ga = gen.parse(["--sim-world", str(a.sim_world), "--layers", str(a.layers), "--hidden", str(a.hidden),
                    "--vocab", "1024", "--batch", "1", "--prompt", str(a.seq), "--new-tokens", str(a.iters + 1)])
    deepspeed.init_distributed()
    s = gen.build(a.child, ga, torch.device("cpu"), 0)
    ids = torch.randint(0, 1024, (1, a.seq), generator=torch.Generator().manual_seed(0))
    gen.run_generate(s, ids, a.iters + 1)
    cg, model, counted = ctypes.CDLL(a.shim), s.model, [0]
    call = model._call_impl

    def counting_call(*args, **kwargs):
        token = kwargs.get("input_ids") is not None and kwargs["input_ids"].shape[1] == 1
        if token:
            counted[0] += 1
            cg.cg_start()
        try:
            return call(*args, **kwargs)
        finally:
            if token:
                cg.cg_stop()

    model._call_impl = counting_call  # (Module.__call__ looks it up on the instance)
    gc.collect()
    gc.disable()
    gen.run_generate(s, ids, a.iters + 1)
    if counted[0] != a.iters:
        raise SystemExit(f"counted {counted[0]} token forwards, expected {a.iters}")


def _count(a, system, phase, shim, work) -> float:
    if shutil.which("valgrind") is None:
        raise SystemExit("bench/host_instructions.py needs valgrind (Debian: apt-get install valgrind)")
    # PYTHONHASHSEED: str hashes (and with them dict and set probing) are drawn per process otherwise, which moved a
    # generated token's count by up to 0.5 % between runs of the same tree
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONWARNINGS="ignore",
               PYTHONHASHSEED="0")
    log = work / f"{system}-{phase}.log"
    cmd = ["valgrind", "--tool=callgrind", "--trace-children=no", "--instr-atstart=no", "--collect-atstart=no",
           f"--callgrind-out-file={work}/{system}-{phase}.%p", sys.executable, __file__, "--child", system,
           "--phase", phase, "--shim", str(shim), "--iters", str(a.iters), "--layers", str(a.layers),
           "--hidden", str(a.hidden), "--seq", str(a.seq), "--sim-world", str(a.sim_world), "--model", a.model,
           "--experts", str(a.experts), "--dtype", a.dtype]
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    text = log.read_text()
    counts = [int(m) for m in re.findall(r"Collected : (\d+)", text)]
    if rc != 0 or not counts:
        raise SystemExit(f"{system} {phase}: valgrind run failed (exit {rc}); see {log}")
    return sum(counts) / a.iters


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default="unsharded,z3ext")
    p.add_argument("--phases", default=",".join(PHASES), help="tiny (no_grad 1x8 forward), fwd, bwd")
    p.add_argument("--model", choices=["gpt", "moe", "llama"], default="gpt",
                   help="moe: --experts expert modules per block; llama: HF Llama, phase token (a generated token)")
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--seq", type=int, default=8, help="tokens of the training batch (one sequence)")
    p.add_argument("--sim-world", type=int, default=8)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--iters", type=int, default=3, help="measured calls per (system, phase)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    p.add_argument("--shim", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        return _child(a)
    systems, phases = a.systems.split(","), a.phases.split(",")
    unknown = [ph for ph in phases if ph not in PHASES or (ph == "token") != (a.model == "llama")]
    if unknown:
        raise SystemExit(f"phase(s) {unknown} not for --model {a.model}: tiny, fwd, bwd for gpt and moe; token for llama")
    out = HERE / "out"
    out.mkdir(exist_ok=True)
    shim = _shim(out)
    work = Path(tempfile.mkdtemp(prefix="host-instr-", dir=out))
    counts = {(s, ph): _count(a, s, ph, shim, work) for s in systems for ph in phases}
    experts = f" with {a.experts} expert modules per block" if a.model == "moe" else ""
    shape = (f"HF Llama {a.layers}x{a.hidden}, a {a.seq}-token prompt, per generated token" if a.model == "llama" else
             f"GPT {a.layers}x{a.hidden}{experts}, {a.seq} tokens")
    print(f"# host instructions (callgrind, M per call, 1 thread): {shape}, "
          f"{a.dtype}, CPU; simulated world {a.sim_world}: no communication time, values wrong")
    print("      system" + "".join(f"{ph:>10}" for ph in phases))
    for s in systems:
        print(f"{s:>12}" + "".join(f"{counts[(s, ph)] / 1e6:10.2f}" for ph in phases))
    base = systems[0]
    for s in systems[1:]:
        print(f"# {s} / {base}: " + ", ".join(f"{ph} {counts[(s, ph)] / counts[(base, ph)]:.2f}x" for ph in phases))


if __name__ == "__main__":
    main()
