"""The package's own Python per training step, counted in bytecodes: a figure that does not move
with the machine's load, to compare a change with the one before it (timings of a few
milliseconds in a 200 ms step drift by more between runs than such a change saves).

Every frame of the package counts, with everything it calls (deepspeed's coordinator, iter_params),
except deepspeed's wrapped hook methods and torch's no_grad decorator around them, which stock runs
too. Each count goes to the entry point: the first package frame below a frame of somebody else's.
A bytecode is not a fixed time (a hook runs between kernels, with cold caches), and C calls count
as one; the timings are scripts/host_own_time.py's and host_profile.py's.

    python scripts/host_bytecodes.py auto --steps 2

The workload is host_profile.py's (the bench's hooks model, 64 blocks, one CPU rank). Run it
with PYTHONPATH naming the deepspeed under test.
"""
import argparse
import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import host_profile  # noqa: E402  (a sibling script, not a package)

PACKAGE_DIR = os.sep + "zero3_recompute" + os.sep
LEFT_OUT_DIRS = (PACKAGE_DIR + "testing" + os.sep, PACKAGE_DIR + "bench" + os.sep)
LEFT_OUT_NAMES = frozenset(host_profile.WRAPPED) | {"decorate_context"}


class Counts:
    """Bytecodes by entry point and by code object, and calls by entry point."""

    def __init__(self):
        self.by_entry, self.by_code, self.calls = collections.Counter(), collections.Counter(), collections.Counter()


class _Counting:
    """A frame's local trace function: counts its bytecodes for its entry point."""

    __slots__ = ("entry", "counts")

    def __init__(self, entry: str, counts: Counts):
        self.entry, self.counts = entry, counts

    def __call__(self, frame, event, arg):
        if event == "opcode":
            self.counts.by_entry[self.entry] += 1
            code = frame.f_code
            name = getattr(code, "co_qualname", code.co_name)  # Python 3.11 on
            self.counts.by_code[f"{os.path.basename(code.co_filename)}:{name}"] += 1
        return self


def tracer(counts: Counts):
    """sys.settrace's function: a package frame, or one a package frame called, is counted."""

    def on_call(frame, event, arg):
        code = frame.f_code
        caller = frame.f_back.f_trace if frame.f_back is not None else None
        entry = caller.entry if isinstance(caller, _Counting) else None
        path = code.co_filename
        if PACKAGE_DIR in path and not any(left in path for left in LEFT_OUT_DIRS):
            if entry is None:
                entry = getattr(code, "co_qualname", code.co_name)
                counts.calls[entry] += 1
        elif entry is None or code.co_name in LEFT_OUT_NAMES:
            return None
        frame.f_trace_opcodes = True
        return _Counting(entry, counts)

    return on_call


def count(mode: str, steps: int) -> Counts:
    """Three untimed steps, then ``steps`` counted."""
    host_profile.start_rank()
    engine, tokens = host_profile.build_engine(mode)

    def step():
        engine.backward(engine(tokens))
        engine.step()

    for _ in range(3):
        step()
    counts = Counts()
    sys.settrace(tracer(counts))
    try:
        for _ in range(steps):
            step()
    finally:
        sys.settrace(None)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=sorted(host_profile.MODES))
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps: expected a positive integer, got {args.steps}")
    counts = count(args.mode, args.steps)
    if counts.calls and not counts.by_entry:
        raise SystemExit(f"the package's frames were called {sum(counts.calls.values())} times but no opcode event "
                         f"came: this Python ({sys.version.split()[0]}) delivers none to sys.settrace where a frame's "
                         "f_trace_opcodes is set at its call event; count on the main torch's "
                         "Python 3.11")
    total = sum(counts.by_entry.values()) / args.steps
    print(f"{args.mode}: {total:.0f} bytecodes per step of the package's own")
    for entry, number in counts.by_entry.most_common():
        calls = counts.calls[entry] / args.steps
        print(f"  {number / args.steps:9.0f}  {calls:5.0f} calls/step  {number / args.steps / calls:6.1f}/call  {entry}")
    print("by code object:")
    for name, number in counts.by_code.most_common(args.top):
        print(f"  {number / args.steps:9.0f}  {name}")


if __name__ == "__main__":
    main()
