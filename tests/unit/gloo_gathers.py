"""Every rank of the distributed tests waits on each asynchronous all-gather as it is launched,
over gloo only: an ordering shim that leaves deepspeed's calls, buffers and dtypes as they are.

deepspeed 0.14.5 to 0.19.3 gather a list of params synchronously (GatheredParameters over
many, the persistent params after each step in _post_step) with one asynchronous all-gather per
param in Init._allgather_params_coalesced and wait on the last handle only. NCCL runs them in
order on one stream; gloo completes them out of order, so on the CPU a param can be read before
its gather lands: a wrong or NaN loss on one rank (docs/testing.md, "gloo all-gathers").
Waiting on each handle as it comes back gives gloo NCCL's order. Nothing else changes: the same
deepspeed code runs, with its own buffers and dtypes, so its bugs and ours show (an earlier shim
gathered one param per call, which sized each buffer right by accident and hid deepspeed
#8072, NOTE [ Mixed-dtype gathers ]).
"""
import functools
import inspect

MARKER = "_zero3_recompute_tests_waits_at_launch"
# deepspeed's TorchBackend methods that launch an all-gather (deepspeed.comm.torch), each with an
# async_op argument; those a release lacks are skipped.
ALL_GATHERS = ("all_gather", "all_gather_into_tensor", "all_gather_base", "all_gather_coalesced")


def _waits_at_launch(launch):
    signature = inspect.signature(launch)

    @functools.wraps(launch)
    def launch_and_wait(self, *args, **kwargs):
        handle = launch(self, *args, **kwargs)
        if handle is not None and signature.bind(self, *args, **kwargs).arguments.get("async_op"):
            handle.wait()
        return handle

    setattr(launch_and_wait, MARKER, True)
    return launch_and_wait


def install(backend: str) -> None:
    """On gloo, once per process: each of TorchBackend's all-gathers waits on its handle at launch."""
    if backend != "gloo":
        return
    from deepspeed.comm.torch import TorchBackend

    for name in ALL_GATHERS:
        launch = vars(TorchBackend).get(name)
        if launch is None or getattr(launch, MARKER, False):
            continue
        setattr(TorchBackend, name, _waits_at_launch(launch))
