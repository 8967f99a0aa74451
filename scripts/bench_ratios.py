"""One line from a bench.json: each policy's step time against the row it names (stock, or
deepspeed's own handling, or TRL's reentrant path where stock crashes), and the no-checkpoint
run's under the package against the same run reverted, at the deepest depth, with the peak
gathered MiB in backward (scripts/gpu_check.sh's bench check)."""
import json
import sys


def summary(document: dict) -> str:
    deepest = max(row["blocks"] for row in document["results"])
    rows = [row for row in document["results"] if row["blocks"] == deepest]
    parts = []
    for row in rows:
        if row.get("crash"):
            parts.append(f"{row['name']} crash")
        elif row["role"] in ("policy", "reference-patched"):
            parts.append(f"{row['name']} {row['time_ratio']:.2f}x {row['time_baseline']}, "
                         f"{row['peak_backward_mib']:.1f} MiB")
    return f"{deepest} blocks, step time ratios: " + "; ".join(parts)


if __name__ == "__main__":
    with open(sys.argv[1]) as handle:
        print(summary(json.load(handle)))
