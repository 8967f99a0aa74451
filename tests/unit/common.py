"""A DistributedTest base for pytest, with DeepSpeed's interface and PyTorch's mechanics.

Interface (as in DeepSpeed's tests/unit/common.py): subclass DistributedTest, set
``world_size`` on the class, write ``test_*`` methods. ``@pytest.mark.world_size(n)`` or a
``world_size`` parameter overrides it per test. ZERO3_WORLD_SIZE=n overrides them all (one
rank on a machine with one GPU: scripts/gpu_check.sh).

Mechanics (as in PyTorch's MultiProcessTestCase):
- ranks are spawned processes; each joins a process group, gloo on CPU or NCCL when CUDA has
  at least world_size devices;
- each rank writes one result file per test and says so on a queue the parent waits on; the
  parent reports every failing rank's traceback, and a skip or xfail in the ranks carries through;
- a per-test ``timeout`` (class attribute): a rank that has not reported by then fails the
  test with the stack it is stuck in, and its workers are replaced, so one hang fails one test.

Spawning a rank imports torch and deepspeed, several seconds each on 2 CPU cores, so the
ranks of one world size are kept as a pool and reused across tests, as DeepSpeed's
``reuse_dist_env`` does. A pool that timed out or lost a rank is torn down and respawned.
"""
import faulthandler
import gc
import importlib
import json
import multiprocessing
import os
import queue
import shutil
import signal
import tempfile
import time
import traceback
from typing import Dict, List, Optional

import pytest

from zero3_recompute.testing.ranks import free_port
from zero3_recompute.testing.teardown import drop_finished_engines

DEFAULT_TIMEOUT_S = 300
# How long the parent waits on the ranks' word before it looks for a rank that died without one.
_DEATH_CHECK_S = 0.5
# How long the other ranks then have to report; a death inside a collective leaves them hung.
_AFTER_A_DEATH_S = 5.0


class DistributedTest:
    """Base class: its test methods run once in each of ``world_size`` ranks."""

    world_size = 2
    timeout = DEFAULT_TIMEOUT_S


def choose_backend(world_size: int) -> str:
    from zero3_recompute.testing.ranks import choose_backend as backend_for

    return backend_for(world_size)


def _init_rank(backend: str) -> None:
    """Runs once in each new rank: activation as after pip install, then the process group
    (the benchmark's ranks start the same way), then gloo_gathers' wait on every all-gather and
    gather_order's record of every rank's all-gathers."""
    import zero3_recompute.autoload
    from tests.unit import gather_order, gloo_gathers
    from zero3_recompute.testing.ranks import init_rank

    zero3_recompute.autoload.install()
    init_rank(backend)
    gloo_gathers.install(backend)
    gather_order.install()


def _outcome_of(exc: BaseException) -> str:
    if isinstance(exc, pytest.skip.Exception):
        return "skipped"
    if isinstance(exc, pytest.xfail.Exception):
        return "xfailed"
    return "failed"


def _run_task(task: dict) -> dict:
    """The task's outcome in this rank, with this rank's all-gathers (gather_order) during it; then
    the process as the rank started it: deepspeed's zero.Init replaces torch.nn.functional.linear
    with ZeRO's memory-efficient linear for good (before 0.16, "This will persist unless manually
    reset"), which a later test in this rank would otherwise run."""
    import torch.nn.functional

    from tests.unit import gather_order

    linear = torch.nn.functional.linear
    gather_order.take()
    try:
        result = _outcome_of_task(task)
    finally:
        torch.nn.functional.linear = linear
    result["gather_order"] = gather_order.take()
    return result


def _outcome_of_task(task: dict) -> dict:
    module = importlib.import_module(task["module"])
    instance = getattr(module, task["cls"])()
    started = time.monotonic()
    try:
        getattr(instance, task["method"])(**task["kwargs"])
    except BaseException as exc:  # every outcome, pytest's skip/xfail included, goes to the parent
        text = str(exc) if isinstance(exc, (pytest.skip.Exception, pytest.xfail.Exception)) else \
            traceback.format_exc()
        return {"outcome": _outcome_of(exc), "text": text, "seconds": time.monotonic() - started}
    return {"outcome": "passed", "text": "", "seconds": time.monotonic() - started}


def _let_the_parent_take_the_interrupt(signum, frame) -> None:
    """A rank's SIGINT handler: does nothing. A handler rather than SIG_IGN, which the programs a
    rank starts (deepspeed's JIT builds of its ops) would inherit: they stop at the Ctrl-C as
    usual. Interrupted system calls resume (PEP 475)."""


def _worker_main(rank: int, world_size: int, port: int, backend: str, tasks, done, stack_dir: str) -> None:
    from zero3_recompute.testing.ranks import rank_environment

    os.environ.update(rank_environment(rank, world_size, port, backend))
    # The stack file gets its name once the dump is registered: the parent sends SIGUSR1 only to a
    # rank whose file exists, and before the registration SIGUSR1 would kill the rank.
    stack_path = os.path.join(stack_dir, f"rank{rank}.stack")
    stacks = open(stack_path + ".tmp", "w")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    os.replace(stack_path + ".tmp", stack_path)
    # A Ctrl-C (gpu_check's limit, or a terminal's) reaches the whole process group. The parent
    # alone takes it: it then dumps each rank's stack where the rank stood, and kills the ranks.
    signal.signal(signal.SIGINT, _let_the_parent_take_the_interrupt)
    _init_rank(backend)
    # deepspeed calls gc.collect() several times per engine (see_memory_usage). Each full
    # collection walks every object torch and deepspeed created at import; freezing those
    # keeps collections to what the tests allocate.
    gc.collect()
    gc.freeze()
    while True:
        task = tasks.get()
        if task is None:
            break
        result = _run_task(task)
        # The test's engines outlived it; freed here, so that a GPU's memory holds one test's at a time.
        drop_finished_engines()  # collects, too
        # What a test still leaves alive is frozen too, so that later collections do not walk
        # it: on deepspeed 0.14.5, whose ZeRO-3 set-up collects per engine, they grew to most
        # of a rank's time over the suite.
        gc.freeze()
        path = os.path.join(task["result_dir"], f"rank{rank}.json")
        with open(path + ".tmp", "w") as handle:
            json.dump(result, handle)
        os.replace(path + ".tmp", path)
        done.put(rank)  # the parent waits on this, not on a poll of the result files
    import torch.distributed

    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


class _RankPool:
    """world_size spawned ranks, alive across tests until they hang, die or the session ends."""

    def __init__(self, world_size: int, backend: str):
        self.world_size = world_size
        self.backend = backend
        self.stack_dir = tempfile.mkdtemp(prefix="zero3_recompute_stacks_")
        context = multiprocessing.get_context("spawn")
        port = free_port()
        self.queues = [context.Queue() for _ in range(world_size)]
        # Each rank puts its rank here once its result file is in place.
        self.done = context.Queue()
        self.waits_run_out = 0  # waits on self.done that ended with no rank's word
        # (task, results) of the latest run(): a rank whose result is still None is at that task.
        self.latest: Optional[tuple] = None
        self.processes = [
            context.Process(target=_worker_main, args=(rank, world_size, port, backend, self.queues[rank],
                                                       self.done, self.stack_dir), daemon=True)
            for rank in range(world_size)
        ]
        for process in self.processes:
            process.start()

    def run(self, task: dict, timeout: float) -> List[Optional[dict]]:
        result_dir = tempfile.mkdtemp(prefix="zero3_recompute_result_")
        results: List[Optional[dict]] = [None] * self.world_size
        # For a Ctrl-C's account (account_of_interrupted_ranks): from before the first rank is told
        # of the task until _fill_hung has filled in the last result.
        self.latest = (task, results)
        try:
            for tasks in self.queues:
                tasks.put(dict(task, result_dir=result_dir))
            deadline, why = time.monotonic() + timeout, f"did not finish within {timeout:.0f} s"
            cut_short = False  # by a rank's death
            while True:
                for rank in range(self.world_size):
                    path = os.path.join(result_dir, f"rank{rank}.json")
                    if results[rank] is None and os.path.exists(path):
                        with open(path) as handle:
                            results[rank] = json.load(handle)
                dead = [rank for rank, process in enumerate(self.processes)
                        if results[rank] is None and not process.is_alive()]
                for rank in dead:
                    results[rank] = {"outcome": "died", "text": f"rank {rank} exited with code "
                                     f"{self.processes[rank].exitcode} before reporting"}
                if all(result is not None for result in results):
                    return results
                if dead and not cut_short:
                    # The others may be past where the dead rank stopped (a death outside a
                    # collective): their words within a few seconds, not the whole timeout.
                    cut_short = True
                    deadline = min(deadline, time.monotonic() + _AFTER_A_DEATH_S)
                    why = f"had not finished {_AFTER_A_DEATH_S:.0f} s after rank {dead[0]} died"
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._wait_for_a_rank(min(_DEATH_CHECK_S, remaining))
            return self._fill_hung(results, why)
        finally:
            shutil.rmtree(result_dir, ignore_errors=True)

    def _wait_for_a_rank(self, timeout: float) -> None:
        """Until a rank says its result is in (one from an earlier task only sends the caller round
        its loop again), or ``timeout``, after which the caller looks for ranks that died."""
        try:
            self.done.get(timeout=timeout)
        except queue.Empty:
            self.waits_run_out += 1

    def _fill_hung(self, results: List[Optional[dict]], why: str) -> List[Optional[dict]]:
        hung = [rank for rank, result in enumerate(results) if result is None]
        for rank, stack in self._stacks(hung).items():
            results[rank] = {"outcome": "hung", "text": f"rank {rank} {why}; its stacks:\n{stack}"}
        return results

    def account_of_interruption(self) -> List[str]:
        """Each rank still at the latest task (no result in): its stacks."""
        if self.latest is None:
            return []
        task, results = self.latest
        unfinished = [rank for rank, result in enumerate(results) if result is None]
        return [f"rank {rank} was running {task['cls']}.{task['method']} when the run was interrupted; its "
                f"stacks:\n{stack}" for rank, stack in self._stacks(unfinished).items()]

    def _stacks(self, ranks: List[int]) -> Dict[int, str]:
        """Each rank's stacks, all threads, as faulthandler dumps them on SIGUSR1. A rank with no
        stack file yet has not registered the dump, and SIGUSR1 would kill it: it is left alone."""
        paths = {rank: os.path.join(self.stack_dir, f"rank{rank}.stack") for rank in ranks}
        sizes = {}
        for rank in ranks:
            if self.processes[rank].is_alive() and os.path.exists(paths[rank]):
                sizes[rank] = os.path.getsize(paths[rank])
                os.kill(self.processes[rank].pid, signal.SIGUSR1)
        # Until every dump has grown and stopped growing; 10 s at most, for ranks scheduled late.
        deadline, last = time.monotonic() + 10, None
        while sizes and time.monotonic() < deadline:
            time.sleep(0.5)
            now = {rank: os.path.getsize(path) for rank, path in paths.items() if rank in sizes}
            if now == last and all(now[rank] > sizes[rank] for rank in sizes):
                break
            last = now
        stacks = {}
        for rank in ranks:
            if rank in sizes:
                with open(paths[rank]) as handle:
                    stacks[rank] = handle.read()
            else:
                process = self.processes[rank]
                state = "had not set up its stack dump yet" if process.is_alive() else \
                    f"had exited with code {process.exitcode}"
                stacks[rank] = f"(no stacks: the rank {state})"
        return stacks

    def healthy(self) -> bool:
        return all(process.is_alive() for process in self.processes)

    def close(self) -> None:
        for queue in self.queues:
            try:
                queue.put(None)
            except (OSError, ValueError):
                pass
        for process in self.processes:
            process.join(timeout=10)
        self.kill()

    def kill(self) -> None:
        for process in self.processes:
            if process.is_alive():
                process.kill()
                process.join(timeout=10)
        shutil.rmtree(self.stack_dir, ignore_errors=True)


_pools: Dict[tuple, _RankPool] = {}


def _pool(world_size: int, backend: str) -> _RankPool:
    key = (world_size, backend)
    pool = _pools.get(key)
    if pool is not None and not pool.healthy():
        pool.kill()
        pool = None
    if pool is None:
        pool = _pools[key] = _RankPool(world_size, backend)
    return pool


def close_pools() -> None:
    while _pools:
        _pools.popitem()[1].close()


def account_of_interrupted_ranks() -> List[str]:
    """After a Ctrl-C in the parent (the ranks do nothing on it): where each rank at a task stood,
    its stacks; then every pool is killed, without waiting on ranks that may be stuck. A second
    Ctrl-C meanwhile is ignored by the parent's handler (tests/conftest.py, _interrupt_once)."""
    texts = []
    while _pools:
        pool = _pools.popitem()[1]
        try:
            texts += pool.account_of_interruption()
        except Exception as exc:  # noqa: BLE001 - pytest's own report of the interrupt comes after
            texts.append(f"the ranks' stacks could not be read: {exc!r}")
        finally:
            pool.kill()
    return texts


def _world_size_of(item) -> int:
    forced = os.environ.get("ZERO3_WORLD_SIZE")
    if forced:  # scripts/gpu_check.sh: one rank on a machine with one GPU
        return int(forced)
    marker = item.get_closest_marker("world_size")
    if marker is not None:
        return int(marker.args[0])
    callspec = getattr(item, "callspec", None)
    if callspec is not None and "world_size" in callspec.params:
        return int(callspec.params["world_size"])
    return int(item.instance.world_size)


def run_in_ranks(task: dict, world_size: int, timeout: float) -> List[dict]:
    """Run ``task`` (module, cls, method, kwargs) in every rank; one result dict per rank.

    A pool that hung or lost a rank is replaced, so the next task starts clean.
    """
    backend = choose_backend(world_size)
    pool = _pool(world_size, backend)
    results = pool.run(task, timeout)
    if any(result["outcome"] in ("hung", "died") for result in results):
        pool.kill()
        _pools.pop((world_size, backend), None)
    return results


def run_distributed(item) -> None:
    """Run a DistributedTest method in every rank and turn the ranks' results into one outcome."""
    world_size = _world_size_of(item)
    task = {
        "module": item.module.__name__,
        "cls": type(item.instance).__name__,
        "method": item.originalname if hasattr(item, "originalname") else item.name,
        "kwargs": {name: item.funcargs[name] for name in item._fixtureinfo.argnames},
    }
    report(run_in_ranks(task, world_size, float(item.instance.timeout)), choose_backend(world_size))


def report(results: List[dict], backend: str) -> None:
    """Fail with every failing rank's text; else with where the ranks' all-gathers first differ
    (gather_order), where every rank passed; else carry an xfail or skip through; else pass."""
    from tests.unit.gather_order import first_divergence

    world_size = len(results)
    bad = [(rank, result) for rank, result in enumerate(results) if result["outcome"] in ("failed", "hung", "died")]
    # A rank that hung or died reports no record: its gathers are unknown.
    records = [result.get("gather_order") for result in results]
    diverged = first_divergence(records) if all(record is not None for record in records) else None
    if bad:
        sections = [f"--- rank {rank} ({result['outcome']}) ---\n{result['text']}" for rank, result in bad]
        order = f"\nall-gather order: {diverged}" if diverged else ""
        pytest.fail(f"{len(bad)} of {world_size} ranks failed ({backend}):\n" + "\n".join(sections) + order,
                    pytrace=False)
    if diverged and all(result["outcome"] == "passed" for result in results):
        pytest.fail(f"every rank passed, but {diverged}", pytrace=False)
    outcomes = {result["outcome"] for result in results}
    if "xfailed" in outcomes:
        pytest.xfail(next(result["text"] for result in results if result["outcome"] == "xfailed"))
    if "skipped" in outcomes:
        pytest.skip(next(result["text"] for result in results if result["outcome"] == "skipped"))
