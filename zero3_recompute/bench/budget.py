"""The budget sweep's rows and its picture, bench-budget.png (--live-limits); its table is
report.budget_table.

One point per stage3_max_live_parameters: all-gathers per frozen param against the frozen bytes
gathered at the peak of backward, under auto, non-reentrant (NOTE [ Holds within the
live-parameter limit ]), with stock's (or upstream's) non-reentrant run beside them, at the
deepest depth.
"""
from typing import Dict, List, Optional

from zero3_recompute.bench.configs import BUDGET, STOCK


def sweep_rows(outcome: Dict, blocks: int) -> List[Dict]:
    """The sweep's rows at ``blocks``, with stock's (or upstream's) beside them."""
    return [row for row in outcome["results"] if row["blocks"] == blocks and row["role"] in (BUDGET, STOCK)]


def has_sweep(outcome: Dict) -> bool:
    return any(row["role"] == BUDGET for row in outcome["results"])


def write_budget_png(outcome: Dict, options: Dict, path: str) -> Optional[str]:
    """The trade as a picture; returns why there is none, or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no bench-budget.png: matplotlib is not installed (pip install 'zero3-recompute[bench]')"
    deepest = max(options["blocks"])
    rows = [row for row in sweep_rows(outcome, deepest) if row["crash"] is None]
    figure, axes = plt.subplots(figsize=(7.5, 5.0))
    sweep = [row for row in rows if row["role"] == BUDGET]
    axes.plot([row["peak_backward_frozen_mib"] for row in sweep], [row["gathers_per_frozen_param"] for row in sweep],
              "o-", color="tab:blue", label="auto, one point per limit")
    labels: Dict[tuple, List[str]] = {}  # limits that land on one point share its label
    for row in sweep:
        point = (row["peak_backward_frozen_mib"], row["gathers_per_frozen_param"])
        labels.setdefault(point, []).append(row["name"].replace("auto limit ", ""))
    for point, names in labels.items():
        axes.annotate(", ".join(names), point, textcoords="offset points", xytext=(5, 5), fontsize=9)
    for row in sweep_rows(outcome, deepest):
        if row["role"] != STOCK:
            continue
        if row["crash"] is None:
            axes.plot(row["peak_backward_frozen_mib"], row["gathers_per_frozen_param"], "x", color="tab:red",
                      markersize=9, label=row["name"])
        else:
            axes.plot([], [], "x", color="tab:red", label=f"{row['name']}: {row['crash'].split(':', 1)[0]}")
    axes.set_xlabel("frozen MiB gathered at the peak of backward")
    axes.set_ylabel("all-gathers per frozen param per step")
    axes.set_title(f"stage3_max_live_parameters, in one layer's frozen numel: {deepest} blocks, "
                   f"deepspeed {outcome['deepspeed']}", fontsize=10)
    axes.legend(fontsize=9)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return None
