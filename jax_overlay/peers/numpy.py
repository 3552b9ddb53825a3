"""Room: NumPy (peer ``"numpy"``): ``numpy.ndarray`` and its subclasses.
Its quirk: a NumPy array that is also CUDA memory (Numba's mapped and
managed arrays, which subclass ``ndarray``) has NumPy's ``__dlpack__``,
host memory, so ``from_dlpack`` gives a host array, as stock's does; the
entry points that read a CAI first (``jnp.asarray``, ``jnp.array``) take
its CAI.  The foreign() adapter views XLA's host buffers on the CPU
backend."""

from __future__ import annotations

import weakref

import numpy as np

from .._vocab import KDLCPU
from ..errors import ForeignError
from ._registry import register
from ._base import Adapter, ForeignEndpoint, Peer, mismatch, where


class NumPy(Peer, ForeignEndpoint):
    name, title, distribution, runs_on = "numpy", "NumPy", "numpy", "cpu"

    def owns(self, t: type) -> bool:
        return issubclass(t, np.ndarray)

    def cai_reader(self, t):
        # A subclass that brings its own __dlpack_device__ describes itself.
        return None if t.__dlpack_device__ is np.ndarray.__dlpack_device__ else super().cai_reader(t)

    def adapter(self):
        return Foreign(self)


class Foreign(Adapter):
    """foreign(framework="numpy"): views of XLA's host buffers as NumPy
    arrays, read-only for inputs."""
    name = "numpy"
    array = np.ndarray  # the exact type of the library's arrays: a pytree leaf

    def __init__(self, peer):
        self.peer = peer

    def ordinal(self, buffers):
        for b in buffers:
            if b.__dlpack_device__()[0] != KDLCPU:
                raise ForeignError(
                    "framework='numpy' runs on host buffers, and this computation runs on a "
                    f"GPU ({b.__dlpack_device__()}); use framework={where('gpu')} "
                    "there, or put the inputs on the CPU (jax.device_put(x, jax.devices('cpu')[0]))")
        return None

    def enter(self, ctx, ordinal, traced=False):
        """(the stream fn runs on, what exit() needs): nothing for the host."""
        return None, None

    def exit(self, state):
        pass

    def view(self, b, writeable, tokens):
        v = np.asarray(b)
        if not writeable:
            v.flags.writeable = False  # fn must not write into JAX's inputs
        # A view of it (v[1:]) holds v: alive after the call means kept.
        tokens.append(weakref.ref(v))
        return v

    def output(self, i, got, view):
        if type(got) is np.ndarray and got.shape == view.shape and got.dtype == view.dtype:
            return got  # the common case, without the conversions below
        arr = np.asarray(got)
        if not isinstance(got, np.ndarray) and np.ndim(got) == 0 and arr.dtype != view.dtype:
            # A Python scalar for a 0-d output: its value, in the declared dtype.
            arr = np.asarray(got, view.dtype)
        if arr.shape != view.shape or arr.dtype != view.dtype:
            raise mismatch(i, arr.dtype, arr.shape, view.dtype, view.shape)
        return arr

    def copy_into(self, view, arr, stream):
        np.copyto(view, arr)


PEER = register(NumPy())
