#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: .venv with torch (first), the project, test tools, the
# HF stack (transformers, peft, accelerate, trl: the [hf] extra), the project in editable mode, and each deepspeed of the
# matrix under .deepspeed/<version> (selected with PYTHONPATH).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON=${PYTHON:-python3}
VENV=$ROOT/.venv

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install -r requirements/torch.txt
"${PIP[@]}" install -r requirements/runtime.txt -r requirements/test.txt -r requirements/hf.txt
# Editable: the tests and the start-up hook import this checkout, never a stale copy.
"${PIP[@]}" install --no-deps -e "$ROOT"

mkdir -p "$ROOT/.deepspeed"
for version in $(bash scripts/matrix_versions.sh); do
    target=$ROOT/.deepspeed/$version
    if [ ! -f "$target/.complete" ]; then
        rm -rf "$target"
        "${PIP[@]}" install --no-deps --target "$target" "deepspeed==$version"
        touch "$target/.complete"
    fi
done
