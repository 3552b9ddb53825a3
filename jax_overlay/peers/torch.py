"""Room: PyTorch (peer ``"torch"``).  Its tensors are recognised by one
rule (``torch.Tensor`` in the type's MRO, found by name: PyTorch is never
imported to ask).  Its quirks: lazy conjugate and negative views that
neither protocol carries; a CUDA Array Interface of version 2 with no
stream, which the import completes (the CAI route skips PyTorch's costly
``__dlpack__``); ``torch.cuda.ExternalStream``; the foreign() adapter for
CUDA and CPU tensors, and ``vjp="autograd"``."""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import secrets
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from .. import _xla_ext as ext
from .._config import config
from .._vocab import KDLCPU
from ..errors import ForeignError, JaxRuntimeError, LayoutCopyRequiredError, like_stock
from ._registry import register
from ._base import ForeignEndpoint, GpuAdapter, Peer, ShareEndpoint, buffer_pointer, token


class Torch(Peer, ForeignEndpoint, ShareEndpoint):
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

    def came_from_share(self, arrays, share, mapped, reopen):
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
            _from_shares[key] = (weakref.ref(t, forget), share, i, reopen)
        _mapped.update(mapped)

    @staticmethod
    def autograd(fn):
        return Autograd(fn)


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


def _torch_dtype(dtype, known={}):  # noqa: B006 - a cache
    """PyTorch's dtype of a NumPy dtype, None where it has none."""
    try:
        return known[dtype]
    except KeyError:
        import torch
        t = getattr(torch, np.dtype(dtype).name, None)
        t = known[dtype] = t if isinstance(t, torch.dtype) else None
        return t


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

    def caller(self, ordinal):
        # The peer's current_stream, without torch.cuda's Python device
        # lookup: inside a call PyTorch's CUDA is initialised already.
        return _facts()[0](ordinal)

    def enter(self, ctx, ordinal, traced=False):
        if ordinal is None:  # host tensors: no stream to make current
            return None, None
        xla = ctx.stream
        stream = self.stream(xla, ordinal)
        caller = self.join(ordinal, xla, traced)  # read before XLA's is made current
        within = stream if self.native_with else self.torch.cuda.stream(stream)
        within.__enter__()
        return stream, (within, ordinal, xla, caller)

    def exit(self, state):
        if state is None:
            return
        within, ordinal, xla, caller = state
        try:
            within.__exit__(None, None, None)
        finally:
            self.leave(ordinal, xla, caller)

    def capture(self, memory):
        """A private pool (torch.cuda.MemPool) where every allocation on
        XLA's stream goes while XLA traces fn: by stream, not by thread
        (torch.cuda.use_mem_pool's rule), since autograd's backward runs on
        PyTorch's own device thread.  PyTorch's allocator itself relaxes
        the capture mode to grow the pool."""
        if not memory:
            memory.append(self.torch.cuda.MemPool())  # its blocks: the traces' temporaries
        return _allocating_to(self.torch, memory[0])

    def dtype(self, dtype):
        t = _torch_dtype(dtype)
        if t is None:
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

    def write(self, i, b, got, stream, tokens):
        # The common case in one driver call: fn's own dense CUDA tensor of
        # the output's exact dtype and shape, copied by cuMemcpyDtoDAsync on
        # XLA's stream (the current one, behind fn's kernels, as copy_ would
        # be), with no view of XLA's buffer and no PyTorch dispatch.  A lazy
        # conjugate or negation is not in its memory: those take copy_.
        torch = self.torch
        if (stream is not None and type(got) is torch.Tensor and got.is_cuda
                and got.layout == torch.strided and got.shape == b.shape
                and got.dtype == _torch_dtype(b.dtype) and got.is_contiguous()
                and not got.is_conj() and not got.is_neg()
                and got.get_device() == stream.device_index):
            n = got.nbytes
            if not n:
                return
            src = got.data_ptr()
            dst = buffer_pointer(b)
            if src == dst:  # fn returned the aliased input itself
                return
            if not (src < dst + n and dst < src + n):  # overlapping: copy_ refuses or stages
                ext.copy_async(stream.device_index, dst, src, n, stream.cuda_stream)
                return
        super().write(i, b, got, stream, tokens)

    def copy_into(self, view, got, stream):
        if isinstance(got, self.torch.Tensor):
            view.copy_(got)  # on the current stream: XLA's
        else:
            view.fill_(got)


@contextlib.contextmanager
def _allocating_to(torch, pool):
    """Allocations on the current stream (XLA's, made current by enter())
    from `pool` for the block, from any thread."""
    device = torch.cuda.current_device()
    torch._C._cuda_beginAllocateCurrentStreamToPool(device, pool.id)
    try:
        yield
    finally:
        torch._C._cuda_endAllocateToPool(device, pool.id)
        # The begin took a use of the pool; `pool` holds its own.
        torch._C._cuda_releasePool(device, pool.id)


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
                return src[3], (src[1], src[2], "torch")
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


def _grads(torch, flat, need, outs, cts, wrt, retain=False):
    """JAX's cotangents of the needed inputs (`wrt`, one per True in
    `need`), flat, from PyTorch's backward of `outs` (tensors or gradient
    edges, None where no gradient flows) for the cotangents `cts`; zeros
    where none flows (an input fn does not use).  `retain` keeps the graph
    for another backward (a template's).

    Complex numbers: PyTorch's backward computes the conjugate Wirtinger
    derivative, JAX's vjp its conjugate, so JAX's vjp of a cotangent is
    the conjugate of PyTorch's backward of the cotangent's conjugate (a
    no-op for real dtypes; the lazy conj is resolved by the copy into XLA's
    buffer)."""
    pairs = [(o, c.conj() if c.is_complex() else c) for o, c in zip(outs, cts) if o is not None]
    grads: list = [None] * len(wrt)
    if pairs and wrt:
        grads = list(torch.autograd.grad([o for o, _ in pairs], wrt, [c for _, c in pairs],
                                         allow_unused=True, retain_graph=retain))
    needed = [t for t, n in zip(flat, need) if n]
    return [torch.zeros_like(t) if g is None else g.conj() if g.is_complex() else g
            for t, g in zip(needed, grads)]


def _leaves(flat, need):
    """The inputs as autograd sees them: the needed ones as leaves that
    require grad (sharing the views' memory), the others as they are."""
    return [t.detach().requires_grad_(True) if n else t for t, n in zip(flat, need)]


class _InputRef:
    """A tensor the forward's graph saved that views one of the call's
    inputs (XLA's memory, valid for that call only): kept as where it lies
    in input `i`, and read from the backward call's view of the same input
    (the residual JAX keeps for it)."""
    __slots__ = ("i", "offset", "shape", "stride")

    def __init__(self, i, t):
        self.i, self.offset, self.shape, self.stride = i, t.storage_offset(), t.shape, t.stride()


class _Residual:
    """Under replay, a tensor the forward's graph saved in PyTorch's own
    memory: copied (as bytes) into the forward call's residual output `j`,
    which JAX keeps, and read from the backward call's view of it."""
    __slots__ = ("j", "dtype", "shape")

    def __init__(self, j, t):
        self.j, self.dtype, self.shape = j, t.dtype, t.shape


class _Graph:
    """One forward's autograd graph, as the backward call needs it: gradient
    edges (no tensors) of its outputs, its differentiated input leaves
    (over a stand-in, not XLA's memory), and the views its saved
    references read (set for one backward call at a time): the call's
    inputs and, under replay, its residuals."""
    __slots__ = ("outs", "wrt", "ct_shapes", "views")

    def __init__(self, outs, wrt, ct_shapes, views):
        self.outs, self.wrt, self.ct_shapes, self.views = outs, wrt, ct_shapes, views


def _stream_of(flat):
    """The raw CUDA stream current for the call's inputs' device (XLA's,
    made current by the adapter), None on the CPU.  PyTorch runs each node
    of a backward on the stream its forward ran on: a template is used only
    on the stream it was made on, where a trace captures that work."""
    t = next((t for t in flat if t.is_cuda), None)
    return None if t is None else _facts()[0](t.device.index)


def _graph_shape(outs):
    """The kinds of the nodes of the graph behind `outs`, in the order a
    walk from the outputs meets them, or None where a node keeps a tensor
    that no saved-tensor hook sees (a custom Function's ``ctx.x = t``): a
    graph kept as a template would read that tensor as it was when
    traced."""
    import torch
    custom = torch.autograd.function.BackwardCFunction
    seen: set = set()
    kinds = []
    todo = [o.grad_fn for o in outs
            if isinstance(o, torch.Tensor) and o.grad_fn is not None]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        kinds.append(type(node).__name__)
        if isinstance(node, custom) and any(
                isinstance(v, torch.Tensor) or (isinstance(v, (tuple, list)) and any(
                    isinstance(e, torch.Tensor) for e in v)) for v in vars(node).values()):
            return None
        todo.extend(n for n, _ in node.next_functions)
    return tuple(kinds)


class Autograd:
    """``vjp="autograd"``: PyTorch's autograd of ``fn``, for the inputs JAX
    differentiates (`need`).  By default without running ``fn`` twice: the
    forward call runs ``fn`` once under autograd and keeps its graph, and
    the backward call runs PyTorch's backward of that graph.  ``recompute``
    runs ``fn`` again under autograd in the backward call instead
    (``foreign(..., recompute=True)``, batched ``vmap_method``s, and a
    ticket whose graph is gone).

    Which graph: the forward writes a ticket (64 bits, a counter from a
    random start) into an extra output that JAX keeps as a residual, and the
    backward reads it back.  Buffer addresses, call order or call sites
    cannot name the forward safely (XLA may move a residual into memory a
    dropped one had, run backward calls in any order, or call one backward
    several times), and a ticket read can: on the GPU it is an 8-byte read
    that waits for XLA's stream (a synchronisation, as ``.item()`` in
    ``fn`` would be).  A ticket with no graph (the graph already used, or
    evicted) falls back to running ``fn`` again: never a wrong graph.

    Lifetime: the graph holds no view of XLA's memory.  Tensors it saves
    that view an input are kept as references (``_InputRef``) and read from
    the backward call's views of the same inputs; the input leaves' data is
    replaced by a one-element stand-in, since their gradient nodes hold
    them.  A graph is released when its backward runs, or when more than
    ``config.saved_graphs`` graphs of this function wait (a forward whose
    backward JAX never runs: ``jax.vjp`` not followed, XLA eliminating an
    unused gradient): then the oldest goes, and its backward, if it ever
    comes, runs ``fn`` again.

    Under replay no ticket can be read (a trace runs no Python when
    replayed), so nothing the backward needs may live outside JAX: the
    forward call (``forward_residuals``) copies each tensor the graph saves in
    PyTorch's memory into a residual output (bytes), and the backward call
    (``backward_residuals``) runs PyTorch's backward of a template graph whose
    saved tensors all read the call's own inputs and residuals.  One
    template serves every call of the same inputs' shapes, since replay's
    ``fn`` is a pure function of its inputs.  What the template must save
    is found before the first call, by running ``fn`` once on meta tensors
    (``residual_sizes``); and each forward checks that its graph has the shape
    found then.  Where it cannot tell (``fn`` fails on meta tensors or
    reads a value), or a forward's graph differs (an operation PyTorch
    dispatches differently by device), or a custom Function keeps a tensor
    outside ``save_for_backward``, the backward runs ``fn`` again."""

    def __init__(self, fn):
        self.fn = fn
        self.graphs: OrderedDict[int, _Graph] = OrderedDict()
        self.lock = threading.Lock()
        # A random start: a buffer that never held a ticket reads as one
        # of this process's tickets with odds of about 2**-62.
        self.tickets = itertools.count(secrets.randbits(62) + 1)
        self.stand_ins: dict = {}
        # Under replay, by (need, input tree, input shapes and dtypes):
        # what the graph saves as found on meta tensors (None: unknown),
        # the template graph, and the keys whose forwards disagreed.
        self.found: dict = {}
        self.templates: dict[Any, _Graph] = {}
        self.broken: set = set()
        self.template_lock = threading.Lock()
        # Backward calls (under replay: traces) by how they ran.
        self.backwards = {"template": 0, "recompute": 0}

    def waiting(self):
        """How many forward graphs wait for their backward call."""
        return len(self.graphs)

    def stand_in(self, t):
        """A tensor with `t`'s dtype, device and shape over one element of
        PyTorch's memory (expanded, never written)."""
        key = (t.dtype, t.device)
        one = self.stand_ins.get(key)
        if one is None:
            import torch
            one = self.stand_ins[key] = torch.zeros((), dtype=t.dtype, device=t.device)
        return one.expand(t.shape)

    def recompute(self, need, *args):
        """(inputs..., cotangent) -> the needed inputs' cotangents, flat: fn
        run again under autograd."""
        import torch
        from jax import tree_util
        *inputs, cotangent = args
        flat, tree = tree_util.tree_flatten(tuple(inputs))
        leaves = _leaves(flat, need)
        with torch.enable_grad():
            outs = tree_util.tree_leaves(self.fn(*tree_util.tree_unflatten(tree, leaves)))
            outs = [o if isinstance(o, torch.Tensor) and o.requires_grad else None
                    for o in outs]
            return _grads(torch, flat, need, outs, tree_util.tree_leaves(cotangent),
                          [t for t, n in zip(leaves, need) if n])

    def _record(self, need, tree, leaves, pack, views):
        """fn run once under autograd on `leaves` with `pack` as its saved
        tensors' hook: (its graph, reading saved references from `views`;
        its outputs' values, flat; their tree; the outputs themselves)."""
        import torch
        from jax import tree_util

        def unpack(p):
            kind = type(p)
            if kind is _InputRef:
                return views[0][p.i].as_strided(p.shape, p.stride, p.offset)
            if kind is _Residual:
                return views[1][p.j].view(p.dtype).view(p.shape)
            return p

        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            got = self.fn(*tree_util.tree_unflatten(tree, leaves))
        outs, out_tree = tree_util.tree_flatten(got)
        edge = torch.autograd.graph.get_gradient_edge
        out_edges = [edge(o) if isinstance(o, torch.Tensor) and o.requires_grad else None
                     for o in outs]
        # The input leaves themselves (their data swapped out below): cheaper
        # than their gradient edges, and their nodes hold them anyway.
        wrt = [t for t, n in zip(leaves, need) if n]
        ct_shapes = [tuple(o.shape) if isinstance(o, torch.Tensor) else None for o in outs]
        # Values for XLA's outputs: detached, so that an output that is an
        # input leaf (fn = identity) keeps its values past the swap below.
        values = [o.detach() if isinstance(o, torch.Tensor) else o for o in outs]
        for t, n in zip(leaves, need):
            if n:
                # Its gradient node holds the leaf: no longer XLA's memory.
                t.data = self.stand_in(t)
        return _Graph(out_edges, wrt, ct_shapes, views), values, out_tree, outs

    def forward(self, need, *inputs):
        """(fn's outputs, ticket)."""
        import torch
        from jax import tree_util
        flat, tree = tree_util.tree_flatten(tuple(inputs))
        leaves = _leaves(flat, need)
        # The storage of each input view: a saved tensor over one of them is
        # XLA's memory (only ints here: the graph keeps these hooks).
        bases: dict[int, tuple[int, Any]] = {}
        for i, t in enumerate(flat):
            if t.numel():
                bases.setdefault(t.untyped_storage().data_ptr(), (i, t.dtype))

        def pack(t):
            if not t.numel():
                return t
            hit = bases.get(t.untyped_storage().data_ptr())
            if hit is not None and (t.is_conj() or t.is_neg()):
                # A lazy conjugate or negation of an input: as_strided over
                # the input would drop the bit, so its values, resolved.
                return t.resolve_conj().resolve_neg()
            if hit is None:
                # PyTorch's own memory: the graph holds it.  Detached: an
                # op's saved output, kept with its grad_fn, would be a cycle
                # (node -> tensor -> node) that outlives a graph dropped
                # unused; the backward needs the values only.
                return t.detach() if t.requires_grad else t
            if hit[1] != t.dtype:
                return t.clone()  # a reinterpreting view: its own copy
            return _InputRef(hit[0], t)

        graph, values, out_tree, _ = self._record(need, tree, leaves, pack, [])
        ticket = next(self.tickets)
        with self.lock:
            self.graphs[ticket] = graph
            while len(self.graphs) > config.saved_graphs:
                self.graphs.popitem(last=False)
        device = flat[0].device if flat else torch.device("cpu")
        mark = torch.full((1,), ticket, dtype=torch.int64, device=device).view(torch.int32)
        return tree_util.tree_unflatten(out_tree, values), mark

    def backward(self, need, *args):
        """(inputs..., ticket, cotangent) -> the needed inputs' cotangents,
        flat."""
        import torch
        from jax import tree_util
        *inputs, mark, cotangent = args
        # On the GPU, a read that waits for XLA's stream: the forward's
        # ticket may still be in flight.
        ticket = int(mark.view(torch.int64).item())
        with self.lock:
            graph = self.graphs.pop(ticket, None)
        cts = tree_util.tree_leaves(cotangent)
        if graph is None or len(cts) != len(graph.ct_shapes) or any(
                s is not None and tuple(c.shape) != s for c, s in zip(cts, graph.ct_shapes)):
            # Gone (used, or evicted), or not this call's shapes (a batched
            # backward of an unbatched forward): run fn again.
            return self.recompute(need, *inputs, cotangent)
        flat = tree_util.tree_leaves(tuple(inputs))
        graph.views.append(flat)  # the inputs the saved references read
        try:
            return _grads(torch, flat, need, graph.outs, cts, graph.wrt)
        finally:
            graph.views.clear()

    # Under replay: the saved tensors as residuals, one template per key.

    def _saving(self, leaves, track):
        """(pack hook, its record): a saved tensor that is an input leaf or
        a view of one becomes an _InputRef (found by the leaf itself, not
        its address: XLA may pass one buffer as two inputs); one in
        PyTorch's memory becomes a _Residual, each tensor once; `track` keeps
        the latter (to copy them out).  The record is what the forward
        checks against the meta run."""
        ids = {id(t): i for i, t in enumerate(leaves)}
        index: dict[int, _Residual] = {}
        record: list = []

        def pack(t):
            if not t.numel():
                record.append(("empty",))
                return t
            base = t if t._base is None else t._base
            i = ids.get(id(base))
            # (A lazy conjugate or negation of an input is a residual: a
            # reference, read through as_strided, would drop the bit.)
            if i is not None and base.dtype == t.dtype and not (t.is_conj() or t.is_neg()):
                ref = _InputRef(i, t)
                record.append(("input", i, tuple(ref.shape), tuple(ref.stride), ref.offset))
                return ref
            got = index.get(id(t))
            if got is None:
                got = index[id(t)] = _Residual(len(track), t)
                track.append(t)  # held: its id stays its own until the copy
            record.append(("residual", got.j, str(t.dtype), tuple(t.shape)))
            return got
        return pack, record

    def residual_sizes(self, key):
        """The bytes of each tensor the graph of fn saves in PyTorch's
        memory, for inputs of `key` (need, tree, ((shape, dtype), ...)),
        found by running fn once on meta tensors; None where that cannot
        tell (the backward then runs fn again)."""
        if key in self.found:
            found = self.found[key]
            return None if found is None else found[0]
        import torch
        need, tree, specs = key
        found = None
        track: list = []
        try:
            leaves = []
            for (shape, dtype), n in zip(specs, need):
                dt = _torch_dtype(dtype)
                if dt is None:
                    raise TypeError(f"PyTorch has no dtype {dtype}")  # caught: fn runs again
                t = torch.empty(shape, dtype=dt, device="meta")
                leaves.append(t.requires_grad_(True) if n else t)
            pack, record = self._saving(leaves, track)
            _, _, _, outs = self._record(need, tree, leaves, pack, [])
            shape = _graph_shape(outs)
            # A saved tensor off the meta device was made by fn on a fixed
            # device: where the real run keeps it is not known here.
            if shape is not None and all(t.device.type == "meta" for t in track):
                found = (tuple(t.nbytes for t in track), tuple(record), shape)
        except Exception:  # noqa: BLE001 - fn reads a value or has no meta kernel
            found = None
        finally:
            track.clear()  # else a cycle: graph -> its hooks -> track -> graph
        self.found[key] = found
        return None if found is None else found[0]

    def forward_residuals(self, need, key, *inputs):
        """(fn's outputs, its saved tensors as bytes), the graph kept as the
        template of `key`."""
        import torch
        from jax import tree_util
        flat, tree = tree_util.tree_flatten(tuple(inputs))
        leaves = _leaves(flat, need)
        track: list = []
        pack, record = self._saving(leaves, track)
        views: list = []
        graph, values, out_tree, outs = self._record(need, tree, leaves, pack, views)
        sizes, want_record, want_shape = self.found[key]
        if tuple(record) != want_record or _graph_shape(outs) != want_shape:
            self.broken.add(key)  # its backward, and every later one, runs fn again
        if key in self.broken:
            device = flat[0].device if flat else torch.device("cpu")
            saved = [torch.zeros(n, dtype=torch.uint8, device=device) for n in sizes]
        else:
            # Bytes, whatever the dtype (JAX without x64 has no int64 output).
            saved = [t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
                     .view(torch.uint8) for t in track]
            with self.template_lock:
                self.templates[key, _stream_of(flat)] = graph
        # The pack hook, which the graph's saved variables keep, holds
        # `track`: emptied, the template holds no activation.
        track.clear()
        return tree_util.tree_unflatten(out_tree, values), saved

    def backward_residuals(self, need, key, *args):
        """(inputs..., residuals, cotangent) -> the needed inputs'
        cotangents, flat: the template's backward over this call's inputs
        and residuals."""
        import torch
        from jax import tree_util
        *inputs, saved, cotangent = args
        flat = tree_util.tree_leaves(tuple(inputs))
        with self.template_lock:
            graph = None if key in self.broken else self.templates.get((key, _stream_of(flat)))
            cts = tree_util.tree_leaves(cotangent)
            if graph is None or len(cts) != len(graph.ct_shapes) or any(
                    s is not None and tuple(c.shape) != s
                    for c, s in zip(cts, graph.ct_shapes)):
                self.backwards["recompute"] += 1
            else:
                self.backwards["template"] += 1
                # The lock holds the template's views for this call: another
                # thread's backward of the same key waits.
                graph.views[:] = [flat, list(saved)]
                try:
                    return _grads(torch, flat, need, graph.outs, cts, graph.wrt, retain=True)
                finally:
                    graph.views.clear()
        return self.recompute(need, *inputs, cotangent)


PEER = register(Torch())
