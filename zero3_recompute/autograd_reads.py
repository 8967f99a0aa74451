"""Whether a module's backward may read its params other than through the tensors autograd saved.

NOTE [ Params read outside saved tensors ]

1. A built-in autograd node reads nothing in backward but its saved tensors.
2. A Python autograd Function may keep the Parameter, or a view of its gathered data, on its ctx
   and read it in backward, before any recompute or without one (bitsandbytes' 4-bit matmul
   keeps weight.t() in ctx.tensors).
3. So a module call under a checkpoint that reruns module calls is walked, by the forward watch,
   from its outputs' grad_fn towards its inputs', MAX_NODES nodes at most (walk_module_call).
4. FOUND: a Python Function not of TRUSTED_PACKAGES was met (deepspeed's wrap module inputs and
   outputs for its backward hooks and keep no params); NONE: none was; UNKNOWN: an output it
   cannot look into, a walk cut short, or no input that needs grad to stop at.
5. Only NONE lets release defer the module's backward fetch (NOTE [ Deferred fetch ]); only
   FOUND lets kept storage take in what the call gathered (NOTE [ Gathered storage kept outside
   saved tensors ]); anything else is stock's path, correct whatever the Function keeps.
"""
from typing import Callable, Optional

import torch

# A leaf module's own nodes are a handful; a walk this long has left the module (a call with
# keyword arguments only gives it no inputs to stop at) or is inside a leaf block (MoE).
MAX_NODES = 64
# Python Functions whose class comes from these packages keep no params on their ctx.
TRUSTED_PACKAGES = ("torch", "deepspeed")


class _Opaque(Exception):
    """An output the walk cannot look into."""


def _tensors(value, found: list) -> list:
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif isinstance(value, dict):
        for item in value.values():
            _tensors(item, found)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _tensors(item, found)
    elif value is not None and not isinstance(value, (bool, int, float, str)):
        raise _Opaque(type(value).__name__)
    return found


def _trusted(function_class: type) -> bool:
    return getattr(function_class, "__module__", "").split(".")[0] in TRUSTED_PACKAGES


FOUND, NONE, UNKNOWN = "found", "none", "unknown"


def function_class_reader(backward_base: Optional[type], forward_cls: str) -> Callable[[object], Optional[type]]:
    """An autograd node's Python Function class, None for a built-in node (targets.python_function_node).
    Where torch no longer says (``backward_base`` None), a node reads as ``object``, a class no one
    trusts, and nothing is deferred past it (correct, at stock's memory)."""
    if backward_base is None:
        return lambda node: object

    def python_function_class(node) -> Optional[type]:
        if not isinstance(node, backward_base):
            return None
        cls = getattr(node, forward_cls, None)
        return cls if isinstance(cls, type) else object

    return python_function_class


def walk_module_call(inputs, output, function_class: Callable[[object], Optional[type]],
                     max_nodes: int = MAX_NODES) -> str:
    """FOUND: a node of the graph from ``output`` back to ``inputs`` runs a Python Function not
    of TRUSTED_PACKAGES; NONE: no such node; UNKNOWN: an output it cannot look into, a walk cut
    short, or a graph built with no input that needs grad (given a call's positional inputs
    alone, past its keyword arguments the walk would go into the modules before it and blame
    their Functions)."""
    try:
        outputs = _tensors(output, [])
        inputs = _tensors(inputs, [])
    except _Opaque:
        return UNKNOWN
    stop = {tensor.grad_fn for tensor in inputs if tensor.grad_fn is not None}
    if not any(tensor.requires_grad for tensor in inputs) and any(tensor.grad_fn is not None for tensor in outputs):
        return UNKNOWN
    frontier = [tensor.grad_fn for tensor in outputs if tensor.grad_fn is not None]
    seen = set()
    while frontier:
        node = frontier.pop()
        if node is None or node in stop or node in seen:
            continue
        if len(seen) == max_nodes:
            return UNKNOWN
        seen.add(node)
        cls = function_class(node)
        if cls is not None and not _trusted(cls):
            return FOUND
        frontier.extend(next_node for next_node, _ in node.next_functions)
    return NONE


def output_grad_fn(output):
    """The grad_fn of a module call's output tensor, or of the first tensor of an output tuple or
    list; None where there is none to read."""
    if type(output) is torch.Tensor:  # the common case, first
        return output.grad_fn
    if isinstance(output, (tuple, list)):
        output = next((item for item in output if isinstance(item, torch.Tensor)), None)
    return output.grad_fn if isinstance(output, torch.Tensor) else None


def output_storages(output) -> Optional[set]:
    """The data pointers of the storages under a module call's output tensors; None when the
    output holds something the walk cannot look into, or a tensor whose storage cannot be read
    (a wrapper subclass)."""
    try:
        return {tensor.untyped_storage().data_ptr() for tensor in _tensors(output, [])}
    except (_Opaque, RuntimeError, NotImplementedError):
        return None


def output_needs_grad(output) -> Optional[bool]:
    """Whether any tensor in a module's output requires grad; None when it cannot tell."""
    if isinstance(output, torch.Tensor):
        return output.requires_grad
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (list, tuple)):
        found = [output_needs_grad(item) for item in output]
        if any(found):
            return True
        return False if all(item is False for item in found) or not found else None
    if output is None:
        return False
    return None
