"""DeepSpeed version range, parsed with the standard library only.

This module is imported by the start-up hook, so it must not import torch or deepspeed.
"""
import re
from typing import Optional, Tuple

Version = Tuple[int, int, int]

# Oldest release whose ZeRO-3 offload/coordinator layout we fingerprint and test.
MIN_PATCHED: Version = (0, 14, 5)
# First release that ships its own recompute handling (deepspeed PR #8148).
FIRST_UPSTREAM_HANDLED: Version = (0, 19, 3)
# The torch releases the matrix runs (requirements/torch-matrix.txt), oldest and newest: what a
# refusal names as working. torch 2.4 never crashes (torch_recompute); 2.5 is the first that does.
TESTED_TORCH = ("2.4.1", "2.15.0")
TESTED_DEEPSPEED = ("0.14.5", "0.19.8")

_RELEASE = re.compile(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?")


def parse(text: str) -> Optional[Version]:
    """Return (major, minor, patch) of a version string such as '0.16.9+abc', or None."""
    match = _RELEASE.match(text or "")
    if match is None:
        return None
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


def render(version: Version) -> str:
    return ".".join(str(part) for part in version)


def at_least() -> str:
    """The versions the package patches: every release from MIN_PATCHED on, those with
    deepspeed's own recompute handling included (it is switched off while we are in charge)."""
    return f">={render(MIN_PATCHED)}"


def working_pairings() -> str:
    """What a refusal names as known to work."""
    return (f"torch {TESTED_TORCH[0]} to {TESTED_TORCH[1]} with deepspeed {TESTED_DEEPSPEED[0]} to "
            f"{TESTED_DEEPSPEED[1]}, as released (tested pairings: the README's support table)")


def classify(version: Optional[Version]) -> str:
    """By number alone: 'patch' before deepspeed's own handling, 'upstream' from its first
    release on (a hint: whether the handling is really installed is read from the code, see
    targets.upstream_handling), else 'unsupported'."""
    if version is None or version < MIN_PATCHED:
        return "unsupported"
    if version >= FIRST_UPSTREAM_HANDLED:
        return "upstream"
    return "patch"
