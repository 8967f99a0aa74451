"""The root_fetch layer (NOTE [ Forward fetch at the root alone ]): an engine's forward fetches pass
deepspeed's method straight, but the root's part of the core runs at every forward, and what
deepspeed trains is as with the layer switched off. One rank, frozen blocks checkpointed
non-reentrant, in bf16. The first test runs in every cell; the others, in the two-version lane
(tests/unit/lanes.py) and the full tier's every cell.

Mutations tried, each fails the test named:
- RootFetch's hook never calling the root's part: test_fetches_pass_straight_and_the_roots_part_runs_each_forward;
- RootFetch._in_force not looking for deepspeed's fetch hook again once its key is gone:
  test_the_roots_part_runs_after_deepspeeds_hooks_are_registered_anew[re-registered];
- RootFetch.stop leaving the engine's __dict__ as it is: test_revert_and_a_later_wrapper_take_the_bypass_off;
- the class check left out of RootFetch._in_force: the same test (the later wrapper sees one call);
- KeptStorage's first storage taken in not stopping the layer: test_kept_storage_engaging_takes_every_bypass_off;
- the compiled test left out of RootFetch.take_on and _in_force: test_a_compiled_root_gets_no_bypass.
Also, test_backward_footprint.py checks that the package's one forward pre-hook is this layer's, on the root.
"""
import contextlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.unit.common import DistributedTest

DIM = 8
BLOCKS = 3
STEPS = 3
# deepspeed's forward fetches per step of _Chain: the root, then each block and its two children,
# in the forward and again in its recompute (the ModuleList is never called).
FETCHES = 1 + 2 * 3 * BLOCKS


class _Block(nn.Module):

    def __init__(self, frozen: nn.Module):
        super().__init__()
        self.frozen = frozen
        self.linear = nn.Linear(DIM, DIM)

    def forward(self, x):
        return self.linear(torch.tanh(self.frozen(x)))


class _Chain(nn.Module):

    def __init__(self, frozen=lambda: nn.Linear(DIM, DIM).requires_grad_(False)):
        super().__init__()
        self.blocks = nn.ModuleList(_Block(frozen()) for _ in range(BLOCKS))

    def forward(self, x, target):
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return F.mse_loss(x.float(), target)


def _engine(model_of=_Chain):
    from tests.unit.v1.zero.scenario_runner import sgd_engine

    torch.manual_seed(0)
    return sgd_engine(model_of(), lr=0.1, overrides={"bf16": {"enabled": True}})


def _batch():
    from tests.unit.v1.zero.scenario_runner import device

    generator = torch.Generator().manual_seed(1)
    x = torch.randn(4, DIM, generator=generator).to(device(), torch.bfloat16).requires_grad_(True)
    return x, torch.randn(4, DIM, generator=generator).to(device())


def _step(engine, x, target) -> float:
    loss = engine(x, target)
    engine.backward(loss)
    engine.step()
    return loss.item()


@contextlib.contextmanager
def _layer():
    """A fresh ledger's RootFetch (an earlier test's kept storage may have stopped the last one's),
    and each module its root's part ran for, inside the block; then the patch applied anew."""
    import zero3_recompute
    from zero3_recompute import patch

    found = zero3_recompute.status()
    if not found.active:
        pytest.skip(f"the package is not patched here: {found}")
    zero3_recompute.revert()
    try:
        fresh = zero3_recompute.apply(policy=found.policy)
        if "root_fetch" not in fresh.layers:
            pytest.skip(f"the root_fetch layer is switched off here: {fresh.layers}")
        root_fetch = vars(patch._offload_class())[patch.MARKER]["root_fetch"]
        calls, root_part = [], root_fetch._root_part

        def counted(offload, module):
            calls.append(module)
            root_part(offload, module)

        root_fetch._root_part = counted
        yield root_fetch, calls
    finally:
        zero3_recompute.revert()
        zero3_recompute.apply(policy=found.policy)


def _bypassed(engine) -> bool:
    from zero3_recompute.root_fetch import FETCH

    return FETCH in vars(engine.optimizer.parameter_offload)


def _stock_losses(model_of=_Chain, between=None):
    from tests.unit.patch_switch import layers_switched_off

    with layers_switched_off("root_fetch"):
        engine = _engine(model_of)
        x, target = _batch()
        losses = [_step(engine, x, target) for _ in range(STEPS)]
        if between is not None:
            between(engine)
            losses.append(_step(engine, x, target))
        assert not _bypassed(engine)
    return losses


def _stepped_once():
    """A fresh engine after its first step, its bypass on, and its batch."""
    engine = _engine()
    x, target = _batch()
    _step(engine, x, target)
    assert _bypassed(engine)
    return engine, x, target


def _hooks_registered_anew(engine, forward_between: bool) -> None:
    """As TRL's unwrap_model_for_generation (deepspeed's own from 0.19): deepspeed's module hooks
    off, a generation's forward with every param gathered (``forward_between``), the hooks on again."""
    import deepspeed

    offload = engine.optimizer.parameter_offload
    for handle in (*offload.forward_hooks, *offload.backward_hooks):
        handle.remove()
    offload.forward_hooks, offload.backward_hooks = [], []
    if forward_between:
        x, target = _batch()
        with torch.no_grad(), deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            engine.module(x, target)
    register = getattr(offload, "_register_deepspeed_module", None) or offload._register_hooks_recursively
    register(offload.module)


class TestRootFetch(DistributedTest):
    world_size = 1
    timeout = 240

    def test_fetches_pass_straight_and_the_roots_part_runs_each_forward(self):
        stock = _stock_losses()
        with _layer() as (root_fetch, calls):
            engine = _engine()
            x, target = _batch()
            losses = [_step(engine, x, target) for _ in range(STEPS)]
            assert _bypassed(engine) and len(root_fetch) == 1
        # The first forward's root fetch comes through the wrapper, which puts the bypass on.
        assert calls == [engine.module] * (STEPS - 1), "the root's part at every forward after the first"
        assert losses == stock, "trained as with the layer off"

    @pytest.mark.lane
    @pytest.mark.parametrize("forward_between", [False, True], ids=["re-registered", "forward-between"])
    def test_the_roots_part_runs_after_deepspeeds_hooks_are_registered_anew(self, forward_between):
        stock = _stock_losses(between=lambda engine: _hooks_registered_anew(engine, forward_between))
        with _layer() as (_, calls):
            engine = _engine()
            x, target = _batch()
            losses = [_step(engine, x, target) for _ in range(STEPS)]
            _hooks_registered_anew(engine, forward_between)
            before = len(calls)
            losses.append(_step(engine, x, target))
            # Re-registered: the hook finds deepspeed's new one. A forward between: deepspeed's hooks
            # were gone, so the bypass came off there, and the wrapper put it on again at this forward.
            assert len(calls) == before + (0 if forward_between else 1) and _bypassed(engine)
        assert losses == stock

    @pytest.mark.lane
    def test_revert_and_a_later_wrapper_take_the_bypass_off(self):
        import zero3_recompute
        from zero3_recompute import patch
        from zero3_recompute.root_fetch import FETCH

        with _layer() as (root_fetch, calls):
            engine = _engine()
            x, target = _batch()
            offload, root = engine.optimizer.parameter_offload, engine.module
            hooks = len(root._forward_pre_hooks)
            _step(engine, x, target)
            assert _bypassed(engine) and len(root._forward_pre_hooks) == hooks + 1
            # Someone's wrapper over the class's method after apply(): theirs sees every fetch again.
            cls, ours = patch._offload_class(), vars(patch._offload_class())[FETCH]
            seen = []

            def theirs(self, module):
                seen.append(module)
                return ours(self, module)

            setattr(cls, FETCH, theirs)
            try:
                _step(engine, x, target)
            finally:
                setattr(cls, FETCH, ours)
            assert len(seen) == FETCHES and seen.count(root) == 1, f"{len(seen)} fetches, {seen.count(root)} of the root"
            assert not _bypassed(engine) and len(root._forward_pre_hooks) == hooks
            assert calls == [], "the wrapper did the root's part of that forward"
            _step(engine, x, target)
            assert _bypassed(engine), "the wrapper put the bypass on again"
            zero3_recompute.revert()
            assert not _bypassed(engine) and len(root._forward_pre_hooks) == hooks and len(root_fetch) == 0
            _step(engine, x, target)
            assert FETCH not in vars(offload), "none put on after revert()"

    @pytest.mark.lane
    def test_a_compiled_root_gets_no_bypass(self):
        with _layer() as (_, calls):
            engine, x, target = _stepped_once()
            # As Module.compile() leaves it, without dynamo: the call goes through _compiled_call_impl.
            engine.module._compiled_call_impl = engine.module._call_impl
            for _ in range(2):
                _step(engine, x, target)
                assert not _bypassed(engine), "a compiled root's calls stay as deepspeed's hooks and the wrapper make them"
            assert calls == [], "the wrapper did the root's part"

    @pytest.mark.lane
    def test_kept_storage_engaging_takes_every_bypass_off(self):
        from tests.unit.v1.zero.context_views import ViewLinear

        with _layer() as (root_fetch, _):
            plain, x, target = _stepped_once()
            kept = _engine(lambda: _Chain(frozen=lambda: ViewLinear(DIM)))
            _step(kept, x, target)
            assert root_fetch.stopped and not _bypassed(plain) and not _bypassed(kept)
            _step(plain, x, target)
            assert not _bypassed(plain), "none put on once kept storage is engaged"
