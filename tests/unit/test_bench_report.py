"""The benchmark's report and options, without ranks: the loss check, the step-time baseline,
the tables, bench.json, bench.png with and without matplotlib, and bad options."""
import argparse
import json
import os
import sys

import pytest

from zero3_recompute.bench.options import BenchUsageError, add_arguments, from_arguments
from zero3_recompute.bench.report import annotate, depth_table, table, write_all

OPTIONS = {"model": "lora", "blocks": [2, 4], "placements": ["call"], "dtype": "fp32", "out": None}


def _row(name, role, blocks, peak, time_s=0.1, losses=(2.0, 1.9), crash=None, placement="call"):
    row = {"name": name, "role": role, "policy": None, "checkpointing": "non-reentrant", "placement": placement,
           "blocks": blocks, "crash": crash, "losses": list(losses) if crash is None else [],
           "step_times_s": [time_s], "step_time_s": None if crash else time_s, "after_backward_mib": 0.0,
           "params_left_after_step": 0,
           "block_frozen_mib": 4.0}
    if crash is None:
        row.update(gathers_per_frozen_param=2.0, allgather_calls_per_step=10, allgather_mib_per_step=5.0,
                   peak_backward_mib=peak, peak_backward_frozen_mib=peak, peak_backward_live_mib=peak,
                   peak_backward_live_frozen_mib=peak, timeline_mib=[[0.0, False], [peak, True], [0.0, True]])
    return row


def _outcome():
    results = []
    for blocks in (2, 4):
        results += [_row("no-checkpoint", "reference", blocks, 1.0, placement=None),
                    _row("stock", "stock", blocks, 0.0, crash="CheckpointError: recomputed shape [0]"),
                    _row("trl", "trl", blocks, 1.0, time_s=0.2),
                    _row("keep", "policy", blocks, 4.0, time_s=0.1, losses=(2.0, 1.95))]
    return {"results": results, "deepspeed": "0.19.2", "torch": "2.13.0", "world_size": 2, "backend": "gloo"}


def test_loss_check_and_time_baseline():
    outcome = _outcome()
    annotate(outcome, OPTIONS)
    keep = next(row for row in outcome["results"] if row["name"] == "keep" and row["blocks"] == 2)
    assert keep["time_baseline"] == "trl", "stock crashed, so TRL's stock path is the baseline"
    assert keep["time_ratio"] == pytest.approx(0.5)
    assert keep["loss_matches_reference"] is False and keep["loss_max_abs_diff"] == pytest.approx(0.05)
    trl = next(row for row in outcome["results"] if row["name"] == "trl" and row["blocks"] == 2)
    assert trl["loss_matches_reference"] is True
    stock = next(row for row in outcome["results"] if row["name"] == "stock" and row["blocks"] == 2)
    assert stock["loss_matches_reference"] is False and stock["time_ratio"] is None


def test_tables_show_crashes_and_depths():
    outcome = _outcome()
    annotate(outcome, OPTIONS)
    text = table(outcome, 4)
    assert "crash: CheckpointError: recomputed shape [0]" in text
    assert "NO" in text.splitlines()[-1], "keep's loss differs from the reference in this outcome"
    sweep = depth_table(outcome, [2, 4]).splitlines()
    assert sweep[0].split()[-2:] == ["4", "blocks"] and any(line.startswith("stock") and "crash" in line
                                                            for line in sweep)


@pytest.mark.parametrize("matplotlib_present", [True, False])
def test_json_always_and_png_with_matplotlib(tmp_path, monkeypatch, matplotlib_present):
    if matplotlib_present:
        pytest.importorskip("matplotlib")
    else:
        monkeypatch.setitem(sys.modules, "matplotlib", None)
    outcome = _outcome()
    options = dict(OPTIONS, out=str(tmp_path))
    annotate(outcome, options)
    lines = write_all(outcome, options)
    with open(tmp_path / "bench.json") as handle:
        document = json.load(handle)
    assert document["schema"] == 1 and len(document["results"]) == 8 and document["options"]["blocks"] == [2, 4]
    if matplotlib_present:
        assert os.path.getsize(tmp_path / "bench.png") > 10_000
    else:
        assert not (tmp_path / "bench.png").exists()
        assert any("matplotlib is not installed" in line for line in lines)


@pytest.mark.parametrize("argv, message", [
    (["--blocks", "2,x"], "expected comma-separated integers such as 2,4,8, got '2,x'"),
    (["--placement", "inside"], "expected one or more of call, forward, got 'inside'"),
])
def test_bad_lists_are_refused_by_the_parser(argv, message, capsys):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(argv)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--hidden", "30", "--heads", "4"], "--hidden: expected a multiple of --heads (4), got 30"),
    (["--steps", "2"], "--steps: expected at least 3 (a warm-up, a measured, a timed), got 2"),
    (["--model", "llama", "--hidden", "12", "--heads", "4"], "expected an even head size"),
    (["--seq", "1"], "--seq: expected at least 2 tokens"),
    (["--ranks", "0"], "--ranks: expected a positive integer, got 0"),
])
def test_bad_options_say_expected_and_got(argv, message):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(BenchUsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        from_arguments(parser.parse_args(argv))
