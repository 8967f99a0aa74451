"""The release policy's placeholder (NOTE [ Placeholders under release ]) lives
only through the checkpoint's metadata check, and costs no allocation per param.

A checkpointed block runs two frozen Linears, n1 then n2. In the block's backward, n2's
backward starts the recompute, which leaves placeholders on n1's weight and bias. Then a hook on
n1's output grad reads n1.weight: that read comes before n1's backward fetch, so on stock
deepspeed (no checkpointing) it sees the partitioned tensor, and a matmul with it would fail.
With the placeholder unveiled, it sees the same; with the placeholder still in place, it would
read a full-shape view of NaN (zero for integer dtypes), silently, or skip fp16 steps as
overflows forever. During the recompute, the block's forward reads n1's placeholders right
after n1's release: one element, shared by the weight, the bias and every step.

Mutations: the unveiling removed (Placeholders.unveil a no-op): the hook reads n1.weight at its
full shape, not the partitioned one. A fresh torch.full per placeholder: the weight's and the
bias's placeholders view two storages.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.unit.common import DistributedTest
from tests.unit.v1.zero.scenario_models import DIM

STEPS = 2


class _ReadingBlock(nn.Module):

    def __init__(self):
        super().__init__()
        self.n1 = nn.Linear(DIM, DIM)
        self.n2 = nn.Linear(DIM, DIM)
        self.requires_grad_(False)
        # What the hook on n1's output grad saw of n1.weight: its shape, per backward.
        self.read_in_backward = []
        # n1's weight and bias right after n1's release in each recompute: (shape, storage address,
        # storage bytes) each.
        self.in_recompute = []

    def forward(self, x):
        h = self.n1(x)
        if torch._C._current_graph_task_id() == -1:
            h.register_hook(self._read)
        else:
            self.in_recompute.append(tuple((tuple(p.data.shape), p.data.untyped_storage().data_ptr(),
                                            p.data.untyped_storage().nbytes()) for p in (self.n1.weight, self.n1.bias)))
        return self.n2(h)

    def _read(self, grad):
        self.read_in_backward.append(tuple(self.n1.weight.shape))


class _Model(nn.Module):

    def __init__(self, checkpointing: bool):
        super().__init__()
        self.checkpointing = checkpointing
        self.block = _ReadingBlock()
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x, target):
        if self.checkpointing:
            x = torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)
        else:
            x = self.block(x)
        return F.mse_loss(self.head(x), target)


def _train(checkpointing: bool) -> _ReadingBlock:
    import deepspeed

    from tests.unit.v1.zero.scenario_runner import base_config, device, local_rows

    torch.manual_seed(0)
    model = _Model(checkpointing)
    optimizer = torch.optim.AdamW(model.head.parameters(), lr=1e-3)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=base_config())
    rows = torch.randn(8, DIM, generator=torch.Generator().manual_seed(1))
    x, target = (local_rows(tensor).to(device()) for tensor in (rows, rows.flip(0)))
    x.requires_grad_(True)  # so that n1's output needs grad, and its recompute release gets a placeholder
    for _ in range(STEPS):
        engine.backward(engine(x, target))
        engine.step()
    return model.block


class TestPlaceholder(DistributedTest):
    world_size = 2
    timeout = 180

    def test_unveiled_after_the_check_and_shared(self):
        import zero3_recompute
        from tests.unit.patch_switch import policy_in_force

        if not zero3_recompute.status().active:
            pytest.skip(f"the package is not patched here: {zero3_recompute.status()}")
        with policy_in_force("release"):
            stock = _train(checkpointing=False)
            block = _train(checkpointing=True)
        full = (DIM, DIM)
        assert len(stock.read_in_backward) == STEPS and full not in stock.read_in_backward, stock.read_in_backward
        assert block.read_in_backward == stock.read_in_backward, \
            f"n1.weight read before its backward fetch: {block.read_in_backward} under release, " \
            f"{stock.read_in_backward} on stock without checkpointing"
        assert len(block.in_recompute) == STEPS, block.in_recompute
        cells = set()
        for weight, bias in block.in_recompute:
            assert (weight[0], bias[0]) == (full, (DIM, )), f"n1's placeholders: {weight}, {bias}"
            assert weight[1:] == bias[1:] and weight[2] == 4, \
                f"the weight's and the bias's placeholders view (address, bytes) {weight[1:]} and {bias[1:]}, " \
                "expected one shared fp32 element"
            cells.add(weight[1])
        assert len(cells) == 1, f"each recompute's placeholders view a storage of their own: {cells}"
