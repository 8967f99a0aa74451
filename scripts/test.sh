#!/usr/bin/env bash
# The test command: set up, then run the whole suite once per deepspeed version of the matrix
# (DS_VERSIONS=0.19.2,0.14.5 picks some). Exits non-zero if any version fails.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
bash scripts/setup_env.sh || { echo "set-up failed"; exit 1; }

versions=$(bash scripts/matrix_versions.sh) || { echo "no deepspeed versions to test"; exit 1; }
# ZERO3_REPORTS=DIR keeps the JUnit reports (one per version) and the rendered scenario table.
if [ -n "${ZERO3_REPORTS:-}" ]; then
    reports=$ZERO3_REPORTS
    mkdir -p "$reports"
else
    reports=$(mktemp -d)
    trap 'rm -rf "$reports"' EXIT
fi
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
"$ROOT/.venv/bin/python" scripts/scenario_table.py "$reports" "$reports/scenarios.md" 2>/dev/null \
    && echo "scenario x version table: $reports/scenarios.md"
exit $status
