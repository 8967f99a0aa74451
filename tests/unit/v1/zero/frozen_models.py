"""The seed's model: checkpointed blocks of a frozen LayerNorm followed by a trainable Linear."""
import torch
import torch.nn as nn
import torch.utils.checkpoint

DIM = 16
BLOCKS = 2
MICRO_BATCH = 4
LR = 1e-3


class FrozenNormLinear(nn.Module):

    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.linear = nn.Linear(dim, dim)
        self.norm.requires_grad_(False)

    def forward(self, x):
        return self.linear(self.norm(x))


class CheckpointedBlocks(nn.Module):

    def __init__(self, use_reentrant: bool, dim: int = DIM, blocks: int = BLOCKS):
        super().__init__()
        self.use_reentrant = use_reentrant
        self.blocks = nn.ModuleList(FrozenNormLinear(dim) for _ in range(blocks))

    def forward(self, x, target):
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=self.use_reentrant)
        return (x - target).pow(2).mean()


def build_model(use_reentrant: bool, seed: int = 0) -> CheckpointedBlocks:
    torch.manual_seed(seed)
    model = CheckpointedBlocks(use_reentrant)
    with torch.no_grad():
        # Non-trivial frozen affine params, so a wrong frozen weight changes the loss.
        for block in model.blocks:
            block.norm.weight.uniform_(0.5, 1.5)
            block.norm.bias.uniform_(-0.5, 0.5)
    return model


def global_batch(step: int, world_size: int, dim: int = DIM):
    """Every rank's micro-batch for ``step``; rank r uses rows [r * MICRO_BATCH, (r + 1) * MICRO_BATCH)."""
    generator = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(world_size * MICRO_BATCH, dim, generator=generator)
    target = torch.randn(world_size * MICRO_BATCH, dim, generator=generator)
    return x, target


def local_rows(tensor: torch.Tensor, rank: int) -> torch.Tensor:
    return tensor[rank * MICRO_BATCH:(rank + 1) * MICRO_BATCH]


def trainable(model: nn.Module):
    return [param for param in model.parameters() if param.requires_grad]
