#!/usr/bin/env bash
# The GPU checks, in one device call (few, full calls: each call to a fresh machine
# rebuilds the ops, ~1 min). From the repo root on the device, with DeepSpeed 0.19.8 and its
# dependencies carried as wheels in .whl (the device tool's README):
#   bash bench/device_run.sh tests   # CUDA build, DeepCompile's op, pytest -m gpu (needs 2 GPUs)
#   bash bench/device_run.sh hf      # HF recipe: step time, peak memory, losses (stock, z3ext, nohold)
#   bash bench/device_run.sh bench   # stock / z3ext / FSDP2 side by side (--rounds 2)
#   bash bench/device_run.sh grads   # gradient path: pytest -m gpu tests/test_gradients.py, then stock /
#                                    # z3ext / z3ext-dsgrads / FSDP2 / unsharded on two shapes (all GPUs)
#   bash bench/device_run.sh step    # bench/step_breakdown.py: the optimizer step phase by phase
#   bash bench/device_run.sh simworld  # one GPU (SIM_PROCS=1: one system per process): GPT 0.94B and 6.7B as rank 0 of simulated worlds of 8
#                                    # and 64 (collectives do nothing: per-rank memory and host time are
#                                    # real, communication time is zero, values wrong), all systems in
#                                    # one process per shape and world; fits one 600 s call
#   bash bench/device_run.sh memory  # pytest -m gpu tests/test_gradients.py, then bench/memory_peak.py: what is
#                                    # live at the peak, by allocation site, GPT 6.7B at simulated world 8
#   bash bench/device_run.sh faults  # pytest -m gpu tests/test_faults.py tests/test_gradients.py: the CUDA
#                                    # allocator out of memory in a gather, a re-fill and autograd (one GPU)
#   bash bench/device_run.sh profile # host phases of the 0.94B GPT's tiny forward and training step (profile_host.py) and
#                                    # the 6.7B GPT's optimizer step phase by phase, at simulated worlds 8 and 64
#   bash bench/device_run.sh step-ab # pytest -m gpu tests/test_gradients.py, then the optimizer step phase by phase at
#                                    # simulated world 8 (6.7B and 0.94B GPT), main against the package in .before
#   bash bench/device_run.sh steps   # bench/step_profile.py: device time and blocking host calls per phase, unsharded
#                                    # and z3ext, 0.94B and 0.47B GPT at simulated worlds 8 and 64 (STEPS_SYSTEMS, STEPS_RUNS:
#                                    # "narrow|0.94B|6.7B W;..."; STEPS_PYTOP=N adds a cProfile of the backward)
#   bash bench/device_run.sh tiny    # the 0.94B GPT's tiny no_grad forward at simulated world 8: host phases
#                                    # (profile_host.py) and the bench with its NVML sampler on and off
#   bash bench/device_run.sh world1-ab  # the 0.94B GPT at world 1 (real): main against the package in .before,
#                                    # alternated processes (WORLD1_RUNS, default 4), each with its own op build;
#                                    # .before: `git archive REV deepspeed_z3ext csrc op_builder | tar -x -C .before`
#   bash bench/device_run.sh simworld-ab  # 0.47B and 0.94B GPT (and per-expert MoE) at simulated worlds, unsharded and z3ext:
#                                    # main against .before, alternated processes (SIMAB_SHAPES, SIMAB_RUNS, SIMAB_WORLDS)
#   bash bench/device_run.sh ranks-on-one-gpu  # pytest -m gpu with every "two GPUs" test as N ranks on the one GPU
#                                    # through gloo, N in ONE_GPU_RANKS (default "2 4"), the N runs side by side
#                                    # ([Note: ranks on one GPU] in tests/harness.py); ONE_GPU_TESTS: pytest arguments
#                                    # (ONE_GPU_TESTS_<N>: for the N-rank run only)
#   bash bench/device_run.sh generate         # HF generate at simulated worlds 8 and 64 (bench/generate.py; GEN_RUNS)
#   bash bench/device_run.sh generate-procs   # the same, each system in its own process, alternated, pooled (GEN_REPS)
#   bash bench/device_run.sh all
# Logs go to $OUT (the device's returned folder) or /tmp/z3ext-device; results to bench/results.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TORCH_CUDA_ARCH_LIST=9.0
export TORCH_EXTENSIONS_DIR=/tmp/z3ext-ext PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
  export PYTHONPATH=/tmp/site:${Z3EXT_SRC:+$Z3EXT_SRC:}$PWD  # Z3EXT_SRC: another tree's deepspeed_z3ext (a before/after run)
fi
LOG=${OUT:-/tmp/z3ext-device}; mkdir -p "$LOG"
what=${1:-all}
nvidia-smi -L
if [[ $what == simworld* || $what == generate* || $what == memory || $what == faults || $what == profile || $what == steps || $what == tiny ]]; then  # the simulated world's backend builds while the ops do
  python3 -c "import sys; sys.path.insert(0, 'bench'); import simworld; simworld.load(); print('simworld backend built')" \
    >"$LOG/simworld-build.log" 2>&1 &
  simworld_build=$!
fi
python3 -c "from deepspeed_z3ext._ops import ops; print('ops built, cuda:', ops().with_cuda)" || exit 1
if [[ $what == tests || $what == all ]]; then
  python3 -c "from deepspeed.ops.op_builder import DeepCompileBuilder; DeepCompileBuilder().load()" >/dev/null 2>&1
  python3 -m pytest -q -m gpu tests 2>&1 | tee "$LOG/gpu-tests.log" | tail -8
fi
if [[ $what == ranks-on-one-gpu ]]; then
  python3 -c "from deepspeed.ops.op_builder import DeepCompileBuilder; DeepCompileBuilder().load()" >/dev/null 2>&1
  python3 -c "from tests.faults import allocator; allocator()" >/dev/null 2>&1  # built once, not by every run
  pids=()
  for n in ${ONE_GPU_RANKS:-2 4}; do
    # One-GPU tests (world 1, "-1]", and the CUDA allocator's out of memory) run in the first run only.
    k="not 1] and not out_of_memory_on_cuda"; ((${#pids[@]} == 0)) && k="${ONE_GPU_K:-}"
    tests_n=ONE_GPU_TESTS_$n
    Z3EXT_RANKS_ON_ONE_GPU=$n GLOO_SOCKET_IFNAME=lo timeout -k 5 "${ONE_GPU_LIMIT:-560}" \
      python3 -m pytest -q -rs -m gpu -p no:cacheprovider ${k:+-k "$k"} ${!tests_n:-${ONE_GPU_TESTS:-tests}} \
      >"$LOG/ranks-on-one-gpu-$n.log" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p"; done
  for n in ${ONE_GPU_RANKS:-2 4}; do echo "== $n ranks on one GPU"; tail -n 30 "$LOG/ranks-on-one-gpu-$n.log"; done
fi
if [[ $what == generate ]]; then
  # HF generate at simulated worlds (bench/generate.py): GEN_RUNS "shape world [new tokens [systems]]" separated
  # by ';', shapes 0.94B (16x2048) and 6.7B (32x4096); each run one process, GEN_LIMIT seconds at most.
  wait "$simworld_build" || { cat "$LOG/simworld-build.log"; exit 1; }
  IFS=';' read -ra runs <<< "${GEN_RUNS:-0.94B 8;0.94B 64;6.7B 8 32 unsharded,stock,z3ext,z3ext@1,z3ext@0.25,z3ext@0}"
  for run in "${runs[@]}"; do
    set -- $run
    args="--new-tokens ${3:-64} --rounds ${GEN_ROUNDS:-2}${4:+ --systems $4}"
    [[ $1 == 6.7B ]] && args+=" --layers 32 --hidden 4096"
    timeout -k 5 "${GEN_LIMIT:-200}" python3 bench/generate.py --sim-world "$2" $args --out "$LOG/generate-$1-w$2.json" 2>&1 |
      grep -v Warning | tee -a "$LOG/generate.log" | sed -n '/^# generate/,$p'
  done
  cp bench/out/generate-0.94B-w8.png "$LOG/" 2>/dev/null
fi
if [[ $what == generate-procs ]]; then
  # Each system in a process of its own, processes alternated, GEN_REPS repetitions (default 3) of every
  # GEN_SYSTEMS (default "unsharded z3ext") for each GEN_RUNS "shape world" (default "0.94B 8;0.94B 64"); every
  # round of every process pooled ([Note: a full-length warm-up] in bench/generate.py): $LOG/generate-procs.md
  wait "$simworld_build" || { cat "$LOG/simworld-build.log"; exit 1; }
  mkdir -p bench/out; rm -f bench/out/genp-*.json
  IFS=';' read -ra runs <<< "${GEN_RUNS:-0.94B 8;0.94B 64}"
  for run in "${runs[@]}"; do
    set -- $run
    args="--new-tokens ${GEN_TOKENS:-64} --rounds ${GEN_ROUNDS:-3}"; [[ $1 == 6.7B ]] && args+=" --layers 32 --hidden 4096"
    for ((k = 0; k < ${GEN_REPS:-3}; k++)); do
      for sys in ${GEN_SYSTEMS:-unsharded z3ext}; do
        timeout -k 5 "${GEN_LIMIT:-120}" python3 bench/generate.py --sim-world "$2" $args --systems "$sys" \
          --out "bench/out/genp-$1-w$2-$sys-r$k.json" >>"$LOG/generate-procs.log" 2>&1 || echo "# $1 w$2 $sys r$k: rc $?"
      done
    done
    python3 bench/generate.py --pool bench/out/genp-$1-w$2-*.json | tee -a "$LOG/generate-procs.md"
  done
fi
if [[ $what == hf || $what == all ]]; then
  python3 bench/hf_recipe.py 2>&1 | tee "$LOG/hf-recipe.log" | tail -20
fi
if [[ $what == faults ]]; then
  wait "$simworld_build" || { cat "$LOG/simworld-build.log"; exit 1; }
  python3 -m pytest -q -rP -m gpu tests/test_faults.py tests/test_gradients.py 2>&1 | tee "$LOG/gpu-faults.log" | tail -30
fi
if [[ $what == grads || $what == grads-tests || ($what == memory && ${MEM_TESTS:-1} == 1) ]]; then  # MEM_TESTS=0: memory alone
  python3 -m pytest -q -m gpu tests/test_gradients.py 2>&1 | tee "$LOG/gpu-gradients.log" | tail -12
fi
if [[ $what == grads || $what == grads-bench ]]; then
  # The 0.94B GPT, and a shape with more, narrower layers and another token count (chosen before tuning).
  systems=unsharded,stock,z3ext,z3ext-dsgrads,fsdp2
  python3 bench/gather_release.py --rounds 2 --systems $systems --out "$LOG/bench-gpt.json" 2>&1 |
    tee "$LOG/bench-gpt.log" | tail -24
  python3 bench/gather_release.py --rounds 2 --systems $systems --layers 32 --hidden 1024 --seq 1024 \
    --micro-batch 4 --out "$LOG/bench-narrow.json" 2>&1 | tee "$LOG/bench-narrow.log" | tail -24
fi
if [[ $what == step ]]; then  # the optimizer step phase by phase (stock, z3ext before/after, FSDP2)
  python3 bench/step_breakdown.py --systems stock,z3ext-dsgrads,z3ext,fsdp2 --steps 5 2>&1 | tee "$LOG/step.log" | tail -18
  python3 bench/step_breakdown.py --systems stock,z3ext-dsgrads,z3ext,fsdp2 --steps 5 --gradient-clipping 0 2>&1 |
    tee "$LOG/step-noclip.log" | tail -18
fi
if [[ $what == profile ]]; then
  wait "$simworld_build" || { cat "$LOG/simworld-build.log"; exit 1; }
  big=${SIM_BIG:-"--layers 32 --hidden 4096 --heads 32 --seq 2048 --micro-batch 1"}
  for w in 8 64; do
    timeout -k 5 150 python3 bench/profile_host.py --model gpt --sim-world $w --systems z3ext,unsharded 2>&1 | grep -v Warning | tail -3
    cp bench/out/profile-*sim$w*.txt "$LOG/" 2>/dev/null
    timeout -k 5 150 python3 bench/step_breakdown.py --sim-world $w $big --systems z3ext,fsdp2 --steps 5 2>&1 |
      tee "$LOG/step-6.7B-w$w.log" | grep -v Warning | tail -22
  done
fi
if [[ $what == steps ]]; then
  wait "$simworld_build" || { cat "$LOG/simworld-build.log"; exit 1; }
  IFS=';' read -ra runs <<< "${STEPS_RUNS:-narrow 8;narrow 64;0.94B 8;0.94B 64}"
  for run in "${runs[@]}"; do
    set -- $run
    shape=""; [[ $1 == narrow ]] && shape="--layers 32 --hidden 1024 --heads 16 --seq 1024 --micro-batch 4"
    [[ $1 == 6.7B ]] && shape="--layers 32 --hidden 4096 --heads 32 --seq 2048 --micro-batch 1"
    timeout -k 5 150 python3 bench/step_profile.py --sim-world "$2" $shape --systems "${STEPS_SYSTEMS:-unsharded,z3ext}" \
      --steps 3 --warmup 2 ${STEPS_PYTOP:+--python-top $STEPS_PYTOP} 2>&1 | grep -v Warning | tee "$LOG/steps-$1-w$2.log" | sed -n '/^# bench/,$p'
  done
fi
if [[ $what == tiny ]]; then  # the 0.94B GPT's tiny no_grad forward at simulated world 8: host phases, and with
  # the NVML sampler thread on and off (BENCH_NVML_PERIOD), one process each, alternated
  wait "$simworld_build" || { cat "$LOG/simworld-build.log"; exit 1; }
  timeout -k 5 150 python3 bench/profile_host.py --model gpt --sim-world 8 --systems z3ext,unsharded --steps 8 \
    >"$LOG/tiny-profile.log" 2>&1
  sed -n '/tiny no_grad forward, host phases/,/^## z3ext tiny no_grad forward, torch/p' "$LOG/tiny-profile.log"
  sed -n '/torch.profiler/,/^$/p' "$LOG/tiny-profile.log" | head -24 | cut -c1-150
  for period in 0.02 0 0.02 0; do
    echo "## BENCH_NVML_PERIOD=$period"
    BENCH_NVML_PERIOD=$period timeout -k 5 100 python3 bench/gather_release.py --sim-world 8 --systems unsharded,z3ext \
      --rounds 3 --steps 4 --warmup 2 --out bench/out/nvml-$period.json 2>&1 | grep -v Warning |
      sed -n '/^      system/,+2p'
  done 2>&1 | tee "$LOG/tiny-nvml.log"
fi
if [[ $what == step-ab ]]; then
  python3 -m pytest -q -m gpu tests/test_gradients.py 2>&1 | tee "$LOG/gpu-gradients.log" | tail -3
  big=${SIM_BIG:-"--layers 32 --hidden 4096 --heads 32 --seq 2048 --micro-batch 1"}
  for shape in "$big" ""; do
    for src in "" "$PWD/.before"; do
      echo "## step phases, simulated world 8, ${shape:-0.94B default shape}, package: ${src:-main}"
      PYTHONPATH=/tmp/site:${src:+$src:}$PWD timeout -k 5 150 python3 bench/step_breakdown.py --sim-world 8 $shape \
        --systems z3ext,fsdp2 --steps 5 2>&1 | grep -v Warning | tail -17
    done
  done 2>&1 | tee "$LOG/step-ab.log"
fi
if [[ $what == world1-ab ]]; then
  # Each package builds its ops once, in its own extensions folder (one folder for both would rebuild at every switch).
  PYTHONPATH=/tmp/site:$PWD/.before:$PWD TORCH_EXTENSIONS_DIR=/tmp/z3ext-ext-before \
    python3 -c "from deepspeed_z3ext._ops import ops; ops(); print('ops of .before built')" || exit 1
  for ((k = 0; k < ${WORLD1_RUNS:-4}; k++)); do
    if ((k % 2 == 0)); then src=$PWD/.before ext=/tmp/z3ext-ext-before; else src="" ext=$TORCH_EXTENSIONS_DIR; fi
    label=${src:+.before}; echo "## world 1 (real), 0.94B GPT, package: ${label:-main}"
    mkdir -p bench/out  # the bench writes a plot beside its JSON: only the JSON goes to $LOG ($OUT returns 8 files)
    PYTHONPATH=/tmp/site:${src:+$src:}$PWD TORCH_EXTENSIONS_DIR=$ext timeout -k 5 150 python3 bench/gather_release.py \
      --sim-world 0 --systems unsharded,fsdp2,z3ext --rounds 3 --steps 4 --warmup 2 --out bench/out/world1-$k.json 2>&1 |
      grep -v Warning | sed -n '/^# gather_release/,/^# ratios/p;/z3ext\/unsharded/p'
    cp bench/out/world1-$k.json "$LOG/" 2>/dev/null
  done 2>&1 | tee "$LOG/world1-ab.log"
fi
if [[ $what == simworld-ab ]]; then
  # Simulated worlds (SIMAB_WORLDS, default "8"): main against the package in .before, unsharded and z3ext in each
  # process, alternated processes (SIMAB_RUNS per package, shape and world, default 2) on the 0.47B and the 0.94B GPT
  # (SIMAB_SHAPES: narrow, 0.94B, moe); ops as in world1-ab. A process starts only while 60 s of SIMAB_BUDGET
  # (default 570, from this script's start) are left. SIMAB_SYSTEM (default z3ext; z3ext-mel: DeepSpeed's default
  # memory_efficient_linear) is the system beside the unsharded model. Table: bench/simworld/ab.py, every process's
  # result in $LOG.
  wait "$simworld_build" || { cat "$LOG/simworld-build.log"; exit 1; }
  PYTHONPATH=/tmp/site:$PWD/.before:$PWD TORCH_EXTENSIONS_DIR=/tmp/z3ext-ext-before \
    python3 -c "from deepspeed_z3ext._ops import ops; ops(); print('ops of .before built')" || exit 1
  rm -f bench/out/simab-*.json
  for shape in ${SIMAB_SHAPES:-narrow 0.94B}; do
    args=""; [[ $shape == narrow ]] && args="--layers 32 --hidden 1024 --heads 16 --seq 1024 --micro-batch 4"
    [[ $shape == moe ]] && args="--model moe --layers 8 --hidden 1024 --heads 16 --experts 32 --topk 2 --seq 1024 --micro-batch 4"
    for ((k = 0; k < 2 * ${SIMAB_RUNS:-2}; k++)); do
      for world in ${SIMAB_WORLDS:-8}; do
        if ((k % 2 == 0)); then src=$PWD/.before ext=/tmp/z3ext-ext-before pkg=before; else src="" ext=$TORCH_EXTENSIONS_DIR pkg=after; fi
        left=$((${SIMAB_BUDGET:-570} - SECONDS))
        if ((left < 60)); then echo "# skipped: $shape at simulated world $world ($pkg): ${left}s left"; continue; fi
        echo "## simulated world $world, $shape GPT, package: $pkg"
        mkdir -p bench/out
        PYTHONPATH=/tmp/site:${src:+$src:}$PWD TORCH_EXTENSIONS_DIR=$ext timeout -k 5 $((left < 150 ? left : 150)) \
          python3 bench/gather_release.py --sim-world "$world" $args --systems unsharded,${SIMAB_SYSTEM:-z3ext} --rounds 2 --steps 4 \
          --warmup 2 --out bench/out/simab-$shape-w$world-$pkg-$k.json 2>&1 | grep -v Warning | sed -n '/z3ext\/unsharded/p'
        cp bench/out/simab-$shape-w$world-$pkg-$k.json "$LOG/" 2>/dev/null
      done
    done
  done 2>&1 | tee "$LOG/simworld-ab.log"
  python3 bench/simworld/ab.py bench/out/simab-*.json | tee "$LOG/simworld-ab.md"
fi
if [[ $what == bench || $what == all ]]; then
  python3 bench/gather_release.py --rounds 2 --systems stock,z3ext,fsdp2 2>&1 | tee "$LOG/bench.log" | tail -30
fi
if [[ $what == memory ]]; then
  wait "$simworld_build" || { cat "$LOG/simworld-build.log"; exit 1; }
  big=${SIM_BIG:-"--layers 32 --hidden 4096 --heads 32 --seq 2048 --micro-batch 1"}
  # MEM_SYSTEMS (three fit one call): z3ext-lpkept keeps stock's bf16 partitions (before partition_from_master); z3ext-layerrb reduces
  # gradients a block at a time (reduce_bucket_size one block, not DeepSpeed's 5e8)
  timeout -k 5 "${MEM_LIMIT:-420}" python3 bench/memory_peak.py --sim-world 8 $big --systems ${MEM_SYSTEMS:-fsdp2,z3ext,z3ext-layerrb} --warmup 2 \
    2>&1 | tee "$LOG/memory-peak.log" | grep -v Warning | tail -60
fi
if [[ $what == simworld ]]; then
  # The 0.94B and 6.7B GPT at --sim-world 8 and 64, each shape and world one process with every system in it
  # (interleaved rounds). The unsharded 6.7B model (54 GB of bf16 weights, gradients and AdamW state)
  # does not fit beside the four sharded systems, so it runs on the 0.94B model only. Each run gets what
  # is left of SIM_BUDGET seconds (default 570, from this script's start): a run cut short leaves the
  # others' results, and the summary says which is missing. Logs: $LOG/simworld.log (all runs), the
  # table: $LOG/simworld-summary.md, the results merged: $LOG/simworld.json (few files: $OUT returns 8).
  wait "$simworld_build" || { cat "$LOG/simworld-build.log"; exit 1; }
  budget=${SIM_BUDGET:-570}
  big=${SIM_BIG:-"--layers 32 --hidden 4096 --heads 32 --seq 2048 --micro-batch 1"}  # SIM_BIG, SIM_EXTRA: CPU dry runs
  results=()
  # SIM_RUNS: which runs ("narrow": 32x1024, 4x1024 tokens; "moe": 8 blocks of 32 expert modules); SIM_ADD: systems added to each (",z3ext-nogroups");
  # hpZ in nodes of 8: SIM_EXTRA="--hpz 8" SIM_ADD=",stock-mel-hpz,z3ext-hpz" (bench/NOTES.md v19);
  # SIM_ROUNDS, SIM_STEPS: interleaved rounds and timed steps per round (default 2 x 4); SIM_SKIP (default
  # "stock-mel z3ext-nohold", "" for none): systems left out of every run
  # A run may repeat ("0.94B 8;0.94B 64;0.94B 8;0.94B 64"): each repeat is a process of its own, its result
  # sim-<shape>-w<N>-r<K>.json, and the summary pools every process of a shape and world ([Note: alternated
  # worlds] in summarize.py). A third field adds systems to that run only ("0.94B 8 stock-mel").
  rm -f bench/out/sim-*.json bench/out/sim-*.log  # a warm machine keeps an earlier call's results
  # Default: the performance issue's shapes and worlds, the 0.94B worlds alternated twice and the 0.47B three times,
  # stock with mel on the 6.7B and the first 0.94B pair (about 540 s with the GPU gradient tests before it).
  default_runs="6.7B 8 stock-mel;6.7B 64 stock-mel;0.94B 8 stock-mel;0.94B 64 stock-mel;narrow 8;narrow 64;0.94B 8;0.94B 64"
  default_runs+=";narrow 8;narrow 64;narrow 8;narrow 64"  # the host-bound 0.47B backward: three pairs pooled
  IFS=';' read -ra runs <<< "${SIM_RUNS:-$default_runs}"
  for run in "${runs[@]}"; do
    set -- $run
    if [[ $1 == 6.7B ]]; then shape=$big systems=stock-mel,fsdp2,z3ext,z3ext-nohold
    elif [[ $1 == narrow ]]; then shape="--layers 32 --hidden 1024 --heads 16 --seq 1024 --micro-batch 4"
      systems=unsharded,stock-mel,fsdp2,z3ext,z3ext-nohold
    elif [[ $1 == moe ]]; then  # per-expert MoE: 8 blocks of 32 expert modules (top 2), 4x1024 tokens
      shape="--model moe --layers 8 --hidden 1024 --heads 16 --experts 32 --topk 2 --seq 1024 --micro-batch 4"
      systems=unsharded,stock-mel,fsdp2,z3ext,z3ext-nohold
    else shape="" systems=unsharded,stock-mel,fsdp2,z3ext,z3ext-nohold; fi
    systems+=${SIM_ADD:-}
    for skip in ${SIM_SKIP-stock-mel z3ext-nohold}; do systems=${systems//$skip,/}; systems=${systems%,$skip}; done  # SIM_SKIP: left out
    [[ -n ${3:-} ]] && systems+=",$3"
    # SIM_PROCS=1: each system in a process of its own, SIM_REPS repetitions (default 3), the order reversed every
    # other repetition; every timed step of every process pooled per system ([Note: alternated worlds])
    procs=("$systems"); reps=1
    if [[ ${SIM_PROCS:-0} == 1 ]]; then IFS=',' read -ra procs <<< "$systems"; reps=${SIM_REPS:-3}; fi
    for ((r = 0; r < reps; r++)); do
      order=("${procs[@]}"); ((r % 2)) && order=($(printf '%s\n' "${procs[@]}" | tac))
      for sys in "${order[@]}"; do
        tag=$1-w$2; [[ ${SIM_PROCS:-0} == 1 ]] && tag+=-${sys//,/+}
        json=bench/out/sim-$tag.json; k=2
        while [[ -e $json ]]; do json=bench/out/sim-$tag-r$k.json; k=$((k + 1)); done
        results+=("$json")
        left=$((budget - SECONDS))
        if ((left < 45)); then echo "# skipped $1 ($sys) at simulated world $2: ${left}s left" | tee -a "$LOG/simworld.log"; continue; fi
        echo "# $1 GPT ($sys) at simulated world $2 (${left}s left)" | tee -a "$LOG/simworld.log"
        mkdir -p bench/out
        timeout -k 5 "$left" python3 bench/gather_release.py --sim-world "$2" $shape --systems "$sys" \
          --rounds "${SIM_ROUNDS:-2}" --steps "${SIM_STEPS:-4}" --warmup 2 ${SIM_EXTRA:-} --out "$json" >"${json%.json}.log" 2>&1
        rc=$?
        cat "${json%.json}.log" >>"$LOG/simworld.log"
        ((rc == 0)) || { echo "# $1 at simulated world $2: exit $rc"; tail -n 15 "${json%.json}.log"; } | tee -a "$LOG/simworld.log"
        [[ ${SIM_PROCS:-0} == 1 ]] || sed -n '/^# gather_release/,/^# ratios/p' "${json%.json}.log"
      done
    done
  done
  python3 bench/simworld/summarize.py "$LOG/simworld.json" "${results[@]}" | tee "$LOG/simworld-summary.md"
fi
