"""Every rank of the distributed tests waits on each of deepspeed's synchronous per-param
all-gathers over gloo.

deepspeed 0.14.5 to 0.19.3 gather a list of params synchronously (GatheredParameters over
many, the persistent params after each step in _post_step) with one asynchronous all-gather per
param in Init._allgather_params_coalesced and wait on the last handle only. NCCL runs them in
order on one stream; gloo completes them out of order, so on the CPU a param can be read before
its gather lands: a wrong or NaN loss on one rank (docs/testing.md, "gloo all-gathers").
deepspeed 0.19.8 waits on each handle. Gathering one param per call makes its handle the last.
The coordinator's fetches (all_gather_coalesced, which the gather counts read) are untouched.
"""
import functools

MARKER = "_zero3_recompute_tests_one_param_per_call"


def install(backend: str) -> None:
    """On gloo, once per process: Init._allgather_params_coalesced gathers one param per call."""
    if backend != "gloo":
        return
    from deepspeed.runtime.zero.partition_parameters import Init

    coalesced = Init.__dict__["_allgather_params_coalesced"]
    if getattr(coalesced, MARKER, False):
        return

    @functools.wraps(coalesced)
    def one_param_per_call(self, param_list, hierarchy=0, quantize=False):
        for param in param_list:
            coalesced(self, [param], hierarchy, quantize)

    setattr(one_param_per_call, MARKER, True)
    Init._allgather_params_coalesced = one_param_per_call
