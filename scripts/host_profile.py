"""Where the package's own host time goes, by a sampling profiler (py-spy), which slows nothing
between its samples as cProfile slows every call.

The workload is the bench's ``hooks`` model (64 blocks, each a frozen and a trainable
Linear(64, 64)) under ZeRO-3 with persistence threshold 0, on one CPU rank, stepped in one
process. Each sample of a timed step goes to the innermost frame that is the package's or
deepspeed's; torch's no-grad decorator around deepspeed's hooks counts as deepspeed's. A second
table gives the package what its frames call too (deepspeed's coordinator, iter_params), all but
deepspeed's wrapped hook methods and the decorator around them.

    python scripts/host_profile.py auto --steps 200 --py-spy /path/to/py-spy
    python scripts/host_profile.py auto --steps 50          # the workload alone: CPU ms per step

Modes: none (the package applied, no checkpointing), auto (non-reentrant), auto-reentrant (auto
under TRL's reentrant checkpointing), trl (stock, reentrant), stock (no checkpointing), upstream
(deepspeed's own handling, non-reentrant).
py-spy is no dependency of the package: ``pip download py-spy`` and unzip its wheel.
"""
import argparse
import collections
import os
import subprocess
import sys
import tempfile
import time

MODES = {"none": ("auto", None), "auto": ("auto", False), "auto-reentrant": ("auto", True), "trl": (None, True),
         "stock": (None, None), "upstream": ("upstream", False)}
STEPS_MARK = "DeepSpeedEngine."  # a sample inside a timed step has an engine call on its stack


def start_rank() -> None:
    """One CPU rank over gloo, in this process."""
    import logging

    for name, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29537"), ("RANK", "0"),
                        ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(name, value)
    import deepspeed

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo")


def switch_to(mode: str) -> None:
    """The package as ``mode`` has it: applied with its policy, or reverted."""
    import zero3_recompute

    policy = MODES[mode][0]
    if policy is None:
        zero3_recompute.revert()
    else:
        zero3_recompute.apply(policy=policy)


def build_engine(mode: str):
    """The hooks workload's engine for ``mode`` (64 blocks, persistence threshold 0, prefetch 0),
    built with the package as ``mode`` has it, and a batch of tokens."""
    import deepspeed
    import torch

    from zero3_recompute.testing.workloads import build_hooks

    switch_to(mode)
    model = build_hooks(64, 64, 4, 512, MODES[mode][1], "call", 0)
    config = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
              "steps_per_print": 10**9, "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 0}}
    trained = [param for param in model.parameters() if param.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(trained, lr=1e-3), config=config)
    return engine, torch.randint(0, 512, (2, 8))


def run(mode: str, steps: int, step_file: str) -> None:
    """The workload: three untimed steps, then ``steps`` timed by main-thread CPU time."""
    start_rank()
    engine, tokens = build_engine(mode)

    def step():
        loss = engine(tokens)
        engine.backward(loss)
        engine.step()

    for _ in range(3):
        step()
    started = time.thread_time()
    for _ in range(steps):
        step()
    step_ms = 1000 * (time.thread_time() - started) / steps
    print(f"{mode}: {step_ms:.2f} ms per step (main-thread CPU, {steps} steps)")
    if step_file:
        with open(step_file, "w") as out:
            out.write(f"{step_ms}\n")


def _owner(frames):
    """The package's frame a sample's time belongs to, or None (deepspeed's, torch's, the loop's)."""
    for frame in reversed(frames):
        where = frame.rpartition(" (")[2]
        if where.startswith("zero3_recompute/") and "/testing/" not in where and "/bench/" not in where:
            return frame
        if where.startswith("deepspeed/") or "decorate_context" in frame:
            return None
    return None


# deepspeed's methods the wrappers call, and torch's no_grad decorator around them: their time is
# deepspeed's, as on stock, wherever they run below a package frame.
WRAPPED = ("pre_sub_module_forward_function", "post_sub_module_forward_function",
           "pre_sub_module_backward_function", "post_sub_module_backward_function", "reset_step")


def _caller(frames):
    """The deepest package frame of a sample whose time the package caused: its own Python and
    whatever it calls (deepspeed's coordinator, iter_params), but not deepspeed's wrapped method
    or the decorator around it; else None."""
    deepest = None
    for index, frame in enumerate(frames):
        where = frame.rpartition(" (")[2]
        if where.startswith("zero3_recompute/") and "/testing/" not in where and "/bench/" not in where:
            deepest = index
    if deepest is None:
        return None
    for frame in frames[deepest + 1:]:
        name, _, where = frame.rpartition(" (")
        if "decorate_context" in name or (where.startswith("deepspeed/") and name.rpartition(".")[2] in WRAPPED):
            return None
    return frames[deepest]


def attribute(raw_path: str, step_ms: float, top: int) -> None:
    """py-spy's raw (collapsed) stacks: the package's share of the timed steps, by function: its
    own frames innermost, and with what they call (_caller)."""
    total, by_function, by_caller = 0, collections.Counter(), collections.Counter()
    with open(raw_path) as raw:
        for line in raw:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            frames = stack.split(";")
            if not count.isdigit() or not any(STEPS_MARK in frame for frame in frames):
                continue
            total += int(count)
            for frame, counter in ((_owner(frames), by_function), (_caller(frames), by_caller)):
                if frame is not None:
                    name, _, where = frame.rpartition(" (")
                    counter[f"{where.split(':')[0].removeprefix('zero3_recompute/')}:{name}"] += int(count)
    if not total:
        raise SystemExit(f"no sample of a timed step in {raw_path}: expected py-spy's raw format")
    for title, counter in (("own frames, innermost", by_function), ("with what they call", by_caller)):
        package = sum(counter.values())
        print(f"{total} samples in timed steps; the package's, {title}: {package} ({100 * package / total:.2f}%), "
              f"about {step_ms * package / total:.2f} ms of a {step_ms:.1f} ms step")
        for name, count in counter.most_common(top):
            print(f"  {step_ms * count / total:7.3f} ms/step  {name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=sorted(MODES))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--py-spy", dest="py_spy", help="py-spy's executable: profile the run and attribute it")
    parser.add_argument("--rate", type=int, default=100, help="py-spy's samples per second (default 100)")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--step-file", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps: expected a positive integer, got {args.steps}")
    if not args.py_spy:
        run(args.mode, args.steps, args.step_file)
        return
    with tempfile.TemporaryDirectory() as folder:
        raw, step_file = os.path.join(folder, "raw.txt"), os.path.join(folder, "step_ms")
        subprocess.run([args.py_spy, "record", "--rate", str(args.rate), "--format", "raw", "-o", raw, "--",
                        sys.executable, os.path.abspath(__file__), args.mode, "--steps", str(args.steps),
                        "--step-file", step_file], check=True)
        with open(step_file) as timed:
            step_ms = float(timed.read())
        attribute(raw, step_ms, args.top)


if __name__ == "__main__":
    main()
