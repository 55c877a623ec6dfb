"""Releasing library objects (moe_engine._handles): a release while the current stream captures a
CUDA graph is deferred to the next release outside one (destroying frees device memory, which a
capture forbids); and a dropped module is released at once, not left to the garbage collector.
Runs without a GPU (the operator's handle calls stubbed); the GPU side is in test_grouped_mlp.py."""
import gc
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
        self.destroyed = []

    def experts_create(self, *args):
        return 41

    def experts_state_bytes(self, handle):
        return 0

    def experts_destroy(self, handle):
        self.destroyed.append(handle)


@pytest.mark.parametrize("kwargs", [dict(), dict(per_expert_weights=True, bias=True), dict(delay_wgrad=True)])
def test_a_dropped_module_is_freed_without_the_garbage_collector(monkeypatch, kwargs):
    # The hooks a module registers on itself (load_state_dict's key conversion) and on its parameters
    # (write-mode gradient hooks) hold it weakly: with bound methods there the module sat in a
    # reference cycle until the collector ran -- at any allocation, inside a graph capture too.
    import moe_engine.module
    ops = _StubOps()
    monkeypatch.setattr(moe_engine.module, "_ops", ops)
    gc.disable()
    try:
        mod = moe_engine.module.GroupedExperts(128, 64, 4, 64, device="cpu", **kwargs)
        mod.load_state_dict(mod.state_dict())  # the key conversion hook still runs
        ref = weakref.ref(mod)
        del mod
        assert ref() is None and ops.destroyed == [41]
    finally:
        gc.enable()
