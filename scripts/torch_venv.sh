#!/usr/bin/env bash
# torch_venv.sh TORCH PYTHON: build .torch/<TORCH>, the venv of one torch pairing, on Python
# PYTHON (X.Y: pyenv's, else pythonX.Y on PATH). Idempotent (.torch/<TORCH>/.complete).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

# python_for X.Y: an interpreter of that Python (pyenv's, else pythonX.Y on PATH).
python_for() {
    local wanted=$1 found
    found=$(ls -d "$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")"/versions/"$wanted".*/bin/python 2>/dev/null \
        | sort -V | tail -n 1)
    [ -n "$found" ] || found=$(command -v "python$wanted" || true)
    [ -n "$found" ] || { echo "no Python $wanted for a torch pairing (pyenv install $wanted, or TORCH_VERSIONS=...)" >&2; return 1; }
    echo "$found"
}

# build_torch_venv TORCH PYTHON: torch first (a CUDA build from the index but for the release this
# disk holds, which runs on the CPU; --no-cache-dir keeps its 2.5 GB of wheels off the disk),
# then the runtime and test tools and the checkout in editable mode; then
# the transformers 5 stack of requirements/hf.txt where it installs beside that torch and Python,
# else the 4.57 stack of requirements/hf4.txt (.torch/<torch>/hf says which, or why neither:
# the support table shows it).
build_torch_venv() {
    local torch=$1 python venv=$ROOT/.torch/$1
    [ -f "$venv/.complete" ] && return 0
    python=$(python_for "$2")
    rm -rf "$venv"
    "$python" -m venv "$venv"
    # Every install in it holds torch at the pairing's release (this constraint replaces any the
    # machine's pip configuration sets).
    echo "torch==$torch" >"$venv/torch-pin.txt"
    local pip=(env PIP_CONSTRAINT="$venv/torch-pin.txt" "$venv/bin/python" -m pip --disable-pip-version-check -q)
    "${pip[@]}" install --no-cache-dir "torch==$torch"
    "${pip[@]}" install -r requirements/runtime.txt -r requirements/test.txt
    "${pip[@]}" install --no-deps -e "$ROOT"
    local stack
    for stack in hf hf4 none; do
        if [ "$stack" = none ]; then
            echo "neither HF stack installs beside torch $torch on Python $2:" \
                "$(grep -m1 -E '^ERROR' "$venv/hf.log" || tail -n 1 "$venv/hf.log")" >"$venv/hf"
        elif "${pip[@]}" install -r "requirements/$stack.txt" >"$venv/hf.log" 2>&1; then
            echo "transformers $("$venv/bin/python" -c 'import transformers; print(transformers.__version__)')" >"$venv/hf"
            break
        fi
    done
    touch "$venv/.complete"
}


build_torch_venv "$1" "$2"
