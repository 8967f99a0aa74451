"""What the lifecycle knows of each engine (DeepSpeedZeRoOffload) and its coordinators."""
import threading
import weakref
from dataclasses import dataclass


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

    def __init__(self):
        self._lock = threading.Lock()
        self._facts: "weakref.WeakKeyDictionary[object, EngineFacts]" = weakref.WeakKeyDictionary()
        self._coordinators_with_books: "weakref.WeakSet" = weakref.WeakSet()

    def _of(self, offload) -> EngineFacts:
        facts = self._facts.get(offload)
        if facts is None:
            with self._lock:
                facts = self._facts.setdefault(offload, EngineFacts())
        return facts

    def forward_released(self, offload, module, grad_enabled: bool, under_hook: bool) -> None:
        """A forward release outside any backward: an engine's training forward that ran a module
        a checkpoint may recompute makes it checkpointing when its root's release ends it."""
        facts = self._of(offload)
        if module is offload.module:
            if grad_enabled and (under_hook or facts.forward_checkpointed):
                facts.checkpointing = True
            facts.forward_checkpointed = False
        elif not grad_enabled or under_hook:
            facts.forward_checkpointed = True

    def checkpointing(self, offload) -> bool:
        facts = self._facts.get(offload)
        return facts is not None and facts.checkpointing

    def may_recompute(self, offload) -> bool:
        """A checkpoint ran in this engine, in a finished training forward or the one under way."""
        facts = self._facts.get(offload)
        return facts is not None and (facts.checkpointing or facts.forward_checkpointed)

    def books_touched(self, coordinator) -> None:
        self._coordinators_with_books.add(coordinator)

    def keeps_books_for(self, coordinator) -> bool:
        """Whether a backward that used ``coordinator`` ever had books."""
        return coordinator in self._coordinators_with_books
