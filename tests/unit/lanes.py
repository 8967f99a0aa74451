"""The two-version lane: tests that CI runs only in the passes of deepspeed 0.19.2 (the last
release without deepspeed's own handling) and 0.19.8 (the newest), on each torch and HF stack
those passes use, to keep CI within its hour. Every other deepspeed of the matrix skips them,
saying why; ZERO3_FULL_LANES=1 runs them on any. The README's "The two commands" lists them.
"""
import os

LANE_VERSIONS = ("0.19.2", "0.19.8")
ENV_FULL = "ZERO3_FULL_LANES"


def skip_outside_lane(what: str) -> None:
    """Skips the calling test, ``what`` (e.g. "the benchmark"), outside the lane."""
    import deepspeed
    import pytest

    if os.environ.get(ENV_FULL) != "1" and deepspeed.__version__ not in LANE_VERSIONS:
        pytest.skip(f"two-version lane ({what}): CI runs it on deepspeed {', '.join(LANE_VERSIONS)} only; "
                    f"{ENV_FULL}=1 runs it on any")
