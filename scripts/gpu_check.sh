#!/usr/bin/env bash
# What only a GPU shows (autograd device threads, in-flight all-gathers, CUDA streams), checked on
# one CUDA GPU, one rank (NCCL), in under 8 minutes; one summary line per check:
#   PASS|FAIL <check> (<seconds> s): <what it saw>
#   1. reproducer  the seed's reproducer (examples/train_frozen_checkpoint.py), 1 rank
#   2. matrix      the core set and the scenario matrix, 1 rank, prefetch off and deepspeed's
#                  default prefetch (every policy)
#   3. fault       a backward that raises inside a recompute, then further steps, with the
#                  coordinator's counts checked (the fault scenarios, prefetch off)
#   4. bench       the benchmark at hidden 2048, 8 blocks, bf16: step-time ratios of each policy
#                  against stock or deepspeed's own handling, measured side by side
#
#   bash scripts/gpu_check.sh          on the GPU machine, in this repository's environments
#   bash scripts/gpu_check.sh --dry    on CPU, one gloo rank, tiny sizes: the plumbing alone
#
# PYTHON (default .venv/bin/python) and DS_VERSION (default 0.19.2; .deepspeed/<version>) pick
# the environment; OUT (default a temporary folder) keeps the logs and bench.json;
# GPU_CHECK_CHECKS=fault,bench runs only those. Exits 1 if a check failed.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DRY=0
[ "${1:-}" = "--dry" ] && DRY=1
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
DS_VERSION=${DS_VERSION:-0.19.2}
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
export PYTHONPATH="$ROOT/.deepspeed/$DS_VERSION${PYTHONPATH:+:$PYTHONPATH}"
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$HOME/.cache/torch_extensions}/gpu-check-$DS_VERSION"
export ZERO3_WORLD_SIZE=1
if [ "$DRY" = 1 ]; then
    export DS_ACCELERATOR=cpu CUDA_VISIBLE_DEVICES="" LOCAL_SIZE=1
    BENCH_SIZE=(--hidden 64 --heads 2 --vocab 128 --seq 16 --blocks 2 --steps 3 --dtype fp32)
else
    if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
        echo "gpu_check: no CUDA GPU visible to $PYTHON (run with --dry for the CPU plumbing check)"
        exit 1
    fi
    BENCH_SIZE=(--hidden 2048 --heads 16 --vocab 8192 --seq 512 --blocks 8 --steps 6 --dtype bf16)
fi
"$PYTHON" -c "import deepspeed, torch; print(f'gpu_check: deepspeed {deepspeed.__version__}, torch {torch.__version__}, ' \
    f'cuda {torch.cuda.is_available()}, dry run {bool($DRY)}')" 2>/dev/null || { echo "gpu_check: cannot import deepspeed"; exit 1; }

passed=0
failed=0
wanted=",${GPU_CHECK_CHECKS:-reproducer,matrix,fault,bench},"
REPRODUCER=(examples/train_frozen_checkpoint.py)
if [ "$DRY" = 1 ]; then
    # One gloo rank needs no shared-memory comm op: skip its JIT build, and its /dev/shm buffers.
    REPRODUCER=(-c "import runpy, deepspeed.ops; deepspeed.ops.__compatible_ops__['deepspeed_shm_comm'] = False; \
runpy.run_path('examples/train_frozen_checkpoint.py', run_name='__main__')")
fi
# check NAME DETAIL-COMMAND -- COMMAND...: runs COMMAND (log under $OUT/NAME.log), then prints
# one line; DETAIL-COMMAND reads the log on stdin and prints what the check saw.
check() {
    local name=$1 detail=$2
    shift 3
    [[ "$wanted" == *",$name,"* ]] || return 0
    local started code seen
    started=$(date +%s)
    "$@" >"$OUT/$name.log" 2>&1
    code=$?
    seen=$(bash -c "$detail" <"$OUT/$name.log" 2>/dev/null | tr '\n' ' ')
    if [ "$code" -eq 0 ]; then
        passed=$((passed + 1))
        echo "PASS $name ($(( $(date +%s) - started )) s): $seen"
    else
        failed=$((failed + 1))
        echo "FAIL $name ($(( $(date +%s) - started )) s): exit $code; $seen (log: $OUT/$name.log)"
    fi
}

port=$("$PYTHON" -c "from zero3_recompute.testing.ranks import free_port; print(free_port())")
check reproducer "grep '^summary: loss' | head -1" -- \
    env RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT="$port" \
    "$PYTHON" "${REPRODUCER[@]}" --steps 4

PYTEST=("$PYTHON" -m pytest -q -p no:cacheprovider)
check matrix "tail -1" -- env ZERO3_DEEPSPEED_PREFETCH=1 "${PYTEST[@]}" \
    tests/unit/v1/zero/test_frozen_param_checkpointing.py tests/unit/v1/zero/test_recompute_scenarios.py \
    -k "not test_stock_behaviour"
check fault "tail -1" -- "${PYTEST[@]}" tests/unit/v1/zero/test_recompute_scenarios.py \
    -k "test_with_package and (fault_in_recompute or backward_aborted_halfway)"
check bench "$PYTHON scripts/bench_ratios.py $OUT/bench/bench.json" -- \
    "$PYTHON" -m zero3_recompute bench "${BENCH_SIZE[@]}" --ranks 1 --out "$OUT/bench" --timeout 420

echo "gpu_check: $passed passed, $failed failed (logs: $OUT)"
[ "$failed" -eq 0 ]
