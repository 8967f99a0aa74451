"""One machine's ranks, for the benchmark and the test harness alike: a free port, the backend
(NCCL with one rank per GPU where CUDA has enough devices, else gloo on the CPU through
deepspeed's CPU accelerator, without its JIT-built shared-memory comm op), each rank's
environment, and its process group.

With ZERO3_RANKS_SHARE_GPU=1 and a CUDA device, every rank runs on cuda:0 over gloo instead
(NCCL refuses two ranks on one device): deepspeed's CUDA accelerator, its all-gathers, CUDA
streams and the caching allocator all in play on a machine with one GPU (scripts/gpu_check.sh).
gloo runs each collective deepspeed's ZeRO-3 calls on CUDA tensors through host copies.
"""
import os
import socket
import tempfile
from typing import Dict

CPU_BACKEND = "gloo"
ENV_SHARE_GPU = "ZERO3_RANKS_SHARE_GPU"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def share_gpu() -> bool:
    """Whether every rank runs on cuda:0 over gloo (ENV_SHARE_GPU set, and CUDA present)."""
    import torch

    return os.environ.get(ENV_SHARE_GPU) == "1" and torch.cuda.is_available()


def choose_backend(world_size: int) -> str:
    import torch

    if not share_gpu() and torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return CPU_BACKEND


def default_ranks() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() and torch.cuda.device_count() else 2


def rank_environment(rank: int, world_size: int, port: int, backend: str) -> Dict[str, str]:
    """What torch.distributed and deepspeed read in a rank, on one machine."""
    import torch

    try:
        from importlib.metadata import version

        deepspeed_version = version("deepspeed")
    except Exception:  # noqa: BLE001 - only names a cache folder
        deepspeed_version = "unknown"
    shared = share_gpu()
    env = {
        "RANK": str(rank),
        # deepspeed puts a rank on the device of its local rank: all on cuda:0 when they share it.
        "LOCAL_RANK": "0" if shared else str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        # deepspeed's CPU accelerator asks numactl for its device count unless this is set.
        "LOCAL_SIZE": str(world_size),
        # Any op that does get JIT-built lands in a folder of its own per torch/deepspeed pair.
        "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
            tempfile.gettempdir(), "zero3_recompute_torch_extensions", f"torch{torch.__version__}-{deepspeed_version}"),
    }
    if backend == CPU_BACKEND and not shared:
        env["DS_ACCELERATOR"] = "cpu"
    return env


def init_rank(backend: str) -> None:
    """The process group of a rank whose environment is rank_environment()'s."""
    import deepspeed
    import deepspeed.ops
    import torch

    if share_gpu():
        torch.cuda.set_device(0)
        # torch's own group first, bound to no device: deepspeed's would bind gloo to
        # cuda:LOCAL_RANK; deepspeed.init_distributed then wraps this one.
        torch.distributed.init_process_group(backend)
    elif backend == CPU_BACKEND:
        # The CPU shared-memory allreduce op is JIT-compiled on first use (minutes on 2 cores)
        # and leaves /dev/shm buffers behind; gloo's own collectives do.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        # The ranks share the machine's cores: torch's default (all of them, per rank)
        # oversubscribes them, which made small CPU steps 3x slower on 2 cores.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["WORLD_SIZE"])))
    deepspeed.init_distributed(dist_backend=backend)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
