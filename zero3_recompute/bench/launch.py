"""Spawns the benchmark's ranks, one process each, and collects what they measured.

The ranks start as the test harness's do (zero3_recompute.testing.ranks). Each rank writes its result,
or its traceback, to a file of its own; if any rank fails or the timeout passes, every rank
still running dumps its stack and is stopped, and every failing rank's story is reported:
its traceback, its stack, or its exit code.
"""
import faulthandler
import gc
import json
import multiprocessing
import os
import signal
import tempfile
import time
import traceback
from typing import Dict, List

from zero3_recompute.bench.options import Options
from zero3_recompute.testing.ranks import choose_backend, default_ranks, free_port, init_rank, rank_environment


class BenchFailed(RuntimeError):
    """A rank raised, died or outlived the timeout."""


def _rank_main(rank: int, world_size: int, port: int, backend: str, options: Options, result_path: str) -> None:
    os.environ.update(rank_environment(rank, world_size, port, backend))
    stacks = open(result_path + ".stack", "w")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    try:
        init_rank(backend)
        from zero3_recompute.bench.worker import run_rank

        # deepspeed collects garbage several times per engine (see_memory_usage), and each full
        # collection walks everything torch and deepspeed created at import: freeze that.
        gc.collect()
        gc.freeze()

        outcome = {"ok": True, **run_rank(options, rank, world_size)}
    except BaseException:  # every failure goes to the parent, which reports every rank's
        outcome = {"ok": False, "traceback": traceback.format_exc()}
    with open(result_path + ".tmp", "w") as handle:
        json.dump(outcome, handle)
    os.replace(result_path + ".tmp", result_path)
    import torch.distributed

    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def run_ranks(options: Options) -> Dict:
    """Rank 0's results, once every rank finished; BenchFailed with every rank's story if not."""
    world_size = options.ranks or default_ranks()
    backend = choose_backend(world_size)
    port = free_port()
    context = multiprocessing.get_context("spawn")
    print(f"[bench] {world_size} ranks over {backend}", flush=True)
    with tempfile.TemporaryDirectory(prefix="zero3_recompute_bench_") as folder:
        paths = [os.path.join(folder, f"rank{rank}.json") for rank in range(world_size)]
        processes = [context.Process(target=_rank_main, args=(rank, world_size, port, backend, options, paths[rank]))
                     for rank in range(world_size)]
        try:
            for process in processes:
                process.start()
            timed_out = _wait(processes, paths, time.monotonic() + options.timeout)
        finally:
            stopped = _stop(processes)
        stories = [_story(rank, process, paths[rank], rank in stopped) for rank, process in enumerate(processes)]
        first = _read(paths[0])
    problems = [story for story in stories if story]
    if timed_out or problems:
        cause = f"timed out after {options.timeout:.0f} s; " if timed_out else ""
        raise BenchFailed(f"{cause}{len(problems)} of {world_size} ranks failed ({backend}):\n" + "\n".join(problems))
    return dict(first, backend=backend)


def _wait(processes: List, paths: List[str], deadline: float) -> bool:
    """Waits until every rank exited, or one failed (the others get a grace period to report
    theirs); returns whether the deadline passed first."""
    while any(process.is_alive() for process in processes):
        if time.monotonic() > deadline:
            return True
        if any(not process.is_alive() and (process.exitcode != 0 or not _read(paths[index]).get("ok"))
               for index, process in enumerate(processes)):
            grace = time.monotonic() + 10
            while any(process.is_alive() for process in processes) and time.monotonic() < grace:
                time.sleep(0.2)
            return False
        time.sleep(0.2)
    return False


def _stop(processes: List) -> set:
    """Every rank still alive dumps its stack (SIGUSR1, faulthandler) and is stopped, killed if
    it must be; returns their ranks."""
    alive = {rank for rank, process in enumerate(processes) if process.is_alive()}
    for rank in alive:
        os.kill(processes[rank].pid, signal.SIGUSR1)
    if alive:
        time.sleep(1)
    for rank in alive:
        processes[rank].terminate()
        processes[rank].join(5)
        if processes[rank].is_alive():
            processes[rank].kill()
            processes[rank].join(5)
    return alive


def _story(rank: int, process, path: str, stopped: bool) -> str:
    """What went wrong in one rank, or '' if nothing did."""
    outcome = _read(path)
    if stopped:
        return f"rank {rank}: stopped while still running; its stack:\n{_stack(path)}"
    if not outcome.get("ok"):
        return f"rank {rank}: {outcome.get('traceback') or outcome.get('error')}"
    if process.exitcode != 0:
        return f"rank {rank}: reported its results, then exited with code {process.exitcode}"
    return ""


def _stack(path: str) -> str:
    try:
        with open(path + ".stack") as handle:
            return handle.read().strip() or "(empty)"
    except FileNotFoundError:
        return "(none written)"


def _read(path: str) -> Dict:
    try:
        with open(path) as handle:
            return json.load(handle)
    except FileNotFoundError:
        return {"ok": False, "error": "no result: the rank died before it reported"}
