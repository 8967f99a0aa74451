#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: .venv with torch (first), the project, test tools, the
# HF stack (transformers, peft, accelerate, trl: the [hf] extra, requirements/hf.txt), the project
# in editable mode; .venv-hf4, the same with the transformers 4.57 stack of requirements/hf4.txt
# (left out with HF4=0); one venv per torch pairing of requirements/torch-matrix.txt under
# .torch/<torch> (scripts/torch_pairings.sh: the ci lines, or TORCH_VERSIONS=...), on the
# Python that line names; and each deepspeed of the matrix under .deepspeed/<version> (selected
# with PYTHONPATH), shared by every environment. SETUP=main builds only what the main job runs
# (scripts/train.sh): .venv, and the deepspeed of DS_VERSIONS if it names one (.venv's own
# deepspeed, requirements/runtime.txt, otherwise).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON=${PYTHON:-python3}
VENV=$ROOT/.venv

# build_venv DIR HF_REQUIREMENTS: torch first, then the runtime, test tools and that HF stack, then
# the checkout in editable mode (the tests and the start-up hook import this checkout, never a
# stale copy). Idempotent: pip leaves what is already pinned in place.
build_venv() {
    local venv=$1 hf_requirements=$2
    if [ ! -x "$venv/bin/python" ]; then
        "$PYTHON" -m venv "$venv"
    fi
    local pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
    "${pip[@]}" install -r requirements/torch.txt
    "${pip[@]}" install -r requirements/runtime.txt -r requirements/test.txt -r "$hf_requirements"
    "${pip[@]}" install --no-deps -e "$ROOT"
}

build_venv "$VENV" requirements/hf.txt
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
if [ "${SETUP:-}" = main ]; then
    versions=${DS_VERSIONS:+$(bash scripts/matrix_versions.sh)}
else
    # The transformers 4.57 stack, for the second pass of the HF integration tests (HF4=0: not needed).
    if [ "${HF4:-}" != 0 ]; then
        build_venv "$ROOT/.venv-hf4" requirements/hf4.txt
    fi
    bash scripts/torch_pairings.sh | while read -r torch python _; do
        bash scripts/torch_venv.sh "$torch" "$python"
    done
    versions=$(bash scripts/matrix_versions.sh)
fi

mkdir -p "$ROOT/.deepspeed"
for version in $versions; do
    target=$ROOT/.deepspeed/$version
    if [ ! -f "$target/.complete" ]; then
        rm -rf "$target"
        "${PIP[@]}" install --no-deps --target "$target" "deepspeed==$version"
        touch "$target/.complete"
    fi
done
