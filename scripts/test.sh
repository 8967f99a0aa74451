#!/usr/bin/env bash
# The test command: set up, then run the whole suite once per deepspeed version of the matrix
# (DS_VERSIONS=0.19.2,0.14.5 picks some), in .venv (torch 2.13.0, the transformers 5 stack of
# requirements/hf.txt). After each version's suite, a second pass runs the HF integration tests
# (tests/integration -m hf) in .venv-hf4, the transformers 4.57 stack of requirements/hf4.txt.
# Then the torch axis: each pairing of requirements/torch-matrix.txt (scripts/torch_pairings.sh:
# the ci lines by default; TORCH_VERSIONS=2.4.1,2.7.1 or =all picks others, and leaves the
# 2.13.0 passes out unless it names 2.13.0) runs the suite in .torch/<torch> with each of its
# deepspeed versions, the HF tests included where an HF stack installed there.
# First of all, the package check (scripts/check_package.sh; PACKAGE_CHECK=0 leaves it out).
# JUnit reports: deepspeed-<version>-torch-<torch>[-hf4].xml; each records its torch and Python.
# Arguments go to pytest, for the suite only: given any, the hf4 pass is left out, unless
# HF4=1, which runs it with those arguments after -m hf (a -m of theirs replaces it). HF4=0 never
# runs it, and the set-up leaves .venv-hf4 out. Exits non-zero if any pass of any version fails.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
bash scripts/setup_env.sh || { echo "set-up failed"; exit 1; }
unset ZERO3_REPEAT_PASS

versions=$(bash scripts/matrix_versions.sh) || { echo "no deepspeed versions to test"; exit 1; }
# ZERO3_REPORTS=DIR keeps the JUnit reports (one per version) and the rendered scenario table.
if [ -n "${ZERO3_REPORTS:-}" ]; then
    reports=$ZERO3_REPORTS
    mkdir -p "$reports"
else
    reports=$(mktemp -d)
    trap 'rm -rf "$reports"' EXIT
fi
MAIN_TORCH=$(sed -n 's/^torch==\([0-9.]*\).*/\1/p' requirements/torch.txt)
status=0

# run_pass LABEL VENV DEEPSPEED REPORT PYTEST-ARGS...: one pytest pass; its own extensions folder
# per torch and deepspeed (nothing is compiled, but a stray JIT build must not mix them).
run_pass() {
    local label=$1 venv=$2 version=$3 report=$4
    shift 4
    echo "=== $label ==="
    local started code
    started=$(date +%s)
    TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$HOME/.cache/torch_extensions}/$(basename "$venv")-deepspeed-$version" \
        PYTHONPATH="$ROOT/.deepspeed/$version" "$venv/bin/python" -m pytest -q -rs -p no:cacheprovider \
        --junitxml="$reports/$report" "$@"
    code=$?
    # Tests marked once_per_run (the harness, the layout) ran in this first pass; the rest leave them out.
    export ZERO3_REPEAT_PASS=1
    echo "=== $label: pytest exit $code in $(( $(date +%s) - started )) s ==="
    # Exit 5 means no test ran: a broken selection, so a failure here.
    [ "$code" -eq 0 ] || status=1
}

# The package as others ship it (scripts/check_package.sh): sdist, wheel from it, twine check, and
# the wheel alone in a fresh venv activating on import. PACKAGE_CHECK=0 leaves it out.
if [ "${PACKAGE_CHECK:-}" != 0 ]; then
    echo "=== package: build, twine check, a fresh venv with the wheel ==="
    started=$(date +%s)
    bash scripts/check_package.sh || status=1
    echo "=== package: done in $(( $(date +%s) - started )) s ==="
fi

if [ -z "${TORCH_VERSIONS+set}" ] || [[ " $(tr ',' ' ' <<<"$TORCH_VERSIONS") " == *" $MAIN_TORCH "* ]] \
        || [[ " $(tr ',' ' ' <<<"$TORCH_VERSIONS") " == *" all "* ]]; then
    for version in $versions; do
        run_pass "deepspeed $version, torch $MAIN_TORCH" "$ROOT/.venv" "$version" \
            "deepspeed-$version-torch-$MAIN_TORCH.xml" tests "$@"
        if [ "${HF4:-}" = 1 ] || { [ "${HF4:-}" != 0 ] && [ $# -eq 0 ]; }; then
            run_pass "deepspeed $version, torch $MAIN_TORCH, transformers 4.57 (-m hf)" "$ROOT/.venv-hf4" "$version" \
                "deepspeed-$version-torch-$MAIN_TORCH-hf4.xml" tests/integration -m hf "$@"
        fi
    done
fi

# The torch axis: the suite in each pairing's venv (what .torch/<torch>/hf says of its HF stack
# goes into the support table).
while read -r torch python pairing_versions; do
    [ -n "$torch" ] || continue
    echo "=== torch $torch on Python $python: $(cat "$ROOT/.torch/$torch/hf" 2>/dev/null || echo 'HF stack unknown') ==="
    cp "$ROOT/.torch/$torch/hf" "$reports/torch-$torch.hf" 2>/dev/null || true
    for version in $pairing_versions; do
        run_pass "deepspeed $version, torch $torch" "$ROOT/.torch/$torch" "$version" \
            "deepspeed-$version-torch-$torch.xml" tests "$@"
    done
done < <(bash scripts/torch_pairings.sh)
"$ROOT/.venv/bin/python" scripts/summarize_junit.py "$reports"
"$ROOT/.venv/bin/python" scripts/scenario_table.py "$reports" "$reports/scenarios.md" 2>/dev/null \
    && echo "scenario x version table: $reports/scenarios.md"
"$ROOT/.venv/bin/python" scripts/support_table.py "$reports" "$reports/support.md" \
    && echo "support table for docs/support.md: $reports/support.md (scripts/support_table.py $reports --readme docs/support.md)"
exit $status
