"""Find and fingerprint every deepspeed and torch object the patch relies on.

Nothing here changes deepspeed. ``resolve()`` either returns a complete ``Targets`` or raises
``PatchTargetMismatch`` naming the first attribute that is missing or has changed shape, so
the caller can refuse to patch anything at all.
"""
import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, Optional, Tuple

from zero3_recompute.errors import PatchTargetMismatch

OFFLOAD_MODULE = "deepspeed.runtime.zero.parameter_offload"
OFFLOAD_CLASS = "DeepSpeedZeRoOffload"
COORDINATOR_MODULE = "deepspeed.runtime.zero.partitioned_param_coordinator"
COORDINATOR_CLASS = "PartitionedParameterCoordinator"
RELEASE_PARAM = "_PartitionedParameterCoordinator__release_param"


@dataclass(frozen=True)
class UpstreamPiece:
    """A piece of deepspeed's own recompute handling (PR #8148, first released in 0.19.3) that
    is switched off while one of our policies is in charge; found by presence, not by version
    (a source install from the weeks before the merge already says 0.19.3)."""
    module: str
    cls: Optional[str]
    name: str
    parameters: Tuple[str, ...]
    role: str

    @property
    def where(self) -> str:
        return ".".join(part for part in (self.module, self.cls, self.name) if part)


# The first piece marks the handling as installed; every piece must then be found.
UPSTREAM_PIECES = (
    UpstreamPiece(COORDINATOR_MODULE, None, "update_recompute_parameters", ("sub_module", "param"),
                  "owner attribution: a recompute's frozen params kept for the innermost backward module"),
    UpstreamPiece(COORDINATOR_MODULE, COORDINATOR_CLASS, "release_backward_leftovers", ("self", ),
                  "end-of-backward sweep of modules whose backward release never fired"),
)

# The pack hooks of the checkpoints whose recompute reruns a module's whole forward call:
# (__module__, __qualname__). A module whose forward ran under one of these may have its
# backward fetch deferred to that recompute (release policy; lifecycle NOTE, step 2). Under any
# other saved-tensors hook (save_on_cpu, a user's own) nothing is deferred; if torch or
# deepspeed rename theirs, deferral stops and release falls back to fetching as stock does.
CHECKPOINT_PACK_HOOKS = frozenset({
    ("torch.utils.checkpoint", "_checkpoint_hook.__init__.<locals>.pack_hook"),
    ("deepspeed.runtime.activation_checkpointing.checkpointing", "non_reentrant_checkpoint.<locals>.checkpoint_pack"),
})

# Methods of DeepSpeedZeRoOffload we wrap: name -> names their code must still reference.
WRAPPED_METHODS: Dict[str, Tuple[str, ...]] = {
    "post_sub_module_forward_function": ("get_param_coordinator", "release_sub_module"),
    "pre_sub_module_backward_function": ("get_param_coordinator", "fetch_sub_module"),
    "post_sub_module_backward_function": ("get_param_coordinator", "release_sub_module"),
}


@dataclass(frozen=True)
class Targets:
    offload_cls: type
    originals: Dict[str, Callable]
    release_param: Callable[[Any, Any], None]
    coordinator_of: Callable[[Any, Any], Any]
    iter_params: Callable[..., Iterable]
    is_leaf_module: Callable[[Any], bool]
    available_status: Any
    # (owner, attribute name, original) of each upstream piece to switch off; empty before 0.19.3.
    upstream: Tuple[Tuple[Any, str, Callable], ...] = ()


def _import(module_name: str):
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        raise PatchTargetMismatch(module_name, "an importable module", f"ImportError: {exc}") from exc


def _attribute(owner, name: str, where: str):
    try:
        return getattr(owner, name)
    except AttributeError:
        raise PatchTargetMismatch(f"{where}.{name}", "an attribute", "nothing") from None


def _own_function(cls: type, name: str) -> Callable:
    where = f"{cls.__module__}.{cls.__qualname__}.{name}"
    found = vars(cls).get(name)
    if not inspect.isfunction(found):
        raise PatchTargetMismatch(where, "a function defined on the class", repr(found))
    return found


def _innermost(function: Callable) -> Callable:
    """The function under decorators: functools.wraps chains and closures over ``func``

    (deepspeed's instrument_w_nvtx wraps without functools.wraps and hides the signature).
    """
    seen = set()
    while id(function) not in seen:
        seen.add(id(function))
        function = inspect.unwrap(function)
        code = getattr(function, "__code__", None)
        if code is None or "func" not in code.co_freevars:
            break
        inner = function.__closure__[code.co_freevars.index("func")].cell_contents
        if not callable(inner):
            break
        function = inner
    return function


def _parameter_names(function: Callable) -> Tuple[str, ...]:
    return tuple(inspect.signature(_innermost(function)).parameters)


def _check_wrapped_method(cls: type, name: str, referenced: Tuple[str, ...]) -> Callable:
    function = _own_function(cls, name)
    where = f"{cls.__qualname__}.{name}"
    params = _parameter_names(function)
    if params != ("self", "sub_module"):
        raise PatchTargetMismatch(where, "signature (self, sub_module)", f"({', '.join(params)})")
    code = _innermost(function).__code__
    missing = [ref for ref in referenced if ref not in code.co_names]
    if missing:
        raise PatchTargetMismatch(where, f"a body that calls {', '.join(referenced)}",
                                  f"a body without {', '.join(missing)}")
    return function


def _coordinator_accessor(offload_cls: type) -> Callable[[Any, Any], Any]:
    """How to get the coordinator a submodule's hooks use: (offload, submodule) -> coordinator."""
    getter = _own_function(offload_cls, "get_param_coordinator")
    params = _parameter_names(getter)
    if params == ("self", ):
        return lambda offload, submodule: offload.get_param_coordinator()
    if params == ("self", "training"):
        return lambda offload, submodule: offload.get_param_coordinator(training=submodule.training)
    raise PatchTargetMismatch(f"{offload_cls.__qualname__}.get_param_coordinator",
                              "signature (self) or (self, training)", f"({', '.join(params)})")


def _check_release_param(coordinator_cls: type) -> Callable:
    function = _own_function(coordinator_cls, RELEASE_PARAM)
    params = _parameter_names(function)
    # (self, param) up to 0.16.2, (self, param, free_data=True) from 0.16.3 on.
    signature = inspect.signature(_innermost(function))
    if params[:2] != ("self", "param") or any(signature.parameters[extra].default is inspect.Parameter.empty
                                              for extra in params[2:]):
        raise PatchTargetMismatch(f"{coordinator_cls.__qualname__}.__release_param",
                                  "signature (self, param[, optional...])", f"({', '.join(params)})")
    return function


def _check_torch() -> None:
    import torch

    if not callable(getattr(torch._C, "_current_graph_task_id", None)):
        raise PatchTargetMismatch("torch._C._current_graph_task_id", "a function", "nothing")
    if not callable(getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)):
        raise PatchTargetMismatch("torch._C._autograd._top_saved_tensors_default_hooks", "a function", "nothing")
    if not callable(getattr(torch.nn.modules.module, "register_module_forward_hook", None)):
        raise PatchTargetMismatch("torch.nn.modules.module.register_module_forward_hook", "a function", "nothing")
    engine = getattr(torch.autograd.Variable, "_execution_engine", None)
    if not callable(getattr(engine, "queue_callback", None)):
        raise PatchTargetMismatch("torch.autograd.Variable._execution_engine.queue_callback", "a function",
                                  "nothing")


def upstream_handling() -> Optional[str]:
    """Where deepspeed's own recompute handling is installed, what marks it; else None."""
    marker = UPSTREAM_PIECES[0]
    return marker.where if callable(getattr(_import(marker.module), marker.name, None)) else None


def _upstream_pieces() -> Tuple[Tuple[Any, str, Callable], ...]:
    """Every upstream piece, fingerprinted, where the handling is installed; else ()."""
    if upstream_handling() is None:
        return ()
    found = []
    for piece in UPSTREAM_PIECES:
        module = _import(piece.module)
        owner = module if piece.cls is None else _attribute(module, piece.cls, piece.module)
        original = vars(owner).get(piece.name)
        if not inspect.isfunction(original):
            raise PatchTargetMismatch(piece.where, "a function (deepspeed's own recompute handling)", repr(original))
        params = _parameter_names(original)
        if params != piece.parameters:
            raise PatchTargetMismatch(piece.where, f"signature ({', '.join(piece.parameters)})",
                                      f"({', '.join(params)})")
        found.append((owner, piece.name, original))
    return tuple(found)


def resolve() -> Targets:
    """Import and fingerprint every target, or raise PatchTargetMismatch."""
    _check_torch()
    offload_module = _import(OFFLOAD_MODULE)
    coordinator_module = _import(COORDINATOR_MODULE)
    offload_cls = _attribute(offload_module, OFFLOAD_CLASS, OFFLOAD_MODULE)
    coordinator_cls = _attribute(coordinator_module, COORDINATOR_CLASS, COORDINATOR_MODULE)

    originals = {
        name: _check_wrapped_method(offload_cls, name, referenced)
        for name, referenced in WRAPPED_METHODS.items()
    }
    _own_function(coordinator_cls, "release_sub_module")
    release_param = _check_release_param(coordinator_cls)
    status_enum = _attribute(coordinator_module, "ZeroParamStatus", COORDINATOR_MODULE)

    return Targets(
        offload_cls=offload_cls,
        originals=originals,
        release_param=release_param,
        coordinator_of=_coordinator_accessor(offload_cls),
        iter_params=_attribute(coordinator_module, "iter_params", COORDINATOR_MODULE),
        is_leaf_module=_attribute(coordinator_module, "z3_leaf_module", COORDINATOR_MODULE),
        available_status=_attribute(status_enum, "AVAILABLE", f"{COORDINATOR_MODULE}.ZeroParamStatus"),
        upstream=_upstream_pieces(),
    )
