#!/usr/bin/env bash
# The test command: set up, then run the whole suite once per deepspeed version of the matrix
# (DS_VERSIONS=0.19.2,0.14.5 picks some), in .venv (the transformers 5 stack of requirements/hf.txt).
# After each version's suite, a second pass runs the HF integration tests (tests/integration -m hf) in .venv-hf4,
# the transformers 4.57 stack of requirements/hf4.txt (JUnit report deepspeed-<version>-hf4.xml).
# Arguments go to pytest, for the suite only: given any, the second pass is left out, unless
# HF4=1, which runs it with those arguments after -m hf (a -m of theirs replaces it). HF4=0 never
# runs it, and the set-up leaves .venv-hf4 out. Exits non-zero if any pass of any version fails.
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
    if [ "${HF4:-}" = 1 ] || { [ "${HF4:-}" != 0 ] && [ $# -eq 0 ]; }; then
        started=$(date +%s)
        PYTHONPATH="$ROOT/.deepspeed/$version" "$ROOT/.venv-hf4/bin/python" -m pytest tests/integration -q -rs -p no:cacheprovider \
            --junitxml="$reports/deepspeed-$version-hf4.xml" -m hf "$@"
        code=$?
        echo "=== deepspeed $version, transformers 4.57 (-m hf): pytest exit $code in $(( $(date +%s) - started )) s ==="
        [ "$code" -eq 0 ] || status=1
    fi
done
"$ROOT/.venv/bin/python" scripts/summarize_junit.py "$reports"
"$ROOT/.venv/bin/python" scripts/scenario_table.py "$reports" "$reports/scenarios.md" 2>/dev/null \
    && echo "scenario x version table: $reports/scenarios.md"
"$ROOT/.venv/bin/python" scripts/support_table.py "$reports" "$reports/support.md" \
    && echo "support table for the README: $reports/support.md (scripts/support_table.py $reports --readme README.md)"
exit $status
