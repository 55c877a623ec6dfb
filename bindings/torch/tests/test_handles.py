"""Releasing library objects (moe_engine._handles): a release while the current stream captures a
CUDA graph is deferred to the next release outside one (destroying frees device memory, which a
capture forbids); and a dropped module is released at once, not left to the garbage collector.
Runs without a GPU (the operator's handle calls stubbed); the GPU side is in test_grouped_mlp.py."""
import copy
import gc
import pickle
import weakref

import pytest

from moe_engine import _handles


def test_a_release_during_a_capture_waits_for_the_next_one_outside(monkeypatch):
    capturing = [True]
    monkeypatch.setattr(_handles, "_capturing", lambda: capturing[0])
    destroyed = []
    _handles.release(destroyed.append, 1)
    _handles.release(destroyed.append, 2)
    assert destroyed == [] and len(_handles._deferred) == 2
    capturing[0] = False
    _handles.release(destroyed.append, 3)
    assert sorted(destroyed) == [1, 2, 3] and _handles._deferred == []


def test_a_release_outside_a_capture_destroys_at_once():
    destroyed = []
    assert not _handles._capturing()
    _handles.release(destroyed.append, 7)
    assert destroyed == [7]


class _StubOps:
    """The experts operator's handle calls, recorded (the module's other calls need a GPU)."""

    def __init__(self):
        self.made, self.destroyed = [], []

    def experts_create(self, *args):
        self.made.append(41 + len(self.made))
        return self.made[-1]

    def experts_state_bytes(self, handle):
        return 0

    def experts_destroy(self, handle):
        self.destroyed.append(handle)


@pytest.fixture
def ops(monkeypatch):
    import moe_engine.module
    stub = _StubOps()
    monkeypatch.setattr(_handles, "_ops", stub)
    monkeypatch.setattr(moe_engine.module, "_ops", stub)
    return stub


@pytest.mark.parametrize("kwargs", [dict(), dict(per_expert_weights=True, bias=True), dict(delay_wgrad=True)])
def test_a_dropped_module_is_freed_without_the_garbage_collector(ops, kwargs):
    # The hooks a module registers on itself (load_state_dict's key conversion) and on its parameters
    # (write-mode gradient hooks) hold it weakly: with bound methods there the module sat in a
    # reference cycle until the collector ran -- at any allocation, inside a graph capture too.
    from moe_engine import GroupedExperts
    gc.disable()
    try:
        mod = GroupedExperts(128, 64, 4, 64, device="cpu", **kwargs)
        mod.load_state_dict(mod.state_dict())  # the key conversion hook still runs
        ref = weakref.ref(mod)
        del mod
        assert ref() is None and ops.destroyed == [41]
    finally:
        gc.enable()


def test_an_object_goes_back_to_the_operators_that_made_it(ops, monkeypatch):
    # An object of an earlier test, collected while a later one had stubbed the operators, went to the
    # stub (which had no destroy operator for it): the destroy operator is taken with the creator.
    import moe_engine.module
    from moe_engine import GroupedExperts
    mod = GroupedExperts(128, 64, 4, 64, device="cpu")
    later = _StubOps()
    monkeypatch.setattr(_handles, "_ops", later)
    monkeypatch.setattr(moe_engine.module, "_ops", later)
    del mod
    assert ops.destroyed == [41] and later.destroyed == []


_fired = []


def _record_hook(name, param):  # a module-level function: pickled by reference with the module
    _fired.append(name)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_owns_a_library_object_and_hooks_of_its_own(ops, monkeypatch, how):
    # A shared handle would be destroyed with either module (the other then fails) and have both bind
    # their weights to one op in turn.
    import torch
    from moe_engine import GroupedExperts
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # an unpickled module makes its object
    mod = GroupedExperts(128, 64, 4, 64, device="cpu", bias=True)
    _fired.clear()
    mod.register_wgrad_hook(_record_hook)
    twin = copy.deepcopy(mod) if how == "deepcopy" else pickle.loads(pickle.dumps(mod))
    assert (mod._handle, twin._handle) == (41, 42)
    assert all(torch.equal(a, b) for a, b in zip(mod.state_dict().values(), twin.state_dict().values()))
    # load_state_dict's key conversion acts on the copy: per-expert keys load into its grouped weights.
    per_expert = {f"{p}.{s}{e}": t[e] for (name, t) in mod.state_dict().items()
                  for p, s in [name.split(".")] for e in range(4)}
    twin.load_state_dict({k: torch.ones_like(v) for k, v in per_expert.items()})
    assert torch.equal(twin.fc1.weight, torch.ones_like(twin.fc1.weight))
    assert not torch.equal(mod.fc1.weight, twin.fc1.weight)
    # The copy's parameters carry its write-mode hooks (PyTorch copies no parameter hooks).
    (twin.fc2.bias * 2).sum().backward()
    assert _fired == ["fc2.bias"]
    del twin
    assert ops.destroyed == [42]


def test_a_shallow_copy_has_its_own_object_and_no_second_hooks(ops, monkeypatch):
    import torch
    from moe_engine import GroupedExperts
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    mod = GroupedExperts(128, 64, 4, 64, device="cpu")
    _fired.clear()
    mod.register_wgrad_hook(_record_hook)
    twin = copy.copy(mod)
    assert (mod._handle, twin._handle) == (41, 42) and twin.fc1.weight is mod.fc1.weight
    (mod.fc2.weight * 2).sum().backward()
    assert _fired == ["fc2.weight"]  # the shared parameters' hooks, registered once
    del twin
    assert ops.destroyed == [42]


def test_a_pickle_without_constructor_arguments_is_refused_and_releases_nothing(ops, monkeypatch):
    # An older version pickled the handle integer alone: in this process it may name a live object.
    import torch
    from moe_engine import GroupedExperts
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    mod = GroupedExperts(128, 64, 4, 64, device="cpu")
    state = mod.__getstate__()
    del state["_handle_recipe"]
    state["_handle"] = mod._handle
    old = GroupedExperts.__new__(GroupedExperts)
    with pytest.raises(RuntimeError, match="constructor arguments"):
        old.__setstate__(state)
    del old
    assert ops.destroyed == []


def test_data_parallel_replicas_are_refused_by_name(ops):
    # nn.DataParallel over several GPUs replicates the module by copying its attributes, the handle too.
    from moe_engine import GroupedExperts
    mod = GroupedExperts(128, 64, 4, 64, device="cpu")
    with pytest.raises(RuntimeError, match="DistributedDataParallel"):
        mod._replicate_for_data_parallel()
    assert ops.destroyed == []


def test_a_construction_outside_a_capture_destroys_the_deferred_objects(ops, monkeypatch):
    from moe_engine import GroupedExperts
    capturing = [True]
    monkeypatch.setattr(_handles, "_capturing", lambda: capturing[0])
    _handles.release(ops.experts_destroy, 7)
    capturing[0] = False
    mod = GroupedExperts(128, 64, 4, 64, device="cpu")  # kept: its own release would destroy them too
    assert ops.destroyed == [7] and _handles._deferred == [] and mod._handle == 41
