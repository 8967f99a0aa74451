#!/usr/bin/env bash
# The test command: set up, then run the whole suite once per deepspeed version of the matrix
# (DS_VERSIONS=0.19.2,0.14.5 picks some). Exits non-zero if any version fails.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
bash scripts/setup_env.sh || { echo "set-up failed"; exit 1; }

versions=$(bash scripts/matrix_versions.sh) || { echo "no deepspeed versions to test"; exit 1; }
reports=$(mktemp -d)
trap 'rm -rf "$reports"' EXIT
status=0
for version in $versions; do
    echo "=== deepspeed $version ==="
    started=$(date +%s)
    PYTHONPATH="$ROOT/.deepspeed/$version" "$ROOT/.venv/bin/python" -m pytest tests -q -rs -p no:cacheprovider \
        --junitxml="$reports/deepspeed-$version.xml" "$@"
    code=$?
    echo "=== deepspeed $version: pytest exit $code in $(( $(date +%s) - started )) s ==="
    # Exit 5 means no test ran: a broken selection, so a failure here.
    [ "$code" -eq 0 ] || status=1
done
"$ROOT/.venv/bin/python" scripts/summarize_junit.py "$reports"
exit $status
