"""A recomputed frozen param is partitioned right after its last use in the graph task (issue #27,
item 1), as on stock deepspeed without checkpointing. 2 ranks, bf16, 2 steps.

The model: a checkpointed embedding block, then BLOCKS checkpointed blocks, then a head.
- The embedding block: a frozen Embedding of the token ids, plus a trainable vector (only so that
  the block's output needs grad), then a trainable Linear. The frozen embedding has no backward
  consumer: its last use is its forward in the block's recompute.
- Each block: a frozen Linear, tanh, a trainable Linear, tanh. The frozen Linear's backward is
  its weight's last use.
A probe (an identity autograd Function) sits before the module whose use is the last: before the
trainable Linear of the embedding block, before the frozen Linear of each block. Its backward
runs right after that module's backward and deepspeed's input wrapper, and notes each probed
param's ds_status and claims (ds_active_sub_modules). Every note must say partitioned with no
claim, as the same model without checkpointing gives on stock deepspeed (checked in each test).

The probe reaches its params through a list made before deepspeed.initialize: a module attribute
read inside the engine's forward would register the param as an external parameter of the
module running (ZeROOrderedDict.__getitem__), which deepspeed then gathers with that module, on
stock without checkpointing too (docs/policies-and-memory.md, "Release at last use").

Checkpointing: torch's non-reentrant (early stop on, and off: the whole block replayed), a
non-reentrant checkpoint of the blocks nested in another, and reentrant blocks. Policies: auto,
keep and release. Prefetch and reuse distance are 0, so that residency is the current use's
alone (deepspeed's prefetch would gather the next module's params early, by design).

Mutation: the core's drop at the module's own backward release left out (the holds go at the
sweep, the owner's boundary): every block's probe sees its frozen weight still gathered, claimed
by the package's hold, under auto and keep.
"""
import contextlib

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from tests.unit.common import DistributedTest
from tests.unit.v1.zero.scenario_models import CallAtBackward

DIM = 8
VOCAB = 16
TOKENS = 4
BLOCKS = 2
STEPS = 2
HOWS = ("non_reentrant", "non_reentrant_no_early_stop", "nested", "reentrant")
POLICIES = ("auto", "keep", "release")


class _Probe:
    """What one probe saw at each backward: per probed param, (status name, claims as text).
    Put in the graph by CallAtBackward, whose backward calls on_backward."""

    def __init__(self, label: str, params):
        self.label = label
        self.params = list(params)
        self.seen = []

    def on_backward(self) -> None:
        self.seen.append([(param.ds_status.name, sorted(map(str, param.ds_active_sub_modules)))
                          for param in self.params])


class _EmbeddingBlock(nn.Module):

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, DIM)
        self.embedding.weight.requires_grad_(False)
        self.grad_token = nn.Parameter(torch.zeros(DIM))
        self.projection = nn.Linear(DIM, DIM)
        self.probe = _Probe("embedding (no backward consumer)", [self.embedding.weight])

    def forward(self, ids):
        hidden = self.embedding(ids) + self.grad_token
        return self.projection(CallAtBackward.apply(hidden, self.probe))


class _Block(nn.Module):

    def __init__(self, index: int):
        super().__init__()
        self.frozen = nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)
        self.trainable = nn.Linear(DIM, DIM)
        self.probe = _Probe(f"block {index}'s frozen Linear", list(self.frozen.parameters()))

    def forward(self, hidden):
        hidden = torch.tanh(self.frozen(CallAtBackward.apply(hidden, self.probe)))
        return torch.tanh(self.trainable(hidden))


class _Model(nn.Module):

    def __init__(self, how):
        super().__init__()
        self.how = how
        self.embedding_block = _EmbeddingBlock()
        self.blocks = nn.ModuleList(_Block(index) for index in range(BLOCKS))
        self.head = nn.Linear(DIM, 1)

    def _blocks(self, hidden):
        for block in self.blocks:
            if self.how is None:
                hidden = block(hidden)
            else:
                hidden = checkpoint(block, hidden, use_reentrant=self.how == "reentrant")
        return hidden

    def forward(self, ids):
        if self.how is None:
            hidden = self.embedding_block(ids)
        else:
            hidden = checkpoint(self.embedding_block, ids, use_reentrant=False)
        if self.how == "nested":
            hidden = checkpoint(self._blocks, hidden, use_reentrant=False)
        else:
            hidden = self._blocks(hidden)
        return self.head(hidden).float().pow(2).mean()

    def probes(self):
        return [self.embedding_block.probe] + [block.probe for block in self.blocks]


def _train(how):
    """(losses, {probe label: what it saw, each note one backward}) over STEPS steps."""
    import deepspeed.comm as dist

    from tests.unit.v1.zero.scenario_runner import device, sgd_engine
    from tests.unit.zero_state import assert_all_released

    torch.manual_seed(0)
    model = _Model(None if how == "none" else how)
    engine = sgd_engine(model, lr=0.1, overrides={"bf16": {"enabled": True}})
    generator = torch.Generator().manual_seed(1 + dist.get_rank())
    ids = torch.randint(0, VOCAB, (4, TOKENS), generator=generator).to(device())
    losses = []
    for step in range(STEPS):
        with (torch.utils.checkpoint.set_checkpoint_early_stop(False)
              if how == "non_reentrant_no_early_stop" else contextlib.nullcontext()):
            loss = engine(ids)
        engine.backward(loss)
        engine.step()
        assert_all_released(engine.module, f"{how}: after step {step}")
        losses.append(loss.item())
    return losses, {probe.label: probe.seen for probe in model.probes()}


def _late(seen: dict) -> dict:
    """The notes that do not say partitioned and unclaimed, by probe label."""
    late = {}
    for label, notes in seen.items():
        bad = [note for note in notes if any(status != "NOT_AVAILABLE" or claims for status, claims in note)]
        if bad or len(notes) != STEPS:
            late[label] = notes
    return late


class TestReleaseAtLastUse(DistributedTest):
    world_size = 2
    timeout = 300

    @pytest.mark.parametrize("how", HOWS)
    def test_partitioned_right_after_the_last_use(self, how):
        import zero3_recompute

        from tests.unit.patch_switch import patch_reverted, policy_in_force

        if not zero3_recompute.status().active:
            pytest.skip(f"the package is not patched here: {zero3_recompute.status()}")
        with patch_reverted():
            reference, stock_seen = _train("none")
        assert not _late(stock_seen), f"stock without checkpointing: {_late(stock_seen)}"
        for policy in POLICIES:
            with policy_in_force(policy):
                losses, seen = _train(how)
            assert not _late(seen), \
                f"{how}, {policy}: frozen params still gathered after their last use (status, claims), " \
                f"one note per backward: {_late(seen)}"
            assert losses == pytest.approx(reference, rel=1e-3), \
                f"{how}, {policy}: losses {losses}, stock without checkpointing {reference}"
