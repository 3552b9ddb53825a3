"""Room: foreign functions inside jax.jit.  A function written for another
array library runs on views of XLA's own buffers, through
``jax.experimental.buffer_callback``, with no copy of its inputs and no
host synchronisation beyond what the library itself does.

Frameworks are the peers with an adapter
(jax_overlay.peers): ``"numpy"`` (host buffers, the CPU backend);
``"torch"``, ``"cupy"`` and ``"numba"`` (device buffers, on XLA's own CUDA
stream); ``"torch"`` also on host buffers (the CPU backend).  Each adapter
lives in its peer's module.

Replay (``replay=True``): XLA traces ``fn`` into its CUDA graph and
replays it; what ``fn`` allocates while traced comes from memory kept for
the traces (the adapters' ``capture``).

Lifetime: the views given to ``fn`` are XLA's buffers for the duration of
the call only.  Inputs are views XLA still owns (read-only where the
framework has read-only arrays); outputs are written by copying what ``fn``
returns into XLA's output buffers, or, with ``out=True``, by ``fn`` itself
into the views it is given.  A view that ``fn`` keeps past the call (in a
global, a closure, a list) would read memory XLA reuses: every view holds a
token, and a token still alive when the call returns fails the call with
an error that says to copy what is kept.
"""

from __future__ import annotations

import functools
import gc
import math
import os
import threading
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from . import _runtime as rt
from . import _xla_ext as ext
from . import peers
from .peers._base import buffer_facts
from .errors import ForeignError, JaxRuntimeError, like_stock


_local = threading.local()


def foreign_stream() -> Any:
    """The stream of the foreign call running on this thread, in its
    framework's type: ``torch.cuda.ExternalStream``,
    ``cupy.cuda.ExternalStream`` or a Numba external stream, each wrapping
    XLA's own stream; None for ``"numpy"`` and for ``"torch"`` on the CPU.  PyTorch and CuPy already have
    it current; Numba kernels take it at launch:
    ``kernel[blocks, threads, jax_overlay.foreign_stream()](...)``."""
    stack = getattr(_local, "streams", None)
    if not stack:
        raise RuntimeError(
            "jax_overlay.foreign_stream() is only defined while a foreign function runs "
            "(inside the fn given to jax_overlay.foreign)")
    return stack[-1]


def _spec_leaf(x, where):
    shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
    if shape is None or dtype is None:
        raise TypeError(
            f"result_shape_dtypes{where} is {x!r}; each leaf needs .shape and .dtype "
            "(a jax.ShapeDtypeStruct)")
    return jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype))


def _spec_of(x):
    """An input's shape and dtype, as JAX will see it."""
    return jax.ShapeDtypeStruct(np.shape(x), jax.numpy.result_type(x))


def _result_spec(result_shape_dtypes, args):
    """The outputs' pytree of ShapeDtypeStructs: given, or computed from the
    inputs' shapes and dtypes."""
    spec = result_shape_dtypes
    if callable(spec) and not hasattr(spec, "shape"):
        spec = spec(*jax.tree_util.tree_map(_spec_of, args))
    leaves, tree = jax.tree_util.tree_flatten_with_path(spec)
    flat = [_spec_leaf(x, jax.tree_util.keystr(path)) for path, x in leaves]
    return jax.tree_util.tree_unflatten(tree, flat)


_MADE: dict = {}


def _adapter(framework):
    """The framework's foreign() adapter, made (and the library imported)
    on first use."""
    made = _MADE.get(framework)
    if made is None:
        peer = peers.foreign_peer(framework)
        try:
            made = _MADE[framework] = peer.adapter()
        except ImportError as e:
            raise ImportError(f"framework={framework!r} needs {peer.title}, which does not import "
                              f"here: {e}") from e
    return made


def _run(fn, adapter, args, outs, in_tree, out_tree, write_out, stream, tokens):
    """Makes the views, calls fn and fills XLA's output buffers.  `args` and
    `outs` are XLA's buffers as flat leaves; `in_tree` and `out_tree` the
    pytrees fn takes and returns (None where that is the flat sequence
    itself).  Its own function, so that no view made here outlives it: what
    is still alive when it returns, fn kept."""
    make_view = adapter.view
    in_views = [make_view(b, False, tokens) for b in args]
    inputs = in_views if in_tree is None else jax.tree_util.tree_unflatten(in_tree, in_views)
    if write_out:
        out_views = [make_view(b, True, tokens) for b in outs]
        got = fn(*inputs, out=out_views[0] if out_tree is None
                 else jax.tree_util.tree_unflatten(out_tree, out_views))
        if got is not None:
            raise ForeignError(
                "with out=True the foreign function writes its outputs into `out` and "
                f"returns None; it returned {type(got).__qualname__}")
        return
    got = fn(*inputs)
    if out_tree is None and type(got) is adapter.array:
        leaves = [got]  # the framework's own array for one output: a leaf
    else:
        leaves, tree = jax.tree_util.tree_flatten(got)
        want = _LEAF if out_tree is None else out_tree
        if tree != want:
            raise ForeignError(
                f"the foreign function returned the structure {tree}, but "
                f"result_shape_dtypes has {want}")
    # Checked against XLA's own output buffers: under vmap they carry the
    # batch dimension that result_shape_dtypes does not.
    for i, (b, leaf) in enumerate(zip(outs, leaves)):
        adapter.write(i, b, leaf, stream, tokens)


_LEAF = jax.tree_util.tree_structure(0)


def _make_callback(fn, adapter, in_tree, out_tree, write_out, replay=False, shapes=None):
    """The buffer_callback body.  It is given flat leaves (`call` flattens
    both sides, so jax's own unflattening is a tuple's): `in_tree` and
    `out_tree` are unflattened here only when fn's pytrees are not already
    that (a tuple of arrays in, one array out).  With `replay`, a call
    that finds XLA's stream captured is a trace: fn's work is recorded
    into XLA's CUDA graph, which XLA replays with no Python.  `shapes`:
    the outputs' own shapes where XLA's output buffers are padded (see
    _caller): fn sees the start of each, in its own shape."""
    if in_tree == jax.tree_util.tree_structure((0,) * in_tree.num_leaves):
        in_tree = None
    if out_tree == _LEAF:
        out_tree = None
    # The memory of fn's traces (pools, allocations), never released: a
    # trace can be replayed by every executable that holds this callback,
    # so for as long as this callback lives.  Traces may share memory only
    # where XLA never runs them at once.  By default XLA's command buffer
    # runs its commands one after another, so every trace on a GPU shares
    # one pool: a call whose buffers move every time (results kept) traces
    # again each call, and must not take new memory each time.  Where XLA
    # is told to run commands concurrently, only the traces that write
    # the same outputs share (one command's, never run at once).
    kept: dict = {}
    serial = _commands_run_one_at_a_time()

    def callback(ctx, outs, *args):
        if shapes is not None:
            outs = [_Start(b, shape) for b, shape in zip(outs, shapes)]
        ordinal = adapter.ordinal((*outs, *args))
        tokens: list = []
        stack = _local.__dict__.setdefault("streams", [])  # foreign_stream()'s
        traced = False
        try:
            traced = replay and ordinal is not None and _capturing(ordinal, ctx)
            # XLA's stream made the framework's current one, and undone in
            # every case: this thread goes on running other callbacks.
            stream, state = adapter.enter(ctx, ordinal, traced)
            stack.append(stream)
            try:
                if traced:
                    key = ordinal if serial else (
                        ordinal, *(buffer_facts(b)[0] for b in (outs or args)))
                    with adapter.capture(kept.setdefault(key, [])):
                        _run(fn, adapter, args, outs, in_tree, out_tree, write_out, stream,
                             tokens)
                else:  # no context manager to enter: a plain call's path is its cost
                    _run(fn, adapter, args, outs, in_tree, out_tree, write_out, stream, tokens)
            finally:
                stack.pop()
                adapter.exit(state)
        except ForeignError as e:
            if traced:
                raise ForeignError(f"{e}{_WHILE_TRACED}") from e
            raise
        except Exception as e:
            # XLA reports it as its runtime error, with this message and the
            # traceback of fn's own exception.
            # Its class and message first: that is the line a reader needs.
            raise ForeignError(
                f"{type(e).__qualname__}: {e} (raised by the foreign function "
                f"{getattr(fn, '__qualname__', fn)!r}{_WHILE_TRACED if traced else ''})") from e
        for t in tokens:
            if t() is not None:
                _kept(tokens)
                break
    return callback


def _xla_flags():
    """XLA_FLAGS as {name: value}: the last of each wins, as in XLA; a bare
    flag (a boolean set) reads "true"."""
    flags = {}
    for flag in os.environ.get("XLA_FLAGS", "").split():
        name, eq, value = flag.lstrip("-").partition("=")
        flags[name] = value if eq else "true"
    return flags


@functools.cache
def _commands_run_one_at_a_time():
    """Whether XLA's command buffers run their commands one after another:
    its default scheduling (LHS: each command after the one before), unless
    XLA_FLAGS asks for concurrent commands.  Read once, as XLA reads its
    flags once.  (Compiler options passed to one jit are not seen here:
    FOREIGN.md says not to ask for concurrent scheduling there.)"""
    flags = _xla_flags()
    mode = flags.get("xla_gpu_command_buffer_scheduling_mode", "").upper()
    concurrent = flags.get("xla_gpu_graph_enable_concurrent_region", "").lower()
    return mode not in ("CONCURRENT", "CONCURRENT_REGIONS") and concurrent not in ("true", "1")


@functools.cache
def _temporaries_stay_put():
    """Whether XLA_FLAGS tells XLA's command buffers not to trace again for
    temporaries that moved (SKIP_TEMP, SKIP_PROFILED): then a replayed call
    whose outputs are temporaries keeps its trace while the caller keeps
    every result (on the H200, fn ran at most 4 times in 1,000 kept calls;
    a separate pool for temporaries, --xla_gpu_temp_buffer_use_separate_color,
    did not keep it: 1,000 of 1,000)."""
    mode = _xla_flags().get("xla_gpu_command_buffer_update_mode", "").upper()
    return mode in ("SKIP_TEMP", "SKIP_PROFILED")


class _Start:
    """XLA's padded output buffer as the output fn writes: its first
    elements, in the output's own shape (what views and copies read)."""

    __slots__ = ("_b", "shape", "dtype")

    def __init__(self, b, shape):
        self._b, self.shape, self.dtype = b, shape, b.dtype

    def __dlpack_device__(self):
        return self._b.__dlpack_device__()

    def __dlpack__(self, **kwargs):
        info = ext.capsule_info(self._b.__dlpack__())
        # No owner: the buffer is XLA's for the call, as its own capsule's.
        return ext.raw_capsule(None, info["data"], self.shape, None, info["dtype"],
                               *info["device"])


def _capturing(ordinal, ctx):
    """Whether XLA's stream is being captured into a CUDA graph: this call
    is a trace, and what fn enqueues is recorded, not run."""
    return ext.capture_status(ordinal, ctx.stream) != ext.CAPTURE_NONE


_WHILE_TRACED = (
    "; it ran while XLA traced it into a CUDA graph (foreign(..., replay=True)), where fn "
    "may not wait for the GPU on the host (.item(), .cpu(), .tolist(), printing values, a "
    "shape that depends on values), launch on a stream other than XLA's "
    "(jax_overlay.foreign_stream()), or use a library that refuses stream capture: make fn "
    "capturable, or pass replay=False")


def _kept(tokens):
    gc.collect()  # a view in a reference cycle of fn's is not kept
    if any(t() is not None for t in tokens):
        raise ForeignError(
            "the foreign function kept a view of XLA's buffers past the call "
            "(XLA reuses that memory once the call returns); copy what you keep, "
            "e.g. np.array(x), x.clone() or x.copy() instead of x")


def _check_placement(args, framework):
    """Concrete inputs that no foreign call can take: sharded, pinned, or on
    the wrong kind of device.  (Traced inputs are checked in the call.)"""
    place = peers.foreign_peer(framework).runs_on  # "gpu", "cpu" or both (None)
    gpu = place == "gpu"
    arrays = [(i, x) for i, x in enumerate(jax.tree_util.tree_leaves(args))
              if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
              and getattr(x, "sharding", None) is not None]
    # An uncommitted array (one JAX made on its default device: jnp.ones,
    # grad's cotangent) goes where the committed ones are: only uncommitted
    # arrays alone say where the call runs.
    if any(getattr(x, "committed", True) for _, x in arrays):
        arrays = [(i, x) for i, x in arrays if getattr(x, "committed", True)]
    for i, x in arrays:
        sharding: Any = x.sharding  # jaxlib types its devices loosely
        devices = sharding.device_set
        rt.refuse_sharded(x, f"input {i}", ValueError, "a foreign function runs on one "
                          "device's buffers: gather it first (jax.device_put(x, device)), or "
                          "call the foreign function per shard inside jax.shard_map")
        if getattr(sharding, "memory_kind", None) == "pinned_host":
            raise ValueError(
                f"input {i} is in pinned host memory; a foreign function reads device memory: "
                "move it first (jax.device_put(x, x.sharding.with_memory_kind('device')))")
        platform = next(iter(devices)).platform
        if place is not None and gpu != (platform in ("gpu", "cuda", "rocm")):
            raise ValueError(
                f"input {i} is on {platform}, and framework={framework!r} runs on "
                f"{'CUDA GPUs' if gpu else 'the CPU'}: "
                + (f"use framework={peers.where('cpu')} for CPU arrays, or "
                   "jax.device_put(x, jax.devices('gpu')[0])"
                   if gpu else f"use framework={peers.where('gpu')} for GPU arrays, or "
                   "jax.device_put(x, jax.devices('cpu')[0])"))


def _aliases(given, in_leaves, out_leaves):
    """input_output_aliases checked against one call's flat leaves: sorted
    (input, output) pairs of the same shape and dtype, each output once."""
    if not isinstance(given, dict):
        raise TypeError(f"input_output_aliases must be a dict {{input: output}} of flat leaf "
                        f"indices, got {type(given).__qualname__}")
    pairs: list[tuple[int, int]] = []
    taken: dict[int, int] = {}
    for i, o in given.items():
        for what, v, n in (("input", i, len(in_leaves)), ("output", o, len(out_leaves))):
            if type(v) is bool or not isinstance(v, (int, np.integer)):
                raise TypeError(f"input_output_aliases: the {what} index {v!r} is a "
                                f"{type(v).__qualname__}; pass an int")
            if not 0 <= v < n:
                raise ValueError(f"input_output_aliases: {what} {v} does not exist; this call "
                                 f"has {n} {what} leaves (jax.tree_util.tree_leaves order)")
        i, o = int(i), int(o)
        if o in taken:
            raise ValueError(f"input_output_aliases: output {o} is given both input "
                             f"{taken[o]} and input {i}; alias each output to one input")
        taken[o] = i
        have, spec = _spec_of(in_leaves[i]), out_leaves[o]
        shape, dtype = tuple(have.shape), np.dtype(have.dtype)
        if shape != tuple(spec.shape) or dtype != np.dtype(spec.dtype):
            raise ValueError(
                f"input_output_aliases: input {i} is {dtype}{list(shape)} and output {o} is "
                f"{np.dtype(spec.dtype)}{list(spec.shape)}; an output shares its input's buffer, "
                "so both need one shape and dtype")
        pairs.append((i, o))
    return tuple(sorted(pairs))


def foreign(fn: Callable[..., Any], *, framework: str, result_shape_dtypes: Any,
            vjp: Callable[..., Any] | str | None = None, vmap_method: str | None = None,
            out: bool = False,
            input_output_aliases: dict[int, int] | None = None,
            recompute: bool = False, replay: bool = False) -> Callable[..., Any]:
    """``fn`` as a JAX function that runs inside ``jax.jit``, eagerly, under
    ``jax.vmap`` and, given ``vjp``, under ``jax.grad``.

    * ``framework``: ``"numpy"`` runs on views of XLA's host buffers (the
      CPU backend); ``"torch"``, ``"cupy"`` and ``"numba"`` on views of its
      device buffers, on XLA's own CUDA stream (PyTorch and CuPy have it
      current; Numba kernels take ``jax_overlay.foreign_stream()``);
      ``"torch"`` also on the CPU backend, as CPU tensors.
    * ``result_shape_dtypes``: a pytree of ``jax.ShapeDtypeStruct``, or a
      function of the inputs' shapes and dtypes (as ShapeDtypeStructs)
      returning one.
    * ``fn(*inputs)`` receives views (pytrees as passed; NumPy's are
      read-only, and no framework may write into them) and returns its
      outputs, which are copied into XLA's output buffers on XLA's stream;
      with ``out=True``, ``fn(*inputs, out=views)`` writes into XLA's output
      buffers itself and returns None (no copy at all).  A returned shape or
      dtype that contradicts ``result_shape_dtypes`` raises on the call.
    * ``vjp(*inputs, cotangent)`` of the same framework returns the inputs'
      cotangents (a tuple, one per input); it is run as a second foreign
      call through ``jax.custom_vjp``, the inputs kept as the residuals.
      ``vjp="autograd"`` (``framework="torch"``): PyTorch's autograd of
      ``fn`` computes them.  The forward call keeps its autograd graph for
      the backward call (which reads back which graph is its own: on the
      GPU an 8-byte read that waits for XLA's stream), so ``fn`` runs once
      per step; up to ``jax_overlay.config.saved_graphs`` graphs wait per
      function.  ``recompute=True`` keeps nothing: the backward call runs
      ``fn`` again under autograd, with no read (as with ``vmap_method``
      ``"expand_dims"``/``"broadcast_all"``, where it is always so).
      Either way PyTorch differentiates only the inputs JAX differentiates
      (``argnums``); the others get zeros, which XLA drops if unused.
      Complex gradients follow JAX's convention (PyTorch's conjugated), as
      a ``vjp`` function's must.
    * ``vmap_method``: as for ``jax.pure_callback`` (``"sequential"``,
      ``"expand_dims"``, ``"broadcast_all"``).
    * ``input_output_aliases``: ``{input: output}`` over the flat leaves
      (``jax.tree_util.tree_leaves`` order), as for ``jax.ffi.ffi_call``:
      the output's buffer starts with the input's values, and is the
      input's own buffer where ``jax.jit`` donates it (``donate_argnums``),
      so nothing is allocated; with ``out=True``, ``fn`` updates it in place.
    * ``replay=True`` (GPU frameworks): XLA may trace ``fn`` into its CUDA
      command buffer and replay it without Python, so ``fn`` must be a
      pure function of its inputs (its Python runs only when XLA traces).
      What ``fn`` allocates while traced stays reserved for the traces as
      long as this function lives.  A host synchronisation in ``fn`` fails
      the trace, naming ``replay=False``.  XLA graphs small programs only
      with ``XLA_FLAGS=--xla_gpu_graph_min_graph_size=1``; otherwise ``fn``
      runs on every call, as by default.  With ``vjp="autograd"`` the
      tensors fn's graph saves (found by running fn once on meta tensors)
      pass to the backward call as residuals; where that run cannot tell,
      the backward runs fn again.
    * Views live for the call only: anything ``fn`` keeps must be a copy.
    """
    peer = peers.foreign_peer(framework)  # ValueError naming the frameworks
    _check_arguments(peer, fn, vjp, vmap_method, out, recompute, replay)
    call = _caller(fn, framework, result_shape_dtypes, vmap_method, out, input_output_aliases,
                   replay)
    if vjp is None:
        return functools.wraps(fn)(call)
    if vjp == "autograd":
        # Under replay the saved tensors travel as residuals instead (a
        # replayed trace runs no Python, and a saved graph is found by
        # reading its ticket on the host).
        unbatched = vmap_method in (None, "sequential", "sequential_unrolled")
        saved = not recompute and not replay and unbatched
        residual = not recompute and replay and unbatched
        return functools.wraps(fn)(_with_autograd(
            call, peer.autograd(fn), framework, result_shape_dtypes, vmap_method, saved,
            replay, residual))
    return functools.wraps(fn)(_with_vjp(call, vjp, framework, vmap_method, replay))


def _check_arguments(peer, fn, vjp, vmap_method, out, recompute, replay):
    """foreign()'s refusals of what it is given, each naming the fix."""
    if vmap_method is not None and vmap_method not in VMAP_METHODS:
        raise ValueError(
            f"vmap_method={vmap_method!r}: pass one of {', '.join(map(repr, VMAP_METHODS))} "
            "(as for jax.pure_callback), or None for a function never batched")
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__qualname__}")
    if isinstance(vjp, str) and (vjp != "autograd" or peer.autograd is None):
        with_autograd = peers.with_autograd()
        raise ValueError(
            f"vjp={vjp!r}: the one named vjp is 'autograd', for framework={with_autograd}; "
            "otherwise pass a function of the same framework")
    if vjp == "autograd" and out:
        raise ValueError(
            "vjp='autograd' differentiates the outputs fn returns, and with out=True fn "
            "returns none (PyTorch's autograd does not follow out= arguments): drop out=True "
            "for autograd (fn's outputs are then copied into XLA's), or pass a vjp function")
    if vjp is not None and not isinstance(vjp, str) and not callable(vjp):
        raise TypeError(f"vjp must be callable, 'autograd' or None, got {type(vjp).__qualname__}")
    for name, flag in (("recompute", recompute), ("replay", replay)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be True or False, got {type(flag).__qualname__}")
    if recompute and vjp != "autograd":
        raise ValueError(
            f"recompute=True chooses how vjp='autograd' finds the forward's graph (it runs fn "
            f"again in the backward call); with vjp={vjp!r} there is no graph: drop recompute")


def _caller(fn, framework, result_shape_dtypes, vmap_method, out, input_output_aliases,
            replay):
    """The foreign call of `fn`: its arguments checked and flattened, one
    buffer_callback per input structure and result spec, compiled once."""

    @functools.lru_cache(maxsize=64)
    def _compiled(in_tree, out_spec_key, aliases, padded):
        out_tree, out_specs = out_spec_key
        from jax.experimental.buffer_callback import buffer_callback
        shapes = None
        if padded:
            shapes = [tuple(o.shape) for o in out_specs]
            out_specs = [jax.ShapeDtypeStruct((math.prod(o.shape) + 1,), o.dtype)
                         for o in out_specs]
        # The framework is imported on the first call, not when fn is wrapped.
        cb = _make_callback(fn, _adapter(framework), in_tree, out_tree, out, replay, shapes)
        # Flat on both sides: the callback gets XLA's buffers as leaves.
        # command_buffer_compatible only with replay=True: otherwise fn's
        # Python runs on every call, never once into a CUDA graph that XLA
        # replays.
        return buffer_callback(cb, list(out_specs), vmap_method=vmap_method,
                               input_output_aliases=dict(aliases) or None,
                               command_buffer_compatible=replay)

    # A replayed call keeps its trace only while its buffers stay put, and
    # a result the caller keeps is a new buffer each call.  Where XLA_FLAGS
    # has XLA not trace again for moved temporaries (SKIP_TEMP), fn writes
    # temporaries one element longer than its outputs, and XLA copies each
    # output's elements out of them into the result: the trace then holds.  Not under a batching
    # vmap method (its buffers' starts are not one block) or with aliases
    # (an output is then an input's buffer).
    paddable = (replay and not input_output_aliases and framework != "numpy"
                and vmap_method in (None, "sequential", "sequential_unrolled"))

    def call(*args):
        if not args:
            raise TypeError("a foreign function takes at least one array argument")
        _check_placement(args, framework)
        spec = _result_spec(result_shape_dtypes, args)
        out_leaves, out_tree = jax.tree_util.tree_flatten(spec)
        in_leaves, in_tree = jax.tree_util.tree_flatten(args)
        aliases = (() if input_output_aliases is None
                   else _aliases(input_output_aliases, in_leaves, out_leaves))
        padded = paddable and _temporaries_stay_put()
        try:
            flat = _compiled(in_tree, (out_tree, tuple(out_leaves)), aliases, padded)(*in_leaves)
        except Exception as e:
            raise _explained(e, fn) from e
        if padded:
            flat = [y[:math.prod(o.shape)].reshape(o.shape) for y, o in zip(flat, out_leaves)]
        return jax.tree_util.tree_unflatten(out_tree, flat)
    return call


def _with_vjp(call, vjp, framework, vmap_method, replay):
    """`call` differentiable through jax.custom_vjp, its backward `vjp` run
    as a second foreign call of the same framework, the inputs kept as the
    residuals."""
    backward_fn = _one_per_input(vjp)

    def vjp_spec(*args):
        return tuple(args[:-1])  # one cotangent per input, shaped as it
    backward = foreign(backward_fn, framework=framework, result_shape_dtypes=vjp_spec,
                       vmap_method=vmap_method, replay=replay)

    @jax.custom_vjp
    def differentiable(*args):
        return call(*args)

    def fwd(*args):
        return call(*args), args  # the inputs are the residuals (JAX arrays)

    def bwd(residuals, cotangent):
        return _cotangents(residuals, backward(*residuals, cotangent))

    differentiable.defvjp(fwd, bwd)
    return differentiable


# The forward's ticket, as an output XLA keeps for the backward: 64 bits
# as two int32 words (JAX without x64 has no 64-bit integers).
_TICKET = jax.ShapeDtypeStruct((2,), np.int32)


def _with_autograd(call, autograd, framework, result_shape_dtypes, vmap_method, saved,
                   replay=False, residual=False):
    """vjp="autograd": the framework's autograd (`autograd`, its peer's
    object) differentiates fn for the inputs JAX differentiates, and no
    others (``custom_vjp``'s symbolic zeros say which: an input outside
    ``argnums`` costs no gradient).  Saved: under differentiation the
    forward is a foreign call of ``autograd.forward``, which keeps fn's
    graph and also returns its ticket, and the backward call
    (``autograd.backward``) gets the inputs, the ticket and the cotangent.
    Residual (under replay): the forward is ``autograd.forward_residuals``, which
    also returns the tensors fn's graph saves, as residuals, and the
    backward (``autograd.backward_residuals``) gets the inputs, those and the
    cotangent; where ``autograd.residual_sizes`` cannot tell what the graph
    saves, as otherwise, the forward is `call` and the backward
    ``autograd.recompute``.  Undifferentiated calls are `call` itself: no
    graph is recorded."""
    from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero

    if callable(result_shape_dtypes) and not hasattr(result_shape_dtypes, "shape"):
        def results(*specs):
            return result_shape_dtypes(*specs)
    else:
        def results(*specs):
            return result_shape_dtypes

    def forward_spec(*specs):
        return results(*specs), _TICKET
    made: dict = {}

    def calls(need, key=None, sizes=None):
        """(forward, backward) foreign functions for the inputs `need`
        marks (and, passing residuals, the inputs `key` describes)."""
        got = made.get((need, key))
        if got is not None:
            return got

        def wanted(*specs):  # the needed input leaves, flat
            leaves = jax.tree_util.tree_leaves(specs[:-2] if saved or key else specs[:-1])
            return [x for x, n in zip(leaves, need) if n]
        forward: Callable[..., Any] | None = None
        if key is not None:
            def residual_spec(*specs):
                return results(*specs), [jax.ShapeDtypeStruct((n,), np.uint8) for n in sizes]
            forward = foreign(functools.partial(autograd.forward_residuals, need, key),
                              framework=framework, result_shape_dtypes=residual_spec,
                              vmap_method=vmap_method, replay=True)
            backward = foreign(functools.partial(autograd.backward_residuals, need, key),
                               framework=framework, result_shape_dtypes=wanted,
                               vmap_method=vmap_method, replay=True)
        else:
            backward = foreign(functools.partial(
                autograd.backward if saved else autograd.recompute, need),
                framework=framework, result_shape_dtypes=wanted, vmap_method=vmap_method,
                replay=replay)
            if saved:
                forward = foreign(functools.partial(autograd.forward, need),
                                  framework=framework, result_shape_dtypes=forward_spec,
                                  vmap_method=vmap_method)
        got = made[(need, key)] = (forward, backward)
        return got

    def template_key(need, args):
        """What a template graph is found by (none of it a JAX type, so not a
        residual: forward and backward each work it out from the inputs)."""
        flat, in_tree = jax.tree_util.tree_flatten(tuple(args))
        return need, in_tree, tuple((tuple(np.shape(x)), np.dtype(jax.numpy.result_type(x)))
                                    for x in flat)

    @jax.custom_vjp
    def differentiable(*args):
        return call(*args)

    def fwd(*primals):
        leaves, tree = jax.tree_util.tree_flatten(
            primals, is_leaf=lambda x: isinstance(x, CustomVJPPrimal))
        args = jax.tree_util.tree_unflatten(tree, [p.value for p in leaves])
        need = tuple(bool(p.perturbed) and jax.numpy.issubdtype(
            jax.numpy.result_type(p.value), jax.numpy.inexact) for p in leaves)
        if residual and any(need):
            key = template_key(need, args)
            sizes = autograd.residual_sizes(key)
            if sizes is not None:
                outs, residuals = calls(need, key, sizes)[0](*args)
                return outs, (args, need, residuals)  # a list: residuals
        forward = calls(need)[0] if any(need) else None
        if forward is None:  # recompute, or nothing to differentiate
            return call(*args), (args, need, None)
        outs, ticket = forward(*args)
        return outs, (args, need, ticket)  # the inputs (JAX arrays) and the ticket

    def bwd(residuals, cotangent):
        args, need, ticket = residuals
        cotangent = jax.tree_util.tree_map(
            _instantiate, cotangent, is_leaf=lambda x: isinstance(x, SymbolicZero))
        got = iter(())
        if isinstance(ticket, list):  # the saved tensors, as residuals
            got = iter(calls(need, template_key(need, args))[1](*args, ticket, cotangent))
        elif any(need):
            _, backward = calls(need)
            got = iter(backward(*args, ticket, cotangent) if ticket is not None
                       else backward(*args, cotangent))
        leaves, tree = jax.tree_util.tree_flatten(args)
        # An input JAX does not differentiate gets zeros, which XLA drops
        # unless they are used; an integer one float0.
        return tuple(jax.tree_util.tree_unflatten(tree, [
            next(got) if n else _zero_cotangent(x) for x, n in zip(leaves, need)]))

    differentiable.defvjp(fwd, bwd, symbolic_zeros=True)
    differentiable.saved = autograd  # type: ignore[attr-defined]
    return differentiable


def _instantiate(c):
    """A symbolic zero cotangent as an array (the framework's autograd takes
    arrays)."""
    from jax.custom_derivatives import SymbolicZero
    if not isinstance(c, SymbolicZero):
        return c
    if c.dtype == jax.dtypes.float0:
        return np.zeros(c.shape, jax.dtypes.float0)
    return jax.numpy.zeros(c.shape, c.dtype)


def _zero_cotangent(x):
    dtype = jax.numpy.result_type(x)
    if jax.numpy.issubdtype(dtype, jax.numpy.inexact):
        return jax.numpy.zeros(np.shape(x), dtype)
    return np.zeros(np.shape(x), jax.dtypes.float0)


# vmap_method values jax.pure_callback and buffer_callback take.
VMAP_METHODS = ("sequential", "sequential_unrolled", "expand_dims", "broadcast_all",
                "legacy_vectorized")


def _explained(e, fn):
    """The exception to raise for `e`, raised while a foreign call was traced
    or run eagerly: JAX's own errors for what foreign() has an argument for
    name that argument; fn's own failure comes back with its class and
    message first (XLA's runtime error puts a traceback before them); any
    other error is `e` itself."""
    name = getattr(fn, "__qualname__", fn)
    text = str(e)
    if isinstance(e, ValueError) and "do not support JVP" in text:
        autograd = peers.with_autograd()
        return ValueError(
            f"the foreign function {name!r} has no derivative: pass foreign(..., vjp=...) a "
            "function of (inputs..., cotangent) returning one cotangent per input, or "
            f"vjp='autograd' with framework={autograd}")
    if isinstance(e, NotImplementedError) and "vmap_method" in text:
        return NotImplementedError(
            f"the foreign function {name!r} is batched by jax.vmap, and was made without "
            f"vmap_method=: pass foreign(..., vmap_method=...) one of "
            f"{', '.join(map(repr, VMAP_METHODS))} (as for jax.pure_callback)")
    marker = "ForeignError: "
    if isinstance(e, JaxRuntimeError) and marker in text:
        return like_stock(ForeignError(text[text.rindex(marker) + len(marker):].strip()),
                          JaxRuntimeError)
    return e


def _one_per_input(vjp):
    """`vjp` taking a bare cotangent for one input (as PyTorch's autograd
    does) as the tuple of one; any other count than one per input is an
    error naming the vjp."""
    name = getattr(vjp, "__qualname__", vjp)

    @functools.wraps(vjp)
    def backward(*args):
        got = vjp(*args)
        n = len(args) - 1
        if not isinstance(got, (tuple, list)):
            if n == 1:
                return (got,)
            raise ForeignError(
                f"the vjp {name!r} returned a {type(got).__qualname__} for {n} inputs; "
                "return a tuple with one cotangent per input")
        if len(got) != n:
            raise ForeignError(
                f"the vjp {name!r} returned {len(got)} cotangents for {n} inputs; "
                "return a tuple with one cotangent per input")
        return tuple(got)
    return backward


def _cotangents(residuals, got):
    """The backward call's outputs as custom_vjp wants them: integer and
    boolean inputs have no cotangent but float0 zeros."""
    out = []
    for x, ct in zip(residuals, got):
        out.append(jax.tree_util.tree_map(
            lambda x, c: c if jax.numpy.issubdtype(jax.numpy.result_type(x), jax.numpy.inexact)
            else _zero_cotangent(x), x, ct))
    return tuple(out)
