"""`zero3-recompute bench` at a tiny size, end to end in its own ranks: the JSON's schema, and
the counts and bytes that are exact with prefetch 0 and reuse distance 0, against the same
contract the memory tests hold the package to. No timing is asserted."""
import json
import os
import subprocess
import sys

import pytest

from tests.unit.patch_switch import stock_crashes, upstream_installed

TINY = ["--hidden", "32", "--heads", "2", "--vocab", "64", "--seq", "8", "--batch", "2", "--steps", "3",
        "--ranks", "2", "--timeout", "400"]
ROW_KEYS = {
    "name": str, "role": str, "checkpointing": str, "blocks": int, "losses": list, "step_times_s": list,
    "after_backward_mib": float, "block_frozen_mib": float, "params_left_after_step": int,
}
MEASURED_KEYS = {
    "gathers_per_frozen_param": float, "allgather_calls_per_step": int, "allgather_mib_per_step": float,
    "peak_backward_mib": float, "peak_backward_frozen_mib": float, "peak_backward_live_mib": float,
    "timeline_mib": list, "step_time_s": float, "time_ratio": float, "loss_matches_reference": bool,
    "trace_invalidations": int, "fetched_params": dict, "host_time_s": float, "module_calls_per_step": int,
}


def _bench(out, *arguments) -> dict:
    done = subprocess.run([sys.executable, "-m", "zero3_recompute", "bench", *TINY, "--out", str(out), *arguments],
                          capture_output=True, text=True, timeout=480)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"bench exited {done.returncode}:\n{output[-6000:]}"
    assert "configuration" in done.stdout and "gathers/frozen param" in done.stdout, done.stdout
    assert "host µs/call" in done.stdout, "the host's cost table"
    with open(os.path.join(out, "bench.json")) as handle:
        document = json.load(handle)
    if _has_matplotlib():
        assert os.path.getsize(os.path.join(out, "bench.png")) > 10_000, output
    else:
        assert "matplotlib is not installed" in done.stdout
    return document


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _row(document, name: str, blocks: int) -> dict:
    return next(row for row in document["results"] if row["name"] == name and row["blocks"] == blocks)


def _check_schema(document: dict, rows_per_depth: int) -> None:
    assert document["schema"] == 1
    for key in ("deepspeed", "torch", "backend", "world_size", "options", "seconds"):
        assert key in document, f"bench.json has no {key!r}"
    assert len(document["results"]) == rows_per_depth * len(document["options"]["blocks"])
    # Each depth's engines are destroyed before the next depth builds its own.
    assert document["engines_left_after_depth"] == [0] * len(document["options"]["blocks"])
    for row in document["results"]:
        for key, kind in ROW_KEYS.items():
            assert isinstance(row[key], kind), f"{row['name']}: {key} = {row.get(key)!r}, expected {kind.__name__}"
        if row["crash"] is None:
            for key, kind in MEASURED_KEYS.items():
                assert isinstance(row[key], kind), f"{row['name']}: {key} = {row.get(key)!r}, expected {kind.__name__}"
            assert row["loss_matches_reference"], f"{row['name']}: losses {row['losses']} vs no-checkpoint's"
            assert any(backward for _, backward in row["timeline_mib"]), f"{row['name']}: no backward in the timeline"
        else:
            assert isinstance(row["crash"], str) and row["crash"]


def _layer_frozen_params() -> int:
    from zero3_recompute.testing.workloads import DecoderLayer

    return sum(1 for param in DecoderLayer(32, 2).parameters() if not param.requires_grad)


@pytest.mark.lane
def test_bench_lora_blocks(tmp_path):
    """The default workload at 2 and 3 blocks: every configuration, one invocation."""
    document = _bench(tmp_path, "--blocks", "2,3", "--live-limits", "0,inf")
    _check_schema(document, rows_per_depth=12)
    stock_name = "upstream" if upstream_installed() else "stock"
    for blocks in (2, 3):
        reference = _row(document, "no-checkpoint", blocks)
        # A backward no checkpoint ran in takes stock's path under the package: the same gathers,
        # bytes and losses as the run reverted (NOTE [ Parameter lifecycle under recompute ]).
        patched = _row(document, "no-checkpoint patched", blocks)
        for key in ("gathers_per_frozen_param", "allgather_calls_per_step", "allgather_mib_per_step",
                    "peak_backward_mib", "after_backward_mib", "losses"):
            assert patched[key] == reference[key], f"no-checkpoint patched: {key} {patched[key]}, reverted {reference[key]}"
        assert patched["time_baseline"] == "no-checkpoint", patched["time_baseline"]
        stock = _row(document, stock_name, blocks)
        trl = _row(document, "trl", blocks)
        if stock_crashes():
            assert stock["crash"] and stock["crash"].startswith("CheckpointError"), stock["crash"]
        else:
            assert stock["crash"] is None, f"{stock_name} crashed: {stock['crash']}"
        if not upstream_installed():
            # Stock's release under reentrant checkpointing: gathered in forward, recompute, backward.
            assert trl["gathers_per_frozen_param"] == 3.0
        for name in ("auto", "keep", "keep reentrant"):
            row = _row(document, name, blocks)
            assert row["gathers_per_frozen_param"] == 2.0, f"{name}: {row['gathers_per_frozen_param']}"
        # Under release the recompute gathers every frozen param once more than a run without
        # checkpointing does, except down_proj's: its backward starts the recompute, and one
        # gather serves both (keep: the recompute's alone, 2 gathers). Without the deferral of
        # its backward fetch (NOTE [ Deferred fetch ]) the count is
        # the same, and the peak doubles: the next assertion.
        release = _row(document, "release", blocks)
        extra = release["gathers_per_frozen_param"] - reference["gathers_per_frozen_param"]
        assert abs(extra - (1 - 1 / _layer_frozen_params())) < 1e-9, \
            f"release: {extra:.4f} more gathers per frozen param than without checkpointing, " \
            f"expected 1 - 1/{_layer_frozen_params()}"
        assert release["peak_backward_mib"] <= 1.1 * reference["peak_backward_mib"], \
            f"release: {release['peak_backward_mib']} MiB, no checkpoint {reference['peak_backward_mib']} MiB"
        for row in document["results"]:
            if row["blocks"] == blocks and row["role"] == "policy":
                assert row["after_backward_mib"] == 0.0, f"{row['name']}: {row['after_backward_mib']} MiB left"
                assert row["params_left_after_step"] == 0, f"{row['name']}: {row['params_left_after_step']} leaked"
        # The contract: one block's frozen params beyond the no-checkpoint run where stock crashes;
        # no more than stock where it trains.
        for name in ("auto", "keep", "release"):
            row = _row(document, name, blocks)
            assert row["peak_backward_mib"] <= reference["peak_backward_mib"] + row["block_frozen_mib"], name
        if not upstream_installed():
            assert _row(document, "auto reentrant", blocks)["peak_backward_mib"] <= trl["peak_backward_mib"]
    for name in ("auto", "keep", "release", "auto reentrant", "keep reentrant", "release reentrant"):
        peaks = [_row(document, name, blocks)["peak_backward_mib"] for blocks in (2, 3)]
        assert peaks[0] == peaks[1], f"{name}: the peak grows with depth: {peaks}"
    # The budget sweep (NOTE [ Holds within the live-parameter limit ]): with no live params
    # allowed, auto leaves placeholders as release does (release's gathers; its peak lies between
    # release's, whose deferral auto has not, and auto's); unlimited, it is auto.
    for blocks in (2, 3):
        nothing, unlimited = _row(document, "auto limit 0", blocks), _row(document, "auto limit unlimited", blocks)
        release, auto = _row(document, "release", blocks), _row(document, "auto", blocks)
        assert nothing["gathers_per_frozen_param"] == release["gathers_per_frozen_param"], (nothing, release)
        assert release["peak_backward_frozen_mib"] <= nothing["peak_backward_frozen_mib"] \
            < auto["peak_backward_frozen_mib"], (release, nothing, auto)
        for key in ("gathers_per_frozen_param", "peak_backward_frozen_mib"):
            assert unlimited[key] == auto[key], f"unlimited: {key} {unlimited[key]}, auto {auto[key]}"
    if _has_matplotlib():
        assert os.path.getsize(os.path.join(tmp_path, "bench-budget.png")) > 10_000


@pytest.mark.exhaustive
@pytest.mark.hf
def test_bench_llama_both_placements(tmp_path):
    """--model llama: HF Llama + PEFT LoRA, the checkpoint around the layer's __call__ and its forward.
    In the full tier: the same rows and counts as the default workload's, which test_bench_lora_blocks
    checks on the current lines, over a model of HF's (about 25 s a run on 2 cores)."""
    pytest.importorskip("transformers", reason="transformers is not installed: pip install '.[hf]'")
    pytest.importorskip("peft", reason="peft is not installed: pip install '.[hf]'")
    document = _bench(tmp_path, "--model", "llama", "--blocks", "2")
    _check_schema(document, rows_per_depth=2 + 2 * 8)
    for placement in ("call", "forward"):
        for name in ("auto", "keep"):
            row = _row(document, f"{name} [{placement}]", 2)
            assert row["gathers_per_frozen_param"] == 2.0, f"{row['name']}: {row['gathers_per_frozen_param']}"
            assert row["after_backward_mib"] == 0.0
