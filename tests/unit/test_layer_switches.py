"""ZERO3_RECOMPUTE_LAYERS_OFF switches each layer over the core off alone, status() says which are in
force, and a name that is no layer is refused with expected vs got, deepspeed left untouched.

Mutations: a layer read from the environment but built regardless (HoldLedger ignoring layers_off)
fails the first test; layers_switched_off() without its check of the names fails the second.
"""
import importlib

import pytest

LEDGER_LAYERS = ("placeholders", "deferral", "kept_storage")


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


def test_an_unknown_layer_is_refused(patched_status, monkeypatch):
    import zero3_recompute
    from zero3_recompute import patch
    from zero3_recompute.errors import UnknownLayer

    zero3_recompute.revert()
    offload = vars(patch._offload_class()).copy()
    monkeypatch.setenv(patch.ENV_LAYERS_OFF, "placeholders,placehodlers")
    with pytest.raises(UnknownLayer, match=r"expected ZERO3_RECOMPUTE_LAYERS_OFF naming some of placeholders, "
                       r"deferral, kept_storage, mixed_dtype_gather, got placehodlers"):
        zero3_recompute.apply(policy=patched_status.policy)
    assert vars(patch._offload_class()) == offload, "a refused apply() changed deepspeed"
    assert zero3_recompute.status().mode in ("not-applied", "upstream")
