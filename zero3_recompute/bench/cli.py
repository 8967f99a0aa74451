"""``zero3-recompute bench``: parse, launch the ranks, print the tables, write the files."""
import argparse
import sys
import time

from zero3_recompute.bench.options import BenchUsageError, Options, add_arguments, from_arguments


def configure(parser: argparse.ArgumentParser) -> None:
    add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    try:
        options = from_arguments(args)
    except BenchUsageError as exc:
        print(f"zero3-recompute bench: {exc}", file=sys.stderr)
        return 2
    return bench(options)


def bench(options: Options) -> int:
    from zero3_recompute.bench.launch import BenchFailed, run_ranks
    from zero3_recompute.bench.report import (annotate, budget_table, depth_table, host_table, table, trace_table,
                                              write_all)

    started = time.monotonic()
    print(f"[bench] {options.model}, blocks {','.join(map(str, options.blocks))}, hidden {options.hidden}, "
          f"seq {options.seq}, batch {options.batch}/rank, {options.dtype}, prefetch {options.prefetch}, "
          f"reuse distance {options.reuse_distance}, {options.steps} steps per configuration", flush=True)
    try:
        outcome = run_ranks(options)
    except BenchFailed as exc:
        print(f"zero3-recompute bench: {exc}", file=sys.stderr)
        return 1
    settings = options.as_dict()
    annotate(outcome, settings)
    outcome["seconds"] = round(time.monotonic() - started, 1)
    deepest = max(options.blocks)
    print(f"\ndeepspeed {outcome['deepspeed']}, torch {outcome['torch']}, {outcome['world_size']} ranks "
          f"({outcome['backend']}); {deepest} blocks; time ratio against the named stock row, same invocation")
    print(table(outcome, deepest))
    print(f"\nthe host's cost, {deepest} blocks: main-thread CPU time, median of the timed steps")
    print(host_table(outcome, deepest))
    print(f"\ndeepspeed's module trace and prefetch in the measured step, {deepest} blocks")
    print(trace_table(outcome, deepest))
    if len(options.blocks) > 1:
        print()
        print(depth_table(outcome, list(options.blocks)))
    budget = budget_table(outcome, deepest)
    if budget is not None:
        print(f"\nthe budget sweep, {deepest} blocks (auto, non-reentrant; stage3_max_live_parameters in numel)")
        print(budget)
    for line in write_all(outcome, settings):
        print(line)
    print(f"done in {outcome['seconds']} s")
    return 0
