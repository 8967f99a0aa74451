"""The two-version lane (tests/unit/lanes.py): a test marked lane is left out at collection
outside the current lines, kept on them and everywhere under ZERO3_FULL_LANES=1; lane(hf4_only=True)
is left out only on the transformers 4.x stack; lane(paired=True) is kept on the newest line with
transformers 5 and the others with transformers 4.x; lane(newest_only=True) on the newest line."""
import pytest

from tests.unit import lanes

pytestmark = pytest.mark.once_per_run


class _Item:
    nodeid = "tests/unit/test_example.py::test_example"

    def __init__(self, marker):
        self._marker = marker

    def get_closest_marker(self, name):
        return self._marker if name == "lane" else None


def _installed(monkeypatch, deepspeed: str, torch: str, transformers: str) -> None:
    found = {"deepspeed": deepspeed, "torch": torch, "transformers": transformers}
    monkeypatch.setattr(lanes.importlib.metadata, "version", lambda name: found[name])
    monkeypatch.delenv(lanes.ENV_FULL, raising=False)


def test_the_current_lines_are_the_fast_tiers_deepspeeds():
    assert lanes.lane_versions() == ("0.19.2", "0.19.8")


@pytest.mark.parametrize("deepspeed, torch, transformers, marker, left_out", [
    ("0.16.9", "2.13.0", "5.24.0", pytest.mark.lane.mark, True),
    ("0.19.2", "2.13.0+cpu", "5.24.0", pytest.mark.lane.mark, False),
    ("0.19.8", "2.14.1", "5.24.0", pytest.mark.lane.mark, True),
    ("0.16.9", "2.13.0", "5.24.0", pytest.mark.lane(hf4_only=True).mark, False),
    ("0.16.9", "2.13.0", "4.57.1", pytest.mark.lane(hf4_only=True).mark, True),
    ("0.19.2", "2.13.0+cpu", "4.57.1", pytest.mark.lane(hf4_only=True).mark, False),
    ("0.16.9", "2.13.0", "5.24.0", None, False),
    ("0.19.8", "2.13.0+cpu", "5.24.0", pytest.mark.lane(paired=True).mark, False),
    ("0.19.2", "2.13.0+cpu", "4.57.1", pytest.mark.lane(paired=True).mark, False),
    ("0.19.2", "2.13.0+cpu", "5.24.0", pytest.mark.lane(paired=True).mark, True),
    ("0.19.8", "2.13.0+cpu", "4.57.1", pytest.mark.lane(paired=True).mark, True),
    ("0.16.9", "2.13.0", "4.57.1", pytest.mark.lane(paired=True).mark, True),
    ("0.19.8", "2.13.0+cpu", "5.24.0", pytest.mark.lane(newest_only=True).mark, False),
    ("0.19.2", "2.13.0+cpu", "5.24.0", pytest.mark.lane(newest_only=True).mark, True),
    ("0.19.8", "2.14.1", "5.24.0", pytest.mark.lane(newest_only=True).mark, True),
])
def test_left_out_only_outside_the_lane(monkeypatch, deepspeed, torch, transformers, marker, left_out):
    _installed(monkeypatch, deepspeed, torch, transformers)
    assert lanes.outside_lane(_Item(marker)) is left_out
    monkeypatch.setenv(lanes.ENV_FULL, "1")
    assert lanes.outside_lane(_Item(marker)) is False


@pytest.mark.parametrize("marker", [pytest.mark.lane(paired=True, newest_only=True).mark,
                                    pytest.mark.lane(stack="hf4").mark, pytest.mark.lane("0.19.2").mark])
def test_a_lane_form_it_does_not_know_is_refused(monkeypatch, marker):
    _installed(monkeypatch, "0.19.8", "2.13.0", "5.24.0")
    with pytest.raises(ValueError, match="expected lane or lane\\(<one of hf4_only, paired, newest_only>=True\\), got"):
        lanes.outside_lane(_Item(marker))
