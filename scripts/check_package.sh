#!/usr/bin/env bash
# The package as others ship it: from a copy of the tree, `python -m build` (hatchling) makes the
# sdist and, from that sdist, the wheel; `twine check` passes on both; a fresh venv with only torch
# (requirements/torch.txt), deepspeed (DEEPSPEED, default 0.19.2, with its dependencies) and the
# built wheel starts nothing heavy at start-up and reports status().mode == "patched" once
# deepspeed's ZeRO-3 module is imported; then the same venv with an editable install of the tree
# copy in place of the wheel does too. Prints one line per check; exits non-zero on the first
# that fails. Run by noxfile.py's package session (bash scripts/nox.sh -s package), which gives it
# BUILD_PYTHON (an interpreter with build and twine), UV (the installer of the fresh venv) and
# FIND_LINKS (pip's configured local wheels, named to uv).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DEEPSPEED=${DEEPSPEED:-0.19.2}
PYTHON=${PYTHON:-python3}
: "${BUILD_PYTHON:?an interpreter with build and twine (bash scripts/nox.sh -s package sets it)}"
: "${UV:?the uv executable (bash scripts/nox.sh -s package sets it)}"
read -ra find_links <<<"${FIND_LINKS:-}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

git ls-files -co --exclude-standard | tar -cf - -T - | tar -xf - -C "$work" --one-top-level=tree
"$BUILD_PYTHON" -m build --outdir "$work/dist" "$work/tree" >"$work/build.log" 2>&1 \
    || { tail -20 "$work/build.log"; echo "package: python -m build FAILED"; exit 1; }
echo "package: built $(cd "$work/dist" && echo *)"
"$BUILD_PYTHON" -m twine check --strict "$work"/dist/* >"$work/twine.log" 2>&1 \
    || { cat "$work/twine.log"; echo "package: twine check FAILED"; exit 1; }
echo "package: twine check passed"

"$UV" venv -q --python "$PYTHON" "$work/venv"
install=(env VIRTUAL_ENV="$work/venv" "$UV" pip install -q ${find_links[@]+"${find_links[@]/#/--find-links=}"})
"${install[@]}" -r requirements/torch.txt
"${install[@]}" "deepspeed==$DEEPSPEED"
"${install[@]}" --no-deps "$work"/dist/*.whl
cd "$work"
# activates KIND: the venv's interpreter, started afresh, finds the .pth and the patch applied.
activates() {
KIND=$1 "$work/venv/bin/python" - <<'PY'
import importlib.metadata
import os
import sys

site = [path for path in sys.path if path.endswith("site-packages")]
if not any(os.path.isfile(os.path.join(path, "zero3_recompute.pth")) for path in site):
    sys.exit(f"package: FAILED, no zero3_recompute.pth in {site}")
heavy = sorted(name for name in ("torch", "deepspeed", "zero3_recompute.patch") if name in sys.modules)
if heavy:
    sys.exit(f"package: FAILED, start-up imported {heavy}; expected nothing until deepspeed is imported")
import deepspeed.runtime.zero.parameter_offload  # noqa: E402,F401
import zero3_recompute  # noqa: E402

status = zero3_recompute.status()
if status.mode != "patched":
    sys.exit(f"package: FAILED, expected status().mode == 'patched', got {status.mode!r}: {status.detail}")
license_files = importlib.metadata.metadata("zero3-recompute").get_all("License-File")
print(f"package: a fresh venv with the {os.environ['KIND']}, torch {importlib.metadata.version('torch')} and "
      f"deepspeed {importlib.metadata.version('deepspeed')} reports {status.mode} (policy {status.policy}); "
      f"imported from {os.path.dirname(zero3_recompute.__file__)}; license files {license_files}")
PY
}
activates wheel
VIRTUAL_ENV="$work/venv" "$UV" pip uninstall -q zero3-recompute
"${install[@]}" --no-deps -e "$work/tree"
activates "editable install"
