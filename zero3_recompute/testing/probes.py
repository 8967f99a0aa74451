"""Instruments on a ZeRO-3 model: all-gathers by param, and gathered bytes over time.

Both follow the definitions of docs/measuring.md, which the benchmark and the memory-contract
tests share. Exact with prefetch 0 and reuse distance 0, where nothing is gathered ahead.
"""
import os
import time
from collections import Counter
from typing import List, Tuple

import torch


def zero3_params(module: torch.nn.Module) -> list:
    return [param for param in module.parameters() if hasattr(param, "ds_id")]


def gathered_bytes(param) -> int:
    """A ZeRO-3 param's full (gathered) size in bytes."""
    return param.ds_numel * param.element_size()


def gathered_or_active(module: torch.nn.Module) -> list:
    """Non-persistent ZeRO-3 params still gathered, or with a ds_active_sub_modules entry:
    what docs/measuring.md counts as left gathered, after step()."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return [
        param for param in zero3_params(module) if not param.ds_persist and (
            param.ds_status != ZeroParamStatus.NOT_AVAILABLE or param.ds_active_sub_modules)
    ]


def available_bytes(params) -> int:
    """The gathered size of those ``params`` that are AVAILABLE now."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return sum(gathered_bytes(param) for param in params if param.ds_status == ZeroParamStatus.AVAILABLE)


class GatherCounter:
    """Counts the all-gathers that take a param from NOT_AVAILABLE to gathered: per param name
    (``counts``), the all_gather_coalesced calls that gather at least one (``calls``), and the
    gathered bytes (``bytes``)."""

    def __init__(self, module: torch.nn.Module):
        self.counts: Counter = Counter()
        self.calls = 0
        self.bytes = 0
        self._names = {param.ds_id: name for name, param in module.named_parameters() if hasattr(param, "ds_id")}
        self._originals = {}
        for param in zero3_params(module):
            self._originals[param] = param.all_gather_coalesced
            param.all_gather_coalesced = self._counting(param.all_gather_coalesced)

    def _counting(self, original):
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        def all_gather_coalesced(params, *args, **kwargs):
            fresh = [param for param in params if param.ds_status == ZeroParamStatus.NOT_AVAILABLE]
            for param in fresh:
                self.counts[self._names[param.ds_id]] += 1
            if fresh:
                self.calls += 1
                self.bytes += sum(gathered_bytes(param) for param in fresh)
            return original(params, *args, **kwargs)

        return all_gather_coalesced

    def take(self) -> Counter:
        """The per-name counts since the last take(); calls and bytes start over too."""
        counts, self.counts = self.counts, Counter()
        self.calls = self.bytes = 0
        return counts

    def close(self) -> None:
        for param, original in self._originals.items():
            param.all_gather_coalesced = original

# A hang guard for other_threads_settle, far above the milliseconds a process group's worker takes.
SETTLE_GUARD_S = 5.0
# Where /proc cannot say what other threads do: the fixed window this wait replaced.
SETTLE_WINDOW_WITHOUT_PROC_S = 0.01
# Thread states in /proc that may still drop a reference: running or runnable, and uninterruptible
# sleep (a thread inside a system call, which goes on when it returns).
_BUSY_STATES = ("R", "D")
FREED, SETTLED, GUARD = "freed", "settled", "guard"


def _other_threads_busy() -> bool:
    """Whether a thread of this process other than the calling one is running, runnable or in an
    uninterruptible sleep (/proc): only such a thread can still drop a reference."""
    import threading

    own = threading.get_native_id()
    for name in os.listdir("/proc/self/task"):
        if int(name) == own:
            continue
        try:
            with open(f"/proc/self/task/{name}/stat") as handle:
                if handle.read().rsplit(")", 1)[1].split()[0] in _BUSY_STATES:
                    return True
        except (FileNotFoundError, ProcessLookupError):  # the thread ended meanwhile
            continue
    return False


def other_threads_settle(done) -> str:
    """Polls ``done()`` every millisecond until it holds (FREED), or until no other thread of this
    process could still change it (SETTLED): every other thread asleep at two looks with a GIL
    release between them (a thread waiting for the GIL to drop its reference sleeps until the
    caller lets go of it). GUARD where SETTLE_GUARD_S passed first; where /proc cannot say, the
    bound is SETTLE_WINDOW_WITHOUT_PROC_S."""
    readable = os.path.isdir("/proc/self/task")
    deadline = time.monotonic() + (SETTLE_GUARD_S if readable else SETTLE_WINDOW_WITHOUT_PROC_S)
    idle_looks = 0
    while not done():
        if time.monotonic() > deadline:
            return GUARD
        if readable:
            idle_looks = 0 if _other_threads_busy() else idle_looks + 1
            if idle_looks >= 2:
                return FREED if done() else SETTLED
        time.sleep(0.001)
    return FREED


def _current_nbytes(ref, registered: int) -> int:
    """A live storage's size now: a storage freed in place (resized to 0 bytes, NOTE [ Gathered
    storage kept outside saved tensors ]) holds nothing, whoever references it. The size when
    registered where torch cannot make a storage from a weak reference."""
    from_weak = getattr(torch.UntypedStorage, "_new_with_weak_ptr", None)
    if from_weak is None:
        return registered
    return 0 if ref.expired() else from_weak(ref.cdata).nbytes()


class GatheredMemory:
    """Bytes of non-persistent ZeRO-3 params gathered, as docs/measuring.md defines them.

    Sampled after every fetch and before and after every release of the coordinator:
      peak_backward         the most bytes of params in status AVAILABLE, during backward
                            (inside an autograd graph task);
      peak_backward_frozen  the same for frozen params alone;
      peak_backward_live    the most bytes of gathered storage still alive during backward,
                            whoever holds it: a storage seen under an AVAILABLE param counts
                            until it is freed, also after the param was released, e.g. while
                            autograd keeps a view of it (F.linear saves weight.t()), at its
                            size now (0 once freed in place); storages are registered in
                            forward too, peaks are taken in backward;
      peak_backward_live_frozen  the same for storages seen under frozen params alone;
      after_backward()      the bytes still gathered now;
      timeline              with ``timeline=True``, (bytes gathered, in backward) at every sample.
    The coordinator's class is wrapped, so one instance at a time; close() unwraps it.
    """

    _SAMPLED = ("fetch_sub_module", "release_sub_module")

    def __init__(self, module: torch.nn.Module, timeline: bool = False):
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
        from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

        self._available = ZeroParamStatus.AVAILABLE
        self._params = [param for param in zero3_params(module) if not param.ds_persist]
        self._storages = {}
        self._outlived = set()
        self._record = timeline
        self.timeline: List[Tuple[int, bool]] = []
        self.reset()
        self._cls = PartitionedParameterCoordinator
        self._originals = {name: vars(self._cls)[name] for name in self._SAMPLED}
        setattr(self._cls, "fetch_sub_module", self._sampling(self._originals["fetch_sub_module"], before=False))
        setattr(self._cls, "release_sub_module", self._sampling(self._originals["release_sub_module"], before=True))

    def reset(self) -> None:
        self.peak_backward = self.peak_backward_frozen = self.peak_backward_live = 0
        self.peak_backward_live_frozen = 0
        self.timeline = []

    def _sampling(self, original, before: bool):

        def sampled(coordinator, *args, **kwargs):
            if before:
                self.sample()
            result = original(coordinator, *args, **kwargs)
            self.sample()
            return result

        return sampled

    def sample(self) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef

        gathered = [param for param in self._params if param.ds_status == self._available]
        current = set()
        for param in gathered:
            storage = param.data.untyped_storage()
            # Keyed by the storage itself, not its data pointer, which a storage freed in place
            # and refilled changes.
            key = storage._cdata
            current.add(key)
            known = self._storages.get(key)
            if known is None or known[0].expired():
                self._storages[key] = (StorageWeakRef(storage), storage.nbytes(), not param.requires_grad)
                self._outlived.discard(key)
        self._prune()
        in_backward = torch._C._current_graph_task_id() != -1
        if not (in_backward or self._record):
            return
        total = sum(gathered_bytes(param) for param in gathered)
        if self._record:
            self.timeline.append((total, in_backward))
        if not in_backward:
            return
        self.peak_backward = max(self.peak_backward, total)
        self.peak_backward_frozen = max(self.peak_backward_frozen,
                                        sum(gathered_bytes(param) for param in gathered if not param.requires_grad))
        live, live_frozen = self._live()
        if (live > self.peak_backward_live or live_frozen > self.peak_backward_live_frozen) and self._unsettled(current):
            self._settle(current)
            live, live_frozen = self._live()
        self.peak_backward_live = max(self.peak_backward_live, live)
        self.peak_backward_live_frozen = max(self.peak_backward_live_frozen, live_frozen)

    def _live(self) -> Tuple[int, int]:
        sizes = [(_current_nbytes(ref, nbytes), frozen) for ref, nbytes, frozen in self._storages.values()]
        return sum(nbytes for nbytes, _ in sizes), sum(nbytes for nbytes, frozen in sizes if frozen)

    def _unsettled(self, current: set) -> List[int]:
        """Live storages whose params are no longer gathered, not yet known to outlive every other
        thread's work (_settle)."""
        return [key for key in self._storages if key not in current and key not in self._outlived]

    def _prune(self) -> None:
        self._storages = {key: entry for key, entry in self._storages.items() if not entry[0].expired()}
        self._outlived &= set(self._storages)

    def _settle(self, current: set) -> None:
        """Before a live peak rises on storages whose params are no longer gathered: waits until
        they are freed or no other thread of this process can still free them (docs/measuring.md,
        "A storage freed a moment late"); those still alive then count from now on."""
        other_threads_settle(lambda: (self._prune(), not self._unsettled(current))[1])
        self._outlived |= {key for key in self._storages if key not in current}

    def after_backward(self) -> int:
        return available_bytes(self._params)

    def close(self) -> None:
        for name, original in self._originals.items():
            setattr(self._cls, name, original)


def training_coordinator(engine):
    """The engine's ZeRO-3 parameter coordinator for training."""
    offload = engine.optimizer.parameter_offload
    try:
        return offload.get_param_coordinator(training=True)
    except TypeError:  # deepspeed >= 0.16 takes no argument
        return offload.get_param_coordinator()


class CoordinatorProbe:
    """deepspeed's module trace and prefetch, on an engine's training coordinator, while open:
    ``invalidations`` counts its _invalidate_trace calls (the trace recorded in an earlier step
    did not match this one), and each fetch_sub_module call classifies its module's params by
    their status at the call: NOT_AVAILABLE (``on_demand``: the fetch gathers them itself),
    INFLIGHT (``prefetched``: a prefetch issued earlier serves them) or AVAILABLE (``resident``:
    still gathered, by a finished prefetch, reuse distance, persistence or a hold)."""

    def __init__(self, engine):
        from deepspeed.runtime.zero.partitioned_param_coordinator import iter_params, z3_leaf_module

        self._coordinator = training_coordinator(engine)
        self._iter_params, self._is_leaf = iter_params, z3_leaf_module
        self.invalidations = 0
        self.served: Counter = Counter()
        self._wrapped = ("_invalidate_trace", "fetch_sub_module")
        self._coordinator._invalidate_trace = self._counting_invalidations(self._coordinator._invalidate_trace)
        self._coordinator.fetch_sub_module = self._classifying_fetches(self._coordinator.fetch_sub_module)

    def _counting_invalidations(self, original):
        def _invalidate_trace(*args, **kwargs):
            self.invalidations += 1
            return original(*args, **kwargs)

        return _invalidate_trace

    def _classifying_fetches(self, original):
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        kinds = {ZeroParamStatus.NOT_AVAILABLE: "on_demand", ZeroParamStatus.INFLIGHT: "prefetched",
                 ZeroParamStatus.AVAILABLE: "resident"}

        def fetch_sub_module(module, *args, **kwargs):
            for param in self._iter_params(module, recurse=self._is_leaf(module)):
                if not getattr(param, "ds_persist", False):
                    self.served[kinds.get(param.ds_status, "other")] += 1
            return original(module, *args, **kwargs)

        return fetch_sub_module

    def close(self) -> None:
        for name in self._wrapped:
            vars(self._coordinator).pop(name, None)
