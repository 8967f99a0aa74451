"""Holds within deepspeed's own limit on live params (``stage3_max_live_parameters``).

NOTE [ Holds within the live-parameter limit ]

A layer over the lifecycle's core (layer name ``live_budget``).
1. deepspeed counts, per coordinator, the numel it has gathered and not yet partitioned, and caps
   its prefetch by ``stage3_max_live_parameters``; a held param stays in that count.
2. A recompute's release holds a frozen param only while the count, with what it already holds
   and this param, stays within the limit; params are taken in the module's order.
3. A param past the limit gets release's action instead, where the placeholders layer is on: a
   placeholder, and its module's backward fetch gathers it again.
4. The holds of rule 6 (the module's own backward under way) are never refused: that backward
   reads them now.
5. So the frozen numel gathered in backward stays within the limit plus the module being run,
   and the gathers rise by the params past it alone; the default limit (1e9) refuses nothing on a
   model whose one checkpointed block holds less.
"""
from typing import AbstractSet, FrozenSet, Tuple

LAYER = "live_budget"
NONE_REFUSED: FrozenSet[int] = frozenset()  # shared, read only


class LiveBudget:
    """Reads a coordinator's count and limit (targets.LIVE_NUMEL_COUNTERS) and refuses what passes it."""

    def __init__(self, counters: Tuple[str, str]):
        self._count, self._limit = counters

    def refused(self, coordinator, candidates: list) -> AbstractSet[int]:
        """The ids of ``candidates`` (gathered, about to be released) past the limit (rules 2, 5)."""
        count, limit = getattr(coordinator, self._count, None), getattr(coordinator, self._limit, None)
        if not isinstance(count, (int, float)) or not isinstance(limit, (int, float)) or count <= limit:
            return NONE_REFUSED  # within the limit now, the candidates counted in: each fits, taken in order
        counted = [param for param in candidates if not getattr(param, "ds_persist", False)]  # never in the count
        live = count - sum(param.ds_numel for param in counted)
        refused = set()
        for param in counted:
            if live + param.ds_numel <= limit:
                live += param.ds_numel
            else:
                refused.add(id(param))
        return refused

