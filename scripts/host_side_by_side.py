"""The host's cost of one configuration against another, side by side in one process: the measure
of issue #37's bounds, free of the drift between runs that the bench's one-after-another rows see.

Two engines of scripts/host_profile.py's workload (the bench's hooks model, 64 blocks, one CPU
rank) are stepped in turn, the order rotated every step, garbage collection off. Before each
engine's step the class gets that engine's methods (Installs): deepspeed's own, or the package's
as one apply() installed them, its one ledger serving every step. A fresh apply() per step would
build a new ledger each time, whose notes leave a key in every module's __dict__ per step: a cost
a user's run, which applies once, never pays. The objects alive once the engines are built are
frozen out of the garbage collector's reach, and one untimed step runs before each timed one.
Main-thread CPU time of the timed steps after the first four: median and minimum of each, and
their ratio; and the median of the ratios of the two modes' steps run side by side (step i of
each), which leaves out what drifts over the run.

``--control`` steps a third engine, a second one of the reference's mode, in the same rotation, and
prints its ratios to the reference as well: what the measure reads where nothing differs, the noise
floor against which the measured ratio is read.

    python scripts/host_side_by_side.py stock none --steps 100 --control   # applied, no checkpointing
    python scripts/host_side_by_side.py trl auto --control                 # deepspeed before 0.19.3
    python scripts/host_side_by_side.py upstream auto --control            # deepspeed 0.19.3 on

Modes as in scripts/host_profile.py. Run it with PYTHONPATH naming the deepspeed under test.
"""
import argparse
import gc
import os
import statistics
import sys
import time
from typing import Dict, List, NamedTuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import host_profile  # noqa: E402  (a sibling script, not a package)

WARM_STEPS = 4  # timed steps left out of the figures


class Engine(NamedTuple):
    label: str  # what the figures print: the mode, or CONTROL
    mode: str  # host_profile.MODES' key
    engine: object
    patched: bool  # whether its mode left the package's methods on deepspeed's classes (Installs.in_place)


CONTROL = "control"  # the label of the second engine of the reference's mode


class Installs:
    """The package's methods on deepspeed's classes, put on and taken off without apply() and
    revert(): the one ledger stays in force, as in a user's run (module docstring)."""

    def __init__(self, engines: List[Engine]):
        self.patched_modes, self.installs = {entry.mode for entry in engines if entry.patched}, ()
        policies = {host_profile.MODES[mode][0] for mode in self.patched_modes}
        if len(policies) > 1:  # each switch between them would release every hold, as no user's run does
            raise SystemExit(f"expected the modes to patch with one policy at most, got {sorted(policies)}")
        if self.patched_modes:
            host_profile.switch_to(sorted(self.patched_modes)[0])  # the one apply() whose ledger serves every step
            self.installs = self.in_place()

    @staticmethod
    def in_place() -> tuple:
        """What apply() installed, as patch.MARKER records it; () where deepspeed is as shipped."""
        from zero3_recompute import patch

        record = vars(patch._offload_class()).get(patch.MARKER)
        return tuple(record["installs"]) if record else ()

    def switch_to(self, mode: str) -> None:
        patched = mode in self.patched_modes
        for install in self.installs:
            setattr(install.owner, install.name, install.replacement if patched else install.original)

    def restore(self) -> None:
        """The package's methods back, as its apply() left them (patch.MARKER records them so)."""
        for install in self.installs:
            setattr(install.owner, install.name, install.replacement)


def side_by_side(engines: List[Engine], tokens, steps: int) -> Dict[str, List[float]]:
    """Main-thread CPU seconds of each engine's timed steps, by label."""
    times = {entry.label: [] for entry in engines}
    installs = Installs(engines)
    gc.freeze()  # every object alive now (the engines') out of each collection's reach: the collections stay short
    gc.disable()
    try:
        for index in range(steps):
            shift = index % len(engines)  # each engine leads in turn
            for entry in engines[shift:] + engines[:shift]:
                installs.switch_to(entry.mode)
                for timed in (False, True):
                    gc.collect()
                    started = time.thread_time()
                    entry.engine.backward(entry.engine(tokens))
                    entry.engine.step()
                    if timed and index >= WARM_STEPS:
                        times[entry.label].append(time.thread_time() - started)
    finally:
        gc.enable()
        gc.unfreeze()
        installs.restore()
    return times


def ratios(reference: List[float], measured: List[float]) -> str:
    """The ratios of medians and minimums, and the median of the ratios of steps run side by side
    (step i of each), which leaves out what drifts over the run."""
    paired = statistics.median(after / before for before, after in zip(reference, measured))
    return (f"median {statistics.median(measured) / statistics.median(reference):.4f}"
            f"  min {min(measured) / min(reference):.4f}  paired median {paired:.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reference", choices=sorted(host_profile.MODES))
    parser.add_argument("measured", choices=sorted(host_profile.MODES))
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--control", action="store_true",
                        help="step a second engine of the reference's mode too, and print its ratios (the noise floor)")
    args = parser.parse_args()
    if args.steps <= WARM_STEPS:
        parser.error(f"--steps: expected more than {WARM_STEPS}, got {args.steps}")
    if args.reference == args.measured:
        parser.error(f"expected two different modes, got {args.reference} twice")
    labels = [(args.reference, args.reference), (args.measured, args.measured)]
    if args.control:
        labels.append((CONTROL, args.reference))
    host_profile.start_rank()
    engines, tokens = [], None
    for label, mode in labels:
        engine, tokens = host_profile.build_engine(mode)
        engines.append(Engine(label, mode, engine, bool(Installs.in_place())))
    times = side_by_side(engines, tokens, args.steps)
    for label, seconds in times.items():
        print(f"{label:10s} median {1000 * statistics.median(seconds):8.2f} ms  min {1000 * min(seconds):8.2f} ms "
              f"({len(seconds)} steps)")
    print(f"{args.measured}/{args.reference}: {ratios(times[args.reference], times[args.measured])}")
    if args.control:
        print(f"{CONTROL}/{args.reference} (the same mode, the noise floor): "
              f"{ratios(times[args.reference], times[CONTROL])}")


if __name__ == "__main__":
    main()
