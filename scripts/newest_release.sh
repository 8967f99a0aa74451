#!/usr/bin/env bash
# The newest-release job: resolve the newest deepspeed and the newest torch on the package index
# at run time, install them beside the matrix (.deepspeed/<version>, .torch/<torch> on Python
# ${TORCH_NEWEST_PYTHON:-3.12}), run the core regression set and the scenario matrix twice
# (the newest deepspeed on the main torch, then on the newest torch), and print how the package
# classifies each:
#   patched and passing | patched, N failing | refused: <the named fingerprint mismatch> | ...
# It needs the package index, so it stays out of .ci/run; .github/workflows/newest-deepspeed.yml
# runs it weekly. DS_NEWEST=0.19.8 and TORCH_NEWEST=2.15.0 skip the look-ups (offline, or to
# re-check one version).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

# newest NAME: the newest release of NAME on the package index.
newest() {
    "${PYTHON_FOR_INDEX:-python3}" -m pip index versions "$1" 2>/dev/null | sed -n "s/^$1 (\(.*\))\$/\1/p"
}

ds_newest=${DS_NEWEST:-$(newest deepspeed)}
[ -n "$ds_newest" ] || { echo "could not resolve the newest deepspeed on the package index"; exit 1; }
torch_newest=${TORCH_NEWEST:-$(newest torch)}
[ -n "$torch_newest" ] || { echo "could not resolve the newest torch on the package index"; exit 1; }
echo "=== newest on the index: deepspeed $ds_newest, torch $torch_newest ==="
# HF4=0: no transformers 4.57 environment, this job runs no HF test. TORCH_VERSIONS=: no pairing.
DS_VERSIONS=$ds_newest HF4=0 TORCH_VERSIONS= bash scripts/setup_env.sh || { echo "set-up failed"; exit 1; }
bash scripts/torch_venv.sh "$torch_newest" "${TORCH_NEWEST_PYTHON:-3.12}" || { echo "torch $torch_newest: set-up failed"; exit 1; }

export PYTHONPATH="$ROOT/.deepspeed/$ds_newest"
status=0

# classify PYTHON LABEL: the package's status and the core set + scenario matrix in that
# environment, then one line: "classification for LABEL: <verdict>".
classify() {
    local python=$1 label=$2 report found mode policy detail code failed verdict
    report="$ROOT/.deepspeed/newest-${label// /-}.xml"
    found=$("$python" - <<'PY' 2>/dev/null
import importlib
import zero3_recompute
try:
    importlib.import_module("deepspeed.runtime.zero.parameter_offload")
except Exception as exc:  # deepspeed itself failed to import: report it as the detail
    print(f"status|no-deepspeed|-|{type(exc).__name__}: {exc}")
else:
    found = zero3_recompute.status()
    print(f"status|{found.mode}|{found.policy}|{found.detail}")
PY
)
    # deepspeed prints its accelerator warning to stdout too: keep only our line.
    IFS='|' read -r _ mode policy detail <<<"$(grep '^status|' <<<"$found")"
    echo "status on $label: ${mode:-unknown} (policy ${policy:-none}): ${detail:-}"
    "$python" -m pytest tests/unit/v1/zero -q -rs -p no:cacheprovider -k "FrozenParamCheckpointing or RecomputeScenarios" \
        --junitxml="$report"
    code=$?
    failed=$("$ROOT/.venv/bin/python" - "$report" <<'PY'
import sys
import xml.etree.ElementTree as ElementTree

suites = list(ElementTree.parse(sys.argv[1]).getroot().iter("testsuite"))
print(sum(int(suite.get("failures", 0)) + int(suite.get("errors", 0)) for suite in suites))
PY
)
    case "$mode" in
        patched) [ "$code" -eq 0 ] && verdict="patched and passing" || verdict="patched, $failed failing" ;;
        mismatch|unsupported) verdict="refused: $detail" ;;
        upstream) verdict="deepspeed's own handling in charge (policy upstream), tests exit $code" ;;
        *) verdict="not patched ($mode): $detail" ;;
    esac
    echo "classification for $label: $verdict"
    [ "$code" -eq 0 ] || status=1
}

classify "$ROOT/.venv/bin/python" "deepspeed $ds_newest"
classify "$ROOT/.torch/$torch_newest/bin/python" "torch $torch_newest with deepspeed $ds_newest"
exit $status
