"""Every test rank records, per step, the params it all-gathers, in the order they go on the wire;
the harness compares the ranks' records after each test (tests/unit/common.py).

ZeRO-3's all-gathers pair up across ranks by call order alone. If one rank gathers other params,
or the same in another order, the collectives still pair up wherever sizes agree, and each rank
gets another param's shards: a wrong or NaN loss on one rank, no error. A record is a list of
steps (one per ``engine.step()``), each a list of gathers, each the ds_ids it gathers in order:
- the coordinator's fetches (each param's ``all_gather_coalesced``): sorted by ds_id, as deepspeed
  sorts them before the collective;
- deepspeed's list gathers (``Init._all_gather``: GatheredParameters, the persistent params after
  each step): the params not yet gathered, in the order of the list deepspeed is handed. On 0.19.2
  NOTE [ Mixed-dtype gathers ] then gathers that list one dtype at a time, an order that follows
  from the list and the params' dtypes alone, so ranks that agree here agree on the wire.
Nothing deepspeed computes changes: the wrappers only note ids, then call deepspeed's own.
"""
import functools
from typing import List, Optional, Sequence, Tuple

MARKER = "_zero3_recompute_tests_records_gathers"
Gather = Tuple[int, ...]
Record = List[List[Gather]]

_steps: Record = [[]]


def _note(ids) -> None:
    gather = tuple(ids)
    if gather:
        _steps[-1].append(gather)


def take() -> Record:
    """This rank's record since the last take() (trailing empty steps left out); starts a new one."""
    global _steps
    record, _steps = _steps, [[]]
    while record and not record[-1]:
        record.pop()
    return record


def _recording_coalesced(gather_coalesced):

    @functools.wraps(gather_coalesced)
    def all_gather_coalesced(params, *args, **kwargs):
        params = list(params)
        _note(sorted(param.ds_id for param in params))
        return gather_coalesced(params, *args, **kwargs)

    return all_gather_coalesced


def install() -> None:
    """Once per process, before any model is built."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.partition_parameters import Init, ZeroParamStatus

    if getattr(vars(Init)["_all_gather"], MARKER, False):
        return
    list_gather = vars(Init)["_all_gather"]
    convert = vars(Init)["_convert_to_deepspeed_param"]
    step = vars(DeepSpeedEngine)["step"]

    @functools.wraps(list_gather)
    def _all_gather(self, param_list, *args, **kwargs):
        _note(param.ds_id for param in param_list if param.ds_status == ZeroParamStatus.NOT_AVAILABLE)
        return list_gather(self, param_list, *args, **kwargs)

    @functools.wraps(convert)
    def _convert_to_deepspeed_param(self, param):
        result = convert(self, param)
        param.all_gather_coalesced = _recording_coalesced(param.all_gather_coalesced)
        return result

    @functools.wraps(step)
    def recorded_step(self, *args, **kwargs):
        try:
            return step(self, *args, **kwargs)
        finally:
            _steps.append([])

    setattr(_all_gather, MARKER, True)
    Init._all_gather = _all_gather
    Init._convert_to_deepspeed_param = _convert_to_deepspeed_param
    DeepSpeedEngine.step = recorded_step


def first_divergence(records: Sequence[Record]) -> Optional[str]:
    """Where the ranks' records first differ, in words; None where every rank gathered alike."""
    reference = records[0]
    for rank, record in enumerate(records[1:], start=1):
        for step in range(max(len(reference), len(record))):
            ours = reference[step] if step < len(reference) else []
            theirs = record[step] if step < len(record) else []
            for index in range(max(len(ours), len(theirs))):
                mine = tuple(ours[index]) if index < len(ours) else None
                other = tuple(theirs[index]) if index < len(theirs) else None
                if mine != other:
                    return (f"ranks 0 and {rank} all-gather differently at step {step}, gather {index} of "
                            f"{len(ours)} / {len(theirs)}: rank 0 ds_ids {_shown(mine)}, rank {rank} ds_ids "
                            f"{_shown(other)}; the gathers before it: {[list(g) for g in ours[max(0, index - 3):index]]}")
    return None


def _shown(gather: Optional[Gather]) -> str:
    return "nothing (it gathered no more this step)" if gather is None else str(list(gather))


def compare_across_ranks() -> Optional[str]:
    """first_divergence over every rank's record so far (a collective; the record is kept)."""
    import torch.distributed

    gathered: List[Optional[Record]] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, [list(step) for step in _steps])
    return first_divergence(gathered)
