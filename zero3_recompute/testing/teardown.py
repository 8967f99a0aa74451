"""Frees the deepspeed engines a process is done with, for the test ranks (between tests) and
the benchmark (between depths), which both build many engines in one process.

Three things keep a finished engine alive, with or without the package; on 0.19.2 and 0.19.8
leaving out any one of the three steps of ``drop_finished_engines`` keeps it
(tests/unit/test_rank_cleanup.py), 0.14.5 needs fewer:
- ``parameter_offload.FWD_MODULE_STACK``, which deepspeed pushes each module on before its
  forward and pops after, never pops the engine's root module, nor any module of a recompute
  that torch stopped early, and each module reaches its engine by its hooks;
- the coordinator's ``__params_to_release`` is an unbounded ``functools.lru_cache`` on the class:
  once deepspeed's trace is complete (the second step) it keeps each coordinator and the modules
  it was asked about;
- an engine's optimizer hooks and its map of module and param names, which only its
  ``destroy()`` drops.
On a GPU each kept engine's buffers stay allocated: 70 GiB per rank after 42 scenario tests on an
H200, and every later test ran out of memory.
"""
import gc
import sys
import traceback


def drop_finished_engines() -> int:
    """Destroys every deepspeed engine in the process and leaves deepspeed's module stack and
    release cache as a fresh process has them; returns how many engines are still alive after,
    and says so on stderr. Call it only when no forward or backward is under way, and when no
    name of the caller's still holds an engine it expects to use. It finds the engines with
    ``gc.get_objects()``, which leaves out what ``gc.freeze()`` froze: an engine alive at a
    freeze is neither destroyed nor counted by a later call."""
    import torch
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero import parameter_offload
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    parameter_offload.FWD_MODULE_STACK.clear()
    _clear_release_cache(PartitionedParameterCoordinator)
    _destroy([obj for obj in gc.get_objects() if isinstance(obj, DeepSpeedEngine)])
    gc.collect()
    left = sum(isinstance(obj, DeepSpeedEngine) for obj in gc.get_objects())
    if left:
        print(f"engine clean-up: {left} deepspeed engine(s) still alive after destroy(), with their buffers",
              file=sys.stderr)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    return left


def _clear_release_cache(coordinator_class: type) -> None:
    """Clears the lru_cache of the coordinator's ``__params_to_release``, which sits under its nvtx
    wrapper (in the wrapper's closure, on every deepspeed of the matrix)."""
    wrapped = getattr(coordinator_class, f"_{coordinator_class.__name__}__params_to_release")
    for candidate in [wrapped] + [cell.cell_contents for cell in wrapped.__closure__ or ()]:
        if hasattr(candidate, "cache_clear"):
            candidate.cache_clear()
            return
    print("engine clean-up: deepspeed's PartitionedParameterCoordinator.__params_to_release has no lru_cache "
          "where it had one (in the closure of its nvtx wrapper); the engines it keeps stay alive", file=sys.stderr)


def _destroy(engines: list) -> None:
    """deepspeed's destroy() on each; a function of its own, so that no name of the caller's
    still holds an engine when it collects."""
    for engine in engines:
        try:
            engine.destroy()
        except Exception:  # noqa: BLE001 - an engine broken by its user stays; the process goes on
            traceback.print_exc()
