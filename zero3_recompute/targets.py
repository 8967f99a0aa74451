"""Find and fingerprint every deepspeed and torch object the patch relies on.

Nothing here changes deepspeed. ``resolve()`` either returns a complete ``Targets`` or raises
``PatchTargetMismatch`` naming the first attribute that is missing or has changed shape, so
the caller can refuse to patch anything at all.
"""
import dis
import functools
import importlib
import inspect
import operator
import types
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, Optional, Tuple, Union

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
    # A coordinator method that stays deepspeed's own for a coordinator whose backwards the
    # package keeps no books for (a model no checkpoint ran in: stock's path, lifecycle NOTE).
    own_where_no_books: bool = False

    @property
    def where(self) -> str:
        return ".".join(part for part in (self.module, self.cls, self.name) if part)


# The first piece marks the handling as installed; every piece must then be found.
UPSTREAM_PIECES = (
    UpstreamPiece(COORDINATOR_MODULE, None, "update_recompute_parameters", ("sub_module", "param"),
                  "owner attribution: a recompute's frozen params kept for the innermost backward module"),
    UpstreamPiece(COORDINATOR_MODULE, COORDINATOR_CLASS, "release_backward_leftovers", ("self", ),
                  "end-of-backward sweep of modules whose backward release never fired", own_where_no_books=True),
)

# The pack hooks of the checkpoints whose recompute reruns a module's whole forward call:
# (__module__, __qualname__). A module whose forward ran under one of these may have its
# backward fetch deferred to that recompute (release policy; NOTE [ Deferred fetch ]). Under any
# other saved-tensors hook (save_on_cpu, a user's own) nothing is deferred; if torch or
# deepspeed rename theirs, deferral stops and release falls back to fetching as stock does.
CHECKPOINT_PACK_HOOKS = frozenset({
    ("torch.utils.checkpoint", "_checkpoint_hook.__init__.<locals>.pack_hook"),
    ("deepspeed.runtime.activation_checkpointing.checkpointing", "non_reentrant_checkpoint.<locals>.checkpoint_pack"),
})

# The unpack hooks inside which those checkpoints recompute and then check what the recompute
# saved against the forward (torch's metadata check): (function name, module). A placeholder
# made while one of them is on the thread's stack is unveiled once none is (NOTE
# [ Placeholders under release ], rule 3). Renamed in a later release, nothing matches and placeholders stay until the sweep.
RECOMPUTE_FRAMES = frozenset({
    ("unpack_hook", "torch.utils.checkpoint"),
    ("checkpoint_unpack", "deepspeed.runtime.activation_checkpointing.checkpointing"),
})

# The pack hook a checkpoint keeps in force while it recomputes, inside one of RECOMPUTE_FRAMES:
# found on top of the saved-tensors stack, the recompute is known without reading any frame. (A
# device thread of a backward begun inside a recompute inherits the stack without the frame: a
# reentrant checkpoint rerun there reads as a recompute, and its module is gathered again at its
# backward rather than held.)
RECOMPUTATION_PACK_HOOKS = frozenset({
    ("torch.utils.checkpoint", "_recomputation_hook.__init__.<locals>.pack_hook"),
})


# Methods of DeepSpeedZeRoOffload we wrap: name -> names their code must still reference.
WRAPPED_METHODS: Dict[str, Tuple[str, ...]] = {
    "pre_sub_module_forward_function": ("get_param_coordinator", "fetch_sub_module"),
    "post_sub_module_forward_function": ("get_param_coordinator", "release_sub_module"),
    "pre_sub_module_backward_function": ("get_param_coordinator", "fetch_sub_module"),
    "post_sub_module_backward_function": ("get_param_coordinator", "release_sub_module"),
}


# What the hold and its clean-up rely on beyond the wrapped methods, checked by what deepspeed's
# code reads or writes (names in its bytecode, nested functions included), so that a deepspeed
# that stopped using one is refused with it named: (where, name, what relies on it).
PARTITION_MODULE = "deepspeed.runtime.zero.partition_parameters"
RELEASE_GATE = ("PartitionedParameterCoordinator.release_sub_module / __release_param", "ds_active_sub_modules",
                "a hold token in ds_active_sub_modules keeps its param gathered through a release")
GRADS_REMAINING = (OFFLOAD_MODULE, "ds_grads_remaining",
                   "a module's count of inputs that need grad says whether its backward release will come")
FINAL_LOCATION = (PARTITION_MODULE, "final_location", "params swapped to NVMe are found and never held")
OFFLOAD_MODEL = ("DeepSpeedZeRoOffload.__init__", "module", "self.module is the model whose ancestry the ledger maps")
OFFLOAD_ZENFLOW = ("DeepSpeedZeRoOffload.__init__", "zenflow",
                   "self.zenflow says whether ZenFlow transposes params, whose fetch is never deferred")


# How the innermost saved-tensors pack hook is read (NOTE [ Reading the saved-tensors hook stack ]
# in zero3_recompute.hook_stack): torch's own reader where it has one (torch 2.8 on), else a
# shadow of the stack kept by wrapping the two bindings every Python push and pop goes through.
AUTOGRAD_BINDINGS = "torch._C._autograd"
TOP_HOOKS = "_top_saved_tensors_default_hooks"
PUSH_HOOKS = "_push_saved_tensors_default_hooks"
POP_HOOKS = "_pop_saved_tensors_default_hooks"
NATIVE_READER = f"{AUTOGRAD_BINDINGS}.{TOP_HOOKS}"
SHADOW_READER = f"shadow stack over {AUTOGRAD_BINDINGS}.{PUSH_HOOKS} / {POP_HOOKS}"
# torch < 2.8 with the shadow switched off (layer hook_stack): the hook in force is never known,
# and reads as UNKNOWN_PACK_HOOK, a hook that may be in force and is no checkpoint's.
NO_READER = "nothing (the hook_stack layer is switched off; torch has no reader of its own)"


def UNKNOWN_PACK_HOOK(tensor):
    """What the top of the saved-tensors hook stack reads as where nothing can read it; never called."""
    raise RuntimeError("UNKNOWN_PACK_HOOK stands for an unknown hook and is never called")

# The layer that reads the stack where torch cannot (zero3_recompute.hook_stack.LAYER).
SHADOW_LAYER = "hook_stack"
# The layer that keeps holds within deepspeed's live-parameter limit (zero3_recompute.live_budget.LAYER).
BUDGET_LAYER = "live_budget"
# Classes whose __enter__ / __exit__ must reach the bindings for the shadow to see their hooks:
# (module, class). saved_tensors_hooks itself calls them; the others must inherit its methods or
# call them through super().
SAVED_TENSORS_HOOKS_CLASS = ("torch.autograd.graph", "saved_tensors_hooks")
SAVED_TENSORS_HOOKS_SUBCLASSES = (
    ("torch.utils.checkpoint", "_checkpoint_hook"),
    ("torch.utils.checkpoint", "_recomputation_hook"),
)


@dataclass(frozen=True)
class SavedTensorsProbe:
    """Reads the innermost saved-tensors pack hook in force on this thread."""
    mechanism: str
    top_pack_hook: Callable[[], Optional[Callable]]
    # (owner, name, original, replacement) that apply() installs and revert() puts back; empty
    # where torch reads its own stack.
    installs: Tuple[Tuple[Any, str, Callable, Callable], ...] = ()
    # Drops what the engine took off the stack since (the shadow's settle()); None where there is
    # nothing to settle (torch's own reader, or none), so that a hot path calls nothing.
    settle: Optional[Callable[[], None]] = None
    # None where no saved-tensors hook is in force on this thread, something else where one is,
    # settled, in one call (rule 7's test at each module call outside any checkpoint); None:
    # top_pack_hook answers it.
    any_hook: Optional[Callable[[], Any]] = None


@dataclass(frozen=True)
class ShadowBindings:
    """torch < 2.8: the two bindings every Python push and pop goes through, fingerprinted, and how
    to tell where this thread is in autograd; the hook_stack layer reads the stack over them."""
    owner: Any
    push: Callable
    pop: Callable
    current_graph_task: Callable[[], int]
    current_node: Callable[[], Any]
    # A node's key, unique within its graph task.
    node_key: Callable[[Any], Any]


COALESCED_GATHER = "_allgather_params_coalesced"
COALESCED_GATHER_PARAMETERS = ("self", "param_list", "hierarchy", "quantize")
ENGINE_MODULE = "deepspeed.runtime.engine"
ENGINE_CONFIGURE = "_configure_distributed_model"
WHOLESALE_CASTS = frozenset({"half", "bfloat16", "float"})


@dataclass(frozen=True)
class GatherFix:
    """Whether the mixed-dtype gather layer is needed here (NOTE [ Mixed-dtype gathers ] in
    zero3_recompute.mixed_dtype_gather), and why; where it is, what it replaces."""
    needed: bool
    reason: str
    owner: Optional[type] = None
    original: Optional[Callable] = None


@dataclass(frozen=True)
class Targets:
    offload_cls: type
    originals: Dict[str, Callable]
    release_param: Callable[[Any, Any], None]
    coordinator_of: Callable[[Any, Any], Any]
    iter_params: Callable[..., Iterable]  # deepspeed's, or as params_reader reads it
    is_leaf_module: Callable[[Any], bool]  # deepspeed's z3_leaf_module, or as leaf_reader reads it
    available_status: Any
    # torch's own reader, or (torch < 2.8) the bindings the hook_stack layer reads it over.
    saved_tensors: Union[SavedTensorsProbe, ShadowBindings]
    # A context in which tensor ops bypass torch dispatch modes (selective checkpointing's).
    outside_dispatch_modes: Callable[[], Any]
    # The class of a Python Function's backward node and the attribute naming its Function
    # (python_function_node; NOTE [ Params read outside saved tensors ] in autograd_reads).
    python_function_node: Tuple[Optional[type], str]
    # (owner, attribute name, original, UpstreamPiece) of each upstream piece to switch off;
    # empty before 0.19.3.
    upstream: Tuple[Tuple[Any, str, Callable, UpstreamPiece], ...] = ()
    # The coordinator's class and its reset_step, which the next forward calls first (its root
    # pre-forward hook): the sweep of a graph task that raised runs before it (lifecycle NOTE, rule 4).
    coordinator_cls: Optional[type] = None
    reset_step: Optional[Callable] = None
    # How many strong references a storage has, None where torch does not say (NOTE [ Gathered
    # storage kept outside saved tensors ] in zero3_recompute.kept_storage).
    storage_use_count: Optional[Callable[[Any], int]] = None
    # The coordinator's attributes of its gathered numel and its limit on it, where its __init__
    # sets both (LIVE_NUMEL_COUNTERS; NOTE [ Holds within the live-parameter limit ]); else None.
    live_numel: Optional[Tuple[str, str]] = None
    # The accelerator whose current stream a freed tensor is recorded on, as deepspeed's free_param
    # does before it drops a gathered tensor; None on the CPU (stream_accelerator).
    stream_accelerator: Optional[Any] = None
    # The mixed-dtype gather layer's target, where deepspeed needs it (NOTE [ Mixed-dtype gathers ]).
    gather_fix: GatherFix = GatherFix(False, "not checked")
    # deepspeed's backward release as the core calls it late (late_backward_release); None: the original.
    late_backward_release: Optional[Callable[[Any, Any], None]] = None
    # Whether coordinator_of reads the engine alone (get_param_coordinator(self)), not also the
    # submodule's training flag: a graph task then notes an engine's coordinator once.
    coordinator_per_engine: bool = False


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


def _check_parameters(function: Callable, where: str, expected: Tuple[str, ...]) -> None:
    params = _parameter_names(function)
    if params != expected:
        raise PatchTargetMismatch(where, f"signature ({', '.join(expected)})", f"({', '.join(params)})")


def _check_wrapped_method(cls: type, name: str, referenced: Tuple[str, ...]) -> Callable:
    function = _own_function(cls, name)
    where = f"{cls.__qualname__}.{name}"
    _check_parameters(function, where, ("self", "sub_module"))
    code = _innermost(function).__code__
    missing = [ref for ref in referenced if ref not in code.co_names]
    if missing:
        raise PatchTargetMismatch(where, f"a body that calls {', '.join(referenced)}",
                                  f"a body without {', '.join(missing)}")
    return function


def _code_objects(function: Callable) -> Iterable[types.CodeType]:
    """The code of ``function`` under its decorators, and every code object nested in it."""
    stack = [getattr(_innermost(function), "__code__", None)]
    while stack:
        code = stack.pop()
        if code is not None:
            yield code
            stack.extend(constant for constant in code.co_consts if isinstance(constant, types.CodeType))


def _names_read(functions: Iterable[Callable]) -> set:
    return {name for function in functions for code in _code_objects(function) for name in code.co_names}


def _stores_attribute(function: Callable, name: str) -> bool:
    return any(instruction.opname == "STORE_ATTR" and instruction.argval == name
               for code in _code_objects(function) for instruction in dis.get_instructions(code))


def _functions_of(module) -> Iterable[Callable]:
    """The functions a module defines, at its top level and on its classes."""
    for value in vars(module).values():
        if getattr(value, "__module__", None) != module.__name__:
            continue
        if inspect.isfunction(value):
            yield value
        elif inspect.isclass(value):
            for member in vars(value).values():
                member = getattr(member, "__func__", member)
                if inspect.isfunction(member):
                    yield member


def _check_contract(contract: Tuple[str, str, str], holds: bool) -> None:
    where, name, role = contract
    if not holds:
        raise PatchTargetMismatch(where, f"code that uses {name} ({role})", f"code without {name}")


def _check_contracts(offload_cls: type, coordinator_cls: type, offload_module, partition_module) -> None:
    """RELEASE_GATE, GRADS_REMAINING, FINAL_LOCATION, OFFLOAD_MODEL and OFFLOAD_ZENFLOW."""
    releases = [_own_function(coordinator_cls, "release_sub_module"), _own_function(coordinator_cls, RELEASE_PARAM)]
    _check_contract(RELEASE_GATE, RELEASE_GATE[1] in _names_read(releases))
    offload_names = _names_read(_functions_of(offload_module))
    _check_contract(GRADS_REMAINING, GRADS_REMAINING[1] in offload_names)
    _check_contract(FINAL_LOCATION, FINAL_LOCATION[1] in _names_read(_functions_of(partition_module)))
    init = _own_function(offload_cls, "__init__")
    _check_contract(OFFLOAD_MODEL, _stores_attribute(init, OFFLOAD_MODEL[1]))
    # Before ZenFlow (0.18) nothing names it, and getattr(offload, "zenflow", False) is right.
    if OFFLOAD_ZENFLOW[1] in offload_names:
        _check_contract(OFFLOAD_ZENFLOW, _stores_attribute(init, OFFLOAD_ZENFLOW[1]))


# The coordinator's count of the numel it has gathered and not partitioned, and its limit on it
# (stage3_max_live_parameters), as its __init__ sets them (name-mangled).
LIVE_NUMEL_COUNTERS = ("_PartitionedParameterCoordinator__n_available_params",
                       "_PartitionedParameterCoordinator__max_n_available_params")


def live_numel_counters(coordinator_cls: type) -> Optional[Tuple[str, str]]:
    """LIVE_NUMEL_COUNTERS where the coordinator's __init__ sets both, else None (the live_budget
    layer is then not installed; an optional layer never stops the patch)."""
    init = _own_function(coordinator_cls, "__init__")
    return LIVE_NUMEL_COUNTERS if all(_stores_attribute(init, name) for name in LIVE_NUMEL_COUNTERS) else None


def _coordinator_parameters(offload_cls: type) -> Tuple[str, ...]:
    return _parameter_names(_own_function(offload_cls, "get_param_coordinator"))


def _coordinator_accessor(offload_cls: type) -> Callable[[Any, Any], Any]:
    """How to get the coordinator a submodule's hooks use: (offload, submodule) -> coordinator."""
    params = _coordinator_parameters(offload_cls)
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


# A backward release that asserts its module is in training mode (deepspeed 0.14 to 0.15.3:
# "backward pass is invalid for module in evaluation mode"), found by the name it reads. A late
# release (the sweep of a backward that raised) can come after an eval forward has switched the
# module out of training; it then goes through the training coordinator, as the original does.
TRAINING_ASSERT = "training"


def late_backward_release(offload_cls: type, coordinator_cls: type, original: Callable) -> Callable[[Any, Any], None]:
    """deepspeed's backward release for the core's late releases (lifecycle NOTE, rules 2 to 4):
    ``original`` itself, except where it asserts its module is training; there a module in eval
    mode is released through ``get_param_coordinator(training=True).release_sub_module``, which is
    what the original does past its assert."""
    if TRAINING_ASSERT not in _names_read([original]):
        return original
    where = f"{offload_cls.__qualname__}.post_sub_module_backward_function"
    getter = _own_function(offload_cls, "get_param_coordinator")
    release = _own_function(coordinator_cls, "release_sub_module")
    if _parameter_names(getter) != ("self", "training") or _parameter_names(release) != ("self", "submodule"):
        raise PatchTargetMismatch(where, "an assert on sub_module.training beside get_param_coordinator(self, "
                                  "training) and release_sub_module(self, submodule)",
                                  f"get_param_coordinator({', '.join(_parameter_names(getter))}), "
                                  f"release_sub_module({', '.join(_parameter_names(release))})")

    def release_late(offload, module) -> None:
        if module.training:
            original(offload, module)
        else:
            offload.get_param_coordinator(training=True).release_sub_module(module)

    return release_late


def own_params(module, is_leaf_module: Callable[[Any], bool]) -> Iterable:
    """``module``'s own params, read off its table (nn.Module._parameters, whose values may be
    None: a caller skips those) rather than through module.parameters()'s generator, as the
    forward watch does at every module call; those below it too where it has children and
    ``is_leaf_module`` says deepspeed treats it as one."""
    if module._modules and is_leaf_module(module):
        return list(module.parameters())
    return module._parameters.values()


# deepspeed's forward pre-hook on each module of an engine's model (parameter_offload's
# _register_deepspeed_module, _register_hooks_recursively before 0.16): its function's name, and the
# closure variable that holds the engine's DeepSpeedZeRoOffload (NOTE [ Forward fetch at the root
# alone ] in zero3_recompute.root_fetch).
FETCH_HOOK = ("_pre_forward_module_hook", "self")


def fetch_hook_key(offload, module) -> Optional[int]:
    """The key, among ``module``'s forward pre-hooks, of deepspeed's hook that fetches ``module`` for
    ``offload``; None where there is none (its hooks taken off, or another shape of deepspeed)."""
    name, holder = FETCH_HOOK
    for key, hook in module._forward_pre_hooks.items():
        function = _innermost(hook)
        code = getattr(function, "__code__", None)
        if code is None or code.co_name != name or holder not in code.co_freevars:
            continue
        try:
            if function.__closure__[code.co_freevars.index(holder)].cell_contents is offload:
                return key
        except ValueError:  # an empty cell
            continue
    return None


def compiled(module) -> bool:
    """Whether ``module.compile()`` (deepspeed's engine.compile calls it) compiled ``module``'s calls."""
    return getattr(module, "_compiled_call_impl", None) is not None


def has_forward_pre_hook(module, key: int) -> bool:
    """Whether ``module`` still carries the forward pre-hook under ``key`` (a RemovableHandle's id)."""
    return key in module._forward_pre_hooks


# What deepspeed's z3_leaf_module reads (deepspeed.utils.z3_leaf_module), and where its
# get_all_parameters finds the external params registered on a module (register_external_parameter).
LEAF_FLAG = "_z3_leaf"
EXTERNAL_PARAMS = "_external_params"
_NOT_SET = object()


def leaf_reader(z3_leaf_module: Callable[[Any], bool]) -> Callable[[Any], bool]:
    """deepspeed's z3_leaf_module, where its code still reads LEAF_FLAG, as a read of the flag off
    the module's instance dict, then its class: deepspeed's hasattr() on a module without the
    flag goes through nn.Module.__getattr__, which raises (about 2 µs in a loop, 7 in a training
    step, at every module call the forward watch sees). Otherwise deepspeed's own function."""
    code = getattr(_innermost(z3_leaf_module), "__code__", None)
    if code is None or LEAF_FLAG not in code.co_consts:
        return z3_leaf_module

    def is_leaf_module(module) -> bool:
        flag = module.__dict__.get(LEAF_FLAG, _NOT_SET)
        return getattr(type(module), LEAF_FLAG, False) if flag is _NOT_SET else flag

    return is_leaf_module


# Whether a param is there (nn.Module._parameters' values may be None): a C call.
is_a_param = functools.partial(operator.is_not, None)


def params_reader(iter_params: Callable[..., Iterable], get_all_parameters: Callable) -> Callable[..., list]:
    """deepspeed's iter_params(module, recurse), where its get_all_parameters still chains
    named_parameters with ds_external_parameters, as a list read off the module's tables: its own
    params once each (module.parameters() with ``recurse``), then EXTERNAL_PARAMS' values.
    named_parameters' generator costs about 4 µs in a loop, 11 in a training step, at each
    recompute release. Otherwise deepspeed's own function."""
    names = getattr(getattr(_innermost(get_all_parameters), "__code__", None), "co_names", ())
    if "named_parameters" not in names or "ds_external_parameters" not in names:
        return iter_params

    def module_params(module, recurse: bool = False) -> list:
        if recurse and module._modules:
            params = list(module.parameters())
        else:
            params = list(filter(is_a_param, module._parameters.values()))  # C calls: no frame per call
            if len(params) > 1 and len(set(map(id, params))) < len(params):
                seen = set()
                params = [param for param in params if not (id(param) in seen or seen.add(id(param)))]
        external = module.__dict__.get(EXTERNAL_PARAMS)
        if external:
            params.extend(external.values())
        return params

    return module_params


def named_in(function, names: "frozenset") -> bool:
    """Whether ``function``'s (__module__, __qualname__) is one of ``names`` (CHECKPOINT_PACK_HOOKS,
    RECOMPUTATION_PACK_HOOKS); False for None and for a callable without either."""
    return (getattr(function, "__module__", None), getattr(function, "__qualname__", None)) in names


# ``module``'s table of the params registered on it (nn.Module._parameters, whose values may be
# None); a C call, no Python frame.
param_table: Callable[[Any], Any] = operator.attrgetter("_parameters")
# Truthy where ``module`` has submodules (its nn.Module._modules), read at every backward release.
has_children: Callable[[Any], Any] = operator.attrgetter("_modules")


def outside_dispatch_modes() -> Callable[[], Any]:
    """torch's guard that keeps ops off the Python dispatch key, where dispatch modes run."""
    import torch

    guard = getattr(torch._C, "_DisableTorchDispatch", None)
    if not callable(guard):
        raise PatchTargetMismatch("torch._C._DisableTorchDispatch", "a context manager class", "nothing")
    return guard


def python_function_node() -> Tuple[Optional[type], str]:
    """(the class of every Python Function's backward node, the attribute naming its Function):
    torch makes each Function's backward node an instance of a subclass of BackwardCFunction
    whose _forward_cls is the Function. None where torch no longer has it: every node then reads
    as a Function no one trusts (autograd_reads.function_class_reader)."""
    import torch

    backward_base = getattr(torch.autograd.function, "BackwardCFunction", None)
    return (backward_base if isinstance(backward_base, type) else None), "_forward_cls"


def storage_use_count() -> Optional[Callable[[Any], int]]:
    """torch's count of a storage's strong references (tensors and storage objects), or None: then
    no storage is freed in place, and kept views cost what they cost on stock."""
    import torch

    count = getattr(torch._C, "_storage_Use_Count", None)
    if not callable(count):
        return None
    return lambda storage: count(storage._cdata)


def stream_accelerator() -> Optional[Any]:
    """deepspeed's accelerator, whose current stream a tensor's memory is kept from reuse for until
    it is done with it (free_param's record_stream); None on a synchronized device (the CPU)."""
    accelerator = _attribute(_import("deepspeed.accelerator"), "get_accelerator", "deepspeed.accelerator")()
    for name in ("on_accelerator", "is_synchronized_device", "current_stream"):
        if not callable(getattr(accelerator, name, None)):
            raise PatchTargetMismatch(f"{type(accelerator).__qualname__}.{name}", "a method", "nothing")
    return None if accelerator.is_synchronized_device() else accelerator


def _check_torch() -> None:
    import torch

    if not callable(getattr(torch._C, "_current_graph_task_id", None)):
        raise PatchTargetMismatch("torch._C._current_graph_task_id", "a function", "nothing")
    hook_parameters = set(inspect.signature(torch.nn.Module.register_forward_hook).parameters)
    if not {"prepend", "with_kwargs"} <= hook_parameters:  # the forward watch's hook (NOTE [ Forward watch ], rule 3)
        raise PatchTargetMismatch("torch.nn.Module.register_forward_hook", "parameters prepend and with_kwargs",
                                  f"{sorted(hook_parameters)}")
    engine = getattr(torch.autograd.Variable, "_execution_engine", None)
    if not callable(getattr(engine, "queue_callback", None)):
        raise PatchTargetMismatch("torch.autograd.Variable._execution_engine.queue_callback", "a function",
                                  "nothing")


def _native_reader(top: Callable) -> Callable[[], Optional[Callable]]:
    def top_pack_hook():
        hooks = top(False)
        return None if hooks is None else hooks[0]

    return top_pack_hook


def _calls(function, binding: str, where: str) -> None:
    code = getattr(_innermost(function), "__code__", None)
    if code is None or binding not in code.co_names:
        raise PatchTargetMismatch(where, f"a method that calls {AUTOGRAD_BINDINGS}.{binding}",
                                  "a method without it" if code is not None else repr(function))


def _check_hook_classes() -> None:
    """saved_tensors_hooks pushes and pops through the bindings, looked up at each call, and the
    checkpoint's hook classes enter and exit through it."""
    module_name, class_name = SAVED_TENSORS_HOOKS_CLASS
    base = _attribute(_import(module_name), class_name, module_name)
    _calls(_own_function(base, "__enter__"), PUSH_HOOKS, f"{module_name}.{class_name}.__enter__")
    _calls(_own_function(base, "__exit__"), POP_HOOKS, f"{module_name}.{class_name}.__exit__")
    for module_name, class_name in SAVED_TENSORS_HOOKS_SUBCLASSES:
        cls = _attribute(_import(module_name), class_name, module_name)
        if not issubclass(cls, base):
            raise PatchTargetMismatch(f"{module_name}.{class_name}", f"a subclass of {base.__qualname__}",
                                      f"bases {cls.__bases__}")
        for method in ("__enter__", "__exit__"):
            found = getattr(cls, method)
            if found is not vars(base)[method]:
                _calls(found, method, f"{module_name}.{class_name}.{method} (through super())")


def shadow_bindings() -> ShadowBindings:
    """The bindings the shadow stack wraps and what it reads of autograd, fingerprinted."""
    import torch

    bindings = torch._C._autograd
    push, pop = (getattr(bindings, name, None) for name in (PUSH_HOOKS, POP_HOOKS))
    for name, found in ((PUSH_HOOKS, push), (POP_HOOKS, pop)):
        if not callable(found):
            raise PatchTargetMismatch(f"{AUTOGRAD_BINDINGS}.{name}",
                                      f"a function (or {NATIVE_READER}, torch >= 2.8)", "nothing")
    _check_hook_classes()
    current_node = getattr(torch._C, "_current_autograd_node", None)
    if not callable(current_node):
        raise PatchTargetMismatch("torch._C._current_autograd_node", "a function", "nothing")
    return ShadowBindings(bindings, push, pop, torch._C._current_graph_task_id, current_node,
                          operator.methodcaller("_sequence_nr"))


def saved_tensors_probe(shadow_on: bool = True) -> Union[SavedTensorsProbe, ShadowBindings]:
    """torch's own reader of the saved-tensors hook stack; else the bindings for the shadow stack;
    else, with the shadow switched off, a reader that always reads UNKNOWN_PACK_HOOK (NOTE
    [ Reading the saved-tensors hook stack ], rule 5)."""
    import torch

    top = getattr(torch._C._autograd, TOP_HOOKS, None)
    if callable(top):
        return SavedTensorsProbe(NATIVE_READER, _native_reader(top), any_hook=functools.partial(top, False))
    if not shadow_on:
        return SavedTensorsProbe(NO_READER, lambda: UNKNOWN_PACK_HOOK)
    return shadow_bindings()


def upstream_handling() -> Optional[str]:
    """Where deepspeed's own recompute handling is installed, what marks it; else None."""
    marker = UPSTREAM_PIECES[0]
    return marker.where if callable(getattr(_import(marker.module), marker.name, None)) else None


def _upstream_pieces() -> Tuple[Tuple[Any, str, Callable, UpstreamPiece], ...]:
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
        _check_parameters(original, piece.where, piece.parameters)
        found.append((owner, piece.name, original, piece))
    return tuple(found)


def _is_partition_dtype(node, owner) -> bool:
    """Whether ``node`` is ``<owner>.ds_tensor.dtype``, ``owner`` an AST node test."""
    import ast

    return (isinstance(node, ast.Attribute) and node.attr == "dtype" and isinstance(node.value, ast.Attribute)
            and node.value.attr == "ds_tensor" and owner(node.value.value))


def _buffer_dtypes(tree) -> Tuple[bool, bool]:
    """(whether the code reads ``param_list[0].ds_tensor.dtype``, whether it reads
    ``param.ds_tensor.dtype``): a buffer sized by the first param's dtype (rule 1), or by each one's."""
    import ast

    def first_of_list(node) -> bool:
        return (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "param_list"
                and isinstance(node.slice, ast.Constant) and node.slice.value == 0)

    def each_param(node) -> bool:
        return isinstance(node, ast.Name) and node.id == "param"

    nodes = list(ast.walk(tree))
    return any(_is_partition_dtype(node, first_of_list) for node in nodes), \
        any(_is_partition_dtype(node, each_param) for node in nodes)


def _method_tree(path: str, cls: str, name: str):
    """The AST of ``cls.name`` in the source file ``path``, or None where it has none: the method's
    lines alone where they parse (a few ms), else the whole file's."""
    import ast
    import re
    import textwrap

    with open(path, encoding="utf-8") as handle:
        text = handle.read()
    found = re.search(rf"^class {cls}\b.*?^(    def {name}\(.*?)(?=^    \S|^\S|\Z)", text, re.S | re.M)
    if found is not None:
        try:
            return ast.parse(textwrap.dedent(found.group(1))).body[0]
        except SyntaxError:
            pass  # a multi-line string at column 0, say: parse the whole file below
    for node in ast.parse(text).body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for member in node.body:
                if isinstance(member, ast.FunctionDef) and member.name == name:
                    return member
    return None


def _casts_module_wholesale(tree) -> bool:
    """Whether the engine's set-up calls ``self.module.half()`` / ``.bfloat16()`` / ``.float()``,
    which casts every param, a ZeRO-Init model's included (rule 2)."""
    import ast

    for node in ast.walk(tree):
        function = getattr(node, "func", None)
        if (isinstance(node, ast.Call) and isinstance(function, ast.Attribute) and function.attr in WHOLESALE_CASTS
                and isinstance(function.value, ast.Attribute) and function.value.attr == "module"
                and isinstance(function.value.value, ast.Name) and function.value.value.id == "self"):
            return True
    return False


def _source_file(module_name: str) -> Optional[str]:
    """The .py file of ``module_name``, found without importing it (the start-up hook runs while
    deepspeed is still importing, before its engine module)."""
    import importlib.util

    spec = importlib.util.find_spec(module_name)
    return spec.origin if spec is not None and spec.origin and spec.origin.endswith(".py") else None


def _read_mixed_dtype_gather() -> GatherFix:
    init_cls = _attribute(_import(PARTITION_MODULE), "Init", PARTITION_MODULE)
    where = f"{PARTITION_MODULE}.Init.{COALESCED_GATHER}"
    original = vars(init_cls).get(COALESCED_GATHER)
    if not inspect.isfunction(original):
        return GatherFix(False, f"not needed: no {where}")
    if _parameter_names(original) != COALESCED_GATHER_PARAMETERS:
        return GatherFix(False, f"not needed: {where} takes ({', '.join(_parameter_names(original))}), "
                         "not the gather of 0.19.2")
    gather = _method_tree(inspect.getsourcefile(_innermost(original)), "Init", COALESCED_GATHER)
    first, each = _buffer_dtypes(gather) if gather is not None else (False, False)
    if not first:
        if each:
            return GatherFix(False, f"not needed: {where} sizes each buffer by its own param's dtype")
        return GatherFix(False, f"unknown: {where} sizes its buffers in a way not recognised; left as it is")
    engine_file = _source_file(ENGINE_MODULE)
    engine = _method_tree(engine_file, "DeepSpeedEngine", ENGINE_CONFIGURE) if engine_file else None
    if engine is None:
        return GatherFix(False, f"unknown: {where} sizes every buffer by the first param's dtype, but "
                         f"DeepSpeedEngine.{ENGINE_CONFIGURE} cannot be read; left as it is")
    if _casts_module_wholesale(engine):
        return GatherFix(False, f"not needed: DeepSpeedEngine.{ENGINE_CONFIGURE} casts every param to the "
                         "engine's dtype, so a list gather sees one dtype")
    return GatherFix(True, f"{where} sizes every buffer by the first param's dtype and the engine leaves a "
                     "ZeRO-Init model's dtypes as loaded", init_cls, original)


def mixed_dtype_gather() -> GatherFix:
    """Whether deepspeed sizes a synchronous list gather by its first param's dtype while its engine
    leaves a ZeRO-Init model's dtypes mixed, both read from the AST of its source (NOTE [ Mixed-dtype
    gathers ]). An optional layer: a source that cannot be read says "unknown" and installs
    nothing, and never stops the patch."""
    try:
        return _read_mixed_dtype_gather()
    except (OSError, SyntaxError, UnicodeDecodeError, TypeError, PatchTargetMismatch) as exc:
        return GatherFix(False, f"unknown: deepspeed's list gather could not be read ({type(exc).__name__}: {exc}); "
                         "left as it is")


def resolve(layers_off: Tuple[str, ...] = ()) -> Targets:
    """Import and fingerprint every target, or raise PatchTargetMismatch; the targets of a layer
    in ``layers_off`` are neither checked nor handed out."""
    _check_torch()
    offload_module = _import(OFFLOAD_MODULE)
    coordinator_module = _import(COORDINATOR_MODULE)
    offload_cls = _attribute(offload_module, OFFLOAD_CLASS, OFFLOAD_MODULE)
    coordinator_cls = _attribute(coordinator_module, COORDINATOR_CLASS, COORDINATOR_MODULE)

    originals = {
        name: _check_wrapped_method(offload_cls, name, referenced)
        for name, referenced in WRAPPED_METHODS.items()
    }
    release_param = _check_release_param(coordinator_cls)
    reset_step = _own_function(coordinator_cls, "reset_step")
    _check_parameters(reset_step, f"{coordinator_cls.__qualname__}.reset_step", ("self", ))
    _check_contracts(offload_cls, coordinator_cls, offload_module, _import(PARTITION_MODULE))
    status_enum = _attribute(coordinator_module, "ZeroParamStatus", COORDINATOR_MODULE)

    return Targets(
        offload_cls=offload_cls,
        originals=originals,
        release_param=release_param,
        coordinator_of=_coordinator_accessor(offload_cls),
        coordinator_per_engine=_coordinator_parameters(offload_cls) == ("self", ),
        iter_params=params_reader(_attribute(coordinator_module, "iter_params", COORDINATOR_MODULE),
                                  _attribute(coordinator_module, "get_all_parameters", COORDINATOR_MODULE)),
        is_leaf_module=leaf_reader(_attribute(coordinator_module, "z3_leaf_module", COORDINATOR_MODULE)),
        available_status=_attribute(status_enum, "AVAILABLE", f"{COORDINATOR_MODULE}.ZeroParamStatus"),
        saved_tensors=saved_tensors_probe(shadow_on=SHADOW_LAYER not in layers_off),
        outside_dispatch_modes=outside_dispatch_modes(),
        python_function_node=python_function_node(),
        storage_use_count=storage_use_count(),
        stream_accelerator=stream_accelerator(),
        live_numel=live_numel_counters(coordinator_cls) if BUDGET_LAYER not in layers_off else None,
        upstream=_upstream_pieces(),
        coordinator_cls=coordinator_cls,
        reset_step=reset_step,
        gather_fix=mixed_dtype_gather(),
        late_backward_release=late_backward_release(offload_cls, coordinator_cls,
                                                    originals["post_sub_module_backward_function"]),
    )
