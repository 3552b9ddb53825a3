"""Foreign functions inside jax.jit: a function written for another array
library runs on views of XLA's own buffers, through
``jax.experimental.buffer_callback``, with no copy of its inputs and no
host synchronisation beyond what the library itself does.

Frameworks: ``"numpy"`` (host buffers, the CPU backend).  The GPU
frameworks (``"torch"``, ``"cupy"``, ``"numba"``) are refused with a clear
error until their paths have been proven on a GPU.

Lifetime: the views given to ``fn`` are XLA's buffers for the duration of
the call only.  Inputs are read-only views; outputs are written by copying
what ``fn`` returns into XLA's output buffers, or, with ``out=True``, by
``fn`` itself into the views it is given.  A view that ``fn`` keeps past
the call (in a global, a closure, a list) would read memory XLA reuses: it
is detected when the call returns, and the call fails with an error that
says to copy what is kept.
"""

from __future__ import annotations

import functools
import sys

import jax
import numpy as np

FRAMEWORKS = ("numpy", "torch", "cupy", "numba")
_PROVEN = ("numpy",)


class ForeignError(RuntimeError):
    """What ``fn`` did wrong inside a foreign call: an exception it raised
    (chained), an output that contradicts ``result_shape_dtypes``, or a view
    it kept.  XLA reports it as its runtime error, naming this class."""


def _spec_leaf(x, where):
    shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
    if shape is None or dtype is None:
        raise TypeError(
            f"result_shape_dtypes{where} is {x!r}; each leaf needs .shape and .dtype "
            "(a jax.ShapeDtypeStruct)")
    return jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype))


def _result_spec(result_shape_dtypes, args):
    """The outputs' pytree of ShapeDtypeStructs: given, or computed from the
    inputs' shapes and dtypes."""
    spec = result_shape_dtypes
    if callable(spec) and not hasattr(spec, "shape"):
        spec = spec(*jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(np.shape(x), jax.numpy.result_type(x)), args))
    leaves, tree = jax.tree_util.tree_flatten_with_path(spec)
    flat = [_spec_leaf(x, jax.tree_util.keystr(path)) for path, x in leaves]
    return jax.tree_util.tree_unflatten(tree, flat)


def _check_output(i, got, want):
    """`got`, the i-th output of fn, as an array XLA's buffer can take."""
    arr = np.asarray(got)
    if not isinstance(got, np.ndarray) and np.ndim(got) == 0 and arr.dtype != want.dtype:
        # A Python scalar for a 0-d output: its value, in the declared dtype.
        arr = np.asarray(got, want.dtype)
    if arr.shape != want.shape or arr.dtype != want.dtype:
        raise ForeignError(
            f"output {i} of the foreign function is {arr.dtype}{list(arr.shape)}, but "
            f"result_shape_dtypes says {np.dtype(want.dtype)}{list(want.shape)}; return "
            "exactly that, or correct result_shape_dtypes")
    return arr


class _NumPy:
    """Views of XLA's host buffers as NumPy arrays."""

    @staticmethod
    def inputs(buffers):
        views = []
        for b in buffers:
            v = np.asarray(b)
            v.flags.writeable = False  # fn must not write into JAX's inputs
            views.append(v)
        return views

    @staticmethod
    def outputs(buffers):
        return [np.asarray(b) for b in buffers]

    @staticmethod
    def copy_into(view, arr):
        np.copyto(view, arr)


_ADAPTERS = {"numpy": _NumPy}


def _refs(views):
    return [sys.getrefcount(v) for v in views]


def _run(fn, adapter, inputs, out_tree, out_views, write_out):
    """Calls fn and fills XLA's output buffers.  Its own function, so that
    nothing of the call (loop variables, the result) outlives it here."""
    if write_out:
        got = fn(*inputs, out=jax.tree_util.tree_unflatten(out_tree, out_views))
        if got is not None:
            raise ForeignError(
                "with out=True the foreign function writes its outputs into `out` and "
                f"returns None; it returned {type(got).__qualname__}")
        return
    leaves, tree = jax.tree_util.tree_flatten(fn(*inputs))
    if tree != out_tree:
        raise ForeignError(
            f"the foreign function returned the structure {tree}, but "
            f"result_shape_dtypes has {out_tree}")
    # Checked against XLA's own output buffers: under vmap they carry the
    # batch dimension that result_shape_dtypes does not.
    for i, (view, leaf) in enumerate(zip(out_views, leaves)):
        adapter.copy_into(view, _check_output(i, leaf, view))


def _make_callback(fn, adapter, in_tree, out_tree, write_out):
    def callback(ctx, outs, *args):
        del ctx  # the CPU backend has no stream
        in_views = adapter.inputs(jax.tree_util.tree_leaves(args))
        out_views = adapter.outputs(jax.tree_util.tree_leaves(outs))
        # Counted before fn sees them: a reference more after the call is
        # one fn kept (the view itself, or a view of it, which holds it).
        before = _refs(in_views) + _refs(out_views)
        try:
            _run(fn, adapter, jax.tree_util.tree_unflatten(in_tree, in_views),
                 out_tree, out_views, write_out)
        except ForeignError:
            raise
        except Exception as e:
            # XLA reports it as its runtime error, with this message and the
            # traceback of fn's own exception.
            raise ForeignError(
                f"the foreign function {getattr(fn, '__qualname__', fn)!r} raised "
                f"{type(e).__qualname__}: {e}") from e
        if _refs(in_views) + _refs(out_views) != before:
            raise ForeignError(
                "the foreign function kept a view of XLA's buffers past the call "
                "(XLA reuses that memory once the call returns); copy what you keep, "
                "e.g. np.array(x) instead of x")
    return callback


def foreign(fn, *, framework, result_shape_dtypes, vjp=None, vmap_method=None, out=False):
    """``fn`` as a JAX function that runs inside ``jax.jit``, eagerly, under
    ``jax.vmap`` and, given ``vjp``, under ``jax.grad``.

    * ``framework``: ``"numpy"`` runs on views of XLA's host buffers (the
      CPU backend).  ``"torch"``, ``"cupy"`` and ``"numba"`` are not
      available yet.
    * ``result_shape_dtypes``: a pytree of ``jax.ShapeDtypeStruct``, or a
      function of the inputs' shapes and dtypes (as ShapeDtypeStructs)
      returning one.
    * ``fn(*inputs)`` receives read-only views (pytrees as passed) and
      returns its outputs, which are copied into XLA's output buffers; with
      ``out=True``, ``fn(*inputs, out=views)`` writes into XLA's output
      buffers itself and returns None (no copy at all).  A returned shape or
      dtype that contradicts ``result_shape_dtypes`` raises on the call.
    * ``vjp(*inputs, cotangent)`` of the same framework returns the inputs'
      cotangents (a tuple, one per input); it is run as a second foreign
      call through ``jax.custom_vjp``, the inputs kept as the residuals.
    * ``vmap_method``: as for ``jax.pure_callback`` (``"sequential"``,
      ``"expand_dims"``, ``"broadcast_all"``).
    * Views live for the call only: anything ``fn`` keeps must be a copy.
    """
    if framework not in FRAMEWORKS:
        raise ValueError(f"framework={framework!r}: pass one of {', '.join(map(repr, FRAMEWORKS))}")
    if framework not in _PROVEN:
        raise NotImplementedError(
            f"framework={framework!r} is not available in this version of jax_overlay; "
            "framework='numpy' runs on the CPU backend, and jax.pure_callback runs "
            "any library through host copies")
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__qualname__}")
    adapter = _ADAPTERS[framework]

    @functools.lru_cache(maxsize=64)
    def _compiled(in_tree, out_spec_key):
        out_tree, out_specs = out_spec_key
        spec = jax.tree_util.tree_unflatten(out_tree, list(out_specs))
        from jax.experimental.buffer_callback import buffer_callback
        cb = _make_callback(fn, adapter, in_tree, out_tree, out)
        return buffer_callback(cb, spec, vmap_method=vmap_method)

    def call(*args):
        if not args:
            raise TypeError("a foreign function takes at least one array argument")
        spec = _result_spec(result_shape_dtypes, args)
        out_leaves, out_tree = jax.tree_util.tree_flatten(spec)
        in_tree = jax.tree_util.tree_structure(args)
        return _compiled(in_tree, (out_tree, tuple(out_leaves)))(*args)

    if vjp is None:
        return functools.wraps(fn)(call)

    def vjp_spec(*args):
        return tuple(args[:-1])  # one cotangent per input, shaped as it

    backward = foreign(vjp, framework=framework, result_shape_dtypes=vjp_spec,
                       vmap_method=vmap_method)

    @jax.custom_vjp
    def differentiable(*args):
        return call(*args)

    def fwd(*args):
        return call(*args), args  # the inputs are the residuals (JAX arrays)

    def bwd(residuals, cotangent):
        return tuple(backward(*residuals, cotangent))

    differentiable.defvjp(fwd, bwd)
    return functools.wraps(fn)(differentiable)
