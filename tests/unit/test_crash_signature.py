"""The stock-crash check (patch_switch.is_recompute_crash) counts the seed bug's failure and
nothing else: torch's metadata check seeing a shrunk frozen tensor, or an op handed one. Any
other error in backward is not "stock crashes as recorded": the scenario table and the memory
contract let it through, and the test fails on it.

Mutation: the check as it was (any RuntimeError or CheckpointError counts): the injected
fault and the other CheckpointError below count as the crash.
"""
import warnings

import pytest
import torch
import torch.utils.checkpoint

from tests.unit.patch_switch import is_recompute_crash

# Reads torch only: once per torch (noxfile.py, NOTE [ Where a test runs ]).
pytestmark = pytest.mark.once_per_torch


def _backward_error(body) -> BaseException:
    """What a checkpointed ``body(x, frozen)`` raises in backward."""
    frozen = torch.ones(4)
    x = torch.ones(4, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch 2.4's checkpoint warns of its own deprecated autocast call
        loss = torch.utils.checkpoint.checkpoint(lambda inputs: body(inputs, frozen), x, use_reentrant=False).sum()
        with pytest.raises((RuntimeError, torch.utils.checkpoint.CheckpointError)) as caught:
            loss.backward()
    return caught.value


def _shrunk_in_recompute(inputs, frozen):
    out = inputs * frozen
    if torch._C._current_graph_task_id() != -1:
        frozen.data = torch.empty(0)  # what ZeRO-3's release does to a Parameter
    return out.exp()


def _fault_in_recompute(inputs, frozen):
    if torch._C._current_graph_task_id() != -1:
        raise RuntimeError("injected fault")
    return (inputs * frozen).exp()


def _saves_less_in_recompute(inputs, frozen):
    # The recompute takes another branch: torch's check finds a tensor it never recomputed.
    if torch._C._current_graph_task_id() != -1:
        return inputs.exp()
    return (inputs * frozen).exp()


def test_the_seed_bug_counts():
    from zero3_recompute.torch_recompute import recompute_keeps_frozen_tensors

    if not recompute_keeps_frozen_tensors():
        pytest.skip(f"torch {torch.__version__}'s checkpoint stores a detached alias: no metadata check to fail")
    error = _backward_error(_shrunk_in_recompute)
    assert is_recompute_crash(error), f"not counted: {error!r}"


def test_an_op_handed_a_partitioned_param_counts():
    frozen = torch.empty(0)  # stock's partitioned param, read where no check caught it
    with pytest.raises(RuntimeError) as caught:
        torch.ones(2, 16) * frozen.view(1, 0)
    assert is_recompute_crash(caught.value), f"not counted: {caught.value!r}"


@pytest.mark.parametrize("body", [_fault_in_recompute, _saves_less_in_recompute], ids=["fault", "other check"])
def test_other_errors_in_backward_do_not_count(body):
    error = _backward_error(body)
    assert not is_recompute_crash(error), f"counted as the seed bug: {error!r}"
