"""Assertions about ZeRO-3 partition state, and an all-gather counter, for the tests."""
from collections import Counter

import torch


def zero3_params(module: torch.nn.Module):
    return [param for param in module.parameters() if hasattr(param, "ds_id")]


def gathered_or_active(module: torch.nn.Module):
    """Non-persistent ZeRO-3 params still gathered, or with a ds_active_sub_modules entry."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return [
        param for param in zero3_params(module) if not param.ds_persist and (
            param.ds_status != ZeroParamStatus.NOT_AVAILABLE or param.ds_active_sub_modules)
    ]


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


class GatherCounter:
    """Counts, per param name, the all-gathers that take it from NOT_AVAILABLE to gathered."""

    def __init__(self, module: torch.nn.Module):
        self.counts: Counter = Counter()
        self._names = {param.ds_id: name for name, param in module.named_parameters() if hasattr(param, "ds_id")}
        self._originals = {}
        for param in zero3_params(module):
            self._originals[param] = param.all_gather_coalesced
            param.all_gather_coalesced = self._counting(param.all_gather_coalesced)

    def _counting(self, original):
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        def all_gather_coalesced(params, *args, **kwargs):
            for param in params:
                if param.ds_status == ZeroParamStatus.NOT_AVAILABLE:
                    self.counts[self._names[param.ds_id]] += 1
            return original(params, *args, **kwargs)

        return all_gather_coalesced

    def take(self) -> Counter:
        counts, self.counts = self.counts, Counter()
        return counts

    def close(self) -> None:
        for param, original in self._originals.items():
            param.all_gather_coalesced = original
