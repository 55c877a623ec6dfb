"""Releasing library objects (moe_engine._handles): a release while the current stream captures a
CUDA graph is deferred to the next release outside one (destroying frees device memory, which a
capture forbids). Plain Python: runs without a GPU; the GPU side is in test_grouped_mlp.py."""
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
