#!/usr/bin/env bash
# The newest-release job: resolve the newest deepspeed on the package index at run time,
# install it beside the matrix (.deepspeed/<version>), run the core regression set and the
# scenario matrix against it, and print how the package classifies it:
#   patched and passing | patched, N failing | refused: <the named fingerprint mismatch> | ...
# It needs the package index, so it stays out of .ci/run; .github/workflows/newest-deepspeed.yml
# runs it weekly. DS_NEWEST=0.19.8 skips the look-up (offline, or to re-check one version).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON="$ROOT/.venv/bin/python"

if [ -n "${DS_NEWEST:-}" ]; then
    newest=$DS_NEWEST
else
    newest=$("${PYTHON_FOR_INDEX:-python3}" -m pip index versions deepspeed 2>/dev/null \
        | sed -n 's/^deepspeed (\(.*\))$/\1/p')
    [ -n "$newest" ] || { echo "could not resolve the newest deepspeed on the package index"; exit 1; }
fi
echo "=== newest deepspeed on the index: $newest ==="
# HF4=0: no transformers 4.57 environment, this job runs no HF test.
DS_VERSIONS=$newest HF4=0 bash scripts/setup_env.sh || { echo "set-up failed"; exit 1; }

export PYTHONPATH="$ROOT/.deepspeed/$newest"
status=$("$PYTHON" - <<'PY' 2>/dev/null
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
IFS='|' read -r _ mode policy detail <<<"$(grep '^status|' <<<"$status")"
echo "status: ${mode:-unknown} (policy ${policy:-none}): ${detail:-}"

"$PYTHON" -m pytest tests/unit/v1/zero -q -rs -p no:cacheprovider -k "FrozenParamCheckpointing or RecomputeScenarios" \
    --junitxml="$ROOT/.deepspeed/newest-$newest.xml"
code=$?
failed=$("$PYTHON" - "$ROOT/.deepspeed/newest-$newest.xml" <<'PY'
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
echo "classification for deepspeed $newest: $verdict"
[ "$code" -eq 0 ]
