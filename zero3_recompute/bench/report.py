"""What the benchmark shows: a table on the terminal, bench.json and bench.png.

matplotlib is optional (the ``[bench]`` extra): without it the table and the JSON are still
written, and the run says why there is no plot.
"""
import json
import os
from typing import Dict, List, Optional

from zero3_recompute.bench.budget import has_sweep, sweep_rows, write_budget_png
from zero3_recompute.bench.configs import BUDGET, PATCHED_REFERENCE, REFERENCE, STOCK, TRL

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
    under the same placement, else TRL's stock path where that crashed; for the no-checkpoint
    run under the package, the same run reverted."""
    trained = [other for other in rows if other["crash"] is None and other["step_time_s"]]
    if row["role"] == PATCHED_REFERENCE:
        return next((other for other in trained if other["role"] == REFERENCE), None)
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
        if row["blocks"] != blocks or row["role"] == BUDGET:
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


def host_table(outcome: Dict, blocks: int) -> str:
    """The host's cost (main-thread CPU time, median of the timed steps): per step, per module call
    (forward and recompute, counted in the measured step), and against the no-checkpoint run and
    the row the step time is compared with. "package's own" is the patched no-checkpoint run less
    the stock one: what the package costs where nothing is checkpointed."""
    rows = [row for row in outcome["results"] if row["blocks"] == blocks and row["role"] != BUDGET]
    by_name = {row["name"]: row for row in rows}
    reference = next((row for row in rows if row["role"] == REFERENCE), None)
    lines = [["configuration", "checkpointing", "host ms/step", "module calls/step", "host µs/call",
              "vs no-checkpoint", "vs compared row", "package's own ms/step"]]
    for row in rows:
        host = row.get("host_time_s")
        if row["crash"] is not None or host is None:
            lines.append([row["name"], row["checkpointing"], "crash" if row["crash"] else "-"])
            continue
        calls = row.get("module_calls_per_step") or 0
        base = by_name.get(row.get("time_baseline") or "")
        own = (host - reference["host_time_s"]) if row["role"] == PATCHED_REFERENCE and reference else None
        lines.append([row["name"], row["checkpointing"], _number(1000 * host, 2), str(calls),
                      _number(1e6 * host / calls if calls else None, 1),
                      _number(host / reference["host_time_s"] if reference and reference.get("host_time_s") else None,
                              3),
                      _number(host / base["host_time_s"] if base and base.get("host_time_s") else None, 3)
                      + (f" ({base['name']})" if base else ""),
                      _number(None if own is None else 1000 * own, 2)])
    return _aligned(lines)


def trace_table(outcome: Dict, blocks: int) -> str:
    """deepspeed's module trace and prefetch in the measured step (the first replay of the trace
    recorded in the warm-up): its invalidations, and the params its fetches found not gathered
    (gathered on demand), in flight (served by a prefetch) or gathered already."""
    lines = [["configuration", "trace invalidations", "params fetched: on demand", "prefetched", "resident"]]
    for row in outcome["results"]:
        if row["blocks"] != blocks or row["role"] == BUDGET or row["crash"] is not None:
            continue
        fetched = row.get("fetched_params") or {}
        lines.append([row["name"], str(row.get("trace_invalidations", "-"))]
                     + [str(fetched.get(kind, "-")) for kind in ("on_demand", "prefetched", "resident")])
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
    """Each configuration's name once, in the order the results list them (the budget sweep's
    aside: it has its own table and figure)."""
    return list(dict.fromkeys(row["name"] for row in outcome["results"] if row["role"] != BUDGET))


def budget_table(outcome: Dict, blocks: int) -> Optional[str]:
    """The budget sweep's table (--live-limits), or None without one: one line per limit, then
    stock's or upstream's rows."""
    if not has_sweep(outcome):
        return None
    lines = [["configuration", "stage3_max_live_parameters", "gathers/frozen param", "frozen peak MiB bwd",
              "all-gather MiB/step", "loss = ref"]]
    for row in sweep_rows(outcome, blocks):
        limit = row.get("live_numel")
        if row["crash"] is not None:
            lines.append([row["name"], "default", "crash: " + row["crash"][:80]])
            continue
        lines.append([row["name"], "default (1e9)" if limit is None else str(limit),
                      _number(row.get("gathers_per_frozen_param")), _number(row.get("peak_backward_frozen_mib"), 4),
                      _number(row.get("allgather_mib_per_step")), "yes" if row.get("loss_matches_reference") else "NO"])
    return _aligned(lines)


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
    """The figure; returns why there is no plot, or None.

    At the deepest depth (the one the table prints): a bar of all-gather MiB per step per
    configuration, and one small panel per configuration, all on the same axes, of the MiB
    gathered over the measured step with the start of backward marked (a crash says so in its
    panel); beside the bars, the peak gathered in backward against depth. The axes are made in
    that order: the bars, the depth panel, then the configurations' panels in the results' order.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no bench.png: matplotlib is not installed (pip install 'zero3-recompute[bench]')"
    deepest = max(options["blocks"])
    rows = [row for row in outcome["results"] if row["blocks"] == deepest and row["role"] != BUDGET]
    names = _configuration_names(outcome)
    colours = {name: plt.get_cmap("tab10")(index % 10) for index, name in enumerate(names)}
    columns = 3 if len(rows) <= 9 else 4
    grid_rows = -(-len(rows) // columns)
    with plt.rc_context({"font.size": 11, "axes.titlesize": 12, "axes.labelsize": 11,
                         "xtick.labelsize": 10, "ytick.labelsize": 10, "legend.fontsize": 10}):
        width, top_height, grid_height = 12.8, max(4.0, 1.2 + 0.27 * len(rows)), 2.1 * grid_rows
        height = 0.55 + top_height + 1.05 + grid_height + 0.5
        figure = plt.figure(figsize=(width, height))
        # The bars' labels, about 0.08 inch a character, set the top row's left edge.
        labels = (0.35 + 0.08 * max(len(row["name"]) for row in rows)) / width
        # Inches from the top, turned into figure fractions: the title, the top row, the grid's caption.
        top_row = figure.add_gridspec(1, 2, width_ratios=[1.1, 1], wspace=0.42, left=max(0.1, labels),
                                      right=0.785,
                                      top=1 - 0.55 / height, bottom=1 - (0.55 + top_height) / height)
        cells = figure.add_gridspec(grid_rows, columns, hspace=0.45, wspace=0.07, left=0.065, right=0.985,
                                    top=(grid_height + 0.5) / height, bottom=0.5 / height)
        per_step = figure.add_subplot(top_row[0])
        over_depth = figure.add_subplot(top_row[1])
        _allgather_bars(per_step, rows, colours, deepest)
        _peak_over_depth(over_depth, outcome, options, names)
        first = None
        for index, row in enumerate(rows):
            panel = figure.add_subplot(cells[index // columns, index % columns], sharex=first, sharey=first)
            first = first or panel
            _timeline(panel, row, colours[row["name"]])
            if index + columns < len(rows):
                panel.tick_params(labelbottom=False)
            else:
                panel.set_xlabel("progress through the step")
            if index % columns:
                panel.tick_params(labelleft=False)
            else:
                panel.set_ylabel("MiB gathered")
        first.set_xlim(0, 1)
        first.set_xticks([0, 0.25, 0.5, 0.75, 1], ["0", "", "0.5", "", "1"])
        first.set_ylim(0, max([mib for row in rows for mib, _ in row.get("timeline_mib") or []] or [1.0]) * 1.25)
        figure.text(0.5, (grid_height + 0.5 + 0.33) / height,
                    f"MiB gathered over the measured step, {deepest} blocks, per configuration (same axes): "
                    f"forward, then backward (shaded, from the dashed line)", ha="center", va="bottom",
                    fontsize=12)
        figure.suptitle(f"zero3-recompute bench: {options['model']}, deepspeed {outcome['deepspeed']}, "
                        f"torch {outcome['torch']}, {outcome['world_size']} ranks ({outcome['backend']}), "
                        f"{options['dtype']}", fontsize=13, y=1 - 0.1 / height, va="top")
        figure.savefig(path, dpi=100)
    plt.close(figure)
    return None


def _crash_name(row: Dict) -> str:
    return row["crash"].split(":", 1)[0][:40]


def _allgather_bars(axes, rows: List[Dict], colours: Dict, blocks: int) -> None:
    """One bar per configuration, the table's order top to bottom; a crash gets no bar but says so."""
    trained = [row for row in rows if row["crash"] is None and row.get("allgather_mib_per_step") is not None]
    positions = {row["name"]: index for index, row in enumerate(rows)}
    axes.barh([positions[row["name"]] for row in trained], [row["allgather_mib_per_step"] for row in trained],
              color=[colours[row["name"]] for row in trained], height=0.7)
    largest = max([row["allgather_mib_per_step"] for row in trained] or [1.0])
    for row in trained:
        axes.text(row["allgather_mib_per_step"] + 0.01 * largest, positions[row["name"]],
                  f"{row['allgather_mib_per_step']:.1f}", va="center", fontsize=10)
    for row in rows:
        if row not in trained:
            axes.text(0.01 * largest, positions[row["name"]],
                      f"crashed: {_crash_name(row)}" if row["crash"] else "not measured",
                      va="center", fontsize=10, color="firebrick")
    reference = next((row for row in trained if row["role"] == REFERENCE), None)
    if reference is not None:
        axes.axvline(reference["allgather_mib_per_step"], color="0.3", linestyle=":", linewidth=1.2)
    axes.set_yticks(range(len(rows)))
    axes.set_yticklabels([row["name"] for row in rows])
    axes.set_ylim(len(rows) - 0.5, -0.5)
    axes.set_xlim(0, largest * 1.15)
    axes.set_xlabel("MiB per step (dotted: no-checkpoint; lower is better)")
    axes.set_title(f"All-gather MiB per step, {blocks} blocks")
    axes.grid(axis="x", alpha=0.3)


def _peak_over_depth(axes, outcome: Dict, options: Dict, names: List[str]) -> None:
    """One line per distinct peak-by-depth, labelled with every configuration that has it: the
    configurations' own lines would lie on each other. Peaks count as the same to 0.1 MiB, as the
    plot shows them; each configuration's panel prints its own."""
    groups: Dict[tuple, List[str]] = {}
    crashed_everywhere = []
    for name in names:
        points = tuple((row["blocks"], round(row["peak_backward_mib"], 1)) for row in outcome["results"]
                       if row["name"] == name and row["crash"] is None and "peak_backward_mib" in row)
        crashed = any(row["crash"] for row in outcome["results"] if row["name"] == name)
        if points:
            groups.setdefault(points, []).append(name + (" (crashes at some depths)" if crashed else ""))
        elif crashed:
            crashed_everywhere.append(name)
    styles = ["o-", "s--", "^-.", "D:", "v-", "P--", "X-."]
    palette = ["#222222", "#c44e52", "#4c72b0", "#55a868", "#8172b2", "#937860", "#da8bc3"]
    ordered = sorted(groups.items(), key=lambda item: -max(mib for _, mib in item[0]))
    for index, (points, members) in enumerate(ordered):
        axes.plot([blocks for blocks, _ in points], [mib for _, mib in points], styles[index % len(styles)],
                  color=palette[index % len(palette)], markersize=7, linewidth=1.8,
                  label=_wrapped(members))
    if crashed_everywhere:
        axes.plot([], [], " ", label=_wrapped(crashed_everywhere, "crashed:"))
    axes.set_title("Peak MiB gathered during backward, by depth")
    axes.set_xlabel("decoder blocks")
    axes.set_ylabel("MiB")
    axes.set_xticks(sorted(options["blocks"]))
    axes.set_ylim(bottom=0)
    axes.set_ylim(top=axes.get_ylim()[1] * 1.1)
    axes.grid(alpha=0.3)
    axes.legend(loc="center left", bbox_to_anchor=(1.02, 0.5), frameon=False, labelspacing=0.9, handlelength=2.6)


def _wrapped(names: List[str], prefix: str = "", width: int = 26) -> str:
    """The names, comma-separated after ``prefix``, on lines of about ``width`` characters, a line
    break only between names."""
    lines = [prefix]
    for index, name in enumerate(names):
        piece = name + ("," if index < len(names) - 1 else "")
        if lines[-1] and len(lines[-1]) + 1 + len(piece) > width:
            lines.append("")
        lines[-1] += (" " if lines[-1] else "") + piece
    return "\n".join(lines)


def _timeline(axes, row: Dict, colour) -> None:
    axes.set_title(row["name"], pad=3)
    axes.grid(alpha=0.3)
    if row["crash"] is not None or not row.get("timeline_mib"):
        axes.set_facecolor("#f6f6f6")
        message = (f"crashed:\n{_crash_name(row)}" if row["crash"] is not None else "no timeline measured")
        axes.text(0.5, 0.5, message, transform=axes.transAxes, ha="center", va="center", fontsize=12,
                  color="firebrick")
        return
    values = [mib for mib, _ in row["timeline_mib"]]
    progress = [event / max(1, len(values) - 1) for event in range(len(values))]
    axes.plot(progress, values, "-", color=colour, linewidth=1.0)
    first_backward = next((event for event, (_, backward) in enumerate(row["timeline_mib"]) if backward), None)
    if first_backward is not None:
        axes.axvspan(progress[first_backward], 1.0, color="0.5", alpha=0.12, linewidth=0)
        axes.axvline(progress[first_backward], color="0.25", linestyle="--", linewidth=1.0)
    if row.get("peak_backward_mib") is not None:
        axes.text(0.98, 0.95, f"peak in bwd {row['peak_backward_mib']:.2f}", transform=axes.transAxes,
                  ha="right", va="top", fontsize=10)


def write_all(outcome: Dict, options: Dict) -> List[str]:
    """bench.json and bench.png under options['out']; returns the lines to print about them."""
    os.makedirs(options["out"], exist_ok=True)
    json_path = os.path.join(options["out"], "bench.json")
    write_json(outcome, options, json_path)
    lines = [f"wrote {json_path}"]
    png_path = os.path.join(options["out"], "bench.png")
    missing = write_png(outcome, options, png_path)
    lines.append(missing or f"wrote {png_path}")
    if has_sweep(outcome):
        budget_path = os.path.join(options["out"], "bench-budget.png")
        lines.append(write_budget_png(outcome, options, budget_path) or f"wrote {budget_path}")
    return lines
