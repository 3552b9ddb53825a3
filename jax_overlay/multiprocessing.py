"""Room: ``multiprocessing`` with GPU ``jax.Array``s sent as shares.

    import jax_overlay.multiprocessing as mp   # instead of multiprocessing
    q = mp.get_context("spawn").Queue()
    q.put(params)        # a single-device GPU jax.Array: a share, not a copy
    x = q.get()          # in the other process: the same array, zero-copy

Importing this module registers a reducer with multiprocessing's pickler,
as ``torch.multiprocessing`` does for tensors; everything else is the
standard library's ``multiprocessing``.  A GPU array is sent as a one-shot
:class:`jax_overlay.Share`: the sender holds the array until the first
process that receives it lets go of it.  A message never received keeps
its array held until the sender exits.  Arrays on the host, and arrays
that cannot be shared, are pickled as before (a copy).
"""

from __future__ import annotations

from multiprocessing import *  # noqa: F401,F403 - this module stands in for it
from multiprocessing.reduction import ForkingPickler

from . import _ipc
from . import _runtime as rt


def _rebuild(share):
    return _ipc.open_shared(share)


def _reduce(x):
    try:
        if _ipc._leaf_error((), x) is None and x.size:
            return _rebuild, (_ipc._share(x, copy=False, once=True),)
    except BufferError:
        pass  # memory that cannot be shared travels as pickle's copy
    return x.__reduce__()


ForkingPickler.register(rt.ArrayImpl, _reduce)
