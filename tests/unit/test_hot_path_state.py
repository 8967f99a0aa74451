"""The state the hooks read on their hot path (#37): tables by id, the set of engines that may
recompute, rule 5's counts and the leftovers' candidates, in one process on plain modules.

Mutations tried, each fails the test named:
- ById.put registering a finalizer at every put (its ``key not in self`` test dropped):
  test_by_id_drops_each_entry_with_its_object_and_registers_once;
- Engines.forward_released never discarding an engine from ``recomputing``, or its finalizer
  left out: test_an_engine_may_recompute_exactly_while_its_facts_say_so;
- CallsDue.take going below 0: test_rule_5_counts_never_go_below_zero;
- module_notes.new_keys giving every ledger the same keys:
  test_each_ledger_counts_on_the_module_under_keys_of_its_own; its keys without the process's
  token: test_a_ledger_in_another_process_notes_under_other_keys;
- Leftovers.below passing over every engine's root rather than its own engine's:
  test_leftovers_pass_over_their_own_engines_root_alone;
- Leftovers.nothing_below passing over the modules due without a release coming:
  test_nothing_below_says_so_only_where_below_finds_nothing;
- LiveBudget.refused returning nothing while the count is up to one param's numel over the limit
  (its early exit at ``count <= limit + 64``): test_the_live_budget_refuses_exactly_what_passes_the_limit.
"""
import gc
import itertools
import weakref
from types import SimpleNamespace

import torch

from zero3_recompute.by_id import ById
from zero3_recompute.engines import Engines
from zero3_recompute.graph_tasks import GraphTask
from zero3_recompute.holds import CallsDue, HoldRegistry
from zero3_recompute.leftovers import Leftovers
from zero3_recompute.live_budget import LiveBudget
from zero3_recompute.module_notes import new_keys, notes_on


class _Engine:
    """A stand-in for deepspeed's DeepSpeedZeRoOffload: weakly referable, as it is."""

    def __init__(self, module):
        self.module = module


def _finalizers_on(obj) -> int:
    """The live finalizers registered on ``obj`` (others, of objects earlier tests left to the
    collector, come and go meanwhile)."""
    return sum(1 for finalizer in list(weakref.finalize._registry) if (finalizer.peek() or (None, ))[0] is obj)


def test_by_id_drops_each_entry_with_its_object_and_registers_once():
    table = ById()
    module = torch.nn.Linear(2, 2)
    for count in range(3):
        table.put(module, count)
    assert table.get(id(module)) == 2 and _finalizers_on(module) == 1, "one finalizer per object"
    key = id(module)
    del module
    gc.collect()
    assert key not in table


def test_an_engine_may_recompute_exactly_while_its_facts_say_so():
    engines = Engines(SimpleNamespace(settle=lambda: None, top_pack_hook=lambda: None, any_hook=None))
    root = torch.nn.Sequential(torch.nn.Linear(2, 2))
    offload = _Engine(root)
    engines.forward_released(offload, root[0], True, False)
    assert id(offload) not in engines.recomputing, "a release outside any checkpoint"
    engines.forward_released(offload, root[0], False, False)
    assert id(offload) in engines.recomputing, "a no-grad release may be a reentrant checkpoint's first pass"
    engines.forward_released(offload, root, False, False)
    assert id(offload) not in engines.recomputing, "a no-grad forward (evaluation) ended: nothing recomputes"
    engines.forward_released(offload, root[0], True, True)
    engines.forward_released(offload, root, True, False)
    assert id(offload) in engines.recomputing and engines.checkpointing(offload), "a checkpointed training forward"
    engines.forward_released(offload, root, True, False)
    assert id(offload) in engines.recomputing, "kept for good"
    key = id(offload)
    del offload
    gc.collect()
    assert key not in engines.recomputing, "the id went with its engine"


def test_rule_5_counts_never_go_below_zero():
    calls_due = CallsDue(new_keys().calls_due)
    module = torch.nn.Linear(2, 2)
    calls_due.take(module)
    assert module not in calls_due
    calls_due.add(module)
    calls_due.add(module)
    calls_due.take(module)
    assert module in calls_due
    calls_due.take(module)
    calls_due.take(module)
    assert module not in calls_due
    calls_due.add(module)
    assert module in calls_due, "a count that went below zero would need two calls here"


def test_each_ledger_counts_on_the_module_under_keys_of_its_own():
    """Rule 5's count sits in the module's own __dict__ (NOTE [ Notes on the module ]), where
    deepspeed's hook has just looked; a ledger made after revert() and apply() reads nothing an
    earlier one left there, as a count left by a step cut off would hold as before rule 5."""
    module = torch.nn.Linear(2, 2)
    earlier = new_keys()
    CallsDue(earlier.calls_due).add(module)
    assert notes_on(module) == {earlier.calls_due: 1}, "counted on the module itself"
    later = CallsDue(new_keys().calls_due)
    assert module not in later, "a later ledger read an earlier one's count"
    later.add(module)
    later.take(module)
    assert module not in later and notes_on(module)[earlier.calls_due] == 1


def test_a_ledger_in_another_process_notes_under_other_keys():
    """A pickled module carries its notes into another process, whose ledgers and graph tasks count
    from the start again: the first ledger of two processes must not share keys (NOTE [ Notes on
    the module ], rule 3)."""
    import subprocess
    import sys

    first_keys = [subprocess.run([sys.executable, "-c", "from zero3_recompute.module_notes import new_keys; "
                                  "print(new_keys().output)"], capture_output=True, text=True, check=True,
                                 timeout=120).stdout.strip() for _ in range(2)]
    assert first_keys[0] and first_keys[0] != first_keys[1], first_keys


def test_leftovers_pass_over_their_own_engines_root_alone():
    """At a block's backward release, due modules without a release coming are candidates: its
    engine's root is never below it and is passed over; another engine's root nested in the block
    (a model wrapped by an engine of its own) is below it and goes."""
    inner_model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(2, 2), inner_model))
    block, leaf = model[0], model[0][0]
    offload, inner = _Engine(model), _Engine(inner_model)
    for module in model.modules():
        module.ds_grads_remaining = 0
    task = GraphTask()
    task.due = {id(model): (offload, model), id(block): (offload, block), id(leaf): (offload, leaf),
                id(inner_model): (inner, inner_model)}
    due, orphans = Leftovers().below(offload, block, task, HoldRegistry(), 1)
    assert sorted(id(module) for _, module in due) == sorted((id(leaf), id(inner_model))) and orphans == []
    due, _ = Leftovers().below(offload, model, task, HoldRegistry(), 1)
    assert {id(module) for _, module in due} == {id(block), id(leaf), id(inner_model)}


def test_nothing_below_says_so_only_where_below_finds_nothing():
    """Leftovers.nothing_below, the unlocked test each backward release of a module with children
    makes first, against below, over every set of modules due, each with or without a release
    coming, with and without a hold in the graph task, at each module: True only where below finds
    nothing, and True at least where nothing is held and every module due has a release coming.
    Mutation: nothing_below passing over the modules without a release coming fails it."""
    inner_model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(2, 2), inner_model))
    offload, inner = _Engine(model), _Engine(inner_model)
    modules = [(offload, model), (offload, model[0]), (offload, model[0][0]), (inner, inner_model)]
    said_nothing = 0
    for due_mask, coming_mask, held in itertools.product(range(16), range(16), (False, True)):
        for index, (_, module) in enumerate(modules):
            module.ds_grads_remaining = (coming_mask >> index) & 1
        task = GraphTask()
        task.due = {id(module): (owner, module) for index, (owner, module) in enumerate(modules)
                    if (due_mask >> index) & 1}
        for owner, module in modules[:3]:
            holds = HoldRegistry()
            if held:
                param = torch.nn.Parameter(torch.zeros(1))
                param.ds_active_sub_modules = set()
                holds.hold(model[0][0], None, [param], 1)
            nothing = Leftovers.nothing_below(owner, module, task, holds, 1)
            if nothing:
                assert Leftovers().below(owner, module, task, holds, 1) == ([], []), (due_mask, coming_mask, held)
                said_nothing += 1
            elif not held and all(other is module or other is model or other.ds_grads_remaining > 0
                                  for _, other in task.due.values()):
                raise AssertionError(f"nothing_below said False with nothing to find: {due_mask}, {coming_mask}")
    assert said_nothing


def _deepspeed_readers():
    import deepspeed.runtime.zero.partitioned_param_coordinator as coordinator

    return coordinator.iter_params, coordinator.get_all_parameters, coordinator.z3_leaf_module


def test_the_fast_readers_answer_as_deepspeeds_own():
    """targets.leaf_reader and targets.params_reader against deepspeed's z3_leaf_module and
    iter_params, on the modules each path meets: plain, with children, flagged a leaf by
    set_z3_leaf_modules, flagged on its class, with a param registered twice, with an external
    param (register_external_parameter). Mutations: the leaf reader without its class fallback,
    or the params reader without the external params or the dedup, fail it."""
    from deepspeed.utils import set_z3_leaf_modules
    from deepspeed.runtime.zero.partition_parameters import _init_external_params, register_external_parameter

    from zero3_recompute.targets import leaf_reader, params_reader

    iter_params, get_all_parameters, z3_leaf_module = _deepspeed_readers()
    is_leaf, module_params = leaf_reader(z3_leaf_module), params_reader(iter_params, get_all_parameters)
    assert is_leaf is not z3_leaf_module and module_params is not iter_params, "deepspeed's code changed"

    class FlaggedOnItsClass(torch.nn.Sequential):
        _z3_leaf = True

    flagged, on_class = torch.nn.Sequential(torch.nn.Linear(2, 2)), FlaggedOnItsClass(torch.nn.Linear(2, 2))
    set_z3_leaf_modules(flagged, [torch.nn.Sequential])
    twice = torch.nn.Linear(2, 2)
    twice.again = twice.weight
    with_external = torch.nn.Sequential(torch.nn.Linear(2, 2))
    register_external_parameter(with_external, twice.bias)
    for module in (torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.Linear(2, 2)), flagged, on_class, twice,
                   with_external, torch.nn.ReLU()):
        _init_external_params(module)  # as zero.Init does for every module
        for recurse in (False, True):
            ours = [id(param) for param in module_params(module, recurse=recurse)]
            theirs = [id(param) for param in iter_params(module, recurse=recurse)]
            assert ours == theirs, f"{module}, recurse={recurse}"
        assert bool(is_leaf(module)) == bool(z3_leaf_module(module)), module
    assert is_leaf(flagged) and is_leaf(on_class) and not is_leaf(with_external)


def test_the_live_budget_refuses_exactly_what_passes_the_limit():
    """LiveBudget.refused, which answers at once while the count is within the limit, refuses what a
    walk of the candidates in order refuses, at every count and limit around the candidates' numel
    (NOTE [ Holds within the live-parameter limit ], rules 2 and 5)."""
    count_name, limit_name = "count", "limit"
    budget = LiveBudget((count_name, limit_name))
    candidates = [SimpleNamespace(ds_numel=numel, ds_persist=persist)
                  for numel, persist in ((64, False), (8, True), (100, False), (36, False))]

    def walked(count, limit):
        counted = [param for param in candidates if not param.ds_persist]
        live, refused = count - sum(param.ds_numel for param in counted), set()
        for param in counted:
            if live + param.ds_numel <= limit:
                live += param.ds_numel
            else:
                refused.add(id(param))
        return refused

    seen_refusals = 0
    for count, limit in itertools.product(range(0, 400, 4), range(0, 400, 4)):
        coordinator = SimpleNamespace(**{count_name: count, limit_name: limit})
        expected = walked(count, limit)
        assert budget.refused(coordinator, candidates) == expected, (count, limit)
        seen_refusals += bool(expected)
    assert seen_refusals, "the grid reaches past the limit"
    assert budget.refused(SimpleNamespace(), candidates) == set(), "no counters: nothing refused"
