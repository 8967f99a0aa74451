"""The same LoRA Llama run through transformers' Trainer, with a ZeRO-3 ``deepspeed`` config dict.

    deepspeed --num_gpus 2 examples/train_llama_lora_trainer.py      # 2 GPUs, or 2 CPU ranks (gloo)

On GPUs this is a plain Trainer script. On a CPU-only machine accelerate has no CPU +
DeepSpeed mode (it would believe there is one process); zero3_recompute.testing.cpu_ranks.make_accelerate_see_ranks()
tells it about the real gloo process group before the Trainer is built.
"""
import argparse

import torch

from zero3_recompute.testing.cpu_ranks import make_accelerate_see_ranks
from zero3_recompute.testing.llama_lora import (TokenDataset, build_lora_llama, token_batch, trainer_class,
                                                trainer_zero3_config)
from zero3_recompute.testing.training import describe_fix


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--reentrant", action="store_true")
    parser.add_argument("--output-dir", default="/tmp/zero3_recompute_trainer")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    return parser.parse_args()


def training_arguments(args, deepspeed_config):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=args.output_dir, per_device_train_batch_size=args.micro_batch, max_steps=args.steps,
        learning_rate=args.lr, lr_scheduler_type="constant", max_grad_norm=0.0, logging_steps=1,
        save_strategy="no", report_to=[], seed=0, deepspeed=deepspeed_config, disable_tqdm=True,
        # Keep the process state make_accelerate_see_ranks() configured.
        accelerator_config={"use_configured_state": True})


def main():
    import deepspeed
    import transformers
    from transformers import Trainer

    args = parse_args()
    deepspeed.init_distributed()
    make_accelerate_see_ranks()
    model = build_lora_llama(use_reentrant=args.reentrant)
    rows = torch.cat([token_batch(index, 0, args.micro_batch) for index in range(4 * args.steps)])
    # trainer_class: on transformers before 5.1, a LoRA model's empty param group upsets the LR scheduler.
    trainer = trainer_class(Trainer)(model=model, args=training_arguments(args, trainer_zero3_config()),
                                     train_dataset=TokenDataset(rows))
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    if torch.distributed.get_rank() == 0:
        print(f"summary: Trainer loss went from {losses[0]:.4f} to {losses[-1]:.4f} in {len(losses)} steps; "
              f"deepspeed {deepspeed.__version__}, transformers {transformers.__version__}", flush=True)
        print(f"summary: {describe_fix()}", flush=True)


if __name__ == "__main__":
    main()
