"""The release policy's placeholders: a layer over the lifecycle's core (layer name
``placeholders``; off, its params are held instead).

NOTE [ Placeholders under release ]

1. Under release, each frozen param that stock's release of a recompute partitioned, while a
   saved-tensors hook is in force, gets a placeholder of its full shape.
2. A placeholder views one element per dtype and device, NaN where the dtype has one: it costs
   no memory, and the checkpoint's metadata check, right after the recompute inside its unpack
   hook (targets.RECOMPUTE_FRAMES), sees the shape the checkpoint stored.
3. At the first backward fetch or release on that thread once it is out of every unpack hook,
   stock's partitioned tensor goes back, so a read before the module's fetch fails as on stock.
4. When the graph task ends, stock's tensor goes back wherever a placeholder is still in place.
"""
import threading
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

from zero3_recompute.targets import Targets

LAYER = "placeholders"


@dataclass
class Placeholder:
    param: torch.nn.Parameter
    placeholder: torch.Tensor
    partitioned: torch.Tensor
    # The thread that made it inside a checkpoint's unpack hook, which unveils it once out of
    # every such hook (rule 3); None: kept until the end of the graph task.
    unveiled_by: Optional[int]


class Placeholders:
    """Makes placeholders and unveils them; the graph task's books hold them (NOTE [ Graph task
    books ])."""

    def __init__(self, targets: Targets, recompute_under_way: Callable[[], bool]):
        self._targets = targets
        # Whether this thread is inside a checkpoint's unpack hook (rule 3; the core's reader).
        self._recompute_under_way = recompute_under_way
        # (dtype, device) -> the one element every placeholder of that dtype and device views.
        self._cells: Dict[Tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def put(self, candidates: List[torch.nn.Parameter]) -> List[Placeholder]:
        """Rule 1, right after stock's release: a placeholder for each of ``candidates`` it
        partitioned (a param still AVAILABLE was kept by another module)."""
        left = [param for param in candidates if param.ds_status != self._targets.available_status]
        if not left:
            return []
        unveiled_by = threading.get_ident() if self._recompute_under_way() else None
        entries = []
        with self._targets.outside_dispatch_modes():
            for param in left:
                entries.append(Placeholder(param, self._placeholder_for(param), param.data, unveiled_by))
                param.data = entries[-1].placeholder
        return entries

    def _placeholder_for(self, param: torch.nn.Parameter) -> torch.Tensor:
        """Rule 2. Made outside any torch dispatch mode: selective activation checkpointing replays
        the forward's ops during the recompute and refuses any op it did not record."""
        key = (param.dtype, param.device)
        cell = self._cells.get(key)
        if cell is None:
            fill = float("nan") if param.dtype.is_floating_point or param.dtype.is_complex else 0
            cell = self._cells.setdefault(key, torch.full((), fill, dtype=param.dtype, device=param.device))
        # A 0-dim cell expands to every shape, () included (a frozen scale or temperature).
        return cell.expand(tuple(param.ds_shape))

    def unveil(self, task, lock) -> None:
        """Rule 3 for ``task`` (its GraphTask), once this thread is out of every unpack hook."""
        thread = threading.get_ident()
        if (task is None or not task.placeholders or not any(entry.unveiled_by == thread for entry in task.placeholders)
                or self._recompute_under_way()):
            return
        with lock:
            ready = [entry for entry in task.placeholders if entry.unveiled_by == thread]
            task.placeholders = [entry for entry in task.placeholders if entry.unveiled_by != thread]
        restore(ready)


def restore(entries: List[Placeholder]) -> None:
    """Rules 3 and 4: stock's partitioned tensor back where a placeholder is still in place."""
    for entry in entries:
        data = entry.param.data
        if data.shape == entry.placeholder.shape and data.data_ptr() == entry.placeholder.data_ptr():
            entry.param.data = entry.partitioned
