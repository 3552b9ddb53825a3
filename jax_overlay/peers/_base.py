"""Room: the peers' interface.  The peer interface, and the base of every ``jax_overlay.foreign``
adapter over XLA's device buffers.  Nothing here imports a library."""

from __future__ import annotations

import contextlib
import math
import threading
import weakref
from typing import Any

import numpy as np

from .. import _xla_ext as ext
from .._vocab import KDLCPU, KDLCUDA, KDLCUDAHOST
from ..errors import ForeignError
from ._registry import REGISTRY

# A peer's cai_reader() answer: no rule of its own, the generic one decides
# (the producer's own CAI when it is v3 with a stream and it also has
# __dlpack__, else DLPack).
GENERIC: Any = object()


class Peer:
    """One array library, as the import paths see it: its names and its
    import quirks.  Subclasses set the names and override what is true of
    their library; the defaults describe a well-behaved producer.  What
    else a library offers is a capability, a class of its own mixed in:
    ForeignEndpoint (``foreign(framework=...)``) and ShareEndpoint
    (``open_shared(framework=...)``); features ask the registry for a
    capability (``peers.having``), never for a library by name."""

    name = ""        # the registry's key, and framework= of its endpoints
    title = ""       # the library's name in messages ("PyTorch")
    distribution = ""  # its distribution on PyPI, for the doctor's versions

    def owns(self, t: type) -> bool:
        """Whether `t` is the library's array type: one rule, by type, that
        never imports the library."""
        return False

    def resolve(self, obj: Any, copy: bool | None) -> tuple[Any, bool]:
        """(obj, copied): a lazy view neither protocol carries, resolved."""
        return obj, False

    # Whether the library's __dlpack__(stream=) orders the consumer's
    # stream after its pending writes, as the protocol asks.  False: the
    # import fences instead (peers.resolve waits for the device's work on
    # the host before the capsule is taken).
    orders_consumer_stream = True

    def cai_reader(self, t: type) -> Any:
        """The import's route for type `t`: a function (obj, copy) -> (owner,
        CAI dict, copied) or None, that reads its CAI where it gives the
        same array as its ``__dlpack__``; None for DLPack always; GENERIC
        for the generic rule."""
        return GENERIC


class ForeignEndpoint:
    """Capability: ``jax_overlay.foreign(fn, framework=name)`` runs the
    library's code on XLA's buffers, through an Adapter."""

    # Where its adapter runs: "cpu", "gpu", or None (both).
    runs_on: str | None = None
    # fn -> fn differentiated by the library's own autodiff
    # (foreign(vjp="autograd")), an object whose methods are foreign
    # functions of this framework, each first given `need` (per flat input
    # leaf, whether JAX wants its cotangent): forward(need, *inputs) ->
    # (outputs, ticket), keeping fn's graph; backward(need, *inputs, ticket,
    # cotangent) and recompute(need, *inputs, cotangent) (fn run again) ->
    # the needed cotangents, flat.  None: the library has no autodiff.
    autograd: Any = None

    def adapter(self) -> "Adapter":
        """A new adapter of ``foreign()`` (the library imported now)."""
        raise NotImplementedError

    def stream(self, handle: int, ordinal: int) -> Any:
        """The library's stream object over a CUDA stream handle it does not
        own (never destroyed by the library)."""
        raise NotImplementedError


class ShareEndpoint:
    """Capability: ``open_shared(share, framework=name)`` hands out the
    library's arrays over a share's mappings."""

    def current_stream(self, ordinal: int) -> int:
        """The handle of the library's current stream on CUDA device
        `ordinal` (0: the legacy default stream), which work on an opened
        share is ordered behind."""
        raise NotImplementedError

    def wrap_capsule(self, capsule: Any, ordinal: int) -> Any:
        """The library's array over a DLPack capsule of CUDA device memory
        it does not own, holding the capsule's owner until it frees it."""
        raise NotImplementedError

    def came_from_share(self, arrays: list, share: Any, mapped: list, reopen: Any) -> None:
        """Told which of the library's arrays `open_shared` just made from
        `share` (mapped: the start of each allocation it mapped), for a
        library whose own interprocess pickling needs a word about them.
        `reopen(share, index, framework)`: how another process opens leaf
        `index` again (picklable; the peer imports no feature module)."""


class Adapter:
    """What ``foreign()`` asks of a library's adapter, per call: the device
    of the call's buffers (`ordinal`), entering and leaving the library's
    stream (`enter`, `exit`), views of XLA's buffers (`view`), fn's outputs
    checked (`output`) and copied into XLA's (`copy_into`, through
    `write`), and the memory a replay's trace keeps (`capture`)."""

    name = ""
    array: type | None = None  # the exact type of the library's arrays: a pytree leaf

    def ordinal(self, buffers) -> int | None:
        raise NotImplementedError

    def enter(self, ctx, ordinal, traced=False):
        """(the stream fn runs on, what exit() needs)."""
        raise NotImplementedError

    def exit(self, state) -> None:
        raise NotImplementedError

    def view(self, b, writeable, tokens):
        raise NotImplementedError

    def output(self, i, got, view):
        raise NotImplementedError

    def copy_into(self, view, arr, stream) -> None:
        raise NotImplementedError

    def write(self, i, b, got, stream, tokens) -> None:
        """fn's output `i` (`got`) checked and copied into XLA's buffer `b`:
        through a view of `b`.  A library with a cheaper way for its
        common case takes that first."""
        view = self.view(b, True, tokens)
        self.copy_into(view, self.output(i, got, view), stream)

    def capture(self, memory: list) -> Any:
        """A context for fn's run while XLA traces it into a CUDA graph
        (``foreign(..., replay=True)``), in which what fn allocates stays
        reserved for the trace: a replay writes the same addresses with no
        Python, so memory the library freed and handed to other arrays
        after the trace would be overwritten.  `memory` is this trace's
        list, kept as long as any executable can replay it, and shared
        with every trace that XLA never runs at the same time as this one
        (by default all of the callback's on this GPU): a pool made into
        it once serves them all.  The default keeps nothing: for a library
        that does not allocate on the device."""
        return contextlib.nullcontext()


def mismatch(i, got_dtype, got_shape, want_dtype, want_shape):
    return ForeignError(
        f"output {i} of the foreign function is {got_dtype}{list(got_shape)}, but "
        f"result_shape_dtypes says {np.dtype(want_dtype)}{list(want_shape)}; return "
        "exactly that, or correct result_shape_dtypes")


class _Token:
    """Owned by every view of one buffer; weakly referenced by the call."""
    __slots__ = ("__weakref__",)


def token(tokens):
    """A new token, weakly recorded in the call's `tokens`."""
    t = _Token()
    tokens.append(weakref.ref(t))
    return t


def buffer_facts(b):
    """(pointer, shape, dtype, size) of an XLA buffer."""
    shape = tuple(b.shape)
    dtype = np.dtype(b.dtype)
    size = math.prod(shape)
    return buffer_pointer(b) if size else 0, shape, dtype, size


def buffer_pointer(b):
    """The device address of an XLA buffer, through its own DLPack capsule
    (any dtype; its CAI has no typestr for bfloat16): read, not consumed,
    then dropped."""
    return ext.capsule_data(b.__dlpack__())


class GpuAdapter(Adapter):
    """A foreign() adapter over XLA's CUDA device buffers: views made with no
    copy, XLA's own stream as the library's stream for the call.

    Ordering: the callback runs on the host when XLA reaches it in its
    stream, possibly before the GPU has finished the work before it.
    Libraries with a current stream get XLA's made current, so every kernel
    ``fn`` launches (and the copies into XLA's outputs) queue behind that
    work and ahead of the work after it: nothing waits on the host.

    Lifetime: each view holds a token through the library's own owner
    field, so any view derived from it holds it too; a token alive after
    the call means ``fn`` kept XLA's memory."""

    array_type = ""

    def __init__(self, peer: Any = None):  # a Peer with the ForeignEndpoint capability
        self.peer = peer
        if peer is not None:
            self.name = peer.name
        self._local = threading.local()

    def stream(self, handle, ordinal):
        """This thread's stream object over XLA's stream `handle`: XLA keeps
        its streams, so one wrapper each, made on first use.  Per thread,
        because a stream object may keep the state of its own ``with``
        (PyTorch's does)."""
        streams = self._local.__dict__.setdefault("streams", {})
        key = (handle, ordinal)
        stream = streams.get(key)
        if stream is None:
            stream = streams[key] = self.wrap(handle, ordinal)
        return stream

    def caller(self, ordinal) -> int:
        """The raw handle of the stream the calling thread's work of the
        library goes to on GPU `ordinal`: its peer's current stream (0: the
        legacy default stream)."""
        return self.peer.current_stream(ordinal)

    def join(self, ordinal, xla, traced):
        """Before fn: XLA's stream waits for what the caller queued on its
        own stream (`caller()`), so fn reads the library's state as the
        caller left it (a module's weights, an optimizer's step).  Returns
        that stream, for leave(); None where there is nothing to fence:
        while XLA's stream is captured (no fence can join a capture: a
        replay runs with no Python), or where the caller's stream is XLA's."""
        if traced:
            return None
        caller = self.caller(ordinal)
        if caller == xla:
            return None
        ext.order_after(ordinal, caller, xla)
        return caller

    def leave(self, ordinal, xla, caller) -> None:
        """After fn, also when it raised: the caller's stream waits for
        fn's work on XLA's stream, so the caller's next work reads what fn
        wrote into the library's state."""
        if caller is not None:
            ext.order_after(ordinal, xla, caller)

    def wrap(self, handle, ordinal):
        """The library's stream object over `handle`: its peer's."""
        assert self.peer is not None, "an adapter without a peer makes its own streams"
        return self.peer.stream(handle, ordinal)

    def facts(self, got):
        """(shape, NumPy dtype) of an array of the library, else (None, None)."""
        raise NotImplementedError

    def np_dtype(self, view):
        """The NumPy dtype of one of the library's views (where its arrays
        carry a NumPy dtype, that one)."""
        return view.dtype

    def view(self, b, writeable, tokens):
        ptr, shape, dtype, size = buffer_facts(b)
        if not size:  # no memory to view, nothing to hold
            return self.empty(shape, dtype)
        return self.over(ptr, shape, dtype, size, b.__dlpack_device__()[1], writeable,
                         token(tokens))

    def empty(self, shape, dtype):
        """A zero-size array of the library."""
        raise NotImplementedError

    def over(self, ptr, shape, dtype, size, ordinal, writeable, token):
        """The library's array over XLA's memory at `ptr`, holding `token`
        through its own owner field, so every view derived from it holds it
        too."""
        raise NotImplementedError

    def ordinal(self, buffers):
        ordinal = None
        for i, b in enumerate(buffers):
            kind, dev = b.__dlpack_device__()
            if kind != KDLCUDA:
                where = ("pinned host memory (kDLCUDAHost); move it to device memory first "
                         "(jax.device_put(x, x.sharding.with_memory_kind('device')))"
                         if kind == KDLCUDAHOST else
                         f"DLPack device {kind} (the CPU backend is {KDLCPU}); "
                         f"framework={_cpu_names()} run there, or put the inputs on the GPU")
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
            raise mismatch(i, dtype, shape, self.np_dtype(view), tuple(view.shape))
        return got


@contextlib.contextmanager
def relaxed_capture():
    """This thread's capture mode relaxed for the block: a library may then
    allocate device memory (cuMemAlloc) while XLA's stream is captured.
    XLA captures in a mode that refuses it; synchronisations stay refused
    in every mode."""
    previous = ext.exchange_capture_mode(ext.CAPTURE_RELAXED)
    try:
        yield
    finally:
        ext.exchange_capture_mode(previous)


def where(place: str) -> str:
    """The frameworks that run on `place` ("cpu" or "gpu"), for messages."""
    names = [repr(n) for n, p in REGISTRY.items()
             if isinstance(p, ForeignEndpoint) and p.runs_on in (place, None)]
    return " or ".join(names) if len(names) < 3 else ", ".join(names[:-1]) + " or " + names[-1]


def _cpu_names():
    return where("cpu")
