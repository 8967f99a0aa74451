"""The two-version lane: tests marked ``lane`` run, in the fast and ci tiers, only with the main
torch (requirements/torch.txt) and the current lines (the deepspeeds requirements/deepspeed-matrix.txt
puts in the fast tier: the last release without deepspeed's own handling, and the newest), with
either HF stack. Three narrower forms, for a test whose outcome the lines or the stacks cannot
change apart:
- ``lane(hf4_only=True)``: confined to the lane on the transformers 4.x stack alone; it runs on
  every cell with transformers 5.
- ``lane(paired=True)``: each current line with one HF stack, the newest line with transformers 5
  and the others with transformers 4.x (the ci tier's 0.19.2 cell on transformers 4.57): a
  comparison with a run of the same line and stack (the no-checkpoint run, stock reentrant), where
  each line and each stack is tried once.
- ``lane(newest_only=True)``: the newest current line alone: what reads the package's start-up or
  the installed HF stack the same way on either line (fresh interpreters, the dearest on 0.19.2).
Elsewhere conftest deselects them at collection, so that they cost nothing there;
ZERO3_FULL_LANES=1 (the full tier) runs them everywhere. The README's "The two commands" lists
them.
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


def in_lane(deepspeed: str) -> bool:
    """Whether ``deepspeed``, the installed one, and this interpreter's torch are a current line."""
    torch_release = importlib.metadata.version("torch").split("+")[0]
    return deepspeed in lane_versions() and torch_release == lane_torch()


def transformers_major() -> int:
    """The installed transformers' major version, 0 where none is installed."""
    try:
        return int(importlib.metadata.version("transformers").split(".")[0])
    except importlib.metadata.PackageNotFoundError:
        return 0


NARROWER = ("hf4_only", "paired", "newest_only")


def outside_lane(item) -> bool:
    """Whether conftest leaves this collected test out: marked ``lane`` and not in the lane, or
    in it on a line or stack its narrower form leaves out."""
    marker = item.get_closest_marker("lane")
    if marker is None:
        return False
    named = [name for name in marker.kwargs if marker.kwargs[name]]
    if marker.args or len(named) > 1 or any(name not in NARROWER for name in marker.kwargs):
        raise ValueError(f"{item.nodeid}: expected lane or lane(<one of {', '.join(NARROWER)}>=True), got "
                         f"lane with arguments {marker.args} and keywords {marker.kwargs}")
    # The full tier runs every form everywhere.
    if os.environ.get(ENV_FULL) == "1":
        return False
    form = named[0] if named else None
    if form == "hf4_only" and transformers_major() >= 5:
        return False
    deepspeed = importlib.metadata.version("deepspeed")
    if not in_lane(deepspeed):
        return True
    newest = deepspeed == lane_versions()[-1]
    if form == "paired":
        return newest != (transformers_major() >= 5)
    if form == "newest_only":
        return not newest
    return False
