#!/usr/bin/env bash
# Prints the torch pairings to use, one per line: "TORCH PYTHON DEEPSPEED..." (torch without
# "torch=="), from requirements/torch-matrix.txt. TORCH_VERSIONS (comma- or space-separated)
# picks lines by torch release, "all" picks every line; unset, the lines marked ci. The main
# environment's torch (requirements/torch.txt, 2.13.0) is not a line: scripts/test.sh runs it
# unless TORCH_VERSIONS is set and leaves it out. DS_VERSIONS, when set, keeps only those
# deepspeed versions of each line, and drops a line left with none. A version marked + in the
# file ("+0.18.9") is left out unless TORCH_VERSIONS picks its line.
set -euo pipefail
cd "$(dirname "$0")/.."
wanted=" $(tr ',' ' ' <<<"${TORCH_VERSIONS-}") "
deepspeeds=" $(tr ',' ' ' <<<"${DS_VERSIONS-}") "
sed 's/#.*//' requirements/torch-matrix.txt | while read -r requirement python ci versions; do
    [ -n "$requirement" ] || continue
    torch=${requirement#torch==}
    if [ -z "${TORCH_VERSIONS+set}" ]; then
        [ "$ci" = ci ] || continue
    elif [[ "$wanted" != *" all "* && "$wanted" != *" $torch "* ]]; then
        continue
    fi
    kept=""
    for version in $versions; do
        if [[ "$version" == +* ]]; then
            [ -n "${TORCH_VERSIONS+set}" ] || continue
            version=${version#+}
        fi
        if [ -z "${DS_VERSIONS:-}" ] || [[ "$deepspeeds" == *" $version "* ]]; then
            kept="$kept $version"
        fi
    done
    [ -n "$kept" ] && echo "$torch $python$kept"
done
exit 0
