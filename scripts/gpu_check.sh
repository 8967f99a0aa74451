#!/usr/bin/env bash
# What only a GPU shows (autograd device threads, in-flight all-gathers, CUDA streams, the caching
# allocator), checked on one CUDA GPU in under 10 minutes; one summary line per check:
#   PASS|FAIL <check> (<seconds> s): <what it saw>
#   1. reproducer  the seed's reproducer (examples/train_frozen_checkpoint.py), 1 rank
#   2. matrix      the core set and the scenario matrix under deepspeed's default prefetch, every
#                  policy, 2 ranks
#   3. fault       a backward that raises inside a recompute, then further steps, with the
#                  coordinator's counts checked (the fault scenarios, prefetch off), 2 ranks
#   4. order       the cross-rank check of all-gather order catches a swap on one rank, 2 ranks
#                  (every distributed test of checks 2-6 runs that check too)
#   5. qlora       QLoRA: bitsandbytes 4-bit on CUDA, HF Trainer + PEFT, 2 ranks
#   6. memcheck    the kept-storage path (free in place and refill: views kept on an autograd
#                  context, QLoRA's live storage) with PyTorch's caching allocator off
#                  (PYTORCH_NO_CUDA_MEMORY_CACHING=1, so a read of freed memory is not hidden by a
#                  cached block); where compute-sanitizer is installed, the custom-Function test
#                  alone under its memcheck instead
#   7. bench       the benchmark at hidden 2048, 8 blocks, bf16: step-time ratios of each policy
#                  against stock or deepspeed's own handling, measured side by side, 1 rank
#
# Two ranks share the one GPU over gloo (NCCL refuses two ranks on a device): each runs on
# cuda:0 with deepspeed's CUDA accelerator, and gloo moves each collective through host copies
# (ZERO3_RANKS_SHARE_GPU=1, zero3_recompute/testing/ranks.py).
#
#   bash scripts/gpu_check.sh          on the GPU machine, in this repository's environments
#   bash scripts/gpu_check.sh --dry    on CPU, two gloo ranks, tiny sizes: the plumbing alone
#
# PYTHON (default the main environment, .nox/environments/torch-<requirements/torch.txt>-hf,
# which `bash scripts/nox.sh -s "fast(torch-2.13.0-deepspeed-0.19.2)"` builds) picks the
# environment, its own deepspeed included (deepspeed 0.19.2 in the main environment);
# DEEPSPEED_DIR, a folder of `pip install --no-deps --target DIR deepspeed==X` (such as
# .nox/deepspeed/0.19.8-py3.11), puts another deepspeed ahead of it; OUT (default a temporary folder) keeps the logs and bench.json;
# GPU_CHECK_CHECKS=fault,bench runs only those. Each check has its own time limit
# (CHECK_LIMITS below), so the whole script ends within 10 minutes; GPU_CHECK_LIMITS=fault=120,order=60
# sets some of them (seconds). At its limit a check gets SIGINT, as a Ctrl-C: the test ranks do
# nothing on it (what they started stops), and pytest writes each rank's stacks, where it stood
# and its summary to the check's log, and kills the ranks; if pytest is still running 15 s later,
# its process group is killed (then the script can take 15 s more per such check). The
# bench's own timeout is 20 s before its limit (it then stops its ranks and reports their stacks),
# so a bench limit under 30 s is refused. Exits 1 if a check failed.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DRY=0
[ "${1:-}" = "--dry" ] && DRY=1

# Seconds each check may take: 540 in all, so that with the start-up the script ends inside 10 minutes.
# Read before anything is imported, so that a bad GPU_CHECK_LIMITS is refused at once.
declare -A CHECK_LIMITS=([reproducer]=40 [matrix]=180 [fault]=50 [order]=30 [qlora]=70 [memcheck]=80 [bench]=90)
BENCH_MARGIN=20  # the bench's own timeout comes this much before its limit: its imports, then its ranks' stacks
limits_text=${GPU_CHECK_LIMITS:-}
IFS=, read -ra limit_settings <<<"${limits_text//$'\n'/,}"
for setting in ${limit_settings[@]+"${limit_settings[@]}"}; do
    setting=${setting//[[:space:]]/}
    [ -z "$setting" ] && continue
    name=${setting%%=*} seconds=${setting#*=}
    if [ -z "$name" ] || [ -z "${CHECK_LIMITS[$name]+set}" ] || ! [[ "$seconds" =~ ^[1-9][0-9]*$ ]]; then
        echo "gpu_check: GPU_CHECK_LIMITS takes check=seconds pairs, the checks being ${!CHECK_LIMITS[*]};" \
            "got '$setting'"
        exit 2
    fi
    if [ "$name" = bench ] && [ "$seconds" -lt $((BENCH_MARGIN + 10)) ]; then
        echo "gpu_check: GPU_CHECK_LIMITS gives the bench $seconds s; it needs $((BENCH_MARGIN + 10)) s or more," \
            "as it stops itself $BENCH_MARGIN s before its limit"
        exit 2
    fi
    CHECK_LIMITS[$name]=$seconds
done

if [ -n "${DS_VERSION:-}" ]; then
    echo "gpu_check: DS_VERSION is no longer read; expected DEEPSPEED_DIR (a folder of" \
        "pip install --no-deps --target DIR deepspeed==X) or PYTHON (an environment with that deepspeed), got DS_VERSION=$DS_VERSION"
    exit 2
fi
MAIN_TORCH=$(sed -n 's/^torch==\([0-9.]*\).*/\1/p' requirements/torch.txt)
PYTHON=${PYTHON:-$ROOT/.nox/environments/torch-$MAIN_TORCH-hf/bin/python}
if ! [ -x "$PYTHON" ] && ! command -v "$PYTHON" >/dev/null; then
    echo "gpu_check: expected an interpreter in PYTHON, or the main environment at $PYTHON" \
        "(bash scripts/nox.sh -s \"fast(torch-$MAIN_TORCH-deepspeed-0.19.2)\" builds it); found none"
    exit 1
fi
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
if [ -n "${DEEPSPEED_DIR:-}" ]; then
    export PYTHONPATH="$DEEPSPEED_DIR${PYTHONPATH:+:$PYTHONPATH}"
fi
DS_VERSION=$(cd "${TMPDIR:-/tmp}" && "$PYTHON" -c "import importlib.metadata as m; print(m.version('deepspeed'))" 2>/dev/null \
    | tail -1)
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$HOME/.cache/torch_extensions}/gpu-check-${DS_VERSION:-unknown}"
export ZERO3_WORLD_SIZE=2
# The slow HF tests run on the deepspeed of this check, whichever it is.
export ZERO3_FULL_LANES=1
if [ "$DRY" = 1 ]; then
    export DS_ACCELERATOR=cpu CUDA_VISIBLE_DEVICES=""
    BENCH_SIZE=(--hidden 64 --heads 2 --vocab 128 --seq 16 --blocks 2 --steps 3 --dtype fp32)
else
    if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
        echo "gpu_check: no CUDA GPU visible to $PYTHON (run with --dry for the CPU plumbing check)"
        exit 1
    fi
    export ZERO3_RANKS_SHARE_GPU=1
    BENCH_SIZE=(--hidden 2048 --heads 16 --vocab 8192 --seq 512 --blocks 8 --steps 6 --dtype bf16)
fi
"$PYTHON" -c "import deepspeed, torch; print(f'gpu_check: deepspeed {deepspeed.__version__}, torch {torch.__version__}, ' \
    f'cuda {torch.cuda.is_available()}, dry run {bool($DRY)}')" 2>/dev/null || { echo "gpu_check: cannot import deepspeed"; exit 1; }
# The tests refuse any zero3_recompute but this checkout (tests/conftest.py): say so once, not per
# check. Asked from another folder, so that this one does not shadow what the interpreter imports.
case "$PYTHON" in */*) PYTHON="$(cd "$(dirname "$PYTHON")" && pwd)/$(basename "$PYTHON")" ;; esac
imported=$(cd "${TMPDIR:-/tmp}" && "$PYTHON" -c "import os, sys
try:
    import zero3_recompute
except Exception as exc:
    sys.exit(f'nowhere ({type(exc).__name__}: {exc})')
print(os.path.dirname(os.path.dirname(os.path.realpath(zero3_recompute.__file__))))" 2>&1 | tail -1)
if [ "$imported" != "$(pwd -P)" ]; then
    echo "gpu_check: $PYTHON imports zero3_recompute from $imported, expected this checkout $ROOT:" \
        "install it in editable mode (pip install --no-deps -e .)"
    exit 1
fi

passed=0
failed=0
wanted=",${GPU_CHECK_CHECKS:-reproducer,matrix,fault,order,qlora,memcheck,bench},"
REPRODUCER=(examples/train_frozen_checkpoint.py)
if [ "$DRY" = 1 ]; then
    # One gloo rank needs no shared-memory comm op: skip its JIT build, and its /dev/shm buffers.
    REPRODUCER=(-c "import runpy, deepspeed.ops; deepspeed.ops.__compatible_ops__['deepspeed_shm_comm'] = False; \
runpy.run_path('examples/train_frozen_checkpoint.py', run_name='__main__')")
fi
# check NAME DETAIL-COMMAND -- COMMAND...: runs COMMAND within its limit (log under $OUT/NAME.log),
# then prints one line; DETAIL-COMMAND reads the log on stdin and prints what the check saw.
check() {
    local name=$1 detail=$2
    shift 3
    [[ "$wanted" == *",$name,"* ]] || return 0
    local started code seen
    started=$(date +%s)
    # Unbuffered, so that what a check printed before its limit is in its log.
    PYTHONUNBUFFERED=1 timeout -s INT -k 15 "${CHECK_LIMITS[$name]}" "$@" >"$OUT/$name.log" 2>&1
    code=$?
    seen=$(bash -c "$detail" <"$OUT/$name.log" 2>/dev/null | tr '\n' ' ')
    if [ "$code" -eq 124 ] || [ "$code" -eq 137 ]; then
        seen="over its ${CHECK_LIMITS[$name]} s limit; $seen"
    fi
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
    env RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 LOCAL_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT="$port" \
    "$PYTHON" "${REPRODUCER[@]}" --steps 4

PYTEST=("$PYTHON" -m pytest -q -p no:cacheprovider)
check matrix "tail -1" -- env ZERO3_DEEPSPEED_PREFETCH=1 "${PYTEST[@]}" \
    tests/unit/v1/zero/test_frozen_param_checkpointing.py tests/unit/v1/zero/test_recompute_scenarios.py \
    -k "not test_stock_behaviour and (test_under_deepspeed_prefetch or FrozenParam)"
check fault "tail -1" -- "${PYTEST[@]}" tests/unit/v1/zero/test_recompute_scenarios.py \
    -k "test_with_package and (fault_in_recompute or backward_aborted_halfway)"
check order "tail -1" -- "${PYTEST[@]}" tests/unit/test_gather_order.py
check qlora "tail -1" -- "${PYTEST[@]}" tests/integration/test_hf_qlora.py -k "not Storage"
# compute-sanitizer slows a run many times over: under it, only the small custom-Function test.
KEPT_VIEWS=(tests/unit/v1/zero/test_context_kept_views.py -k "test_freed_until_fetched or test_returned_view_left_alone")
MEMCHECK=(env PYTORCH_NO_CUDA_MEMORY_CACHING=1 "${PYTEST[@]}" tests/unit/v1/zero/test_context_kept_views.py
          tests/integration/test_hf_qlora.py -k "test_freed_until_fetched or test_returned_view_left_alone or Storage")
if [ "$DRY" = 0 ] && command -v compute-sanitizer >/dev/null; then
    MEMCHECK=(env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --leak-check no --error-exitcode 3
              "${PYTEST[@]}" "${KEPT_VIEWS[@]}")
fi
check memcheck "tail -1" -- "${MEMCHECK[@]}"
check bench "$PYTHON scripts/bench_ratios.py $OUT/bench/bench.json" -- \
    "$PYTHON" -m zero3_recompute bench "${BENCH_SIZE[@]}" --ranks 1 --out "$OUT/bench" \
    --timeout $((CHECK_LIMITS[bench] - BENCH_MARGIN))

echo "gpu_check: $passed passed, $failed failed (logs: $OUT)"
[ "$failed" -eq 0 ]
