"""One rank of the benchmark.

For each depth, every configuration gets its own engine over the same model (same seed), and
their steps interleave: step 0 of each, then step 1 of each, and so on, with the package
switched to that configuration's state (a policy applied, or reverted) before each step. The
measured step counts all-gathers and gathered bytes over the step; the timed steps run
without instruments, so the step time is a median over interleaved repeats. Step 0 warms up
(deepspeed records its module trace there); step 1, the first to replay it, is measured; the
later steps are timed. A configuration whose step raises torch's CheckpointError (the bug
this package fixes, raised alike on every rank) is marked crashed with the error's first
line and not stepped again; any other error stops the benchmark, as one rank going on alone
would hang.
"""
import logging
import statistics
import time
from typing import Dict, List, Optional

import torch

from zero3_recompute.bench.configs import Config, configurations
from zero3_recompute.bench.options import Options
from zero3_recompute.testing.probes import (CoordinatorProbe, GatheredMemory, GatherCounter, available_bytes,
                                          gathered_bytes, gathered_or_active, zero3_params)
from zero3_recompute.testing.teardown import drop_finished_engines
from zero3_recompute.testing.workloads import BUILDERS, Checkpointed

MIB = float(2**20)
# Step 0 records deepspeed's module trace; step 1 replays it, with prefetch and reuse.
MEASURED_STEP = 1


def _switch(config: Config) -> None:
    import zero3_recompute

    if config.policy is None:
        zero3_recompute.revert()
    else:
        zero3_recompute.apply(policy=config.policy)


def _deepspeed_config(options: Options, world_size: int, live_numel: Optional[int] = None) -> dict:
    config = {
        "train_batch_size": options.batch * world_size,
        "train_micro_batch_size_per_gpu": options.batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_prefetch_bucket_size": options.prefetch,
            "stage3_max_reuse_distance": options.reuse_distance,
        },
        "bf16": {"enabled": options.dtype == "bf16"},
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
    }
    if live_numel is not None:
        config["zero_optimization"]["stage3_max_live_parameters"] = live_numel
    return config


def _live_numel(config: Config, model: torch.nn.Module) -> Optional[int]:
    """The configuration's stage3_max_live_parameters in numel: its limit in one checkpointed
    layer's frozen numel; None for deepspeed's default."""
    if config.finite_live_limit is None:
        return None
    layer = next(sub for sub in model.modules() if isinstance(sub, Checkpointed))
    return int(config.finite_live_limit * sum(param.numel() for param in layer.parameters() if not param.requires_grad))


def _tokens(options: Options, step: int, rank: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(options.seed * 100_003 + 1_000 * step + rank)
    return torch.randint(0, options.vocab, (options.batch, options.seq), generator=generator)


def _block_frozen_bytes(module: torch.nn.Module) -> int:
    layer = next(sub for sub in module.modules() if isinstance(sub, Checkpointed))
    return sum(gathered_bytes(param) for param in layer.parameters() if not param.requires_grad)


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _reduced_over_ranks(value, dtype: torch.dtype, op):
    """``value`` all-reduced by ``op`` over the ranks, as a Python number (on the GPU under NCCL)."""
    tensor = torch.tensor([value], dtype=dtype)
    if torch.distributed.get_backend() == "nccl":
        tensor = tensor.cuda()
    torch.distributed.all_reduce(tensor, op=op)
    return tensor.item()


def _most_over_ranks(value: int) -> int:
    return int(_reduced_over_ranks(value, torch.int64, torch.distributed.ReduceOp.MAX))


def _mean_over_ranks(value: float) -> float:
    total = _reduced_over_ranks(value, torch.float64, torch.distributed.ReduceOp.SUM)
    return total / torch.distributed.get_world_size()


class _Run:
    """One configuration at one depth: its engine and what was measured."""

    def __init__(self, config: Config, engine, blocks: int, live_numel: Optional[int]):
        self.config = config
        self.live_numel = live_numel
        self.engine = engine
        self.blocks = blocks
        self.params = [param for param in zero3_params(engine.module) if not param.ds_persist]
        # The frozen params of the checkpointed layers: the ones a recompute gathers again.
        self.frozen = [f"{prefix}.{name}" for prefix, layer in engine.module.named_modules()
                       if isinstance(layer, Checkpointed)
                       for name, param in layer.named_parameters() if not param.requires_grad]
        self.crash: Optional[str] = None
        self.losses: List[float] = []
        self.times: List[float] = []
        # Main-thread CPU seconds of each timed step: the host's work (Python, hooks, kernels on a
        # CPU), without the time spent waiting on a device or another rank.
        self.host_times: List[float] = []
        self.module_calls = 0
        self.after_backward = 0
        self.left_after_step = 0
        self.measured: Dict = {}

    def step(self, tokens: torch.Tensor, measure: bool, timed: bool) -> None:
        from deepspeed.accelerator import get_accelerator

        tokens = tokens.to(get_accelerator().current_device_name())
        memory = GatheredMemory(self.engine.module, timeline=True) if measure else None
        counter = GatherCounter(self.engine.module) if measure else None
        trace = CoordinatorProbe(self.engine) if measure else None
        calls = _ModuleCalls() if measure else None
        try:
            _sync()
            started, host_started = time.perf_counter(), time.thread_time()
            loss = self.engine(tokens)
            self.engine.backward(loss)
            _sync()
            forward_backward = time.perf_counter() - started
            host = time.thread_time() - host_started
            self.after_backward = max(self.after_backward, available_bytes(self.params))
            _sync()
            started, host_started = time.perf_counter(), time.thread_time()
            self.engine.step()
            _sync()
            elapsed = forward_backward + time.perf_counter() - started
            host += time.thread_time() - host_started
            self.left_after_step = max(self.left_after_step, len(gathered_or_active(self.engine.module)))
            if measure:
                self._keep_measures(memory, counter, trace)
                self.module_calls = calls.count
            elif timed:
                self.times.append(elapsed)
                self.host_times.append(host)
            self.losses.append(_mean_over_ranks(loss.item()))
        except torch.utils.checkpoint.CheckpointError as exc:
            self.crash = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
        finally:
            if measure:
                memory.close()
                counter.close()
                trace.close()
                calls.close()

    def _keep_measures(self, memory: GatheredMemory, counter: GatherCounter, trace: CoordinatorProbe) -> None:
        calls, gathered = counter.calls, counter.bytes
        counts = counter.take()
        self.measured = {
            "gathers_per_frozen_param": sum(counts[name] for name in self.frozen) / max(1, len(self.frozen)),
            "allgather_calls_per_step": calls,
            "allgather_mib_per_step": gathered / MIB,
            "peak_backward_mib": memory.peak_backward / MIB,
            "peak_backward_frozen_mib": memory.peak_backward_frozen / MIB,
            "peak_backward_live_mib": memory.peak_backward_live / MIB,
            "peak_backward_live_frozen_mib": memory.peak_backward_live_frozen / MIB,
            "timeline_mib": [[round(nbytes / MIB, 6), backward] for nbytes, backward in memory.timeline],
            "trace_invalidations": trace.invalidations,
            "fetched_params": {kind: trace.served[kind] for kind in ("on_demand", "prefetched", "resident")},
        }

    def result(self) -> Dict:
        return dict(self.measured, name=self.config.name, role=self.config.role, policy=self.config.policy,
                    live_limit=self.config.finite_live_limit, live_numel=self.live_numel,
                    checkpointing=self.config.checkpointing, placement=self.config.placement, blocks=self.blocks,
                    crash=self.crash, losses=self.losses, step_times_s=self.times,
                    step_time_s=statistics.median(self.times) if self.times else None,
                    host_times_s=self.host_times,
                    host_time_s=statistics.median(self.host_times) if self.host_times else None,
                    module_calls_per_step=self.module_calls,
                    after_backward_mib=self.after_backward / MIB, params_left_after_step=self.left_after_step,
                    block_frozen_mib=_block_frozen_bytes(self.engine.module) / MIB)


class _ModuleCalls:
    """Counts every module call of a step, forward and recompute (a global forward pre-hook)."""

    def __init__(self):
        self.count = 0
        self._handle = torch.nn.modules.module.register_module_forward_pre_hook(self._note)

    def _note(self, module, args) -> None:
        self.count += 1

    def close(self) -> None:
        self._handle.remove()


def _progress(rank: int, text: str) -> None:
    if rank == 0:
        print(f"[bench] {text}", flush=True)


def run_depth(options: Options, blocks: int, configs: List[Config], rank: int, world_size: int) -> List[Dict]:
    import deepspeed

    build = BUILDERS[options.model]
    runs = []
    for config in configs:
        _switch(config)
        model = build(blocks, options.hidden, options.heads, options.vocab, config.reentrant,
                      config.placement or "call", options.seed)
        if options.dtype == "bf16":
            model = model.to(torch.bfloat16)
        optimizer = torch.optim.AdamW([param for param in model.parameters() if param.requires_grad], lr=1e-3,
                                      weight_decay=0.0)
        live_numel = _live_numel(config, model)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,
                                               config=_deepspeed_config(options, world_size, live_numel))
        runs.append(_Run(config, engine, blocks, live_numel))
    for step in range(options.steps):
        for run in runs:
            if run.crash is not None:
                continue
            role = "warm-up" if step < MEASURED_STEP else "measured" if step == MEASURED_STEP else "timed"
            _progress(rank, f"{blocks} blocks, step {step + 1}/{options.steps} ({role}): {run.config.name}")
            _switch(run.config)
            run.step(_tokens(options, step, rank), measure=step == MEASURED_STEP, timed=step > MEASURED_STEP)
            if run.crash is not None:
                _progress(rank, f"{blocks} blocks: {run.config.name} crashed: {run.crash}")
    return [run.result() for run in runs]


def run_rank(options: Options, rank: int, world_size: int) -> Dict:
    """Every depth, every configuration; the package left as it was found. The depth's engines
    are destroyed after it (every engine of the process: the rank's own), so that one depth's
    engines are alive at a time; how many outlive that is counted per depth (the most on any
    rank)."""
    import deepspeed

    import zero3_recompute
    from zero3_recompute.targets import upstream_handling

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    before = zero3_recompute.status()
    configs = configurations(list(options.placements), upstream_handling() is not None, options.live_limits)
    try:
        results, engines_left = [], []
        for blocks in options.blocks:
            results += run_depth(options, blocks, configs, rank, world_size)
            engines_left.append(_most_over_ranks(drop_finished_engines()))
    finally:
        if before.active:
            zero3_recompute.apply(policy=before.policy)
        else:
            zero3_recompute.revert()
    return {"results": results, "engines_left_after_depth": engines_left, "deepspeed": deepspeed.__version__,
            "torch": torch.__version__, "package_before": str(before), "backend": torch.distributed.get_backend(),
            "world_size": world_size}
