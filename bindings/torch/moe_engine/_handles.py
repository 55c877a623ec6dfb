"""The library objects behind the Python objects' integer handles: made, copied, released.

Destroying one frees device memory with cudaFree, which a CUDA graph capture in progress forbids:
the call would invalidate the capture. Python's garbage collector may run at any allocation,
including one inside `torch.cuda.graph`, and collect an unrelated module there; so a handle
released while the current stream is capturing is kept and destroyed at the next release outside a
capture instead."""
import contextlib

import torch

from ._arg_names import create

_ops = torch.ops.moe_engine
_deferred = []  # (destroy, handle) released during a capture, destroyed at the next release or
# construction outside one


def _capturing():
    # No capture can be under way before CUDA is initialised (and the query needs a device).
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def release(destroy, handle):
    """destroy(handle) now, or after the capture in progress on the current stream has ended."""
    if _capturing():
        _deferred.append((destroy, handle))
        return
    _destroy_deferred()
    destroy(handle)


def _destroy_deferred():
    while _deferred:
        deferred_destroy, deferred_handle = _deferred.pop()
        deferred_destroy(deferred_handle)


class HandleOwner:
    """Base of the objects that own a library object through a handle: the attribute named by
    `_HANDLE`, made by `_make_handle`, destroyed through release() by the operator named by
    `_DESTROY` when the owner goes. A copy (copy.deepcopy) or an unpickled owner makes a library
    object of its own from the same arguments: sharing the original's would have both bind their
    weights to one op in turn, and destroy it with either owner (the other then fails with "unknown
    or destroyed handle"). A shallow copy (copy.copy) shares everything else with the original."""
    _HANDLE = "handle"
    _DESTROY = ""

    def _make_handle(self, creator, *args):
        """The library object torch.ops.moe_engine.<creator>(*args) makes (errors in the caller's names)."""
        self._handle_recipe = (creator, args)
        if not _capturing():
            _destroy_deferred()  # objects released during an earlier capture
        self._own(creator, args)

    def _own(self, creator, args):
        # The destroy operator is taken with the creator, so that the object goes back to the operators
        # that made it even where the module's operators were replaced since (a test's stub: an object
        # of an earlier test collected during that test went to the stub).
        self.__dict__["_handle_destroy"] = getattr(_ops, self._DESTROY)
        setattr(self, self._HANDLE, create(getattr(_ops, creator), *args))

    def __del__(self):
        handle = self.__dict__.get(self._HANDLE)
        if handle is not None:
            release(self.__dict__["_handle_destroy"], handle)

    def __getstate__(self):
        parent = getattr(super(), "__getstate__", None)
        state = dict(parent() if parent is not None else self.__dict__)
        state[self._HANDLE] = None
        state.pop("_handle_destroy", None)
        return state

    def __setstate__(self, state):
        parent = getattr(super(), "__setstate__", None)
        if parent is not None:
            parent(state)
        else:
            self.__dict__.update(state)
        # An integer from another process (a pickle of an older version) names no object of this one:
        # never released.
        setattr(self, self._HANDLE, None)
        recipe = self.__dict__.get("_handle_recipe")
        if recipe is None:
            raise RuntimeError(f"moe_engine: this {type(self).__name__} was saved without its constructor "
                               "arguments (by an older version); construct it anew and load its state_dict")
        creator, args = recipe
        # On the device of the owner's parameters (the current one where it has none on a GPU), as the
        # constructor makes it there; none without a GPU (an owner unpickled there can be inspected,
        # not run).
        if torch.cuda.is_available():
            device = self._handle_device()
            with torch.cuda.device(device) if device is not None else contextlib.nullcontext():
                self._own(creator, args)

    def __copy__(self):
        cls = type(self)
        twin = cls.__new__(cls)
        HandleOwner.__setstate__(twin, self.__getstate__())  # the shared parameters keep their hooks
        return twin

    def _replicate_for_data_parallel(self):
        # torch.nn.DataParallel's replicas (one per GPU, made by each forward) share the module's
        # attributes, this handle among them: an op object made for one device, destroyed with the
        # first replica dropped.
        raise RuntimeError(f"moe_engine: {type(self).__name__} does not run under torch.nn.DataParallel over "
                           "several GPUs (its replicas would share one library object); use "
                           "DistributedDataParallel, one process per GPU")

    def _handle_device(self):
        """The CUDA device a copy's library object is made on (None: the current one)."""
        return None
