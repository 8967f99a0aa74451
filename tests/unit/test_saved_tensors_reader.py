"""How the ledger reads the saved-tensors hook in force: torch's own reader (torch 2.8 on) or the
shadow stack (NOTE [ Reading the saved-tensors hook stack ]), against torch's real stack."""
import pytest
import torch
import torch.utils.checkpoint

import zero3_recompute
from zero3_recompute import patch, targets, versions
from zero3_recompute.errors import PatchTargetMismatch
from zero3_recompute.hook_stack import ShadowStack

from tests.unit.patch_switch import patch_reverted

BINDINGS = torch._C._autograd
NATIVE = getattr(BINDINGS, targets.TOP_HOOKS, None)
PATCHED = versions.classify(versions.parse(patch.deepspeed_version())) != "unsupported"


def _native_top():
    """torch's own answer where it has one, else None (nothing to compare against)."""
    if NATIVE is None:
        return None
    hooks = NATIVE(False)
    return None if hooks is None else hooks[0]


@pytest.fixture
def shadow(monkeypatch):
    """A fresh shadow stack, installed over the bindings for the test, as apply() installs it."""
    stack = ShadowStack(targets.shadow_bindings())
    monkeypatch.setattr(BINDINGS, targets.PUSH_HOOKS, stack.push)
    monkeypatch.setattr(BINDINGS, targets.POP_HOOKS, stack.pop)
    return stack


def _bindings():
    return {name: getattr(BINDINGS, name) for name in (targets.PUSH_HOOKS, targets.POP_HOOKS)}


def _qualname(hook):
    return (getattr(hook, "__module__", None), getattr(hook, "__qualname__", None))


@pytest.mark.once_per_torch
def test_the_shadow_follows_every_push_and_pop(shadow):
    """Nested contexts, torch's checkpoint forward and its recompute in backward: the shadow's top
    is the hook torch applies, and matches torch's own reader where torch has one."""
    seen = []

    def look(where):
        top = shadow.top_pack_hook()
        seen.append((where, top))
        if NATIVE is not None:
            assert top is _native_top(), f"{where}: the shadow and torch disagree"

    def outer_pack(tensor):
        return tensor

    look("outside")
    with torch.autograd.graph.saved_tensors_hooks(outer_pack, lambda packed: packed):
        look("outer")
        with torch.autograd.graph.save_on_cpu():
            look("save_on_cpu")
        look("outer again")
    look("outside again")

    def body(x):
        look("checkpoint forward" if torch._C._current_graph_task_id() == -1 else "recompute")
        return x.sin()

    x = torch.ones(2, requires_grad=True)
    torch.utils.checkpoint.checkpoint(body, x, use_reentrant=False).sum().backward()
    look("after backward")

    tops = dict(seen)
    assert tops["outside"] is None and tops["outside again"] is None and tops["after backward"] is None
    assert tops["outer"] is outer_pack and tops["outer again"] is outer_pack
    assert _qualname(tops["save_on_cpu"])[1].startswith("save_on_cpu.")
    assert targets.named_in(tops["checkpoint forward"], targets.CHECKPOINT_PACK_HOOKS)
    recompute = tops["recompute"]
    assert recompute is not None and not targets.named_in(recompute, targets.CHECKPOINT_PACK_HOOKS), \
        "the recompute runs under the checkpoint's recomputation hook"
    assert targets.named_in(recompute, targets.RECOMPUTATION_PACK_HOOKS), \
        "the recompute's own pack hook tells the lifecycle it is inside a recompute without a walk of frames"


def _node(on_backward):
    """An autograd Function whose backward calls ``on_backward()`` and passes the grad on."""

    class Node(torch.autograd.Function):

        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            on_backward()
            return grad

    return Node


def _backward_through(*on_backward):
    """One backward through a node per callable, the first one's node first."""
    x = torch.ones(2, requires_grad=True)
    for callback in reversed(on_backward):
        x = _node(callback).apply(x)
    x.sum().backward()


def _push_without_pop(pack_hook):
    getattr(BINDINGS, targets.PUSH_HOOKS)(pack_hook, lambda packed: packed)


@pytest.mark.once_per_torch
def test_a_hook_a_backward_node_leaves_pushed_ends_with_the_node(shadow):
    """The engine restores the thread's hook stack when a node ends: a push the node never
    popped is in force in that node only, neither in the next node nor after the backward."""
    seen = {}

    def stale_pack(tensor):
        return tensor

    def look(where):
        seen[where] = shadow.top_pack_hook()
        if NATIVE is not None:
            assert seen[where] is _native_top(), f"{where}: the shadow and torch disagree"

    _backward_through(lambda: (_push_without_pop(stale_pack), look("in the node")), lambda: look("in the next node"))
    look("after backward")
    assert seen == {"in the node": stale_pack, "in the next node": None, "after backward": None}


@pytest.mark.once_per_torch
def test_what_a_finished_backward_left_is_gone_once_settled(shadow):
    """A hook a node of one backward left pushed is not in force in the next backward once the
    shadow settled outside backward (the ledger settles at every forward release there)."""
    seen = {}

    def read():
        seen["next backward"] = shadow.top_pack_hook()
        if NATIVE is not None:
            assert seen["next backward"] is _native_top(), "the shadow and torch disagree"

    _backward_through(lambda: _push_without_pop(lambda t: t))
    shadow.settle()
    _backward_through(read)
    assert seen["next backward"] is None


@pytest.mark.once_per_torch
def test_a_hook_pushed_in_a_node_is_in_force_in_the_backward_it_starts(shadow):
    """A nested backward (reentrant checkpointing runs one) starts from the node's state."""
    seen = {}

    def outer_pack(tensor):
        return tensor

    def read():
        seen["nested"] = shadow.top_pack_hook()
        if NATIVE is not None:
            assert seen["nested"] is _native_top(), "the shadow and torch disagree"

    def nested_backward():
        with torch.autograd.graph.saved_tensors_hooks(outer_pack, lambda packed: packed), torch.enable_grad():
            leaf = torch.ones(2, requires_grad=True)
            torch.autograd.grad(_node(read).apply(leaf).sum(), leaf)

    _backward_through(nested_backward)
    assert seen["nested"] is outer_pack


@pytest.mark.once_per_torch
def test_a_push_torch_refuses_leaves_the_shadow_as_it_was(shadow):
    with torch.autograd.graph.disable_saved_tensors_hooks("disabled for the test"):
        with pytest.raises(RuntimeError, match="disabled for the test"):
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                pass
        assert shadow.top_pack_hook() is None


@pytest.mark.once_per_torch
def test_the_shadow_is_per_thread(shadow):
    import threading

    found = {}
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        thread = threading.Thread(target=lambda: found.setdefault("other", shadow.top_pack_hook()))
        thread.start()
        thread.join()
        assert shadow.top_pack_hook() is not None
    assert found["other"] is None, "a hook pushed on one thread is not in force on another"


@pytest.mark.skipif(not PATCHED, reason=f"deepspeed {patch.deepspeed_version()} is outside the patched range")
def test_without_torchs_reader_apply_installs_the_shadow_and_revert_restores_the_bindings(monkeypatch):
    """As on torch 2.4-2.7: status names the mechanism; revert puts torch's bindings back."""
    with patch_reverted(), monkeypatch.context() as torch_before_2_8:
        originals = _bindings()
        torch_before_2_8.delattr(BINDINGS, targets.TOP_HOOKS, raising=False)
        patched = zero3_recompute.apply()
        assert patched.active and patched.mechanism == targets.SHADOW_READER
        installed = _bindings()
        assert all(installed[name] is not originals[name] for name in originals)
        assert zero3_recompute.apply().mechanism == targets.SHADOW_READER
        assert _bindings() == installed, "a second apply() changes nothing"
        zero3_recompute.revert()
        assert all(getattr(BINDINGS, name) is originals[name] for name in originals), \
            "revert() puts back torch's own bindings"


@pytest.mark.skipif(NATIVE is None, reason="torch has no reader of its own here")
@pytest.mark.skipif(not PATCHED, reason=f"deepspeed {patch.deepspeed_version()} is outside the patched range")
def test_with_torchs_reader_nothing_of_torch_is_replaced():
    with patch_reverted():
        originals = _bindings()
        patched = zero3_recompute.apply()
        assert patched.mechanism == targets.NATIVE_READER
        assert all(getattr(BINDINGS, name) is originals[name] for name in originals)


@pytest.mark.skipif(not PATCHED, reason=f"deepspeed {patch.deepspeed_version()} is outside the patched range")
@pytest.mark.parametrize("broken", ["enter", "binding"])
def test_a_changed_saved_tensors_hooks_refuses_and_patches_nothing(monkeypatch, broken):
    """Where the shadow is needed and a push would not reach it, nothing is patched."""
    with patch_reverted(), monkeypatch.context() as changed:
        changed.delattr(BINDINGS, targets.TOP_HOOKS, raising=False)
        if broken == "enter":
            changed.setattr(torch.autograd.graph.saved_tensors_hooks, "__enter__", lambda self: None)
            expected = r"saved_tensors_hooks\.__enter__ changed: expected a method that calls"
        else:
            changed.delattr(BINDINGS, targets.PUSH_HOOKS)
            expected = r"_push_saved_tensors_default_hooks changed: expected a function \(or .*torch >= 2\.8\)"
        offload = dict(vars(patch._offload_class()))
        with pytest.raises(PatchTargetMismatch, match=expected):
            zero3_recompute.apply()
        assert dict(vars(patch._offload_class())) == offload, "nothing may be patched"
        assert zero3_recompute.status().mode == "mismatch", "status() reports the refusal"
