"""The release policy's deferred backward fetch: a layer over the lifecycle's core (layer name
``deferral``; off, every backward fetch is stock's).

NOTE [ Deferred fetch ]

1. Under release, the backward fetch of a module whose params are all frozen, not persistent, not
   external and not on NVMe (ZenFlow off) is skipped when its last grad-enabled forward ran inside
   a checkpoint whose recompute reruns whole module calls (targets.CHECKPOINT_PACK_HOOKS) and no
   recompute has rerun it since, in any graph task.
2. Such a module's backward reads its params only through tensors autograd saved (the forward
   watch found no Python Function that may keep them: NOTE [ Params read outside saved tensors ]),
   so its backward starts that recompute, whose fetch gathers the module: one gather serves both.
   Fetched at once instead, it would stay gathered while the recompute gathers the others.
3. A deferral holds whatever the params' status (deepspeed records each fetch in its module trace),
   and only a grad-enabled forward sets or clears it.
4. Under prefetch a param left in flight is waited for by the recompute's fetch of the module,
   which precedes every read of its saved tensors, on the thread and stream of its backward.
5. On deepspeed 0.19.3+ a deferred module is missing from the coordinator's active-backward
   record, which a backward release asserts non-empty: its ancestors stay in it while late
   releases run (lifecycle NOTE, rule 2).
"""
import threading
import weakref

import torch

from zero3_recompute.policies import swapped_to_nvme
from zero3_recompute.targets import Targets

LAYER = "deferral"


class FetchDeferral:
    """Which modules' backward fetch the coming recompute serves (rule 1)."""

    def __init__(self, targets: Targets):
        self._targets = targets
        self._lock = threading.Lock()
        # True while a module's last training forward ran inside a rerunning checkpoint, read
        # through saved tensors alone, and no recompute has rerun it, nor was its fetch deferred.
        self._pending: "weakref.WeakKeyDictionary[torch.nn.Module, bool]" = weakref.WeakKeyDictionary()
        # Per thread, for the forward under way: the modules the forward watch saw read through
        # saved tensors alone, until their forward release takes them.
        self._calls = threading.local()

    def note_call(self, module) -> None:
        """From the forward watch: this call of ``module`` (all params frozen, inside a rerunning
        checkpoint) built a graph of nodes that read saved tensors alone (rule 2)."""
        if getattr(self._calls, "saved_only", None) is None:
            self._calls.saved_only = weakref.WeakSet()
        self._calls.saved_only.add(module)

    def forward_done(self, module, rerunning: bool) -> None:
        """A grad-enabled forward release of ``module`` outside any backward (rule 3). A call the
        watch did not see (its hooks bypassed, or the ledger made mid-forward) is not deferred."""
        watched = getattr(self._calls, "saved_only", None)
        saved_only = watched is not None and module in watched
        if saved_only:
            watched.discard(module)
        with self._lock:
            self._pending[module] = saved_only and rerunning

    def rerun(self, module) -> None:
        """A recompute released ``module``: it is gathered by then."""
        with self._lock:
            self._pending[module] = False

    def take(self, offload, module) -> bool:
        """Rule 1 at ``module``'s backward fetch: whether to skip it."""
        with self._lock:
            if not self._pending.get(module, False) or getattr(offload, "zenflow", False):
                return False
            targets = self._targets
            params = list(targets.iter_params(module, recurse=targets.is_leaf_module(module)))
            if not params or any(param.requires_grad or getattr(param, "is_external_param", False)
                                 or getattr(param, "ds_persist", False) or swapped_to_nvme(param)
                                 for param in params):
                return False
            self._pending[module] = False
            return True

    def clear(self) -> None:
        with self._lock:
            self._pending.clear()
