"""The benchmark's report and options, without ranks: the loss check, the step-time baseline,
the tables, bench.json, bench.png with and without matplotlib (and what its panels hold), and bad
options."""
import argparse
import json
import os
import re
import struct
import sys

import pytest

from zero3_recompute.bench.options import BenchUsageError, add_arguments, from_arguments
from zero3_recompute.bench.report import annotate, depth_table, host_table, table, trace_table, write_all

# Pure Python: once per run (noxfile.py, NOTE [ Where a test runs ]).
pytestmark = pytest.mark.once_per_run

OPTIONS = {"model": "lora", "blocks": [2, 4], "placements": ["call"], "dtype": "fp32", "out": None}


def _row(name, role, blocks, peak, time_s=0.1, losses=(2.0, 1.9), crash=None, placement="call", allgather=5.0):
    row = {"name": name, "role": role, "policy": None, "checkpointing": "non-reentrant", "placement": placement,
           "blocks": blocks, "crash": crash, "losses": list(losses) if crash is None else [],
           "step_times_s": [time_s], "step_time_s": None if crash else time_s, "after_backward_mib": 0.0,
           "params_left_after_step": 0,
           "block_frozen_mib": 4.0}
    if crash is None:
        # Backward starts at the third of five events: at progress 0.5.
        row.update(gathers_per_frozen_param=2.0, allgather_calls_per_step=10, allgather_mib_per_step=allgather,
                   peak_backward_mib=peak, peak_backward_frozen_mib=peak, peak_backward_live_mib=peak,
                   peak_backward_live_frozen_mib=peak,
                   timeline_mib=[[0.0, False], [0.25, False], [peak, True], [peak / 2, True], [0.0, True]])
    return row


def _outcome():
    results = []
    for blocks in (2, 4):
        # Each configuration's all-gather MiB and timeline its own, and different at each depth.
        results += [_row("no-checkpoint", "reference", blocks, 1.0, placement=None, allgather=8.0 * blocks),
                    _row("stock", "stock", blocks, 0.0, crash="CheckpointError: recomputed shape [0]"),
                    _row("trl", "trl", blocks, 1.5, time_s=0.2, allgather=12.5 * blocks),
                    _row("keep", "policy", blocks, 4.0, time_s=0.1, losses=(2.0, 1.95), allgather=8.25 * blocks)]
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


def test_png_one_panel_per_configuration_and_the_allgather_bars(tmp_path, monkeypatch):
    """bench.png: the all-gather MiB per step per configuration as bars, the peak against depth, and
    one panel per configuration, on shared axes, of its gathered MiB over the step, backward's
    start marked; a crash's panel says so instead. All at the deepest depth, as the table."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    saved = []
    original = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda figure, *args, **kwargs: (saved.append(figure),
                                                                             original(figure, *args, **kwargs)))
    outcome = _outcome()
    options = dict(OPTIONS, out=str(tmp_path))
    annotate(outcome, options)
    write_all(outcome, options)
    with open(tmp_path / "bench.json") as handle:
        rows = [row for row in json.load(handle)["results"] if row["blocks"] == 4]
    with open(tmp_path / "bench.png", "rb") as handle:
        width, height = struct.unpack(">II", handle.read(24)[16:24])
    assert 1000 <= width <= 1400, f"README width: expected 1000-1400 px, got {width}"
    figure, = saved
    names = [row["name"] for row in rows]
    assert len(figure.axes) == len(names) + 2, "the bars, the depth panel and one panel per configuration"
    bars, over_depth, panels = figure.axes[0], figure.axes[1], figure.axes[2:]

    trained = [row for row in rows if row["crash"] is None]
    assert [patch.get_width() for patch in bars.patches] == [row["allgather_mib_per_step"] for row in trained]
    assert [patch.get_y() + patch.get_height() / 2 for patch in bars.patches] == [names.index(row["name"])
                                                                                   for row in trained]
    assert [label.get_text() for label in bars.get_yticklabels()] == names
    assert any(text.get_text() == "crashed: CheckpointError" for text in bars.texts)

    assert list(over_depth.get_xticks()) == [2, 4]
    legend = " ".join(text.get_text() for text in over_depth.get_legend().get_texts()).replace("\n", " ")
    assert all(name in legend for name in names) and "crashed: stock" in legend

    for panel, row in zip(panels, rows):
        assert panel.get_title() == row["name"]
        assert panel.get_shared_x_axes().joined(panels[0], panel)
        assert panel.get_shared_y_axes().joined(panels[0], panel)
        drawn = [list(line.get_ydata()) for line in panel.lines]
        if row["crash"] is not None:
            assert drawn == [] and any("crashed" in text.get_text() and "CheckpointError" in text.get_text()
                                       for text in panel.texts)
            continue
        values = [mib for mib, _ in row["timeline_mib"]]
        assert [line for line in drawn if len(line) == len(values)] == [values], "its own timeline, only"
        assert any(list(line.get_xdata()) == [0.5, 0.5] for line in panel.lines), "backward's start marked"


@pytest.mark.parametrize("argv, message", [
    (["--blocks", "2,x"], "expected comma-separated integers such as 2,4,8, got '2,x'"),
    (["--placement", "inside"], "expected one or more of call, forward, got 'inside'"),
    (["--live-limits", "0,-1"], "expected numbers >= 0 (or inf) such as 0,0.5,1,inf, got '0,-1'"),
    (["--live-limits", "half"], "expected comma-separated numbers of layers such as 0,0.5,1,inf, got 'half'"),
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


def test_the_budget_sweep_has_its_own_table_and_figure(tmp_path):
    """--live-limits rows (role budget) stay out of the main table and figure, and get a table of
    their own beside stock's row, and bench-budget.png where matplotlib is installed. Mutation:
    the main table listing budget rows fails the first assertion."""
    from zero3_recompute.bench.report import budget_table

    outcome = _outcome()
    for limit, peak, gathers in ((0.0, 1.0, 3.0), (1.0, 2.0, 2.0), (None, 2.0, 2.0)):
        for blocks in (2, 4):
            row = _row(f"auto limit {'unlimited' if limit is None else f'{limit:g}'}", "budget", blocks, peak)
            row.update(gathers_per_frozen_param=gathers, live_limit=limit,
                       live_numel=None if limit is None else int(limit * 1000))
            outcome["results"].append(row)
    annotate(outcome, OPTIONS)
    assert "auto limit" not in table(outcome, 4) and "auto limit" not in depth_table(outcome, [2, 4])
    lines = budget_table(outcome, 4).splitlines()
    assert [line.split()[0] for line in lines[1:]] == ["stock", "auto", "auto", "auto"], lines
    assert lines[2].split()[3:5] == ["0", "3.00"] and "default (1e9)" in lines[4], lines
    assert budget_table(_outcome(), 4) is None, "no sweep, no table"
    written = write_all(outcome, dict(OPTIONS, out=str(tmp_path)))
    if any("matplotlib is not installed" in line for line in written):
        assert not os.path.exists(tmp_path / "bench-budget.png")
    else:
        assert os.path.getsize(tmp_path / "bench-budget.png") > 10_000, written


def test_the_trace_table_gives_invalidations_and_how_fetches_were_served():
    outcome = _outcome()
    for row in outcome["results"]:
        if row["crash"] is None:
            row.update(trace_invalidations=1 if row["name"] == "keep" else 0,
                       fetched_params={"on_demand": 7, "prefetched": 3, "resident": 2})
    lines = trace_table(outcome, 4).splitlines()
    assert lines[0].split()[:3] == ["configuration", "trace", "invalidations"]
    assert [line.split() for line in lines[1:]] == [["no-checkpoint", "0", "7", "3", "2"], ["trl", "0", "7", "3", "2"],
                                                    ["keep", "1", "7", "3", "2"]], "crashed rows left out"


def test_host_table():
    """Main-thread CPU per step and per module call, against the no-checkpoint run and the compared
    row, and the package's own cost where nothing is checkpointed (patched less stock). Mutation:
    "package's own" taken against the compared row's time of another configuration fails it."""
    rows = [_row("no-checkpoint", "reference", 4, 1.0, placement=None),
            _row("no-checkpoint patched", "reference-patched", 4, 1.0, placement=None),
            _row("trl", "trl", 4, 1.5), _row("auto", "policy", 4, 1.5),
            _row("stock", "stock", 4, 0.0, crash="CheckpointError: recomputed shape [0]")]
    for row, host, calls in zip(rows, (0.100, 0.101, 0.150, 0.147, None), (200, 200, 400, 400, 0)):
        row.update(host_time_s=host, module_calls_per_step=calls)
    outcome = {"results": rows}
    annotate(outcome, dict(OPTIONS, blocks=[4]))
    lines = {line.split("  ")[0]: line for line in host_table(outcome, 4).splitlines()}
    patched, auto = (re.split(r"\s{2,}", lines[name].strip()) for name in ("no-checkpoint patched", "auto"))
    assert patched[2:] == ["101.00", "200", "505.0", "1.010", "1.010 (no-checkpoint)", "1.00"], patched
    assert auto[2:] == ["147.00", "400", "367.5", "1.470", "0.980 (trl)", "-"], \
        "the package's own time is shown only against the same work"
    assert "crash" in lines["stock"]
