"""The seed's reproducer as a training run: ZeRO-3 + non-reentrant activation checkpointing
over blocks of a frozen LayerNorm followed by a trainable Linear.

On deepspeed 0.14.5-0.19.2 without zero3_recompute, the first backward raises
    CheckpointError: ... Recomputed values ... saved {'shape': [N]} vs recomputed {'shape': [0]}
With the package installed it trains; nothing below activates it: its .pth does.

    deepspeed --num_gpus 2 examples/train_frozen_checkpoint.py            # GPUs, or 2 CPU ranks
    deepspeed --num_gpus 2 examples/train_frozen_checkpoint.py --reentrant
"""
import argparse

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator

from zero3_recompute.testing.frozen_blocks import CheckpointedModel
from zero3_recompute.testing.training import describe_fix, train_steps


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--reentrant", action="store_true", help="use_reentrant=True (TRL's PEFT + ZeRO-3 path)")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    return parser.parse_args()


def main():
    args = parse_args()
    deepspeed.init_distributed()
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    device = get_accelerator().current_device_name()

    torch.manual_seed(0)
    model = CheckpointedModel(args.dim, args.blocks, args.reentrant)
    teacher = torch.randn(args.dim, args.dim) / args.dim**0.5
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 10**9,
    }
    # A torch optimizer: no DeepSpeed C++ optimizer op has to be compiled.
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)

    generator = torch.Generator().manual_seed(rank)

    def compute_loss(step):
        x = torch.randn(args.micro_batch, args.dim, generator=generator)
        return engine(x.to(device).requires_grad_(), (x @ teacher).to(device))

    losses = train_steps(engine, args.steps, compute_loss, rank)
    if rank == 0:
        mode = "reentrant" if args.reentrant else "non-reentrant"
        print(f"summary: loss went from {losses[0]:.4f} to {losses[-1]:.4f} in {args.steps} steps on "
              f"{world_size} ranks ({torch.distributed.get_backend()}), ZeRO-3, {mode} checkpointing; "
              f"deepspeed {deepspeed.__version__}, torch {torch.__version__}", flush=True)
        print(f"summary: {describe_fix()}", flush=True)


if __name__ == "__main__":
    main()
