"""The ledger's per-param rules, in one process, on plain torch params with ZeRO-3's fields.

Each rule runs inside a real backward graph task (a custom Function's backward), with and
without a saved-tensors hook, as the recompute's post-forward release would meet it.
"""
import contextlib
from types import SimpleNamespace

import pytest
import torch

from zero3_recompute import policies
from zero3_recompute.lifecycle import HoldLedger
from zero3_recompute.targets import Targets

AVAILABLE, NOT_AVAILABLE = "AVAILABLE", "NOT_AVAILABLE"


def _param(shape, location="cpu"):
    param = torch.nn.Parameter(torch.randn(*shape), requires_grad=False)
    param.ds_shape = torch.Size(shape)
    param.ds_status = AVAILABLE
    param.ds_active_sub_modules = set()
    param.ds_persist = False
    param.ds_tensor = SimpleNamespace(final_location=SimpleNamespace(value=location))
    return param


def _release(coordinator, param):
    param.ds_status = NOT_AVAILABLE
    param.data = torch.empty(0)


def _targets():
    return Targets(offload_cls=object, originals={}, release_param=_release, coordinator_of=lambda offload, m: None,
                   iter_params=lambda module, recurse: module.parameters(recurse=recurse),
                   is_leaf_module=lambda module: False, available_status=AVAILABLE)


def _in_backward(action):
    """Run ``action()`` inside a backward graph task; return what it returned."""
    box = {}

    class Probe(torch.autograd.Function):

        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            box["result"] = action()
            return grad

    Probe.apply(torch.ones(1, requires_grad=True)).sum().backward()
    return box["result"]


def _module(*params):
    module = torch.nn.Module()
    for index, param in enumerate(params):
        module.register_parameter(f"p{index}", param)
    return module


def _recompute_release(ledger, module, hooked: bool, release=None, check=None):
    """Inside a backward: the ledger's step 1 around a release (``release(param)`` for each
    param stock would partition), then ``check(plan)``; the graph task ends after it."""

    def step():
        with contextlib.ExitStack() as stack:
            if hooked:
                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))
            plan = ledger.before_release(None, module)
        if release is not None:
            release(plan)
        ledger.after_release(plan)
        if check is not None:
            check(plan)
        return plan

    return _in_backward(step)


@pytest.mark.parametrize("policy, hooked, held, placeholder", [
    (policies.AUTO, True, True, False),
    (policies.AUTO, False, False, False),
    (policies.KEEP, False, True, False),
    (policies.RELEASE, True, False, True),
    (policies.RELEASE, False, False, False),
])
def test_policy_actions(policy, hooked, held, placeholder):
    ledger = HoldLedger(_targets(), policy)
    param = _param((3, 4))

    def check(plan):
        assert [p for p, _ in plan.held] == ([param] if held else [])
        assert plan.placeholder_candidates == ([param] if placeholder else [])
        assert (len(param.ds_active_sub_modules) == 1) == held

    _recompute_release(ledger, _module(param), hooked, check=check)
    assert not param.ds_active_sub_modules, "the end of the graph task drops every hold"
    assert param.ds_status == (NOT_AVAILABLE if held else AVAILABLE), "and releases what it held"


def test_nvme_swapped_params_are_never_held():
    """Holding NVMe-swapped params could exhaust the swapper's buffers: they get placeholders."""
    ledger = HoldLedger(_targets(), policies.KEEP)
    on_disk, in_memory = _param((3, 4), location="nvme"), _param((3, 4))

    def check(plan):
        assert [p for p, _ in plan.held] == [in_memory]
        assert plan.placeholder_candidates == [on_disk]
        assert not on_disk.ds_active_sub_modules

    _recompute_release(ledger, _module(on_disk, in_memory), hooked=True, check=check)


def _stock_release(plan):
    for param in plan.placeholder_candidates:
        _release(None, param)


def test_placeholder_keeps_the_shape_without_storage_until_the_backward_ends():
    ledger = HoldLedger(_targets(), policies.RELEASE)
    param = _param((3, 4))

    def check(plan):
        assert param.shape == (3, 4) and param.data.untyped_storage().nbytes() == param.element_size()
        assert torch.isnan(param.data).all(), "a read of the placeholder must show"

    _recompute_release(ledger, _module(param), hooked=True, release=_stock_release, check=check)
    assert param.shape == (0, ), "stock's partitioned tensor is back once the backward ended"


def test_a_released_param_that_was_gathered_again_keeps_its_data():
    ledger = HoldLedger(_targets(), policies.RELEASE)
    param = _param((3, 4))
    gathered = torch.randn(3, 4)

    def gather_again(plan):
        param.data, param.ds_status = gathered, AVAILABLE

    _recompute_release(ledger, _module(param), hooked=True, release=_stock_release, check=gather_again)
    assert param.data.data_ptr() == gathered.data_ptr()


@pytest.mark.parametrize("after", ["one element", "transposed", "unchanged"])
def test_a_held_param_is_restored_only_when_its_data_shrank(after):
    """The fast leaf path swaps param.data for a 1-element buffer even for a param it kept;
    ZenFlow transposes param.data around the release: that is not ours to undo."""
    ledger = HoldLedger(_targets(), policies.KEEP)
    param = _param((3, 4))
    gathered = param.data
    replacement = {"one element": torch.empty(1), "transposed": gathered.t(), "unchanged": gathered}[after]

    def swap(plan):
        param.data = replacement

    def check(plan):
        expected = gathered if after != "transposed" else replacement
        assert param.data.data_ptr() == expected.data_ptr() and param.shape == expected.shape

    _recompute_release(ledger, _module(param), hooked=True, release=swap, check=check)


def test_unknown_policy_names_the_choices():
    from zero3_recompute.errors import UnknownPolicy

    with pytest.raises(UnknownPolicy, match=r"expected one of auto, keep, release .*got 'hold'"):
        policies.for_patching(policies.requested("hold"))
    with pytest.raises(UnknownPolicy, match="this deepspeed has none"):
        policies.for_patching(policies.requested("upstream"))
    assert policies.requested(" KEEP ") == "keep"


def test_policy_from_the_environment(monkeypatch):
    monkeypatch.setenv(policies.ENV_POLICY, "release")
    assert policies.requested() == "release"
    monkeypatch.delenv(policies.ENV_POLICY)
    assert policies.requested() == "auto"


def test_the_ledger_keeps_no_model_alive():
    """The ancestry it caches per model (for releasing a block's leftovers) holds ids only."""
    import gc
    import weakref

    ledger = HoldLedger(_targets(), policies.KEEP)
    model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    inner = model[0][0]
    parents = ledger._parent_map(SimpleNamespace(module=model))
    assert parents[id(inner)] == id(model[0]) and parents[id(model[0])] == id(model)
    alive = weakref.ref(model)
    del model, inner
    gc.collect()
    assert alive() is None, "the ledger kept the model alive"
