"""The ledger's per-param rules, in one process, on plain torch params with ZeRO-3's fields.

Each rule runs inside a real backward graph task (a custom Function's backward), with and
without a saved-tensors hook, as the recompute's post-forward release would meet it.
"""
import contextlib
import dataclasses
import types
from types import SimpleNamespace

import pytest
import torch

from zero3_recompute import hook_stack, policies
from zero3_recompute.autograd_reads import function_class_reader
from zero3_recompute.lifecycle import HoldLedger
from zero3_recompute.targets import (Targets, outside_dispatch_modes,
                                     python_function_node, saved_tensors_probe)

AVAILABLE, NOT_AVAILABLE = "AVAILABLE", "NOT_AVAILABLE"


def _param(shape, location="cpu"):
    param = torch.nn.Parameter(torch.randn(*shape), requires_grad=False)
    param.ds_shape = torch.Size(shape)
    param.ds_status = AVAILABLE
    param.ds_active_sub_modules = set()
    param.ds_persist = False
    param.ds_id = id(param)
    param.ds_tensor = SimpleNamespace(final_location=SimpleNamespace(value=location))
    return param


def _release(coordinator, param):
    param.ds_status = NOT_AVAILABLE
    param.data = torch.empty(0)


@pytest.fixture(autouse=True)
def saved_tensors_reader(monkeypatch):
    """The reader of the saved-tensors hook stack in force for each test: where torch has none
    of its own (before 2.8), the shadow stack installed as apply() would install it."""
    probe = hook_stack.reader(saved_tensors_probe())
    for owner, name, _, replacement in probe.installs:
        monkeypatch.setattr(owner, name, replacement)
    return probe


# The engine (DeepSpeedZeRoOffload) of the modules these tests release: its forwards and
# backwards are the ledger's to tell apart; it has no model of its own here.
class _Engine:
    """A stand-in for deepspeed's DeepSpeedZeRoOffload: weakly referable, as it is."""

    def __init__(self, module=None, zenflow: bool = False):
        self.module = module
        self.zenflow = zenflow


ENGINE = _Engine()


class _Coordinator:
    """Stands in for the engine's PartitionedParameterCoordinator: the ledger only tells them apart."""


COORDINATOR = _Coordinator()


def _targets():
    # Stock's backward release, which the sweep gives a fetched module whose own never came.
    originals = {"post_sub_module_backward_function": lambda offload, module: None}
    return Targets(offload_cls=object, originals=originals, release_param=_release, coordinator_of=lambda offload, m: COORDINATOR,
                   iter_params=lambda module, recurse: module.parameters(recurse=recurse),
                   is_leaf_module=lambda module: False, available_status=AVAILABLE,
                   saved_tensors=hook_stack.reader(saved_tensors_probe()),
                   outside_dispatch_modes=outside_dispatch_modes(), python_function_node=python_function_node())


def _in_backward(action):
    """Run ``action()`` inside a backward graph task; return what it returned."""
    box = {}

    class Probe(torch.autograd.Function):

        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            box["result"] = action()
            return grad

    Probe.apply(torch.ones(1, requires_grad=True)).sum().backward()
    return box["result"]


def _recomputation_pack_hook():
    """A pack hook named as torch's non-reentrant checkpoint names the one it recomputes under
    (targets.RECOMPUTATION_PACK_HOOKS): a call under it builds no graph a backward will read."""
    def pack_hook(tensor):
        return tensor

    pack_hook.__module__, pack_hook.__qualname__ = "torch.utils.checkpoint", "_recomputation_hook.__init__.<locals>.pack_hook"
    return pack_hook


def _before_recompute_release(ledger, module):
    """The ledger's step 1 before a recompute's release of ``module``, with grad enabled as a
    recompute runs (a backward node runs without)."""
    with torch.enable_grad():
        return ledger.before_recompute_release(None, module)


class _Module(torch.nn.Module):
    """A module with the given params whose forward builds a graph of built-in nodes only, or
    runs ``function`` (an autograd Function's apply)."""

    def __init__(self, params, function=None):
        super().__init__()
        for index, param in enumerate(params):
            self.register_parameter(f"p{index}", param)
        self.function = function

    def forward(self, x):
        return x * 2 if self.function is None else self.function(x)


def _module(*params, function=None):
    return _Module(params, function)


@pytest.fixture(autouse=True)
def _retire_ledgers(monkeypatch):
    """Every ledger a test made is retired after it: under release one registers a module forward
    hook (NOTE [ Params read outside saved tensors ]), which would outlive the test."""
    made = []
    init = HoldLedger.__init__

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(HoldLedger, "__init__", recording_init)
    yield
    for ledger in made:
        ledger.switch_policy(ledger.policy, retire=True)


def _forward(ledger, engine, module) -> None:
    """The module's call, which the ledger's forward hook watches (armed on it as a root's fetch
    arms a model's), then its forward release."""
    ledger.watch.hooks.arm(module, check=True)
    module(torch.ones(2, requires_grad=True))
    ledger.forward_done(engine, module)


def _recompute_release(ledger, module, hooked: bool, release=None, check=None):
    """After the module's forward (a call whose backward is still to come), inside a backward: the
    ledger's step 1 around a release (``release(param)`` for each param stock would partition),
    then ``check(plan)``; the graph task ends after it."""
    _forward(ledger, ENGINE, module)

    def step():
        with contextlib.ExitStack() as stack:
            if hooked:
                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))
            plan = _before_recompute_release(ledger, module)
        if release is not None:
            release(plan)
        ledger.after_recompute_release(plan)
        if check is not None:
            check(plan)
        return plan

    return _in_backward(step)


@pytest.mark.parametrize("policy, hooked, held, placeholder", [
    (policies.AUTO, True, True, False),
    (policies.AUTO, False, False, False),
    (policies.KEEP, False, True, False),
    (policies.RELEASE, True, False, True),
    (policies.RELEASE, False, False, False),
])
def test_policy_actions(policy, hooked, held, placeholder):
    ledger = HoldLedger(_targets(), policy)
    param = _param((3, 4))

    def check(plan):
        assert plan.held == ([param] if held else [])
        assert plan.placeholder_candidates == ([param] if placeholder else [])
        assert (len(param.ds_active_sub_modules) == 1) == held

    _recompute_release(ledger, _module(param), hooked, check=check)
    assert not param.ds_active_sub_modules, "the end of the graph task drops every hold"
    assert param.ds_status == (NOT_AVAILABLE if held else AVAILABLE), "and releases what it held"


@pytest.mark.parametrize("hooked", [False, True])
def test_a_release_the_policy_leaves_to_stock_reads_no_params(hooked):
    """auto under a reentrant checkpoint (no saved-tensors hook) leaves the release to stock: its
    mechanics, decided once per policy (Policy.mechanics), end it before the module's params are
    read; under a hook they are read once, and held. Mutation: the params read before the
    mechanics' test (as before #37's eleventh round) fails the reentrant case."""
    targets, reads = _targets(), []

    def counted(module, recurse):
        if torch._C._current_graph_task_id() != -1:  # the recompute's release, not the forward before it
            reads.append(module)
        return module.parameters(recurse=recurse)

    ledger = HoldLedger(dataclasses.replace(targets, iter_params=counted), policies.AUTO)
    param = _param((3, 4))
    module = _module(param)
    plan = _recompute_release(ledger, module, hooked)
    assert plan.held == ([param] if hooked else [])
    assert reads == ([module] if hooked else []), "params read where the release is stock's"


@pytest.mark.parametrize("policy", [policies.AUTO, policies.KEEP, policies.RELEASE])
def test_a_module_whose_backward_ran_is_released_as_stock(policy):
    """A recompute (under torch's recomputation pack hook) that replays a module whose backward release
    already fired for each of its calls (it saved nothing, so its backward ran before the
    recompute): nothing will read what the recompute stores of it, and a hold would last until
    the graph task ends. Stock's release, under every policy; a second call whose backward is
    still to come is held again."""
    ledger = HoldLedger(_targets(), policy)
    param = _param((3, 4))
    module = _module(param)

    def backward_then_recompute():
        ledger.drop_holds(module)  # right before its backward release
        with torch.autograd.graph.saved_tensors_hooks(_recomputation_pack_hook(), lambda t: t):
            return _before_recompute_release(ledger, module)

    _forward(ledger, ENGINE, module)
    plan = _in_backward(backward_then_recompute)
    assert (plan.held, plan.placeholder_candidates) == ([], []), "a module whose backward ran was held"
    _forward(ledger, ENGINE, module)
    _forward(ledger, ENGINE, module)
    plan = _in_backward(backward_then_recompute)
    assert plan.held or plan.placeholder_candidates, "a call whose backward is still to come was released"
    ledger.release_everything()


def test_a_nested_graph_task_releases_nothing_its_enclosing_task_holds():
    """A reentrant checkpoint's inner backward, or an autograd.grad inside a backward, is a
    graph task of its own. Where it holds a param that the enclosing task holds too, its end
    leaves the hold in place; the enclosing task's end releases it."""
    ledger = HoldLedger(_targets(), policies.KEEP)
    param = _param((3, 4))
    module = _module(param)
    after_inner = {}

    def outer():
        ledger.after_recompute_release(_before_recompute_release(ledger, module))
        with torch.enable_grad():  # as a reentrant checkpoint's backward runs its inner one
            _recompute_release(ledger, module, hooked=False)
        after_inner.update(held=bool(param.ds_active_sub_modules), status=param.ds_status)

    _in_backward(outer)
    assert after_inner == {"held": True, "status": AVAILABLE}, "the nested task's end released the outer's hold"
    assert not param.ds_active_sub_modules and param.ds_status == NOT_AVAILABLE, "the outer task's end releases it"


def test_nvme_swapped_params_are_never_held():
    """Holding NVMe-swapped params could exhaust the swapper's buffers: they get placeholders."""
    ledger = HoldLedger(_targets(), policies.KEEP)
    on_disk, in_memory = _param((3, 4), location="nvme"), _param((3, 4))

    def check(plan):
        assert plan.held == [in_memory]
        assert plan.placeholder_candidates == [on_disk]
        assert not on_disk.ds_active_sub_modules

    _recompute_release(ledger, _module(on_disk, in_memory), hooked=True, check=check)


def _stock_release(plan):
    for param in plan.placeholder_candidates:
        _release(None, param)


def test_placeholder_keeps_the_shape_without_storage_until_the_backward_ends():
    ledger = HoldLedger(_targets(), policies.RELEASE)
    param = _param((3, 4))

    def check(plan):
        assert param.shape == (3, 4) and param.data.untyped_storage().nbytes() == param.element_size()
        assert torch.isnan(param.data).all(), "a read of the placeholder must show"

    _recompute_release(ledger, _module(param), hooked=True, release=_stock_release, check=check)
    assert param.shape == (0, ), "stock's partitioned tensor is back once the backward ended"


def test_a_released_param_that_was_gathered_again_keeps_its_data():
    ledger = HoldLedger(_targets(), policies.RELEASE)
    param = _param((3, 4))
    gathered = torch.randn(3, 4)

    def gather_again(plan):
        param.data, param.ds_status = gathered, AVAILABLE

    _recompute_release(ledger, _module(param), hooked=True, release=_stock_release, check=gather_again)
    assert param.data.data_ptr() == gathered.data_ptr()


@pytest.mark.parametrize("after", ["one element", "transposed", "unchanged"])
@pytest.mark.parametrize("leaf", [True, False], ids=["a leaf", "not a leaf"])
def test_a_held_param_is_restored_only_when_its_data_shrank(after, leaf):
    """The fast leaf path swaps param.data for a 1-element buffer even for a param it kept, in the
    release of a module deepspeed treats as a leaf, the one whose gathered data is read before;
    ZenFlow transposes param.data around the release: that is not ours to undo. Mutations tried:
    the data read for every module restores the non-leaf's swap; read for none, the leaf's stays."""
    import dataclasses

    ledger = HoldLedger(dataclasses.replace(_targets(), is_leaf_module=lambda module: leaf), policies.KEEP)
    param = _param((3, 4))
    gathered = param.data
    replacement = {"one element": torch.empty(1), "transposed": gathered.t(), "unchanged": gathered}[after]

    def swap(plan):
        param.data = replacement

    def check(plan):
        expected = gathered if after != "transposed" and leaf else replacement
        assert param.data.data_ptr() == expected.data_ptr() and param.shape == expected.shape

    _recompute_release(ledger, _module(param), hooked=True, release=swap, check=check)


def test_unknown_policy_names_the_choices():
    from zero3_recompute.errors import UnknownPolicy

    with pytest.raises(UnknownPolicy, match=r"expected one of auto, keep, release .*got 'hold'"):
        policies.for_patching(policies.requested("hold"))
    with pytest.raises(UnknownPolicy, match="this deepspeed has none"):
        policies.for_patching(policies.requested("upstream"))
    assert policies.requested(" KEEP ") == "keep"


def test_policy_from_the_environment(monkeypatch):
    monkeypatch.setenv(policies.ENV_POLICY, "release")
    assert policies.requested() == "release"
    monkeypatch.delenv(policies.ENV_POLICY)
    assert policies.requested() == "auto"


def test_the_ledger_keeps_no_model_alive():
    """The ancestry it caches per model (for releasing a block's leftovers) holds ids only."""
    import gc
    import weakref

    ledger = HoldLedger(_targets(), policies.KEEP)
    model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    inner = model[0][0]
    parents = ledger.leftovers._parent_map(_Engine(model), ())
    assert parents[id(inner)] == id(model[0]) and parents[id(model[0])] == id(model)
    alive = weakref.ref(model)
    del model, inner
    gc.collect()
    assert alive() is None, "the ledger kept the model alive"


def test_the_ancestry_learns_of_modules_added_later():
    """A block appended after the first backward (a model grown in place) is found below its
    parent: its leftovers go at that parent's backward release, not at the graph task's end."""
    ledger = HoldLedger(_targets(), policies.KEEP)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    offload = _Engine(model)
    ledger.leftovers._parent_map(offload, (id(model[0]), ))
    model.append(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    added = model[1][0]
    parents = ledger.leftovers._parent_map(offload, (id(added), ))
    assert parents.get(id(added)) == id(model[1]) and parents.get(id(model[1])) == id(model)


def _forward_then_fetch(ledger, module, under, offload=None):
    """The module's forward release outside any backward, under the context ``under()``, then
    its backward fetch inside a graph task; returns whether the fetch was deferred."""
    engine = offload or ENGINE
    with under():
        _forward(ledger, engine, module)
    return _in_backward(lambda: ledger.backward_fetched(engine, module))


def _partitioned(*shapes):
    params = [_param(shape) for shape in shapes]
    for param in params:
        _release(None, param)
    return params


def _torch_checkpoint():
    """The context torch's non-reentrant checkpoint puts its forward under."""
    seen = {}

    def body(x):
        seen["pack"] = hook_stack.reader(saved_tensors_probe()).top_pack_hook()
        return x * 2

    torch.utils.checkpoint.checkpoint(body, torch.ones(1, requires_grad=True), use_reentrant=False)
    return torch.autograd.graph.saved_tensors_hooks(seen["pack"], lambda packed: packed)


@pytest.mark.parametrize("per_engine", [False, True])
def test_a_graph_task_notes_every_coordinator_its_backward_fetches_use(per_engine):
    """The books of a graph task note each coordinator its backward fetches use, which keeps that
    coordinator's own end-of-backward sweep switched off (NOTE [ Graph task books ]). Where the
    coordinator follows the module's training flag (targets.coordinator_per_engine False, as on
    deepspeed 0.14), each fetch reads it; where it follows the engine alone, once per engine and
    task. Mutation: noting the engine whatever coordinator_per_engine says fails the False case."""
    import dataclasses

    training, evaluating = _Coordinator(), _Coordinator()
    reads = []

    def coordinator_of(offload, module):
        reads.append(module)
        return training if per_engine or module.training else evaluating

    targets = dataclasses.replace(_targets(), coordinator_of=coordinator_of, coordinator_per_engine=per_engine)
    ledger = HoldLedger(targets, policies.AUTO)
    modules = [_module(*_partitioned((3, 2))), _module(*_partitioned((3, 2))).eval(), _module(*_partitioned((3, 2)))]
    with _torch_checkpoint():
        for module in modules:
            _forward(ledger, ENGINE, module)

    def fetches():
        for module in modules:
            ledger.backward_fetched(ENGINE, module)
        return set(ledger.books.tasks[torch._C._current_graph_task_id()].coordinators)

    noted = _in_backward(fetches)
    assert noted == ({id(training)} if per_engine else {id(training), id(evaluating)})
    assert len(reads) == (1 if per_engine else len(modules))


def test_a_graph_task_notes_every_coordinator_its_holds_use():
    """A recompute release's hold notes its coordinator in the graph task's books, as a backward
    fetch does: rule 4 sweeps a task that raised at the next forward of each coordinator noted
    there. The second coordinator to hold in a task is noted too. Mutation: noting a coordinator
    only where its hold opens the books (HoldTaking.take) fails it."""
    first, second = _Coordinator(), _Coordinator()
    modules = [_module(_param((3, 4))), _module(_param((3, 4)))]
    coordinators = {id(modules[0]): first, id(modules[1]): second}
    targets = dataclasses.replace(_targets(), coordinator_of=lambda offload, module: coordinators[id(module)])
    ledger = HoldLedger(targets, policies.AUTO)
    for module in modules:
        _forward(ledger, ENGINE, module)

    def recompute_releases():
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            plans = [_before_recompute_release(ledger, module) for module in modules]
        held = [plan.held for plan in plans]
        return held, set(ledger.books.tasks[torch._C._current_graph_task_id()].coordinators)

    held, noted = _in_backward(recompute_releases)
    assert held == [list(module.parameters()) for module in modules], "each release holds its frozen param"
    assert noted == {id(first), id(second)}
    assert ledger.engines.keeps_books_for(first) and ledger.engines.keeps_books_for(second)


@pytest.mark.parametrize("policy, under, deferred", [
    ("release", _torch_checkpoint, True),
    ("keep", _torch_checkpoint, False),
    ("auto", _torch_checkpoint, False),
    ("release", contextlib.nullcontext, False),
    ("release", lambda: torch.autograd.graph.save_on_cpu(), False),
    ("release", lambda: torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t), False),
])
def test_backward_fetch_is_deferred_only_under_release_inside_a_checkpoint(policy, under, deferred):
    """Release defers the fetch of a module that ran inside torch's non-reentrant checkpoint:
    the recompute its backward starts gathers it. Under another saved-tensors hook, or none,
    nothing recomputes it, so it is fetched as stock does; keep and auto always fetch."""
    ledger = HoldLedger(_targets(), policies.for_patching(policy))
    assert _forward_then_fetch(ledger, _module(*_partitioned((3, 2))), under) is deferred


def test_a_fetch_is_deferred_once_and_never_after_a_recompute_reran_the_module():
    """Once deferred, or once a recompute reran the module (in any graph task: a reentrant
    checkpoint's backward is a graph task of its own), its later fetches gather as stock."""
    ledger = HoldLedger(_targets(), policies.RELEASE)
    module = _module(*_partitioned((3, 2)))
    assert _forward_then_fetch(ledger, module, _torch_checkpoint) is True
    assert _in_backward(lambda: ledger.backward_fetched(ENGINE, module)) is False
    with _torch_checkpoint():
        _forward(ledger, ENGINE, module)
    _recompute_release(ledger, module, hooked=True)
    assert _in_backward(lambda: ledger.backward_fetched(ENGINE, module)) is False


@pytest.mark.parametrize("case", ["trainable", "nvme", "persistent", "zenflow", "no params"])
def test_a_fetch_is_not_deferred_where_the_recompute_would_not_cover_it(case):
    """Only all-frozen, non-persistent params off NVMe are deferred, and never under ZenFlow,
    whose backward fetch also transposes them."""
    params = _partitioned((3, 2), (2, ))
    offload = _Engine(zenflow=case == "zenflow")
    if case == "trainable":
        params[1].requires_grad_(True)
    elif case == "nvme":
        params[0].ds_tensor.final_location.value = "nvme"
    elif case == "persistent":
        params[0].ds_persist = True
    module = _module(*([] if case == "no params" else params))
    ledger = HoldLedger(_targets(), policies.RELEASE)
    assert _forward_then_fetch(ledger, module, _torch_checkpoint, offload) is False


def test_deepspeed_non_reentrant_checkpoint_is_recognised():
    """deepspeed's own non_reentrant_checkpoint reruns whole module calls too: its pack hook,
    a function nested in it, is one the ledger knows (read from its code, as calling it needs
    a process group on some releases)."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.activation_checkpointing import checkpointing

    from zero3_recompute.targets import CHECKPOINT_PACK_HOOKS

    function = checkpointing.non_reentrant_checkpoint
    # co_qualname arrived in Python 3.11; before it, a nested function's is its parent's plus its name.
    nested = [getattr(const, "co_qualname", f"{function.__qualname__}.<locals>.{const.co_name}")
              for const in function.__code__.co_consts if isinstance(const, types.CodeType)]
    known = {qualname for module, qualname in CHECKPOINT_PACK_HOOKS if module == function.__module__}
    assert known & set(nested), f"pack hooks in {function.__module__}: known {known}, found {nested}"


def test_the_deferral_does_not_depend_on_the_params_status():
    """Params a reuse distance or a prefetch kept gathered are deferred too: deepspeed records
    each fetch in its module trace, and fetching in one step where the recording step deferred
    would invalidate the trace every other step."""
    params = _partitioned((3, 2))
    params[0].ds_status = AVAILABLE
    ledger = HoldLedger(_targets(), policies.RELEASE)
    assert _forward_then_fetch(ledger, _module(*params), _torch_checkpoint) is True


def test_a_no_grad_forward_leaves_the_deferral_as_it_was():
    """A no-grad forward (a reference model's log-probs, evaluation) makes no backward: it
    neither arms nor disarms the deferral of the forward that does."""
    ledger = HoldLedger(_targets(), policies.RELEASE)
    module = _module(*_partitioned((3, 2)))
    with _torch_checkpoint():
        _forward(ledger, ENGINE, module)
    with torch.no_grad():
        _forward(ledger, ENGINE, module)
    assert _in_backward(lambda: ledger.backward_fetched(ENGINE, module)) is True
    with _torch_checkpoint(), torch.no_grad():
        _forward(ledger, ENGINE, module)
    assert _in_backward(lambda: ledger.backward_fetched(ENGINE, module)) is False


def test_every_forward_release_outside_backward_settles_the_hook_stack_reader():
    """So nothing a finished backward left on the shadow stack reaches the next backward's
    recompute (NOTE [ Reading the saved-tensors hook stack ]), under every policy."""
    import dataclasses

    settled = []
    for name in ("auto", "keep", "release"):
        targets = _targets()
        probe = dataclasses.replace(targets.saved_tensors, settle=lambda: settled.append(name))
        ledger = HoldLedger(dataclasses.replace(targets, saved_tensors=probe), policies.for_patching(name))
        with torch.no_grad():
            ledger.forward_done(ENGINE, _module(*_partitioned((3, 2))))
        ledger.forward_done(ENGINE, _module(*_partitioned((3, 2))))
    assert settled == ["auto", "auto", "keep", "keep", "release", "release"]


class _KeepsInputOnContext(torch.autograd.Function):
    """A Python Function that keeps what it reads in backward on its ctx, as bitsandbytes' 4-bit
    matmul keeps its weight."""

    @staticmethod
    def forward(ctx, x):
        ctx.kept = x
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class _Opaque:
    """An output the forward hook cannot look into."""


def _long_chain(x):
    for _ in range(100):
        x = x + 1
    return x


@pytest.mark.parametrize("function, deferred", [
    (None, True),
    (_KeepsInputOnContext.apply, False),
    (lambda x: (x * 2, {"extra": [x + 1]}), True),
    (lambda x: (x * 2, _Opaque()), False),
    (_long_chain, False),
])
def test_a_fetch_is_deferred_only_past_nodes_that_read_saved_tensors_alone(function, deferred):
    """NOTE [ Params read outside saved tensors ]: a module whose call ran a Python Function of
    neither torch nor deepspeed, returned something the hook cannot look into, or built more
    nodes than the walk follows, is fetched as stock does under release."""
    ledger = HoldLedger(_targets(), policies.RELEASE)
    assert _forward_then_fetch(ledger, _module(*_partitioned((3, 2)), function=function), _torch_checkpoint) \
        is deferred


def test_a_module_the_hook_did_not_watch_is_not_deferred():
    """A forward release with no watched call of the module before it (its forward hooks
    bypassed, or the ledger made mid-forward) counts as a Function found."""
    ledger = HoldLedger(_targets(), policies.RELEASE)
    module = _module(*_partitioned((3, 2)))
    with _torch_checkpoint():
        ledger.forward_done(ENGINE, module)
    assert _in_backward(lambda: ledger.backward_fetched(ENGINE, module)) is False


def test_the_walk_stops_at_the_module_inputs():
    """A Python Function upstream of a module's inputs is another module's concern; with no
    positional input to stop at (a call by keyword), the walk cannot tell it from the module's
    own, nor with only inputs outside any graph. Mutation: the check of inputs to stop at left
    out blames the upstream Function (FOUND)."""
    from zero3_recompute.autograd_reads import NONE, UNKNOWN, walk_module_call

    upstream = _KeepsInputOnContext.apply(torch.ones(2, requires_grad=True))
    classify = function_class_reader(*python_function_node())
    assert walk_module_call((upstream, ), upstream * 3, classify) == NONE
    assert walk_module_call((), upstream * 3, classify) == UNKNOWN
    assert walk_module_call((torch.ones(2), ), upstream * 3, classify) == UNKNOWN
    assert classify(upstream.grad_fn) is _KeepsInputOnContext and classify((upstream * 3).grad_fn) is None


class _NoStorage(torch.Tensor):
    """A wrapper subclass: untyped_storage() raises."""

    @staticmethod
    def __new__(cls, elem):
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(str(func))


def _gathered_frozen(data: torch.Tensor) -> torch.nn.Parameter:
    param = torch.nn.Parameter(data, requires_grad=False)
    param.ds_numel_aligned = data.numel()
    return param


def test_kept_storage_takes_in_only_a_resizable_storage_it_can_read():
    """NOTE [ Gathered storage kept outside saved tensors ]: a storage that cannot be resized
    (memory of numpy's) is never freed in place, and a tensor whose storage cannot be read (a
    wrapper subclass) is left alone, in the output as in the param. Mutations: the resizable()
    check left out takes the numpy storage in (its free would raise); the except left out raises."""
    import numpy

    from zero3_recompute.autograd_reads import output_storages
    from zero3_recompute.kept_storage import _candidate

    assert _candidate(_gathered_frozen(torch.ones(4)), set()) is not None
    assert _candidate(_gathered_frozen(torch.from_numpy(numpy.ones(4, dtype=numpy.float32))), set()) is None
    assert output_storages(_NoStorage(torch.ones(3))) is None


def test_kept_storage_reuses_a_modules_none_per_class_of_its_output_node(monkeypatch):
    """NOTE [ Forward watch ], rule 2: for kept storage alone, a module's NONE is reused for later
    calls whose output's grad_fn is of the same class, and a call ending in another class (the
    Python Function bitsandbytes' 4-bit matmul is) is walked anew, as is every FOUND. Mutations:
    NONE kept for the module alone reports NONE for the Function's call; no reuse walks the
    third call."""
    from zero3_recompute import forward_watch
    from zero3_recompute.autograd_reads import FOUND, NONE

    walks = []
    walk = forward_watch.walk_module_call
    monkeypatch.setattr(forward_watch, "walk_module_call", lambda *args: walks.append(args) or walk(*args))
    watch = forward_watch.ForwardWatch(_targets(), None, SimpleNamespace(enabled=True), "output")
    module, x = torch.nn.Linear(2, 2), torch.ones(2, requires_grad=True)
    assert watch._walk_once(module, (x, ), x * 2) == NONE
    assert watch._walk_once(module, (x, ), _KeepsInputOnContext.apply(x)) == FOUND
    assert watch._walk_once(module, (x, ), x * 3) == NONE and len(walks) == 2
    assert watch._walk_once(module, (x, ), _KeepsInputOnContext.apply(x)) == FOUND and len(walks) == 3


def test_a_known_none_is_of_its_class_itself_not_of_one_at_its_address():
    """The watch keeps each NONE's class weakly, by id (deepspeed's Function class per module
    reaches its engine), and a hit must be that class: a class collected and another made at its
    address reads as unknown, and is walked. Mutation: the hit by id alone fails it."""
    import weakref

    from zero3_recompute import forward_watch

    watch = forward_watch.ForwardWatch(_targets(), None, SimpleNamespace(enabled=True, engaged=False), "output")
    module, x = torch.nn.Linear(2, 2), torch.ones(2, requires_grad=True)
    output = _KeepsInputOnContext.apply(x)
    other = type("Collected", (), {})
    watch._walked.put(module, {id(type(output.grad_fn)): weakref.ref(other)})  # the address taken up again
    assert not watch._known_none(module, output)
    watch._walked[id(module)] = {id(type(output.grad_fn)): weakref.ref(type(output.grad_fn))}
    assert watch._known_none(module, output)


def _model_with_the_watch():
    """(a ledger, a model: frozen Linear, trainable Linear, a container of a frozen Linear), armed
    as a root fetch arms a model a checkpoint ran in."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.Linear(2, 2)))
    model[0].requires_grad_(False)
    model[2][0].requires_grad_(False)
    ledger = HoldLedger(_targets(), policies.AUTO)
    return ledger, model


def _watched(ledger, model) -> list:
    """The names of ``model``'s modules that carry the watch's hook, each once or more."""
    hook = ledger.watch.hooks.hook
    return [name for name, module in model.named_modules() for each in module._forward_hooks.values() if each is hook]


def test_the_watch_hook_sits_first_once_on_each_module_with_a_frozen_param_of_its_own():
    """NOTE [ Forward watch ], rule 3: on the frozen Linears alone, before a hook registered
    earlier (deepspeed's release), once however often the model is armed (an engine built again)
    and whatever other model a module is in. Mutations: the hook on every module; appended, not
    prepended; put on a module that has it."""
    ledger, model = _model_with_the_watch()
    earlier = model[0].register_forward_hook(lambda module, args, output: None)
    for root, check in ((model, False), (model, True), (model[2], True), (model, False)):
        ledger.watch.hooks.arm(root, check=check)  # model[2]: a second model over a module of the first
    assert _watched(ledger, model) == ["0", "2.0"]
    assert next(iter(model[0]._forward_hooks.values())) is ledger.watch.hooks.hook, "after an earlier hook"
    earlier.remove()


def test_the_watch_hook_follows_requires_grad_at_a_checked_arm():
    """A param frozen or unfrozen since is seen at the next root fetch (check=True), not before,
    each module hooked once. Mutations: an armed model never armed again; armed again without
    taking its old hooks off."""
    ledger, model = _model_with_the_watch()
    ledger.watch.hooks.arm(model, check=False)
    model[1].requires_grad_(False)
    model[0].requires_grad_(True)
    ledger.watch.hooks.arm(model, check=False)
    assert _watched(ledger, model) == ["0", "2.0"], "armed again without a check"
    ledger.watch.hooks.arm(model, check=True)
    assert _watched(ledger, model) == ["1", "2.0"]


def test_a_model_with_the_watch_hook_deep_copies_and_is_collected(monkeypatch):
    """copy.deepcopy of a model copies the hook as the function it is (a bound method of the
    watch would copy its thread-local), which records nothing of the copy's calls; and the watch
    keeps no param alive (a ZeRO-3 param reaches its engine). Mutations: the watch's bound method
    registered; the copy's calls recorded; the params kept strongly."""
    import copy
    import gc
    import weakref

    ledger, model = _model_with_the_watch()
    ledger.watch.hooks.arm(model, check=False)
    copied = copy.deepcopy(model)
    assert _watched(ledger, copied) == ["0", "2.0"]
    recorded = []
    monkeypatch.setattr(ledger.watch, "_record", lambda module, *call: recorded.append(id(module)))
    copied(torch.ones(2))
    model(torch.ones(2))
    assert recorded == [id(model[0]), id(model[2][0])], "the hook recorded a call of the copy, or missed the model's"
    model[0].weight.reaches = model  # as a ZeRO-3 param reaches its engine, and so its model, through its optimizer
    param = weakref.ref(model[0].weight)
    del model, copied
    gc.collect()
    assert param() is None, "the watch kept a param of a collected model alive"


def test_the_watch_hook_is_armed_by_a_checkpointed_training_forward_not_by_one_without_grad():
    """A reference model's forward under no_grad (also a release outside grad, as a reentrant
    checkpoint's first pass is) arms nothing; a grad-enabled release under torch's checkpoint arms
    the model then, before its later calls; a reentrant one, at the root's release. Mutations:
    armed without grad; never armed there; not at the root of an engine known to checkpoint."""
    ledger, model = _model_with_the_watch()
    engine = _Engine(model)
    with torch.no_grad():
        ledger.forward_done(engine, model[0])
        ledger.forward_done(engine, model)
    assert _watched(ledger, model) == [], "a forward without grad armed the hook"
    with _torch_checkpoint():
        ledger.forward_done(engine, model[0])
    assert _watched(ledger, model) == ["0", "2.0"]
    ledger, model = _model_with_the_watch()
    engine = _Engine(model)
    with torch.no_grad():  # a reentrant checkpoint's first pass
        ledger.forward_done(engine, model[0])
    ledger.forward_done(engine, model)  # the root's release, with grad: the engine checkpoints
    assert _watched(ledger, model) == ["0", "2.0"], "a reentrant checkpoint's forward did not arm the hook"


def test_retiring_the_ledger_takes_every_watch_hook_off():
    """revert() retires the ledger: no module keeps the hook. Mutation: the watch's sync without
    its disarm."""
    ledger, model = _model_with_the_watch()
    ledger.watch.hooks.arm(model, check=False)
    ledger.switch_policy(ledger.policy, retire=True)
    assert _watched(ledger, model) == []


def test_an_output_not_noted_needs_grad_only_while_grad_is_enabled():
    """Rule 1 where no hook noted the call (a model no checkpoint ran in, called inside a backward,
    as a reference model's forward): without grad nothing is held; a note, where there is one,
    decides. Mutations: unknown counts as needed whatever the grad mode; the grad mode alone."""
    watch = HoldLedger(_targets(), policies.AUTO).watch
    module = torch.nn.Linear(2, 2)
    with torch.no_grad():
        assert watch.output_needs_grad(module, 7) is False
    with torch.enable_grad():
        assert watch.output_needs_grad(module, 7) is True

    def noted_then_read(output, grad_enabled):  # the hook's note of a call, then the release's read
        watch._record(module, (), {}, output)
        with torch.set_grad_enabled(grad_enabled):
            return watch.output_needs_grad(module, torch._C._current_graph_task_id())

    assert _in_backward(lambda: noted_then_read(torch.ones(1), True)) is False, "a note of no grad lost"
    assert _in_backward(lambda: noted_then_read(torch.ones(1, requires_grad=True), False)) is True, "a note lost"


def test_a_note_taken_in_another_graph_task_is_not_read():
    """Rule 1's note sits on the module with the graph task it was taken in (NOTE [ Notes on the
    module ]): a call noted in one backward and never released there (its release raised, or it
    ran outside a checkpoint) says nothing of the next backward's call, whose output counts as
    needed while grad is enabled. Mutation: the read without its graph task's test."""
    watch = HoldLedger(_targets(), policies.AUTO).watch
    module = torch.nn.Linear(2, 2)

    def read():
        with torch.enable_grad():  # as in a recompute
            return watch.output_needs_grad(module, torch._C._current_graph_task_id())

    _in_backward(lambda: watch._record(module, (), {}, torch.ones(1)))  # needs no grad, left unread
    assert _in_backward(read) is True
    noted = _in_backward(lambda: (watch._record(module, (), {}, torch.ones(1)), read(), read()))
    assert noted[1:] == (False, True), "a note is read once, in its own graph task"


def test_a_forward_past_its_notes_sweeps_a_task_its_finalizer_queued_at_its_next_release():
    """Rule 4: a graph task whose backward raised (its finalizer queued it) is swept at the next
    forward release, also in a forward past its notes (Engines.forward_noted). Mutation: the
    queued-task sweep moved after the fast path leaves it on the books until the root's release."""
    ledger = HoldLedger(_targets(), policies.AUTO)  # kept storage off: a checkpointed call takes every note
    engine, second, _ = _engine_past_its_notes(ledger)
    _queue_a_raised_task(ledger)
    with _torch_checkpoint():
        _forward(ledger, engine, second)
    assert not ledger.books.queued and not ledger.books.tasks


def _engine_past_its_notes(ledger):
    """An engine of three modules whose training forward has run its first under a checkpoint,
    past its notes (Engines.forward_noted) from then on: (engine, the second module, the third)."""
    first, second, third = (_module(*_partitioned((3, 2))) for _ in range(3))
    root = torch.nn.Sequential(first, second, third)
    engine = _Engine(root)
    ledger.forward_fetching(engine, root)
    with _torch_checkpoint():
        _forward(ledger, engine, first)
    assert id(engine) in ledger.engines.forward_noted
    return engine, second, third


def _queue_a_raised_task(ledger) -> None:
    """A graph task with books whose backward raised: its finalizer queues it (graph_tasks NOTE, rule 3)."""

    def raises():
        ledger.books.open(torch._C._current_graph_task_id())
        raise RuntimeError("a backward that raised")

    with pytest.raises(RuntimeError, match="raised"):
        _in_backward(raises)
    assert list(ledger.books.queued) and ledger.books.tasks, "the raised task's finalizer queued it"


def test_the_forward_release_wrapper_counts_a_forward_past_its_notes_and_sweeps_a_queued_task():
    """The forward release's wrapper takes HoldLedger.forward_done's first lines itself for a
    training forward past its notes (Engines.forward_noted): rule 5's count, and nothing more; with
    a raised task queued by its finalizer it calls forward_done, whose sweep takes it (rule 4).
    Mutations tried (torch 2.8 on: before it the hook stack settles at each release, and the wrapper
    leaves every call to forward_done): the wrapper's test of the queue left out leaves the task on
    the books; its count left out leaves the call uncounted."""
    import dataclasses

    from zero3_recompute.patch import _build_wrappers

    released = []

    def deepspeeds(name):
        def method(offload, module):
            released.append(module)
        method.__name__ = name
        return method

    originals = {name: deepspeeds(name) for name in ("pre_sub_module_forward_function", "post_sub_module_forward_function",
                                                     "pre_sub_module_backward_function", "post_sub_module_backward_function")}
    ledger = HoldLedger(dataclasses.replace(_targets(), originals=originals), policies.AUTO)
    wrappers = {install.name: install.replacement for install in _build_wrappers(ledger._targets, ledger, ())[0]}
    release = wrappers["post_sub_module_forward_function"]
    engine, second, third = _engine_past_its_notes(ledger)
    with _torch_checkpoint():
        second(torch.ones(2, requires_grad=True))
        release(engine, second)
    assert second in ledger.calls_due and released == [second], "past its notes: counted, then deepspeed's release"
    _queue_a_raised_task(ledger)
    with _torch_checkpoint():
        third(torch.ones(2, requires_grad=True))
        release(engine, third)
    assert not ledger.books.queued and not ledger.books.tasks and third in ledger.calls_due


@pytest.mark.parametrize("policy", ["auto", "release"])
def test_a_forward_takes_notes_until_its_watch_starts_and_its_root_ends_them(policy):
    """A training forward's releases stop noting (Engines.forward_noted) only once the engine's
    facts say it checkpoints and the watch for kept storage runs: a call under another saved-tensors
    hook first (save_on_cpu) sets the facts but does not start the watch, and the checkpointed call
    after it must (in the first forward: from the second on, the root's fetch starts the watch of
    an engine known to checkpoint). The root's release ends the notes, and the deferral, which notes every call,
    never stops. Mutations tried: the watch's condition left out (the second call is passed over
    and the watch never starts); the root's release keeping the engine noted; the deferral's
    condition left out (release notes nothing after the first checkpointed call)."""
    import dataclasses

    targets = dataclasses.replace(_targets(), storage_use_count=lambda storage: 1)  # kept storage on
    ledger = HoldLedger(targets, policies.for_patching(policy))
    first, second, third = (_module(*_partitioned((3, 2))) for _ in range(3))
    root = torch.nn.Sequential(first, second, third)
    engine = _Engine(root)
    noted = ledger.engines.forward_noted
    for step in range(2):
        ledger.forward_fetching(engine, root)
        with torch.autograd.graph.save_on_cpu():
            _forward(ledger, engine, first)
        # From the second forward on the engine is known to checkpoint: its root's fetch starts the watch.
        assert (id(engine) in noted) is (policy == "auto" and step == 1), "noted only once the watch runs"
        with _torch_checkpoint():
            _forward(ledger, engine, second)
            assert ledger.watch.watching(engine), "the checkpointed call starts the watch"
            assert (id(engine) in noted) is (policy == "auto")
            _forward(ledger, engine, third)
        ledger.forward_done(engine, root)
        assert id(engine) not in noted and id(engine) in ledger.engines.recomputing
        assert not ledger.watch.watching(engine), "the root's release ends the watch"
