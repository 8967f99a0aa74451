"""Gathered storage that something outside autograd's saved tensors keeps alive.

NOTE [ Gathered storage kept outside saved tensors ]

A layer over the lifecycle's core (layer name ``kept_storage``). A Python autograd Function may keep
a view of a frozen param's gathered data on its ctx (bitsandbytes' 4-bit matmul keeps weight.t()):
under a non-reentrant checkpoint that ctx is the forward's, so every layer's gathered weight would
stay allocated until backward, growing with depth, while ZeRO says partitioned.
1. Taken in: the gathered storage of a frozen param whose module call, in a training forward under
   a checkpoint that reruns module calls, ran a Python Function not of torch or deepspeed
   (NOTE [ Params read outside saved tensors ]) and returned outputs that need grad and view
   none of it (_candidate has the rest).
2. Every release that partitions such a param (forward, recompute, backward, and the lifecycle's
   own late ones) frees the storage in place if something else still references it.
3. Every fetch that leaves the param AVAILABLE refills it and makes the param view it, so one copy
   is alive, between the module's fetch and its release, as ZeRO accounts it.
4. A storage nothing else references is let go.
5. revert() refuses while a storage it freed is still referenced: only the package refills it.
It relies on what ZeRO-3 relies on for every saved tensor: a module's backward runs after its
backward fetch. A read while the param is partitioned reads freed memory, where stock reads a
stale copy; no Function we know of does that.
"""
import threading
import weakref
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Set, Tuple

import torch

from zero3_recompute.autograd_reads import output_needs_grad, output_storages
from zero3_recompute.policies import swapped_to_nvme
from zero3_recompute.targets import Targets


LAYER = "kept_storage"


@dataclass
class _Freed:
    """One storage taken in, and the geometry of the param's gathered tensor over it."""
    storage: object
    nbytes: int
    size: Tuple[int, ...]
    stride: Tuple[int, ...]
    dtype: torch.dtype

    def view(self) -> torch.Tensor:
        tensor = torch.empty(0, dtype=self.dtype, device=self.storage.device)
        return tensor.set_(self.storage, 0, self.size, self.stride)


# What one release may free: (param, the storage under it to take in, or None).
Release = List[Tuple[torch.nn.Parameter, Optional[_Freed]]]


class KeptStorage:
    """The storages taken in, per param (see NOTE). One per ledger, which calls note_call from its
    module forward hook during a watched training forward."""

    def __init__(self, targets: Targets, enabled: bool = True):
        self._targets = targets
        # None: switched off, or torch cannot count a storage's references.
        self._use_count: Optional[Callable[[object], int]] = targets.storage_use_count if enabled else None
        self._lock = threading.RLock()
        # id(param) -> the storages taken in under it; an entry goes with its param (a tensor
        # compares elementwise, so it cannot key a WeakKeyDictionary).
        self._freed: Dict[int, List[_Freed]] = {}
        self._refs: Dict[int, "weakref.ref"] = {}
        # Per thread: id(module) -> the storages its call just returned, for a call the forward
        # hook found may keep views (NOTE); taken by that module's release, which comes next.
        self._calls = threading.local()
        # Whether note_call ever noted a call, on any thread. Until then nothing is taken in, and
        # the wrappers and the late releases call neither the fetch's nor the release's methods.
        self.engaged = False
        # Called once, as it engages (the root_fetch layer's stop: NOTE [ Forward fetch at the root alone ]).
        self.on_engaged: Optional[Callable[[], None]] = None

    @property
    def enabled(self) -> bool:
        return self._use_count is not None

    def _record_current_stream(self, tensor: torch.Tensor) -> None:
        """Keeps ``tensor``'s memory from reuse until the current stream is done with it, as
        deepspeed's free_param does before it drops a gathered tensor (nothing on the CPU)."""
        accelerator = self._targets.stream_accelerator
        if accelerator is not None and accelerator.on_accelerator(tensor):
            tensor.record_stream(accelerator.current_stream())

    def _keep(self, param, kept: List[_Freed]) -> None:
        """Record ``kept`` as the storages taken in under ``param``; call with the lock held."""
        key = id(param)
        if not kept:
            self._freed.pop(key, None)
            self._refs.pop(key, None)
            return
        self._freed[key] = kept
        if key not in self._refs:
            self._refs[key] = weakref.ref(param, lambda _, key=key: self._forget(key))

    def _forget(self, key: int) -> None:
        with self._lock:
            self._freed.pop(key, None)
            self._refs.pop(key, None)

    def _params(self, module) -> List[torch.nn.Parameter]:
        targets = self._targets
        return list(targets.iter_params(module, recurse=targets.is_leaf_module(module)))

    def note_call(self, module, output) -> None:
        """From the ledger's module forward hook, right before deepspeed's release of ``module``:
        ``output`` of a call in a checkpointed training forward that ran a Python Function not of
        torch or deepspeed (NOTE), else None."""
        calls = getattr(self._calls, "pending", None) if self.engaged else None
        if calls:
            calls.pop(id(module), None)
        if output is None or output_needs_grad(output) is not True:
            return
        returned = output_storages(output)
        if returned is None:
            return
        if calls is None:
            calls = self._calls.pending = {}
        calls[id(module)] = returned
        if not self.engaged:
            self.engaged = True
            if self.on_engaged is not None:
                self.on_engaged()

    def forward_ended(self) -> None:
        """The root's release: nothing noted in this thread's forward is left for a later one."""
        calls = getattr(self._calls, "pending", None) if self.engaged else None
        if calls:
            calls.clear()

    def _take_call(self, module) -> Optional[Set[int]]:
        if not self.engaged:
            return None
        calls = getattr(self._calls, "pending", None)
        return None if not calls else calls.pop(id(module), None)

    def before_release(self, offload, module) -> Optional[Release]:
        if self._use_count is None:
            return None
        returned = self._take_call(module)
        if getattr(offload, "zenflow", False):
            returned = None
        if returned is None and not self._freed:
            return None
        available = self._targets.available_status
        entries = []
        for param in self._params(module):
            if param.ds_status != available:
                continue
            candidate = _candidate(param, returned) if returned is not None else None
            if candidate is not None or id(param) in self._freed:
                entries.append((param, candidate))
        return entries or None

    def after_release(self, release: Optional[Release]) -> None:
        """Rules 2 and 4. A storage freed in place first records the current stream."""
        if release is None:
            return
        available = self._targets.available_status
        with self._lock, self._targets.outside_dispatch_modes():
            for param, candidate in release:
                if param.ds_status == available:
                    continue  # held
                freed = self._freed.get(id(param), [])
                if candidate is not None and not any(entry.storage.data_ptr() == candidate.storage.data_ptr()
                                                     for entry in freed):
                    freed.append(candidate)
                kept = [entry for entry in freed if self._use_count(entry.storage) > 1]
                for entry in kept:
                    if entry.storage.nbytes() != 0:
                        self._record_current_stream(entry.view())
                        entry.storage.resize_(0)
                self._keep(param, kept)

    def freed_in_use(self) -> int:
        """How many storages taken in are freed while something still references them (a graph
        of a forward that ran patched, whose backward has not run)."""
        if self._use_count is None:
            return 0
        with self._lock:
            return sum(1 for freed in self._freed.values() for entry in freed
                       if entry.storage.nbytes() == 0 and self._use_count(entry.storage) > 1)

    def after_params_released(self, params: List[torch.nn.Parameter]) -> None:
        """The lifecycle's own releases of held params (its sweep, its late backward releases):
        the storages taken in under those it partitioned are freed, as after stock's release."""
        if self._freed:
            self.after_release([(param, None) for param in params if id(param) in self._freed])

    def after_fetch(self, module) -> None:
        """Rule 3. The copy runs on the current stream, which deepspeed's fetch made wait for the
        gather; the gathered tensor it leaves (allocated on deepspeed's all-gather stream) first
        records the current stream, so the allocator does not reuse it early. Outside torch dispatch
        modes: selective checkpointing records and replays ops, and these are not the user's."""
        if not self._freed:
            return
        available = self._targets.available_status
        with self._lock, torch.no_grad(), self._targets.outside_dispatch_modes():
            for param in self._params(module):
                freed = self._freed.get(id(param))
                if not freed or param.ds_status != available:
                    continue
                kept = [entry for entry in freed if self._use_count(entry.storage) > 1]
                viewed = False
                for entry in kept:
                    if entry.storage.nbytes() != 0:
                        continue
                    entry.storage.resize_(entry.nbytes)
                    refilled = entry.view()
                    gathered = param.data
                    refilled.copy_(gathered)
                    if not viewed and _same_geometry(refilled, gathered):
                        # deepspeed allocated the gathered tensor on its all-gather stream.
                        self._record_current_stream(gathered)
                        param.data, viewed = refilled, True
                    del gathered
                self._keep(param, kept)


def _candidate(param, returned: Set[int]) -> Optional[_Freed]:
    """Rule 1: the storage under a gathered frozen param (not persistent, external or on NVMe), if
    it may be taken in: a resizable buffer holding this param alone (from its start, no bigger than
    its padded size, ds_numel_aligned: deepspeed's all-gathers give each param its own; its
    all-reduce fetch shares one), not its partition (with one rank deepspeed gathers nothing), and
    not under what its module's call returned (a module may return a slice of its weight)."""
    aligned = getattr(param, "ds_numel_aligned", None)
    if (param.requires_grad or getattr(param, "ds_persist", False) or getattr(param, "is_external_param", False)
            or swapped_to_nvme(param) or not isinstance(aligned, int)):
        return None
    data = param.data
    try:
        storage = data.untyped_storage()
        if (not storage.resizable() or data.storage_offset() != 0 or storage.nbytes() == 0
                or storage.nbytes() > aligned * data.element_size() or storage.data_ptr() in returned):
            return None
    except (RuntimeError, NotImplementedError):
        return None  # a wrapper subclass: no storage of its own to free
    # With one rank, deepspeed skips the gather and the param views its partition itself.
    for partition in (getattr(param, "ds_tensor", None), getattr(param, "ds_secondary_tensor", None)):
        if isinstance(partition, torch.Tensor) and partition.untyped_storage().data_ptr() == storage.data_ptr():
            return None
    return _Freed(storage, storage.nbytes(), tuple(data.shape), tuple(data.stride()), data.dtype)


def _same_geometry(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype and a.device == b.device
