#!/usr/bin/env bash
# The main job: set up (noxfile.py's train session: torch, the package, the HF stack, deepspeed),
# then fine-tune a small Llama with PEFT LoRA under ZeRO-3 and non-reentrant activation
# checkpointing, with the deepspeed launcher (EXAMPLE=examples/train_frozen_checkpoint.py runs the
# bug's plain-torch reproducer instead). CPU-only machines get 2 ranks over gloo; with GPUs,
# NUM_GPUS ranks (default 2). DS_VERSION=0.14.5 runs it on another deepspeed of the matrix;
# arguments go to the script.
set -euo pipefail
cd "$(dirname "$0")/.."
# The CPU shm comm op leaves /dev/shm/deepspeed_* buffers behind: remove the ones this run made.
before=$(ls /dev/shm 2>/dev/null | grep '^deepspeed_' || true)
cleanup() {
    for name in $(ls /dev/shm 2>/dev/null | grep '^deepspeed_' || true); do
        grep -qxF "$name" <<<"$before" || rm -f "/dev/shm/$name"
    done
}
trap cleanup EXIT
bash scripts/nox.sh -s train -- "$@"
