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


class GatheredMemory:
    """Bytes of non-persistent ZeRO-3 params gathered, by shared NOTES §4's definitions.

    Sampled after every fetch and before and after every release of the coordinator:
      peak_backward         the most bytes of params in status AVAILABLE, during backward
                            (inside an autograd graph task);
      peak_backward_frozen  the same for frozen params alone;
      peak_backward_live    the most bytes of gathered storage still alive during backward,
                            whoever holds it: a storage seen under an AVAILABLE param counts
                            until it is freed, also after the param was released, e.g. while
                            autograd keeps a view of it (F.linear saves weight.t()); storages
                            are registered in forward too, peaks are taken in backward;
      after_backward()      the bytes still gathered now.
    """

    _SAMPLED = ("fetch_sub_module", "release_sub_module")

    def __init__(self, module: torch.nn.Module):
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
        from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

        self._available = ZeroParamStatus.AVAILABLE
        self._params = [param for param in zero3_params(module) if not param.ds_persist]
        self._storages = {}
        self.reset()
        self._cls = PartitionedParameterCoordinator
        self._originals = {name: vars(self._cls)[name] for name in self._SAMPLED}
        setattr(self._cls, "fetch_sub_module", self._sampling(self._originals["fetch_sub_module"], before=False))
        setattr(self._cls, "release_sub_module", self._sampling(self._originals["release_sub_module"], before=True))

    def reset(self) -> None:
        self.peak_backward = self.peak_backward_frozen = self.peak_backward_live = 0

    def _sampling(self, original, before: bool):

        def sampled(coordinator, *args, **kwargs):
            if before:
                self.sample()
            result = original(coordinator, *args, **kwargs)
            self.sample()
            return result

        return sampled

    @staticmethod
    def _bytes(param) -> int:
        return param.ds_numel * param.element_size()

    def sample(self) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef

        gathered = [param for param in self._params if param.ds_status == self._available]
        for param in gathered:
            storage = param.data.untyped_storage()
            known = self._storages.get(storage.data_ptr())
            if known is None or known[0].expired():
                self._storages[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())
        self._storages = {key: entry for key, entry in self._storages.items() if not entry[0].expired()}
        if torch._C._current_graph_task_id() == -1:
            return
        self.peak_backward = max(self.peak_backward, sum(self._bytes(param) for param in gathered))
        self.peak_backward_frozen = max(self.peak_backward_frozen,
                                        sum(self._bytes(param) for param in gathered if not param.requires_grad))
        self.peak_backward_live = max(self.peak_backward_live, sum(nbytes for _, nbytes in self._storages.values()))

    def after_backward(self) -> int:
        return sum(self._bytes(param) for param in self._params if param.ds_status == self._available)

    def close(self) -> None:
        for name, original in self._originals.items():
            setattr(self._cls, name, original)


def coordinator_counts(engine) -> tuple:
    """(the coordinator's count of available numel, the numel of non-persistent params gathered
    now): the two agree whenever the coordinator's bookkeeping is consistent."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    offload = engine.optimizer.parameter_offload
    try:
        coordinator = offload.get_param_coordinator(training=True)
    except TypeError:  # deepspeed >= 0.16 takes no argument
        coordinator = offload.get_param_coordinator()
    counted = getattr(coordinator, "_PartitionedParameterCoordinator__n_available_params")
    gathered = sum(param.ds_numel for param in zero3_params(engine.module)
                   if not param.ds_persist and param.ds_status == ZeroParamStatus.AVAILABLE)
    return counted, gathered
