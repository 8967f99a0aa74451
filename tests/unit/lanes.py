"""The two-version lane: tests marked ``lane`` run, in the fast and ci tiers, only with the main
torch (requirements/torch.txt) and the current lines (the deepspeeds requirements/deepspeed-matrix.txt
puts in the fast tier: the last release without deepspeed's own handling, and the newest), with
either HF stack; ``lane(hf4_only=True)`` confines a test to the lane on the transformers 4.x stack
alone, and it runs on every cell with transformers 5. Elsewhere conftest deselects them at
collection, so that they cost nothing there; ZERO3_FULL_LANES=1 (the full tier) runs them
everywhere. The README's "The two commands" lists them.
"""
import functools
import importlib.metadata
import os
import re

ENV_FULL = "ZERO3_FULL_LANES"
_REQUIREMENTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                             "requirements")


@functools.lru_cache(maxsize=None)
def lane_torch() -> str:
    """The torch release of the main environment, as requirements/torch.txt pins it."""
    path = os.path.join(_REQUIREMENTS, "torch.txt")
    with open(path) as requirement:
        found = re.search(r"^torch==([0-9.]+)", requirement.read(), re.MULTILINE)
    if found is None:
        raise RuntimeError(f"{path}: expected a line torch==X.Y.Z, found none")
    return found.group(1)


@functools.lru_cache(maxsize=None)
def lane_versions() -> tuple:
    """The deepspeeds of requirements/deepspeed-matrix.txt's fast tier."""
    path = os.path.join(_REQUIREMENTS, "deepspeed-matrix.txt")
    with open(path) as matrix:
        rows = [line.partition("#")[0].split() for line in matrix]
    found = tuple(row[0] for row in rows if len(row) >= 2 and row[1] == "fast")
    if not found:
        raise RuntimeError(f"{path}: expected lines 'VERSION fast', found none")
    return found


def in_lane() -> bool:
    """Whether this interpreter's deepspeed and torch are a current line (or ZERO3_FULL_LANES=1)."""
    if os.environ.get(ENV_FULL) == "1":
        return True
    torch_release = importlib.metadata.version("torch").split("+")[0]
    return importlib.metadata.version("deepspeed") in lane_versions() and torch_release == lane_torch()


def transformers_major() -> int:
    """The installed transformers' major version, 0 where none is installed."""
    try:
        return int(importlib.metadata.version("transformers").split(".")[0])
    except importlib.metadata.PackageNotFoundError:
        return 0


def outside_lane(item) -> bool:
    """Whether conftest leaves this collected test out: marked ``lane`` and not in the lane."""
    marker = item.get_closest_marker("lane")
    if marker is None or in_lane():
        return False
    return not (marker.kwargs.get("hf4_only") and transformers_major() >= 5)
