"""The host's cost of one configuration against another, side by side in one process: the measure
of issue #37's bounds, free of the drift between runs that the bench's one-after-another rows see.

Two engines of scripts/host_profile.py's workload (the bench's hooks model, 64 blocks, one CPU
rank) are stepped in turn, the order reversed every step, garbage collection off. Before each
engine's step the package is switched to that engine's mode (apply() or revert()), and one
untimed step runs first: a fresh apply() builds the package's tables anew, which a user's run pays
once, not every step. Main-thread CPU time of the timed steps after the first four: median and
minimum of each, and their ratio; and the median of the ratios of the two modes' steps run side by
side (step i of each), which leaves out what drifts over the run.

    python scripts/host_side_by_side.py stock none --steps 100      # applied, no checkpointing
    python scripts/host_side_by_side.py trl auto                    # deepspeed before 0.19.3
    python scripts/host_side_by_side.py upstream auto               # deepspeed 0.19.3 on

Modes as in scripts/host_profile.py. Run it with PYTHONPATH naming the deepspeed under test.
"""
import argparse
import gc
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import host_profile  # noqa: E402  (a sibling script, not a package)

WARM_STEPS = 4  # timed steps left out of the figures


def side_by_side(modes, steps: int):
    """Main-thread CPU seconds of each mode's timed steps."""
    host_profile.start_rank()
    built = [host_profile.build_engine(mode) for mode in modes]
    tokens = built[0][1]
    times = {mode: [] for mode in modes}
    gc.disable()
    try:
        for index in range(steps):
            order = list(zip(modes, (engine for engine, _ in built)))
            for mode, engine in (order if index % 2 == 0 else order[::-1]):
                host_profile.switch_to(mode)
                for timed in (False, True):
                    gc.collect()
                    started = time.thread_time()
                    engine.backward(engine(tokens))
                    engine.step()
                    if timed and index >= WARM_STEPS:
                        times[mode].append(time.thread_time() - started)
    finally:
        gc.enable()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reference", choices=sorted(host_profile.MODES))
    parser.add_argument("measured", choices=sorted(host_profile.MODES))
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    if args.steps <= WARM_STEPS:
        parser.error(f"--steps: expected more than {WARM_STEPS}, got {args.steps}")
    if args.reference == args.measured:
        parser.error(f"expected two different modes, got {args.reference} twice")
    times = side_by_side((args.reference, args.measured), args.steps)
    for mode, seconds in times.items():
        print(f"{mode:10s} median {1000 * statistics.median(seconds):8.2f} ms  min {1000 * min(seconds):8.2f} ms "
              f"({len(seconds)} steps)")
    reference, measured = times[args.reference], times[args.measured]
    # Step i of each mode ran next to the other's step i: their ratio leaves out what drifts over the run.
    paired = statistics.median(after / before for before, after in zip(reference, measured))
    print(f"{args.measured}/{args.reference}: median {statistics.median(measured) / statistics.median(reference):.4f}"
          f"  min {min(measured) / min(reference):.4f}  paired median {paired:.4f}")


if __name__ == "__main__":
    main()
