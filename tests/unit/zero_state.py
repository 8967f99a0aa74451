"""Assertions about ZeRO-3 partition state for the tests, beside the benchmark's instruments
(all-gathers per param, gathered bytes over a step), which the tests measure with too."""
import torch

from zero3_recompute.testing.probes import (GatheredMemory, GatherCounter, gathered_or_active, training_coordinator,
                                          zero3_params)

__all__ = ["GatheredMemory", "GatherCounter", "LeakError", "assert_all_released", "coordinator_counts",
           "gathered_or_active", "zero3_params"]


class LeakError(AssertionError):
    """A ZeRO-3 param is still gathered, or still claimed by a submodule, when it should not be."""


def assert_all_released(module: torch.nn.Module, when: str) -> None:
    """Every non-persistent param partitioned, with no active submodule left; nothing held."""
    from zero3_recompute.patch import held_params

    offenders = gathered_or_active(module)
    if offenders:
        details = "\n".join(f"  ds_id={p.ds_id} shape={tuple(p.ds_shape)} requires_grad={p.requires_grad} "
                            f"status={p.ds_status.name} active={p.ds_active_sub_modules}" for p in offenders)
        raise LeakError(f"{len(offenders)} ZeRO-3 params not released {when}:\n{details}")
    held = held_params()
    if held:
        raise LeakError(f"{len(held)} params still held by zero3_recompute {when}")


def coordinator_counts(engine) -> tuple:
    """(the coordinator's count of available numel, the numel of non-persistent params gathered
    now): the two agree whenever the coordinator's bookkeeping is consistent."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    coordinator = training_coordinator(engine)
    counted = getattr(coordinator, "_PartitionedParameterCoordinator__n_available_params")
    gathered = sum(param.ds_numel for param in zero3_params(engine.module)
                   if not param.ds_persist and param.ds_status == ZeroParamStatus.AVAILABLE)
    return counted, gathered
