"""ZERO3_RECOMPUTE_LAYERS_OFF switches each layer over the core off alone, status() says which are in
force, and a name that is no layer is refused with expected vs got, deepspeed left untouched.

Mutations: a layer read from the environment but built regardless (HoldLedger ignoring layers_off)
fails the first test; layers_switched_off() without its check of the names fails the second.
"""
import importlib

import pytest

LEDGER_LAYERS = ("placeholders", "deferral", "kept_storage", "live_budget")


@pytest.fixture
def patched_status():
    import zero3_recompute

    importlib.import_module("deepspeed.runtime.zero.parameter_offload")
    before = zero3_recompute.status()
    if not before.active:
        pytest.skip(f"the package is not patched here: {before}")
    yield before
    zero3_recompute.revert()
    zero3_recompute.apply(policy=before.policy)


@pytest.mark.parametrize("layer", LEDGER_LAYERS)
def test_each_layer_switched_off_alone(patched_status, monkeypatch, layer):
    import zero3_recompute
    from zero3_recompute import patch

    monkeypatch.setenv(patch.ENV_LAYERS_OFF, layer)
    zero3_recompute.revert()
    switched = zero3_recompute.apply(policy=patched_status.policy)
    expected = [name for name in LEDGER_LAYERS if name != layer and (name != "kept_storage" or
                                                                    patched_status.frees_kept_storage)]
    assert [name for name in switched.layers if name in LEDGER_LAYERS] == expected, switched.layers
    assert switched.frees_kept_storage == (layer != "kept_storage" and patched_status.frees_kept_storage)
    ledger = patch._ledger
    assert (ledger.placeholders is None) == (layer == "placeholders")
    assert (ledger.deferral is None) == (layer == "deferral")
    assert (ledger.budget is None) == (layer == "live_budget")


def test_an_unknown_layer_is_refused(patched_status, monkeypatch):
    import zero3_recompute
    from zero3_recompute import patch
    from zero3_recompute.errors import UnknownLayer

    zero3_recompute.revert()
    offload = vars(patch._offload_class()).copy()
    monkeypatch.setenv(patch.ENV_LAYERS_OFF, "placeholders,placehodlers")
    with pytest.raises(UnknownLayer, match=r"expected ZERO3_RECOMPUTE_LAYERS_OFF naming some of placeholders, "
                       r"deferral, kept_storage, live_budget, hook_stack, mixed_dtype_gather, root_fetch, got placehodlers"):
        zero3_recompute.apply(policy=patched_status.policy)
    assert vars(patch._offload_class()) == offload, "a refused apply() changed deepspeed"
    assert zero3_recompute.status().mode in ("not-applied", "upstream")


@pytest.mark.parametrize("switched_off", [False, True], ids=["on", "off"])
def test_the_hook_stack_layer_without_torchs_reader(patched_status, monkeypatch, switched_off):
    """As on torch 2.4-2.7 (torch's reader taken away): on, the shadow stack replaces torch's two
    bindings and status() lists the layer; switched off, torch's bindings stay as they are, the
    hook in force always reads as unknown (in force, no checkpoint's: NOTE [ Reading the
    saved-tensors hook stack ], rule 5), and the status says so. Mutation: resolve() ignoring
    layers_off for the shadow fails the "off" case."""
    import torch

    import zero3_recompute
    from zero3_recompute import patch, targets

    bindings = torch._C._autograd
    names = (targets.PUSH_HOOKS, targets.POP_HOOKS)
    zero3_recompute.revert()
    originals = {name: getattr(bindings, name) for name in names}
    monkeypatch.delattr(bindings, targets.TOP_HOOKS, raising=False)
    if switched_off:
        monkeypatch.setenv(patch.ENV_LAYERS_OFF, "hook_stack")
    status = zero3_recompute.apply(policy=patched_status.policy)
    replaced = [name for name in names if getattr(bindings, name) is not originals[name]]
    if switched_off:
        assert status.mechanism == targets.NO_READER and "hook_stack" not in status.layers, status
        assert replaced == []
        read = patch._ledger._targets.saved_tensors.top_pack_hook
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            assert read() is targets.UNKNOWN_PACK_HOOK
        assert read() is targets.UNKNOWN_PACK_HOOK
    else:
        assert status.mechanism == targets.SHADOW_READER and "hook_stack" in status.layers, status
        assert replaced == list(names)
    zero3_recompute.revert()
    assert all(getattr(bindings, name) is originals[name] for name in names)


def test_the_layer_names_agree():
    """patch.LAYERS repeats each layer module's LAYER (so that start-up imports none of them)."""
    from zero3_recompute import (deferral, hook_stack, kept_storage, live_budget, mixed_dtype_gather, patch,
                                 placeholders, root_fetch, targets)

    assert patch.LAYERS == tuple(module.LAYER for module in (placeholders, deferral, kept_storage, live_budget,
                                                             hook_stack, mixed_dtype_gather, root_fetch))
    assert (targets.SHADOW_LAYER, targets.BUDGET_LAYER) == (hook_stack.LAYER, live_budget.LAYER)
