"""The two-version lane: tests that CI runs only in the torch 2.13.0 passes (requirements/torch.txt)
of deepspeed 0.19.2 (the last release without deepspeed's own handling) and 0.19.8 (the newest),
with either HF stack, to keep CI within its hour. Every other deepspeed, and the torch pairings
(which cross the torch axis with the core and scenario tests), skip them, saying why;
ZERO3_FULL_LANES=1 runs them on any. The README's "The two commands" lists them.
"""
import functools
import os
import re

LANE_VERSIONS = ("0.19.2", "0.19.8")
ENV_FULL = "ZERO3_FULL_LANES"
_TORCH_REQUIREMENT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                  "requirements", "torch.txt")


@functools.lru_cache(maxsize=None)
def lane_torch() -> str:
    """The torch release of the main environment, as requirements/torch.txt pins it."""
    with open(_TORCH_REQUIREMENT) as requirement:
        found = re.search(r"^torch==([0-9.]+)", requirement.read(), re.MULTILINE)
    if found is None:
        raise RuntimeError(f"{_TORCH_REQUIREMENT}: expected a line torch==X.Y.Z, found none")
    return found.group(1)


def skip_outside_lane(what: str) -> None:
    """Skips the calling test, ``what`` (e.g. "the benchmark"), outside the lane."""
    import deepspeed
    import pytest
    import torch

    if os.environ.get(ENV_FULL) == "1":
        return
    torch_release = torch.__version__.split("+")[0]
    if deepspeed.__version__ not in LANE_VERSIONS or torch_release != lane_torch():
        pytest.skip(f"two-version lane ({what}): CI runs it on deepspeed {', '.join(LANE_VERSIONS)} with torch "
                    f"{lane_torch()} only (here {deepspeed.__version__}, torch {torch_release}); {ENV_FULL}=1 "
                    "runs it on any")
