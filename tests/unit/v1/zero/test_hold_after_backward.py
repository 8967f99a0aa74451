"""A frozen module whose backward has already run when its block's recompute reruns it: the
recompute's release must not hold its params, or the holds grow with depth. 2 ranks, at 2 and 5
blocks, under every policy.

Each block is a trainable Linear, then a frozen module whose backward saves nothing
(``x + bias``), checkpointed non-reentrant with early stop off: the frozen module's backward
fetch, backward and backward release all run before the Linear's backward unpacks and starts the
recompute, which replays the whole block, the frozen module included. Its backward will not run
again in that graph task, so nothing needs its params kept: stock releases them, and trains.
The frozen bytes gathered during backward (GatheredMemory.peak_backward_frozen) must equal
stock's at each depth, and the losses too.

Mutation: the rule's check of the module's backward having run left out (a recompute release
of a frozen module held under keep and auto, as landed until this test): the package's frozen
peak grows with depth, one block's bias per block (2 blocks: 2 biases, 5 blocks: 5), where
stock's is one bias at both.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.unit.common import DistributedTest

DIM = 8
STEPS = 2
DEPTHS = (2, 5)
POLICIES = ("auto", "keep", "release")


class _FrozenBias(nn.Module):

    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.full((DIM, ), 0.1), requires_grad=False)

    def forward(self, x):
        return x + self.bias


class _Block(nn.Module):

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)
        self.frozen = _FrozenBias()

    def forward(self, x):
        return self.frozen(torch.tanh(self.linear(x)))


class _Chain(nn.Module):

    def __init__(self, blocks: int):
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(blocks))

    def forward(self, x, target):
        with torch.utils.checkpoint.set_checkpoint_early_stop(False):
            for block in self.blocks:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return F.mse_loss(x, target)


def _train(blocks: int):
    """Losses and the frozen peak gathered in backward, over STEPS steps."""
    import deepspeed.comm as dist

    from tests.unit.v1.zero.scenario_runner import device, local_rows, random_rows, sgd_engine, train_mean_losses
    from zero3_recompute.testing.probes import GatheredMemory

    torch.manual_seed(0)
    engine = sgd_engine(_Chain(blocks), lr=0.1)
    x, target = (local_rows(tensor).to(device()) for tensor in random_rows(DIM, dist.get_world_size()))
    x.requires_grad_(True)
    memory = GatheredMemory(engine.module)
    try:
        losses = train_mean_losses(engine, x, target, STEPS)
    finally:
        memory.close()
    return losses, memory.peak_backward_frozen


class TestHoldAfterBackward(DistributedTest):
    world_size = 2
    timeout = 240

    def test_frozen_peak_as_stock_at_every_depth(self):
        import zero3_recompute

        from tests.unit.patch_switch import patch_reverted, policy_in_force

        if not zero3_recompute.status().active:
            pytest.skip(f"the package is not patched here: {zero3_recompute.status()}")
        with patch_reverted():
            stock = {blocks: _train(blocks) for blocks in DEPTHS}
        bias_bytes = DIM * 4
        for policy in POLICIES:
            with policy_in_force(policy):
                ours = {blocks: _train(blocks) for blocks in DEPTHS}
            for blocks in DEPTHS:
                (stock_losses, stock_peak), (losses, peak) = stock[blocks], ours[blocks]
                assert losses == pytest.approx(stock_losses, rel=1e-6), \
                    f"{policy}, {blocks} blocks: losses {losses} vs stock {stock_losses}"
                assert peak == stock_peak, \
                    f"{policy}, {blocks} blocks: frozen bytes gathered in backward {peak} B, stock {stock_peak} B " \
                    f"(one block's frozen bias = {bias_bytes} B); by depth, ours " \
                    f"{ {depth: ours[depth][1] for depth in DEPTHS} }, stock { {depth: stock[depth][1] for depth in DEPTHS} }"
