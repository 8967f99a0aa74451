"""A synchronous gather of a param list whose dtypes differ, one dtype at a time (deepspeed 0.19.2).

NOTE [ Mixed-dtype gathers ]

1. deepspeed up to 0.19.2 gathers a param list synchronously (``GatheredParameters`` over several
   params, the persistent params after every ``step()``) in ``Init._allgather_params_coalesced``,
   which sizes every output buffer by the first param's dtype; 0.19.3 sizes each by its own
   (deepspeed #8073).
2. deepspeed 0.19.2 stopped casting a ZeRO-Init model's params to the engine's dtype (#8072), so
   a bf16 model with PEFT's fp32 adapters puts both dtypes in that list, and the first optimizer
   step raises ("invalid tensor type" on gloo, "output tensor must have the same type as input
   tensor" on NCCL), with or without checkpointing.
3. The layer is installed only where both hold, judged by deepspeed's code
   (targets.mixed_dtype_gather): every other release is left as it is.
4. It hands deepspeed's own method one dtype's params at a time, dtypes in the order the list
   first names them, each run in the list's order; a list of one dtype goes through as it came.
5. Every rank holds the same list in the same order (deepspeed relies on it already), so every
   rank splits it alike and the collectives still pair up.
"""
import functools
from typing import Callable, Dict, List

LAYER = "mixed_dtype_gather"


def dtype_key(param, quantize: bool) -> tuple:
    """What one output buffer's dtype depends on: the partition's dtype, and its scale's when quantized."""
    partition = param.ds_tensor
    scale = getattr(partition, "ds_quant_scale", None) if quantize else None
    return partition.dtype, None if scale is None else scale.dtype


def split_by_dtype(param_list, quantize: bool) -> List[list]:
    """``param_list`` as runs of one dtype key (NOTE, rule 4)."""
    runs: Dict[tuple, list] = {}
    for param in param_list:
        runs.setdefault(dtype_key(param, quantize), []).append(param)
    return list(runs.values())


def one_dtype_at_a_time(original: Callable, retired: Callable[[], bool] = lambda: False) -> Callable:
    """The replacement of ``Init._allgather_params_coalesced``: ``original`` once per dtype run; once
    ``retired()`` (after revert(), under someone who wrapped it later), ``original`` as it is."""

    @functools.wraps(original)
    def _allgather_params_coalesced(self, param_list, hierarchy=0, quantize=False):
        if retired():
            return original(self, param_list, hierarchy, quantize)
        runs = split_by_dtype(param_list, quantize)
        if len(runs) <= 1:
            return original(self, param_list, hierarchy, quantize)
        for run in runs:
            original(self, run, hierarchy, quantize)
        return None

    return _allgather_params_coalesced
