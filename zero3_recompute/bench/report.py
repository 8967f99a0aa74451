"""What the benchmark shows: a table on the terminal, bench.json and bench.png.

matplotlib is optional (the ``[bench]`` extra): without it the table and the JSON are still
written, and the run says why there is no plot.
"""
import json
import os
from typing import Dict, List, Optional

from zero3_recompute.bench.configs import REFERENCE, STOCK, TRL

SCHEMA = 1
# Relative to the reference's loss; fp32 leaves room for GPU kernels' nondeterminism (SDPA).
LOSS_TOLERANCE = {"fp32": 1e-3, "bf16": 2e-2}


def annotate(outcome: Dict, options: Dict) -> None:
    """Adds to each result: the loss check against the no-checkpoint run, and the step time's
    ratio against the stock row it is compared with (same depth)."""
    tolerance = LOSS_TOLERANCE[options["dtype"]]
    for blocks in options["blocks"]:
        rows = [row for row in outcome["results"] if row["blocks"] == blocks]
        reference = next(row for row in rows if row["role"] == REFERENCE)
        for row in rows:
            row["loss_max_abs_diff"] = _loss_difference(row, reference)
            row["loss_matches_reference"] = (row["loss_max_abs_diff"] is not None and row["loss_max_abs_diff"]
                                             <= tolerance * max(1.0, abs(reference["losses"][0])))
            base = time_baseline(rows, row)
            row["time_baseline"] = base["name"] if base else None
            row["time_ratio"] = (row["step_time_s"] / base["step_time_s"]
                                 if base and row["step_time_s"] and base["step_time_s"] else None)


def time_baseline(rows: List[Dict], row: Dict) -> Optional[Dict]:
    """The stock row whose step time ``row``'s is compared with: stock (upstream from 0.19.3)
    under the same placement, else TRL's stock path where that crashed."""
    trained = [other for other in rows if other["crash"] is None and other["step_time_s"]]
    for same_placement in (True, False):
        for role in (STOCK, TRL):
            for other in trained:
                if other["role"] == role and (other["placement"] == row["placement"] or not same_placement):
                    return other
    return None


def _loss_difference(row: Dict, reference: Dict) -> Optional[float]:
    if row["crash"] is not None or not row["losses"] or len(row["losses"]) != len(reference["losses"]):
        return None
    return max(abs(ours - theirs) for ours, theirs in zip(row["losses"], reference["losses"]))


def _number(value, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table(outcome: Dict, blocks: int) -> str:
    header = ["configuration", "checkpointing", "gathers/frozen param", "all-gathers/step", "all-gather MiB/step",
              "peak MiB bwd", "peak MiB live", "MiB after bwd", "leaks", "step ms", "time ratio", "loss = ref"]
    lines = [header]
    for row in outcome["results"]:
        if row["blocks"] != blocks:
            continue
        if row["crash"] is not None:
            lines.append([row["name"], row["checkpointing"], "crash: " + row["crash"][:120]])
            continue
        lines.append([row["name"], row["checkpointing"], _number(row.get("gathers_per_frozen_param")),
                      str(row.get("allgather_calls_per_step", "-")), _number(row.get("allgather_mib_per_step")),
                      _number(row.get("peak_backward_mib"), 3), _number(row.get("peak_backward_live_mib"), 3),
                      _number(row["after_backward_mib"], 3), str(row["params_left_after_step"]),
                      _number(None if row["step_time_s"] is None else 1000 * row["step_time_s"], 1),
                      _number(row.get("time_ratio")) + (f" ({row['time_baseline']})" if row.get("time_baseline")
                                                        else ""),
                      "yes" if row.get("loss_matches_reference") else "NO"])
    return _aligned(lines)


def depth_table(outcome: Dict, depths: List[int]) -> str:
    names = _configuration_names(outcome)
    lines = [["peak MiB gathered in backward"] + [f"{blocks} blocks" for blocks in depths]]
    for name in names:
        cells = []
        for blocks in depths:
            row = next(row for row in outcome["results"] if row["name"] == name and row["blocks"] == blocks)
            cells.append("crash" if row["crash"] else _number(row.get("peak_backward_mib"), 3))
        lines.append([name] + cells)
    return _aligned(lines)


def _configuration_names(outcome: Dict) -> List[str]:
    """Each configuration's name once, in the order the results list them."""
    return list(dict.fromkeys(row["name"] for row in outcome["results"]))


def _aligned(lines: List[List[str]]) -> str:
    # A short row (a crash's message) runs on past the columns and does not widen them.
    widths = [max(len(line[index]) for line in lines if len(line) == len(lines[0])) for index in range(len(lines[0]))]
    return "\n".join("  ".join(cell.ljust(widths[index]) if index < len(line) - 1 else cell
                               for index, cell in enumerate(line)) for line in lines)


def write_json(outcome: Dict, options: Dict, path: str) -> None:
    document = {"schema": SCHEMA, "options": options,
                **{key: value for key, value in outcome.items() if key != "results"}, "results": outcome["results"]}
    with open(path, "w") as handle:
        json.dump(document, handle, indent=1)


def write_png(outcome: Dict, options: Dict, path: str) -> Optional[str]:
    """The two panels; returns why there is no plot, or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no bench.png: matplotlib is not installed (pip install 'zero3-recompute[bench]')"
    shallowest = min(options["blocks"])
    rows = [row for row in outcome["results"] if row["blocks"] == shallowest]
    figure, (over_step, over_depth) = plt.subplots(1, 2, figsize=(15, 5.5))
    styles = ["-", "--", "-.", ":"]
    for index, row in enumerate(rows):
        if row["crash"] is not None or not row.get("timeline_mib"):
            continue
        values = [mib for mib, _ in row["timeline_mib"]]
        progress = [event / max(1, len(values) - 1) for event in range(len(values))]
        line, = over_step.plot(progress, values, styles[index % len(styles)], label=row["name"], linewidth=1.1,
                               alpha=0.85)
        first_backward = next((event for event, (_, backward) in enumerate(row["timeline_mib"]) if backward), None)
        if first_backward is not None:
            over_step.plot([progress[first_backward]], [values[first_backward]], "o", markersize=7,
                           color=line.get_color())
    over_step.set_title(f"Gathered MiB over one training step, {shallowest} blocks (o: backward starts)")
    over_step.set_xlabel("progress through the step's ZeRO-3 fetches and releases (forward, then backward)")
    over_step.set_ylabel("MiB gathered")
    over_step.legend(fontsize=7)
    names = _configuration_names(outcome)
    for name in names:
        points = [(row["blocks"], row["peak_backward_mib"]) for row in outcome["results"]
                  if row["name"] == name and row["crash"] is None and "peak_backward_mib" in row]
        crashed = any(row["crash"] for row in outcome["results"] if row["name"] == name)
        if points:
            over_depth.plot([blocks for blocks, _ in points], [mib for _, mib in points],
                            "os^vD<>"[names.index(name) % 7] + styles[names.index(name) % len(styles)],
                            label=name + (" (crashes at some depths)" if crashed else ""))
    over_depth.set_title("Peak MiB gathered during backward, by depth")
    over_depth.set_xlabel("decoder blocks")
    over_depth.set_ylabel("MiB")
    over_depth.set_xticks(sorted(options["blocks"]))
    over_depth.legend(fontsize=7)
    figure.suptitle(f"zero3-recompute bench: {options['model']}, deepspeed {outcome['deepspeed']}, "
                    f"torch {outcome['torch']}, {outcome['world_size']} ranks ({outcome['backend']}), {options['dtype']}")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return None


def write_all(outcome: Dict, options: Dict) -> List[str]:
    """bench.json and bench.png under options['out']; returns the lines to print about them."""
    os.makedirs(options["out"], exist_ok=True)
    json_path = os.path.join(options["out"], "bench.json")
    write_json(outcome, options, json_path)
    lines = [f"wrote {json_path}"]
    png_path = os.path.join(options["out"], "bench.png")
    missing = write_png(outcome, options, png_path)
    lines.append(missing or f"wrote {png_path}")
    return lines
