"""A ZeRO-3 backward that no checkpoint ran in registers nothing with torch, process-wide or on a module.

The package's module forward hook sits on each module with a frozen param of its own of a model a
checkpoint ran in (NOTE [ Forward watch ], rule 3), and its callback and finalizer come with a
graph task's books (NOTE [ Graph task books ]), which only a backward that can recompute opens:
one after a training forward without grad or under a saved-tensors hook. A node in the middle of
the model's backward (the pause of scenario_models.PausingBlock) reads torch's global module
forward hooks, the model's modules that carry the package's hook, and the graph tasks the
package keeps books for (each with its callback and finalizer). Without checkpointing they must
be exactly the user's, none and none; with non-reentrant checkpointing the hook sits on each
frozen norm alone and one task has books, which shows that the reading sees them. No global
hook of the package's in either.

Mutations: books opened by every backward fetch, as before (the gate in
HoldLedger.backward_fetched removed): the run without checkpointing sees one graph task. The
hooks armed on every module: the run with checkpointing sees them on the blocks and linears.
The hooks armed at every root fetch (the gate in HoldLedger.forward_fetching removed): the run
without checkpointing sees them. The package's forward pre-hooks are the root_fetch layer's one on
the root (NOTE [ Forward fetch at the root alone ]); mutation: its hook put on a block too.

test_core_never_entered: in an engine no checkpoint ran in, every hook passes straight to
deepspeed (lifecycle NOTE, rule 7): none of the core's bookkeeping (forward and backward notes,
holds, kept storage; rule 5's count alone is kept) is called, while with checkpointing each is. Kept storage is
called only once engaged (a call noted in some engine): the test engages it, as another engine's 4-bit matmul would.
Mutation: the fast path in patch's wrappers removed: the run without checkpointing calls each of them.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.unit.common import DistributedTest
from tests.unit.v1.zero.scenario_models import DIM, PausingBlock

STEPS = 2


class _Model(nn.Module):

    def __init__(self, checkpointing: bool):
        super().__init__()
        self.checkpointing = checkpointing
        self.blocks = nn.ModuleList(PausingBlock() for _ in range(2))

    def forward(self, x, target):
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) if self.checkpointing else block(x)
        return F.mse_loss(x, target)


def _global_forward_hooks() -> set:
    return set(torch.nn.modules.module._global_forward_hooks)


def _watched(model) -> list:
    """The names of ``model``'s modules that carry the package's forward watch hook."""
    from zero3_recompute import patch

    hook = patch._ledger.watch.hooks.hook
    return [name for name, module in model.named_modules() if any(each is hook for each in module._forward_hooks.values())]


def _package_pre_hooks(model) -> list:
    """The names of ``model``'s modules that carry a forward pre-hook of the package's."""
    import inspect

    return [name for name, module in model.named_modules()
            if any(getattr(inspect.unwrap(hook), "__module__", "").startswith("zero3_recompute")
                   for hook in module._forward_pre_hooks.values())]


class TestBackwardFootprint(DistributedTest):
    world_size = 2
    timeout = 180

    @pytest.mark.parametrize("checkpointing", [False, True])
    def test_forward_hooks_during_backward(self, checkpointing):
        import deepspeed

        import zero3_recompute
        from zero3_recompute.patch import graph_tasks_on_the_books
        from tests.unit.v1.zero.scenario_runner import base_config, device, local_rows

        if not zero3_recompute.status().active:
            pytest.skip(f"the package is not patched here: {zero3_recompute.status()}")
        users = torch.nn.modules.module.register_module_forward_hook(lambda module, inputs, output: None)
        try:
            torch.manual_seed(0)
            model = _Model(checkpointing)
            seen = []
            for block in model.blocks:
                block.on_backward = lambda: seen.append((_global_forward_hooks(), _watched(model),
                                                         graph_tasks_on_the_books()))
            optimizer = torch.optim.AdamW([param for param in model.parameters() if param.requires_grad], lr=1e-3)
            engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=base_config())
            rows = torch.randn(8, DIM, generator=torch.Generator().manual_seed(1))
            x, target = (local_rows(tensor).to(device()) for tensor in (rows, rows.flip(0)))
            x.requires_grad_(True)  # so that the first block's reading node is in the graph too
            for _ in range(STEPS):
                engine.backward(engine(x, target))
                engine.step()
            assert len(seen) == 2 * STEPS, f"the reading node ran {len(seen)} times"
            assert all(hooks == {users.id} for hooks, _, _ in seen), \
                f"global module forward hooks in backward: {seen}, the user's {users.id}"
            if checkpointing:
                assert all(watched == ["blocks.0.norm", "blocks.1.norm"] and books == 1 for _, watched, books in seen), \
                    f"under checkpointing the hook on each frozen norm and one graph task's books in backward: {seen}"
            else:
                assert all(watched == [] and books == 0 for _, watched, books in seen), \
                    f"(global hooks, modules with the package's hook, graph tasks with books) during a backward " \
                    f"without checkpointing: {seen}"
            assert _global_forward_hooks() == {users.id}, "a global hook of the package's"
            # The root_fetch layer's hook on the root alone, checkpointing or not (NOTE [ Forward
            # fetch at the root alone ]); none where the layer is not in force.
            assert _package_pre_hooks(model) == ([""] if "root_fetch" in zero3_recompute.status().layers else []), \
                f"modules with a forward pre-hook of the package's: {_package_pre_hooks(model)}"
            assert graph_tasks_on_the_books() == 0, "books outlived the backward"
        finally:
            users.remove()

    @pytest.mark.parametrize("checkpointing", [False, True])
    def test_core_never_entered(self, checkpointing):
        import deepspeed

        import zero3_recompute
        from tests.unit.v1.zero.scenario_runner import base_config, device, local_rows
        from zero3_recompute.holds import HoldRegistry
        from zero3_recompute.kept_storage import KeptStorage
        from zero3_recompute.lifecycle import HoldLedger

        if not zero3_recompute.status().active:
            pytest.skip(f"the package is not patched here: {zero3_recompute.status()}")
        entered = {}
        # The backward release's wrapper makes before_backward_release's common case itself (an open
        # task without placeholders): with checkpointing, the drop of the frozen norm's hold shows it ran.
        targets = [(HoldLedger, "forward_done"), (HoldLedger, "backward_fetched"), (HoldLedger, "before_backward_release"),
                   (HoldRegistry, "drop"), (KeptStorage, "before_release")]
        originals = {(cls, name): vars(cls)[name] for cls, name in targets}

        def counting(cls, name):
            original = originals[cls, name]

            def counted(*args, **kwargs):
                entered[f"{cls.__name__}.{name}"] = entered.get(f"{cls.__name__}.{name}", 0) + 1
                return original(*args, **kwargs)

            return counted

        torch.manual_seed(0)
        model = _Model(checkpointing)
        optimizer = torch.optim.AdamW([param for param in model.parameters() if param.requires_grad], lr=1e-3)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=base_config())
        rows = torch.randn(8, DIM, generator=torch.Generator().manual_seed(1))
        x, target = (local_rows(tensor).to(device()) for tensor in (rows, rows.flip(0)))
        x.requires_grad_(True)
        for cls, name in targets:
            setattr(cls, name, counting(cls, name))
        from zero3_recompute import patch

        kept = patch._ledger.kept_storage
        engaged, kept.engaged = kept.engaged, True
        try:
            for _ in range(STEPS):
                engine.backward(engine(x, target))
                engine.step()
        finally:
            kept.engaged = engaged
            for (cls, name), original in originals.items():
                setattr(cls, name, original)
        names = sorted(f"{cls.__name__}.{name}" for cls, name in targets if name != "before_backward_release")
        if checkpointing:
            assert sorted(set(entered) - {"HoldLedger.before_backward_release"}) == names, \
                f"with checkpointing the core saw only {entered}"
        else:
            assert entered == {}, f"an engine no checkpoint ran in entered the core: {entered}"
