"""The package's own time per step, by its entry points, timed in a training step: each wrapper
the package installs on deepspeed's four module hooks (timed outside) less deepspeed's method it
calls (timed inside), and the forward watch's module hook. A sampling profiler (host_profile.py) gives
the package only the samples whose innermost frame is its own; this counts deepspeed's functions
the package calls (its coordinator, iter_params) as the package's, and reads Python as it runs
between the step's kernels, with cold caches: several times slower than in a loop.

The timers cost time themselves. The same timers around deepspeed's own methods, with the package
reverted (each wrapper calling the method straight), measure what they add per call; that is
taken off each wrapper's figure (the watch hook's timer has nothing of its own in its window).

    python scripts/host_own_time.py auto --steps 30
    python scripts/host_own_time.py auto --steps 30 --by-phase   # each entry point in and out of backward

The workload is host_profile.py's (the bench's hooks model, 64 blocks, one CPU rank). Run it
with PYTHONPATH naming the deepspeed under test.
"""
import argparse
import collections
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import host_profile  # noqa: E402  (a sibling script, not a package)

HOOKS = ("pre_sub_module_forward_function", "post_sub_module_forward_function",
         "pre_sub_module_backward_function", "post_sub_module_backward_function")
WATCH_HOOK = "forward watch hook"
# With the root_fetch layer, the forward fetch's wrapper sees an engine's first root fetch alone:
# the root's hook does the rest (NOTE [ Forward fetch at the root alone ]), and is timed as itself.
ROOT_HOOK = "root_fetch hook (the root's fetch)"
# Timers with nothing of their own inside their window but the call: no cost taken off.
SINGLE_TIMERS = (WATCH_HOOK, ROOT_HOOK)


IN_BACKWARD = " (in backward)"  # the suffix of an entry point's calls inside a backward graph task, by phase


class Timers:
    """Nanoseconds outside and inside, and calls, by entry point; ``by_phase``: by entry point and
    whether the call came inside a backward graph task (a recompute) or not (the training forward)."""

    def __init__(self, by_phase: bool = False):
        self.outside, self.inside, self.calls = collections.Counter(), collections.Counter(), collections.Counter()
        self.by_phase = by_phase
        self._keys = []  # the key of each outside timer running, innermost last
        self.step_ns = 0.0  # main-thread CPU time per timed step, the timers' own included

    def clear(self) -> None:
        for counter in (self.outside, self.inside, self.calls):
            counter.clear()

    def around(self, name: str, function, inside: bool = False):
        clock, totals = time.perf_counter_ns, (self.inside if inside else self.outside)
        calls = None if inside else self.calls
        if self.by_phase:
            return self._around_by_phase(name, function, inside, clock, totals, calls)

        def timed(*args, **kwargs):
            started = clock()
            try:
                return function(*args, **kwargs)
            finally:
                totals[name] += clock() - started
                if calls is not None:
                    calls[name] += 1

        return timed

    def _around_by_phase(self, name: str, function, inside: bool, clock, totals, calls):
        import torch

        graph_task, keys = torch._C._current_graph_task_id, self._keys

        def timed(*args, **kwargs):
            key = keys[-1] if inside else name + (IN_BACKWARD if graph_task() != -1 else "")
            if not inside:
                keys.append(key)
            started = clock()
            try:
                return function(*args, **kwargs)
            finally:
                totals[key] += clock() - started
                if not inside:
                    keys.pop()
                    calls[key] += 1

        return timed


def _deepspeed_method_inside(wrapper, name: str):
    """The closure cell of ``wrapper`` that holds deepspeed's method ``name``."""
    for cell in wrapper.__closure__ or ():
        found = cell.cell_contents
        if callable(found) and getattr(found, "__name__", "") == name and found is not wrapper:
            return cell
    raise SystemExit(f"no deepspeed method {name} inside the package's wrapper: expected the wrappers of patch.py")


def instrument(offload_cls, timers: Timers, patched: bool) -> None:
    """Timers around the four hooks; patched: deepspeed's methods inside the wrappers timed too,
    and the forward watch's hook; else deepspeed's methods timed outside and inside alike (the
    timers' own cost)."""
    root_fetch = bypassed = None
    if patched:
        from zero3_recompute import patch

        watch = patch._ledger.watch
        watch._record = timers.around(WATCH_HOOK, watch._record)  # the hooks read it when called
        root_fetch = vars(offload_cls)[patch.MARKER].get("root_fetch")  # None before the layer, or switched off
        if root_fetch is not None:
            from zero3_recompute.root_fetch import FETCH as bypassed
    for name in HOOKS:
        method = vars(offload_cls)[name]
        if name == bypassed:
            # A timer over the class's wrapper would be someone's wrapper, and no bypass would go
            # on: the wrapper's calls (the first root fetch alone) stay untimed.
            continue
        if patched:
            cell = _deepspeed_method_inside(method, name)
            cell.cell_contents = timers.around(name, cell.cell_contents, inside=True)
            setattr(offload_cls, name, timers.around(name, method))
        else:
            setattr(offload_cls, name, timers.around(name, timers.around(name, method, inside=True)))
    if root_fetch is not None:
        hook_for = root_fetch._hook  # each bypass's hook, timed whole (its checks and the root's part)
        root_fetch._hook = lambda bypass: timers.around(ROOT_HOOK, hook_for(bypass))


def timed_run(mode: str, steps: int, by_phase: bool = False) -> Timers:
    import deepspeed.runtime.zero.parameter_offload as offload_module

    host_profile.start_rank()
    engine, tokens = host_profile.build_engine(mode)
    timers = Timers(by_phase)
    instrument(offload_module.DeepSpeedZeRoOffload, timers, patched=host_profile.MODES[mode][0] is not None)
    for index in range(3 + steps):
        if index == 3:
            timers.clear()
            started = time.thread_time_ns()
        engine.backward(engine(tokens))
        engine.step()
    timers.step_ns = (time.thread_time_ns() - started) / steps
    return timers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("auto", "auto-reentrant", "none"),
                        help="a mode in which the package is in charge")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--timers-cost-ns", type=float, default=None,
                        help="the timers' own cost per call (else measured in a run of 'trl' first, here)")
    parser.add_argument("--by-phase", action="store_true",
                        help="each entry point's calls inside a backward (a recompute's) apart from the others")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps: expected a positive integer, got {args.steps}")
    cost = args.timers_cost_ns
    if cost is None:
        import subprocess

        calibrate = [sys.executable, os.path.abspath(__file__), "--calibrate", "--steps", str(args.steps)]
        out = subprocess.run(calibrate + (["--by-phase"] if args.by_phase else []),
                             capture_output=True, text=True, check=True).stdout
        cost = float(out.strip().splitlines()[-1])
    timers = timed_run(args.mode, args.steps, args.by_phase)
    total = 0.0
    print(f"{args.mode}: the package's own time per step, the timers' {cost:.0f} ns a call taken off")
    names = [name + phase for name in (*HOOKS, *SINGLE_TIMERS)
             for phase in (("", IN_BACKWARD) if args.by_phase else ("", ))]
    for name in names:
        calls = timers.calls[name] / args.steps
        if not calls and (args.by_phase or name in SINGLE_TIMERS):
            continue  # an entry point never called in that phase, or a layer not in force
        single = name.startswith(SINGLE_TIMERS)
        own_ms = ((timers.outside[name] - timers.inside[name]) / args.steps - (0 if single else cost * calls)) / 1e6
        total += own_ms
        print(f"  {name:50s} {calls:6.0f} calls/step  {own_ms:6.3f} ms/step  {1000 * own_ms / max(calls, 1):6.2f} µs/call")
    # The step without the timers' own cost (inside and outside each wrapper, once in the watch's
    # hook): own time as a share of it reads the same on a machine twice as slow.
    timed_calls = sum(timers.calls.values()) / args.steps  # the counts are over every timed step
    single_calls = sum(calls for name, calls in timers.calls.items() if name.startswith(SINGLE_TIMERS)) / args.steps
    step_ms = (timers.step_ns - cost * (2 * (timed_calls - single_calls) + single_calls)) / 1e6
    print(f"  total {total:.2f} ms/step, {100 * total / step_ms:.2f}% of a {step_ms:.1f} ms step (main-thread CPU)")


if __name__ == "__main__" and "--calibrate" in sys.argv:
    sys.argv.remove("--calibrate")
    steps = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else 30
    calibration = timed_run("trl", steps, "--by-phase" in sys.argv)
    calls = sum(calibration.calls.values())
    print(f"{(sum(calibration.outside.values()) - sum(calibration.inside.values())) / calls:.1f}")
elif __name__ == "__main__":
    main()
