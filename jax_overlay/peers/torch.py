"""Room: PyTorch (peer ``"torch"``).  Its tensors are recognised by one
rule (``torch.Tensor`` in the type's MRO, found by name: PyTorch is never
imported to ask).  Its quirks: lazy conjugate and negative views that
neither protocol carries; a CUDA Array Interface of version 2 with no
stream, which the import completes (the CAI route skips PyTorch's costly
``__dlpack__``); ``torch.cuda.ExternalStream``; the foreign() adapter for
CUDA and CPU tensors, and ``vjp="autograd"``."""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from .. import _xla_ext as ext
from .._dlpack import KDLCPU
from ..errors import ForeignError, JaxRuntimeError, LayoutCopyRequiredError, like_stock
from . import register
from ._base import GpuAdapter, Peer, token


class Torch(Peer):
    name, title, distribution, runs_on = "torch", "PyTorch", "torch", None

    def owns(self, t: type) -> bool:
        return any(c.__name__ == "Tensor" and c.__module__ == "torch" for c in t.__mro__)

    def resolve(self, obj, copy):
        """(obj, copied): a tensor whose conj() or neg view is still lazy, a
        bit on the tensor over memory left as it was, resolved first by
        PyTorch (a copy on its current stream, which the import then holds
        and orders after).  Neither protocol carries the bit: the CAI omits
        it, and __dlpack__ refuses the conjugate bit but exports a negative
        view's memory as it is, so ``x.conj().imag`` read the values with
        the wrong sign (PyTorch 2.14: its own from_dlpack too).  copy=False
        cannot have the copy: LayoutCopyRequiredError, an instance of every
        class stock raises for such tensors (PyTorch's BufferError for the
        conjugate, jaxlib's runtime error for a strided view)."""
        if not (obj.is_conj() or obj.is_neg()) or obj.numel() == 0:
            return obj, False  # a zero-size view has no values for the bit to change
        bit, test = ("conjugate", "is_conj") if obj.is_conj() else ("negative", "is_neg")
        if copy is False:
            raise LayoutCopyRequiredError(
                f"Specified input which requires a copy since the PyTorch tensor has "
                f"its lazy {bit} bit set ({test}() is True): its memory holds the "
                "values before that view, and neither __dlpack__ nor "
                "__cuda_array_interface__ carries the bit, so only a resolved copy "
                "reads right. However copy=False. Call tensor.resolve_conj()."
                "resolve_neg() first, or set copy=True or copy=None.")
        try:
            return obj.resolve_conj().resolve_neg(), True
        except RuntimeError as e:  # no negation in PyTorch for bool, uint16-64, float8
            raise like_stock(BufferError(
                f"the PyTorch tensor ({obj.dtype}) has its lazy {bit} bit set, and PyTorch "
                f"cannot resolve it ({type(e).__name__}: {e}); its memory alone does not "
                "hold its values, so it is not imported: convert it to a dtype PyTorch "
                "negates first"), JaxRuntimeError) from e

    def cai_reader(self, t):
        return self._cai

    def _cai(self, t, copy):
        """A CUDA tensor's CAI, ordered as its __dlpack__ orders: after the
        current stream of the tensor's device.  PyTorch exports CAI version
        2 with no stream, so the stream is added here.  None (DLPack) for
        what the CAI would refuse or get wrong: tensors requiring grad, and
        any dtype whose type string is not exactly its own (bfloat16 is
        exported as '<f2').  A lazy view is resolved first, on either
        route."""
        if not t.is_cuda or t.requires_grad:
            return None
        stream_of, exact = _facts()
        want = exact.get(t.dtype)
        if want is None:
            return None
        t, copied = self.resolve(t, copy)
        try:
            cai = t.__cuda_array_interface__
        except Exception:
            return None
        if cai.get("typestr") != want.str:
            return None
        stream = stream_of(t.get_device())
        cai["version"] = 3
        cai["stream"] = stream if stream else 1  # PyTorch's 0 is the legacy stream
        return t, cai, copied

    def stream(self, handle, ordinal):
        """A ``torch.cuda.ExternalStream`` over `handle` on GPU `ordinal`."""
        import torch
        return torch.cuda.ExternalStream(handle, device=torch.device("cuda", ordinal))

    def adapter(self):
        return Foreign(self)

    def current_stream(self, ordinal):
        import torch
        return torch.cuda.current_stream(ordinal).cuda_stream

    def wrap_capsule(self, capsule, ordinal):
        import torch.utils.dlpack
        return torch.utils.dlpack.from_dlpack(capsule)

    def came_from_share(self, arrays, share, mapped):
        """PyTorch's own interprocess pickling (torch.multiprocessing) needs
        memory from its caching allocator, and refuses tensors over a
        share's mappings.  Those tensors are passed on as the share itself
        (the next process opens it from the exporter); any other tensor
        over such memory (a slice, a view) gets an error saying so."""
        import weakref
        if not _from_shares:
            _wrap_reducers()
        for i, t in enumerate(arrays):
            # By identity (a tensor's == is elementwise); the weak
            # reference's callback drops the entry when the tensor dies.
            key = id(t)

            def forget(_, key=key):
                _from_shares.pop(key, None)
            _from_shares[key] = (weakref.ref(t, forget), share, i)
        _mapped.update(mapped)

    @staticmethod
    def autograd(fn):
        return autograd_vjp(fn)


@functools.cache
def _facts():
    """(current raw stream of a device, the NumPy dtype of each PyTorch
    dtype its CAI describes exactly)."""
    import torch
    get = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if get is None:  # a PyTorch without the raw accessor
        def get(index):
            return torch.cuda.current_stream(index).cuda_stream
    exact = {getattr(torch, name): np.dtype(name) for name in (
        "bool", "int8", "int16", "int32", "int64", "uint8", "float16",
        "float32", "float64", "complex64", "complex128")}
    return get, exact


def _np_dtype(t, known={}):  # noqa: B006 - a cache
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


class Foreign(GpuAdapter):
    """foreign(framework="torch"): views of XLA's device buffers as CUDA
    tensors on XLA's stream, made current; on the CPU backend, views of its
    host buffers as CPU tensors (no stream).  Each view holds its token
    through the DLPack capsule PyTorch takes, which every view of the
    tensor shares."""

    array_type = "torch.Tensor"

    def __init__(self, peer):
        super().__init__(peer)
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

    def ordinal(self, buffers):
        """The GPU of the call's buffers, or None where all are host
        buffers: the CPU backend, where PyTorch runs on CPU tensors."""
        # One look at the first buffer on the GPU's path (its hot one).
        if (buffers and buffers[0].__dlpack_device__()[0] == KDLCPU
                and all(b.__dlpack_device__()[0] == KDLCPU for b in buffers)):
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
                               device="cpu" if kind == KDLCPU else f"cuda:{ordinal}")
        # XLA's own capsule describes the buffer; the one PyTorch takes
        # holds the token until PyTorch frees the storage, which every view
        # of this tensor shares.  XLA's capsule is dropped unconsumed.
        return self.from_dlpack(ext.view_capsule(b.__dlpack__(), token(tokens)))

    def facts(self, got):
        if not isinstance(got, self.torch.Tensor):
            return None, None
        return tuple(got.shape), _np_dtype(got.dtype)

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


# Tensors open_shared made, by id: (weak reference, share, leaf index); and
# the starts of the allocations it mapped: see Torch.came_from_share.
_from_shares: dict[int, tuple] = {}
_mapped: set = set()


def _wrap_reducers():
    """Wraps PyTorch's pickling reducers of CUDA tensors (registered with
    multiprocessing's pickler when torch is imported, which open_shared has
    done by now) for tensors that came from a share."""
    import torch
    from multiprocessing.reduction import ForkingPickler
    for cls in (torch.Tensor, torch.nn.Parameter):
        theirs = ForkingPickler._extra_reducers.get(cls)  # type: ignore[attr-defined]
        if theirs is None or getattr(theirs, "_jax_overlay", False):
            continue  # not registered by PyTorch, or wrapped already

        def reduce(t, theirs=theirs):
            src = _from_shares.get(id(t))
            if src is not None and src[0]() is t:
                from .._ipc import open_leaf
                return open_leaf, (src[1], src[2], "torch")
            try:
                return theirs(t)
            except RuntimeError as e:
                if t.is_cuda and _in_a_share(t):
                    raise BufferError(
                        "this CUDA tensor views memory opened with jax_overlay.open_shared, "
                        "which PyTorch's own interprocess sharing cannot send "
                        f"({type(e).__name__}: {e}); send the jax_overlay.Share itself, or "
                        "the tensors open_shared returned (jax_overlay sends those as the "
                        "share), or t.clone() for a tensor of PyTorch's own memory") from e
                raise
        reduce._jax_overlay = True  # type: ignore[attr-defined]
        ForkingPickler.register(cls, reduce)


def _in_a_share(t):
    from .. import _xla_ext as ext
    try:
        start = ext.pointer_info(t.data_ptr()).range_start
    except BufferError:
        return False
    return start in _mapped


def autograd_vjp(fn: Any):
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


PEER = register(Torch())
