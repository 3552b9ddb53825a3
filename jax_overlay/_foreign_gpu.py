"""The GPU frameworks of ``jax_overlay.foreign``: views of XLA's device
buffers as PyTorch tensors, CuPy arrays and Numba device arrays, made with
no copy, and XLA's own CUDA stream as the framework's stream for the call.
PyTorch also runs on the CPU backend, on views of XLA's host buffers (no
stream).

Ordering: the callback runs on the host when XLA reaches it in its stream,
possibly before the GPU has finished the work before it.  PyTorch and CuPy
have XLA's stream made current, so every kernel ``fn`` launches (and the
copies into XLA's outputs) queue behind that work and ahead of the work
after it: nothing waits on the host.  Numba has no current stream: its
kernels take ``jax_overlay.foreign_stream()``, and kernels launched on its
default stream are fenced with events before and after ``fn`` (XLA's
stream is non-blocking, so the legacy stream would not order with it).

Lifetime: each view holds a token through the framework's own owner field
(the DLPack capsule's owner for PyTorch, ``UnownedMemory``'s for CuPy,
``owner=`` for Numba), so any view derived from it holds it too; a token
alive after the call means ``fn`` kept XLA's memory.
"""

from __future__ import annotations

import math
import threading
import weakref

import numpy as np

from . import _streams
from . import _xla_ext as ext
from ._foreign import ForeignError, _mismatch

_KDL_CPU, _KDL_CUDA, _KDL_CUDAHOST = 1, 2, 3
_LEGACY, _PER_THREAD = 1, 2  # the CUDA driver's stream handles


class _Token:
    """Owned by every view of one buffer; weakly referenced by the call."""
    __slots__ = ("__weakref__",)


def _token(tokens):
    """A new token, weakly recorded in the call's `tokens`."""
    token = _Token()
    tokens.append(weakref.ref(token))
    return token


def _facts(b):
    """(pointer, shape, dtype, size) of an XLA buffer."""
    shape = tuple(b.shape)
    dtype = np.dtype(b.dtype)
    size = math.prod(shape)
    # The pointer through the buffer's own DLPack capsule (any dtype; its
    # CAI has no typestr for bfloat16): read, not consumed, then dropped.
    ptr = ext.capsule_info(b.__dlpack__())["data"] if size else 0
    return ptr, shape, dtype, size


class _Gpu:
    name = ""
    array_type = ""
    array: type | None = None  # the exact type of the framework's arrays: a pytree leaf

    def __init__(self):
        self._local = threading.local()

    def stream(self, handle, ordinal):
        """This thread's framework stream over XLA's stream `handle`: XLA
        keeps its streams, so one wrapper each, made on first use.  Per
        thread, because a stream object may keep the state of its own
        ``with`` (PyTorch's does)."""
        streams = self._local.__dict__.setdefault("streams", {})
        key = (handle, ordinal)
        stream = streams.get(key)
        if stream is None:
            stream = streams[key] = self.wrap(handle, ordinal)
        return stream

    def wrap(self, handle, ordinal):
        raise NotImplementedError

    def facts(self, got):
        """(shape, NumPy dtype) of an array of the framework, else (None, None)."""
        raise NotImplementedError

    def np_dtype(self, view):
        """The NumPy dtype of one of the framework's views."""
        raise NotImplementedError

    def view(self, b, writeable, tokens):
        ptr, shape, dtype, size = _facts(b)
        if not size:  # no memory to view, nothing to hold
            return self.empty(shape, dtype)
        return self.over(ptr, shape, dtype, size, b.__dlpack_device__()[1], writeable,
                         _token(tokens))

    def empty(self, shape, dtype):
        """A zero-size array of the framework."""
        raise NotImplementedError

    def over(self, ptr, shape, dtype, size, ordinal, writeable, token):
        """The framework's array over XLA's memory at `ptr`, holding `token`
        through the framework's own owner field, so every view derived
        from it holds it too."""
        raise NotImplementedError

    def ordinal(self, buffers):
        ordinal = None
        for i, b in enumerate(buffers):
            kind, dev = b.__dlpack_device__()
            if kind != _KDL_CUDA:
                where = ("pinned host memory (kDLCUDAHost); move it to device memory first "
                         "(jax.device_put(x, x.sharding.with_memory_kind('device')))"
                         if kind == _KDL_CUDAHOST else
                         f"DLPack device {kind} (the CPU backend is 1); framework='numpy' "
                         "and 'torch' run there, or put the inputs on the GPU")
                raise ForeignError(f"framework={self.name!r} runs on CUDA device buffers; "
                                   f"buffer {i} of this call is in {where}")
            if ordinal is None:
                ordinal = int(dev)
            elif ordinal != dev:
                raise ForeignError(f"buffers of one foreign call on GPUs {ordinal} and {dev}")
        return 0 if ordinal is None else ordinal

    def output(self, i, got, view):
        shape, dtype = self.facts(got)
        if shape is None:
            if np.ndim(got) == 0 and view.ndim == 0 and not hasattr(got, "shape"):
                return got  # a Python scalar for a 0-d output: filled in
            raise ForeignError(
                f"output {i} of the foreign function is a {type(got).__qualname__}; "
                f"framework={self.name!r} returns {self.array_type} (or a Python scalar "
                "for a 0-d output)")
        if shape != tuple(view.shape) or dtype != self.np_dtype(view):
            raise _mismatch(i, dtype, shape, self.np_dtype(view), tuple(view.shape))
        return got


def _torch_np_dtype(t, known={}):  # noqa: B006 - a cache
    dtype = known.get(t)
    if dtype is None:
        name = str(t).removeprefix("torch.")
        try:
            dtype = np.dtype(name)
        except TypeError:  # bfloat16, float8_*: ml_dtypes' types, which JAX uses
            import ml_dtypes
            dtype = np.dtype(getattr(ml_dtypes, name))
        known[t] = dtype
    return dtype


class _Torch(_Gpu):
    name, array_type = "torch", "torch.Tensor"

    def __init__(self):
        super().__init__()
        import torch
        import torch.utils.dlpack
        self.torch = torch
        self.array = torch.Tensor
        # PyTorch's own importer of a capsule, without the wrapper's checks
        # for producer objects (views are always capsules).
        self.from_dlpack = getattr(torch._C, "_from_dlpack", torch.utils.dlpack.from_dlpack)
        # torch.Stream's own `with` (C++: sets device and stream, restores
        # both) costs a few µs; torch.cuda.stream() tens (it looks the
        # device up through Python on every call).
        self.native_with = hasattr(torch.Stream, "__enter__")

    def wrap(self, handle, ordinal):
        return _streams.torch_stream(self.torch, handle, ordinal)

    def ordinal(self, buffers):
        """The GPU of the call's buffers, or None where all are host
        buffers: the CPU backend, where PyTorch runs on CPU tensors."""
        # One look at the first buffer on the GPU's path (its hot one).
        if (buffers and buffers[0].__dlpack_device__()[0] == _KDL_CPU
                and all(b.__dlpack_device__()[0] == _KDL_CPU for b in buffers)):
            return None
        return super().ordinal(buffers)

    def enter(self, ctx, ordinal):
        if ordinal is None:  # host tensors: no stream to make current
            return None, None
        stream = self.stream(ctx.stream, ordinal)
        state = stream if self.native_with else self.torch.cuda.stream(stream)
        state.__enter__()
        return stream, state

    def exit(self, state):
        if state is not None:
            state.__exit__(None, None, None)

    def dtype(self, dtype):
        t = getattr(self.torch, dtype.name, None)
        if not isinstance(t, self.torch.dtype):
            raise ForeignError(f"PyTorch has no dtype {dtype}")
        return t

    def np_dtype(self, view):
        return self.facts(view)[1]

    def view(self, b, writeable, tokens):
        torch = self.torch
        if not math.prod(b.shape):  # no memory to view
            kind, ordinal = b.__dlpack_device__()
            return torch.empty(b.shape, dtype=self.dtype(np.dtype(b.dtype)),
                               device="cpu" if kind == _KDL_CPU else f"cuda:{ordinal}")
        # XLA's own capsule describes the buffer; the one PyTorch takes
        # holds the token until PyTorch frees the storage, which every view
        # of this tensor shares.  XLA's capsule is dropped unconsumed.
        return self.from_dlpack(ext.view_capsule(b.__dlpack__(), _token(tokens)))

    def facts(self, got):
        if not isinstance(got, self.torch.Tensor):
            return None, None
        return tuple(got.shape), _torch_np_dtype(got.dtype)

    def output(self, i, got, view):
        if (isinstance(got, self.torch.Tensor) and got.dtype == view.dtype
                and got.shape == view.shape):
            return got  # the common case, without the NumPy dtype lookups
        return super().output(i, got, view)

    def copy_into(self, view, got, stream):
        if isinstance(got, self.torch.Tensor):
            view.copy_(got)  # on the current stream: XLA's
        else:
            view.fill_(got)


class _CuPy(_Gpu):
    name, array_type = "cupy", "cupy.ndarray"

    def __init__(self):
        super().__init__()
        import cupy
        self.cupy = cupy
        self.array = cupy.ndarray

    def wrap(self, handle, ordinal):
        return _streams.cupy_stream(self.cupy, handle, ordinal)

    def enter(self, ctx, ordinal):
        stream = self.stream(ctx.stream, ordinal)
        device = self.cupy.cuda.Device(ordinal)
        device.__enter__()
        try:
            stream.__enter__()
        except BaseException:
            device.__exit__(None, None, None)
            raise
        return stream, (device, stream)

    def exit(self, state):
        device, stream = state
        try:
            stream.__exit__(None, None, None)
        finally:
            device.__exit__(None, None, None)

    def np_dtype(self, view):
        return view.dtype

    def empty(self, shape, dtype):
        return self.cupy.empty(shape, dtype)

    def over(self, ptr, shape, dtype, size, ordinal, writeable, token):
        cupy = self.cupy
        mem = cupy.cuda.UnownedMemory(ptr, size * dtype.itemsize, token, ordinal)
        return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(mem, 0))

    def facts(self, got):
        if not isinstance(got, self.cupy.ndarray):
            return None, None
        return tuple(got.shape), got.dtype

    def copy_into(self, view, got, stream):
        if view.size:
            view[...] = got  # on the current stream: XLA's


class _Numba(_Gpu):
    name, array_type = "numba", "a Numba device array"

    def __init__(self):
        super().__init__()
        from numba import cuda
        self.cuda = cuda
        self.array = cuda.devicearray.DeviceNDArray
        # Kernels launched without a stream go to Numba's default stream.
        from numba.core import config
        self.default = _PER_THREAD if getattr(config, "CUDA_PER_THREAD_DEFAULT_STREAM", 0) else _LEGACY

    def wrap(self, handle, ordinal):
        return self.cuda.external_stream(handle)  # in the device's context: enter()'s

    def enter(self, ctx, ordinal):
        xla = ctx.stream
        gpu = self.cuda.gpus[ordinal]
        gpu.__enter__()
        try:
            stream = self.stream(xla, ordinal)
            # Work fn puts on the default stream runs after XLA's work
            # before the call, and XLA's work after the call runs after it
            # (exit()).
            ext.order_after(ordinal, xla, self.default)
        except BaseException:
            gpu.__exit__(None, None, None)
            raise
        return stream, (gpu, ordinal, xla)

    def exit(self, state):
        gpu, ordinal, xla = state
        try:
            # Also when fn raised: a kernel it launched may still write
            # into XLA's buffers, which XLA must not reuse before it ends.
            ext.order_after(ordinal, self.default, xla)
        finally:
            gpu.__exit__(None, None, None)

    def np_dtype(self, view):
        return view.dtype

    def empty(self, shape, dtype):
        return self.cuda.device_array(shape, dtype)

    def over(self, ptr, shape, dtype, size, ordinal, writeable, token):
        desc = {"shape": shape, "typestr": dtype.str, "data": (ptr, not writeable),
                "strides": None, "version": 2}
        return self.cuda.from_cuda_array_interface(desc, owner=token, sync=False)

    def facts(self, got):
        if not self.cuda.is_cuda_array(got) or isinstance(got, np.ndarray):
            return None, None
        return tuple(got.shape), np.dtype(got.dtype)

    def copy_into(self, view, got, stream):
        if not view.size:
            return
        if not hasattr(got, "shape"):  # a Python scalar for a 0-d output
            got = np.asarray(got, view.dtype)
        elif not isinstance(got, self.cuda.devicearray.DeviceNDArray):
            got = self.cuda.as_cuda_array(got, sync=False)
        view.copy_to_device(got, stream=stream)


_MADE: dict = {}
_KINDS = {"torch": (_Torch, "PyTorch"), "cupy": (_CuPy, "CuPy"), "numba": (_Numba, "Numba (numba-cuda)")}


def adapter(framework):
    made = _MADE.get(framework)
    if made is None:
        cls, what = _KINDS[framework]
        try:
            made = _MADE[framework] = cls()
        except ImportError as e:
            raise ImportError(f"framework={framework!r} needs {what}, which does not import "
                              f"here: {e}") from e
    return made


def autograd_vjp(fn):
    """The backward of ``fn`` by PyTorch's autograd, as a foreign function
    of framework "torch": (inputs..., cotangent) -> one cotangent per input."""

    def backward(*args):
        import torch
        from jax import tree_util
        *inputs, cotangent = args
        flat, tree = tree_util.tree_flatten(tuple(inputs))
        diff = [t.is_floating_point() or t.is_complex() for t in flat]
        leaves = [t.detach().requires_grad_(True) if d else t for t, d in zip(flat, diff)]
        with torch.enable_grad():
            outs = tree_util.tree_leaves(fn(*tree_util.tree_unflatten(tree, leaves)))
            cts = tree_util.tree_leaves(cotangent)
            pairs = [(o, c) for o, c in zip(outs, cts) if o.requires_grad]
            wrt = [t for t, d in zip(leaves, diff) if d]
            grads = [None] * len(wrt)
            if pairs and wrt:
                grads = list(torch.autograd.grad([o for o, _ in pairs], wrt,
                                                 [c for _, c in pairs], allow_unused=True))
        # No gradient (an input fn does not use, or an integer one): zeros.
        result = [(grads.pop(0) if d else None) for d in diff]
        result = [torch.zeros_like(t) if g is None else g for t, g in zip(flat, result)]
        return tuple(tree_util.tree_unflatten(tree, result))
    return backward
