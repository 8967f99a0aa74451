"""Let accelerate (under transformers' Trainer and TRL) see CPU ranks that DeepSpeed runs.

accelerate has no CPU + DeepSpeed mode: on a machine without GPUs it finds no backend and
records one process, while deepspeed runs world_size ranks over gloo, and the Trainer's ZeRO-3
batch-size check fails (``2 != 2 * 1 * 2``). After deepspeed.init_distributed(), this fills
accelerate's shared process state from the real process group. It does nothing where
accelerate already sees the ranks (GPUs), so scripts may call it unconditionally. Pass
``accelerator_config={"use_configured_state": True}`` to TrainingArguments, or it resets the
state this sets up.
"""
import os

import torch


def make_accelerate_see_ranks() -> None:
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    if not torch.distributed.is_initialized():
        raise RuntimeError("call deepspeed.init_distributed() first")
    os.environ.setdefault("ACCELERATE_USE_DEEPSPEED", "true")
    state = PartialState()
    world_size = torch.distributed.get_world_size()
    if state.num_processes == world_size:
        return
    state.backend = torch.distributed.get_backend()
    state.distributed_type = DistributedType.DEEPSPEED
    state.num_processes = world_size
    state.process_index = torch.distributed.get_rank()
    state.local_process_index = int(os.environ.get("LOCAL_RANK", state.process_index))
    state.device = torch.device("cpu")
