#!/usr/bin/env bash
# The main job: set up, then fine-tune a small Llama with PEFT LoRA under ZeRO-3 and
# non-reentrant activation checkpointing, with the deepspeed launcher
# (EXAMPLE=examples/train_frozen_checkpoint.py runs the bug's plain-torch reproducer instead).
# CPU-only machines get 2 ranks over gloo; with GPUs, NUM_GPUS ranks (default 2).
# DS_VERSION=0.14.5 runs it on another deepspeed of the matrix; extra arguments go to the script.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
# Only what this run needs: .venv (torch, the package, the HF stack, deepspeed 0.19.2), and the
# deepspeed DS_VERSION names. The test command (scripts/test.sh) builds the whole matrix.
SETUP=main DS_VERSIONS=${DS_VERSION:-} bash scripts/setup_env.sh

export PATH="$ROOT/.venv/bin:$PATH"
NUM_GPUS=${NUM_GPUS:-2}
# deepspeed's CPU accelerator counts its "devices" from LOCAL_SIZE, or else runs numactl
# (not installed here; deepspeed 0.14.x's launcher needs one or the other). CUDA ignores it.
export LOCAL_SIZE=${LOCAL_SIZE:-$NUM_GPUS}
if [ -n "${DS_VERSION:-}" ]; then
    export PYTHONPATH="$ROOT/.deepspeed/$DS_VERSION${PYTHONPATH:+:$PYTHONPATH}"
    # deepspeed JIT-builds its CPU shm comm op on first use; keep each version's build apart.
    export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$HOME/.cache/torch_extensions}/deepspeed-$DS_VERSION"
fi

# The CPU shm comm op leaves /dev/shm/deepspeed_* buffers behind: remove the ones this run made.
before=$(ls /dev/shm 2>/dev/null | grep '^deepspeed_' || true)
cleanup() {
    for name in $(ls /dev/shm 2>/dev/null | grep '^deepspeed_' || true); do
        grep -qxF "$name" <<<"$before" || rm -f "/dev/shm/$name"
    done
}
trap cleanup EXIT
deepspeed --num_gpus "$NUM_GPUS" "${EXAMPLE:-examples/train_llama_lora.py}" "$@"
