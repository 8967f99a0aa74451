"""The start-up hook's cost: CPU time of ``python -c pass`` with the hook armed and opted out.

    python scripts/startup_cost.py [--runs 20] [--python PATH]

Runs the two side by side, interleaved, in the interpreter given (default: this one, whose
site-packages must hold zero3_recompute.pth), and prints the median CPU time (user + system)
of each and their ratio.
"""
import argparse
import os
import resource
import statistics
import subprocess
import sys


def _cpu_seconds(python: str, env: dict) -> float:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([python, "-c", "pass"], env=env, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--python", default=sys.executable)
    args = parser.parse_args()
    armed = {name: value for name, value in os.environ.items() if name != "ZERO3_RECOMPUTE_DISABLE"}
    opted_out = dict(armed, ZERO3_RECOMPUTE_DISABLE="1")
    times = {"armed": [], "opted out": []}
    for _ in range(args.runs):
        times["armed"].append(_cpu_seconds(args.python, armed))
        times["opted out"].append(_cpu_seconds(args.python, opted_out))
    medians = {label: statistics.median(values) for label, values in times.items()}
    for label, median in medians.items():
        print(f"{label:<10} median CPU {median * 1000:.1f} ms over {args.runs} runs")
    print(f"ratio      {medians['armed'] / medians['opted out']:.3f}")


if __name__ == "__main__":
    main()
