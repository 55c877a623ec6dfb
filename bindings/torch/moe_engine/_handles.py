"""Releasing the library objects behind the modules' handles.

Destroying one frees device memory with cudaFree, which a CUDA graph capture in progress forbids:
the call would invalidate the capture. Python's garbage collector may run at any allocation,
including one inside `torch.cuda.graph`, and collect an unrelated module there; so a handle
released while the current stream is capturing is kept and destroyed at the next release outside a
capture instead."""
import torch

_deferred = []  # (destroy, handle) released during a capture, destroyed at the next release outside one


def _capturing():
    # No capture can be under way before CUDA is initialised (and the query needs a device).
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def release(destroy, handle):
    """destroy(handle) now, or after the capture in progress on the current stream has ended."""
    if _capturing():
        _deferred.append((destroy, handle))
        return
    while _deferred:
        deferred_destroy, deferred_handle = _deferred.pop()
        deferred_destroy(deferred_handle)
    destroy(handle)
