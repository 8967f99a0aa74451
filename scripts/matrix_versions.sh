#!/usr/bin/env bash
# Prints the deepspeed versions to use, one per line: DS_VERSIONS (comma- or space-separated)
# when set, else requirements/deepspeed-matrix.txt without comments (whole-line or trailing).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${DS_VERSIONS:-}" ]; then
    tr ', ' '\n\n' <<<"$DS_VERSIONS" | grep -v '^$'
else
    sed 's/#.*//; s/[[:space:]]*$//; s/^[[:space:]]*//' requirements/deepspeed-matrix.txt | grep -v '^$'
fi
