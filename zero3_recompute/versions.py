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


def patched_range() -> str:
    return f">={render(MIN_PATCHED)},<{render(FIRST_UPSTREAM_HANDLED)}"


def classify(version: Optional[Version]) -> str:
    """'patch' where we patch, 'upstream' where deepspeed handles it, else 'unsupported'."""
    if version is None or version < MIN_PATCHED:
        return "unsupported"
    if version >= FIRST_UPSTREAM_HANDLED:
        return "upstream"
    return "patch"
