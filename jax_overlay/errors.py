"""Room: the public exception classes, which keep stock JAX's contract.

The protocols (DLPack, the Array API) ask for ``BufferError`` where a copy
is needed but ``copy=False`` forbids it, or where memory cannot be held;
stock JAX raises ``ValueError`` for the same refusals, and jaxlib's own
``JaxRuntimeError`` where it cannot read a layout or has no GPU.  Code
written against stock JAX catches stock's class, code written against the
protocols catches ``BufferError``: each refusal here is an instance of both.
"""

from __future__ import annotations

import functools

from jax.errors import JaxRuntimeError


def _runtime_init(self, *args):
    # jaxlib's JaxRuntimeError keeps its message in native state that its
    # __str__ reads; BufferError's __init__, first in the MRO, would skip it.
    JaxRuntimeError.__init__(self, *args)


class CopyRequiredError(BufferError, ValueError):
    """copy=False, and the import or export needs a copy (another device or
    memory kind, a host pointer jaxlib cannot view): stock JAX's
    ``ValueError`` and the protocols' ``BufferError``."""


class LayoutCopyRequiredError(CopyRequiredError, JaxRuntimeError):
    """copy=False on strides no view can hold (sliced, negative, broadcast)
    or a misaligned GPU pointer: stock jaxlib refuses such layouts with
    ``JaxRuntimeError`` whatever ``copy`` says."""
    __init__ = _runtime_init


class ForeignError(RuntimeError):
    """What ``fn`` did wrong inside a ``jax_overlay.foreign`` call: an
    exception it raised (chained), an output that contradicts
    ``result_shape_dtypes``, or a view it kept.  XLA reports it as its
    runtime error, naming this class."""


class NoCudaError(BufferError, JaxRuntimeError):
    """GPU memory in a process where JAX has no CUDA backend (or no driver):
    stock JAX's ``JaxRuntimeError`` ("requires CUDA support")."""
    __init__ = _runtime_init


@functools.cache
def _joined(ours: type, stock: type) -> type:
    """One class deriving from both, named after both (BufferError and
    TypeError give ``jax_overlay.errors.BufferTypeError``: never a builtin's
    name) and reachable under that name here, so that it pickles; cached,
    so ``except`` clauses and ``type(e)`` comparisons see the same class
    every time."""
    if issubclass(ours, stock):
        return ours
    name = ours.__name__.removesuffix("Error") + stock.__name__
    body = {"__init__": _runtime_init} if issubclass(stock, JaxRuntimeError) else {}
    cls = type(name, (ours, stock), {
        **body, "__module__": __name__, "__qualname__": name,
        "__doc__": f"{ours.__name__} of jax_overlay that is also stock JAX's "
                   f"{stock.__name__} for the same refusal."})
    globals()[name] = cls
    return cls


def like_stock(e: BaseException, stock: type) -> BaseException:
    """`e` again, as an instance of a class deriving from its own and from
    `stock`, the class stock JAX raises at this entry point for the same
    input; the message and the cause are kept."""
    if isinstance(e, stock):
        return e
    cls: type = type(e)
    out = _joined(cls, stock)(*e.args)
    out.__cause__ = e.__cause__
    out.__suppress_context__ = True
    return out
