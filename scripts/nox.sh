#!/usr/bin/env bash
# nox on a fresh machine: installs nox and uv (requirements/nox.txt) into .nox-tools with the
# machine's python3 the first time, or when that file changes, then runs nox with the arguments.
#   bash scripts/nox.sh -t fast     the inner loop          bash scripts/nox.sh -t ci     what CI runs
#   bash scripts/nox.sh -t full     everything              bash scripts/nox.sh -l        the sessions
set -euo pipefail
cd "$(dirname "$0")/.."
TOOLS=.nox-tools
if ! cmp -s requirements/nox.txt "$TOOLS/requirements.txt" 2>/dev/null; then
    rm -rf "$TOOLS"
    "${PYTHON:-python3}" -m venv "$TOOLS"
    "$TOOLS/bin/python" -m pip install --disable-pip-version-check -q -r requirements/nox.txt
    cp requirements/nox.txt "$TOOLS/requirements.txt"
fi
exec "$TOOLS/bin/nox" "$@"
