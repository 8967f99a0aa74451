"""Every rank of the distributed tests, over gloo only, waits on each asynchronous all-gather that
deepspeed's synchronous list gather launches, as it is launched: an ordering shim that leaves
deepspeed's calls, buffers and dtypes as they are.

deepspeed 0.14.5 to 0.19.3 gather a list of params synchronously (``Init._all_gather`` with
``async_op=False``: GatheredParameters over many, the persistent params after each step in
_post_step) with one asynchronous all-gather per param in Init._allgather_params_coalesced, and
wait on the last handle only. NCCL runs them in order on one stream; gloo completes them out of
order, so on the CPU a param can be read before its gather lands: a wrong or NaN loss on one
rank, or a hang in the next collective (docs/testing.md, "gloo all-gathers"). Waiting on each
handle as it comes back gives gloo NCCL's order there. The coordinator's fetches and prefetches
(each param's all_gather_coalesced), which deepspeed waits on before any use, stay in flight as
they are. Nothing else changes: the same deepspeed code runs, with its own buffers and dtypes, so
its bugs and ours show (an earlier shim gathered one param per call, which sized each buffer right
by accident and hid deepspeed #8072, NOTE [ Mixed-dtype gathers ]).
"""
import functools
import inspect
import threading

MARKER = "_zero3_recompute_tests_waits_at_launch"
# deepspeed's TorchBackend methods that launch an all-gather (deepspeed.comm.torch), each with an
# async_op argument; those a release lacks are skipped.
ALL_GATHERS = ("all_gather", "all_gather_into_tensor", "all_gather_base", "all_gather_coalesced")

_inside = threading.local()


def _in_list_gather() -> bool:
    return getattr(_inside, "list_gather", False)


def _waits_at_launch(launch):
    signature = inspect.signature(launch)

    @functools.wraps(launch)
    def launch_and_wait(self, *args, **kwargs):
        handle = launch(self, *args, **kwargs)
        if handle is not None and _in_list_gather() and signature.bind(self, *args, **kwargs).arguments.get("async_op"):
            handle.wait()
        return handle

    setattr(launch_and_wait, MARKER, True)
    return launch_and_wait


def _marks_list_gather(list_gather):
    """``Init._all_gather(self, param_list, async_op=False, hierarchy=None)`` on every release of the
    matrix, under deepspeed's instrument_w_nvtx, which hides that signature."""

    @functools.wraps(list_gather)
    def _all_gather(self, param_list, *args, **kwargs):
        if kwargs.get("async_op", args[0] if args else False):
            return list_gather(self, param_list, *args, **kwargs)
        outer, _inside.list_gather = _in_list_gather(), True
        try:
            return list_gather(self, param_list, *args, **kwargs)
        finally:
            _inside.list_gather = outer

    setattr(_all_gather, MARKER, True)
    return _all_gather


def install(backend: str) -> None:
    """On gloo, once per process: inside deepspeed's synchronous list gather, each of TorchBackend's
    all-gathers waits on its handle at launch."""
    if backend != "gloo":
        return
    from deepspeed.comm.torch import TorchBackend
    from deepspeed.runtime.zero.partition_parameters import Init

    if getattr(vars(Init)["_all_gather"], MARKER, False):
        return
    Init._all_gather = _marks_list_gather(vars(Init)["_all_gather"])
    for name in ALL_GATHERS:
        launch = vars(TorchBackend).get(name)
        if launch is not None:
            setattr(TorchBackend, name, _waits_at_launch(launch))
