"""What the lifecycle knows of each engine (DeepSpeedZeRoOffload) and its coordinators."""
import threading
import weakref
from dataclasses import dataclass
from typing import Set

from zero3_recompute.by_id import ById


@dataclass
class EngineFacts:
    # Its training forward ran a module a checkpoint may recompute: one without grad (reentrant
    # checkpointing, deepspeed's) or under a saved-tensors hook (non-reentrant). Only such an
    # engine's backwards open books; kept for good: whether a backward recomputes is known only
    # once it does.
    checkpointing: bool = False
    # The forward under way ran such a module; the root's release settles it.
    forward_checkpointed: bool = False


class Engines:
    """EngineFacts per engine, and the coordinators a graph task with books touched: their
    deepspeed end-of-backward sweep (0.19.3 on) stays switched off; any other's backward is
    stock's throughout."""

    def __init__(self, saved_tensors):
        # None where no saved-tensors hook is in force on this thread, settled, in one call
        # (targets.SavedTensorsProbe): with torch.is_grad_enabled(), rule 7's test outside any
        # backward, which the forward release's wrapper makes itself, without a frame of its own,
        # for a release of an engine not in ``recomputing``. A release without grad takes the
        # core's path: it may be a reentrant checkpoint's first pass.
        self.any_hook = saved_tensors.any_hook or saved_tensors.top_pack_hook
        self._lock = threading.Lock()
        self._facts = ById()  # id(offload) -> EngineFacts
        # The ids of the engines that may recompute: a checkpoint ran in a finished training forward
        # or in the one under way. Where none did, every hook of the engine is deepspeed's after
        # this one test, a set lookup the wrappers make themselves (lifecycle NOTE, rule 7). Each
        # id goes with its engine.
        self.recomputing: Set[int] = set()
        # The ids of the engines whose training forward under way has every note the ledger takes
        # (its facts, the watch's start): its releases up to its root's count rule 5 alone. Its
        # root's fetch and release take an engine off; each id goes with its engine.
        self.forward_noted: Set[int] = set()
        self._coordinators_with_books: "weakref.WeakSet" = weakref.WeakSet()

    def _of(self, offload) -> EngineFacts:
        facts = self._facts.get(id(offload))
        if facts is None:
            with self._lock:
                facts = self._facts.get(id(offload))
                if facts is None:
                    facts = self._facts.put(offload, EngineFacts())
                    weakref.finalize(offload, self._forget, id(offload)).atexit = False
        return facts

    def _forget(self, key: int) -> None:
        self.recomputing.discard(key)
        self.forward_noted.discard(key)

    def forward_released(self, offload, module, grad_enabled: bool, under_hook: bool) -> bool:
        """A forward release outside any backward: an engine's training forward that ran a module
        a checkpoint may recompute makes it checkpointing when its root's release ends it. Whether
        the forward under way ran such a module."""
        facts = self._facts.get(id(offload)) or self._of(offload)
        if module is offload.module:
            if grad_enabled and (under_hook or facts.forward_checkpointed):
                facts.checkpointing = True
            facts.forward_checkpointed = False
            self.forward_noted.discard(id(offload))
        elif (not grad_enabled or under_hook) and not facts.forward_checkpointed:
            facts.forward_checkpointed = True
        else:
            return facts.forward_checkpointed
        if facts.checkpointing or facts.forward_checkpointed:
            self.recomputing.add(id(offload))
        else:
            self.recomputing.discard(id(offload))
        return facts.forward_checkpointed

    def checkpointing(self, offload) -> bool:
        facts = self._facts.get(id(offload))
        return facts is not None and facts.checkpointing

    def books_touched(self, coordinator) -> None:
        self._coordinators_with_books.add(coordinator)

    def keeps_books_for(self, coordinator) -> bool:
        """Whether a backward that used ``coordinator`` ever had books."""
        return coordinator in self._coordinators_with_books
