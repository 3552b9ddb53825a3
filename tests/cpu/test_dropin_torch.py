"""The drop-in rule for PyTorch CPU tensors, differentially (tests/dropin.py):
every entry point x PyTorch dtype x layout (including its lazy conjugate and
negative views, tensors requiring grad, Parameters and sparse tensors) x copy
x device, stock JAX and installed in one process, each result checked
against the tensor's own values; and JAX arrays read by PyTorch.  Skipped where PyTorch is not installed:
CI installs the CPU build in its jax 0.10 environment (.ci/run), and sets
JAX_OVERLAY_REQUIRE_TORCH=1 there, which makes a missing PyTorch a failure."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from torch_or_skip import torch as _torch

torch = _torch()
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import dropin as D  # noqa: E402
import jax_overlay  # noqa: E402
from jax_overlay import peers  # noqa: E402
from jax_overlay import _runtime as rt  # noqa: E402
from jax_overlay.errors import CopyRequiredError  # noqa: E402
from test_dropin import _coords  # noqa: E402

NAMES = ("bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
         "float16", "bfloat16", "float32", "float64", "complex64", "complex128",
         "float8_e4m3fn")
# NumPy has no bfloat16 or float8: their bits are read through an integer view.
_BITS = {"bfloat16": (torch.int16, ml_dtypes.bfloat16),
         "float8_e4m3fn": (torch.uint8, ml_dtypes.float8_e4m3fn)}


def _np_dtype(name):
    return np.dtype(getattr(ml_dtypes, name, None) or name)


def truth(t):
    """The values a PyTorch tensor holds, on the host: its lazy bits applied
    (PyTorch has no negation for some dtypes: None, nothing to judge)."""
    try:
        t = t.detach().resolve_conj().resolve_neg()
    except RuntimeError:
        return None
    if t.is_sparse:
        return None
    name = str(t.dtype).removeprefix("torch.")
    if name in _BITS:
        as_int, dtype = _BITS[name]
        return t.view(as_int).numpy().view(dtype)
    return t.numpy()


def _base(name):
    dtype = getattr(torch, name)
    host = D.values((8, 16), _np_dtype(name))
    if name in _BITS:
        return torch.from_numpy(host.view(np.dtype(str(_BITS[name][0]).removeprefix("torch."))))\
            .view(dtype)
    return torch.from_numpy(host)


def producers(name):
    dtype = getattr(torch, name)

    def base():
        return _base(name)
    out = {
        "aligned": base, "unaligned": lambda: base().reshape(-1)[1:],
        "strided": lambda: base()[:, ::2], "transposed": lambda: base().T,
        "broadcast": lambda: base()[:1].expand(8, 16), "0d": lambda: base().reshape(-1)[3],
        "empty": lambda: base()[:0],
        # A negative view: only a bit on the tensor, over the memory as it was.
        "neg_view": lambda: torch._neg_view(base()),
        "neg_view_strided": lambda: torch._neg_view(base())[:, ::2],
    }
    if name in ("float32", "int64", "bool"):  # PyTorch's to_sparse() lacks some dtypes
        out["sparse"] = lambda: base().to_sparse()
    if dtype.is_floating_point or dtype.is_complex:
        out["requires_grad"] = lambda: base().requires_grad_(True)
        out["parameter"] = lambda: torch.nn.Parameter(base())
    if dtype.is_complex:
        out["conj_view"] = lambda: base().conj()
        # Its imaginary part: the common way to a negative view.
        out["conj_imag"] = lambda: base().conj().imag
    return out


def _check(diffs, counts):
    assert counts["stock ok"] > 0
    assert not diffs, f"{len(diffs)} differences:\n" + "\n".join(diffs[:40])


@pytest.mark.parametrize("x64", [False, True], ids=["x32", "x64"])
@pytest.mark.parametrize("name", NAMES)
def test_torch_imports_match_stock(name, x64):
    cases = D.import_cases(D.IMPORTS, producers(name), _coords(), truth)
    with rt.x64(x64):
        _check(*D.differential(cases))


@pytest.mark.parametrize("entry", ["jax.dlpack.from_dlpack", "jnp.from_dlpack"])
@pytest.mark.parametrize("view", ["conj().imag", "_neg_view", "_neg_view[:, ::2]"])
def test_negative_views_import_their_values(installed, entry, view):
    """PyTorch exports a negative view's memory unnegated through DLPack
    (stock JAX, NumPy and PyTorch's own from_dlpack read 1 for -1): the
    overlay resolves it first, and copy=False, which cannot have that copy,
    is refused with a class stock's callers catch."""
    z = torch.complex(torch.arange(1.0, 9.0), torch.arange(2.0, 10.0)).reshape(2, 4)
    t = {"conj().imag": lambda: z.conj().imag,
         "_neg_view": lambda: torch._neg_view(z.real.contiguous()),
         "_neg_view[:, ::2]": lambda: torch._neg_view(z.real.contiguous())[:, ::2]}[view]()
    assert t.is_neg()
    fn = eval(entry, {"jax": jax, "jnp": jnp})
    np.testing.assert_array_equal(np.asarray(fn(t)), t.resolve_neg().numpy())
    with pytest.raises(CopyRequiredError, match="negative bit") as e:
        fn(t, copy=False)
    assert isinstance(e.value, (BufferError, ValueError, jax.errors.JaxRuntimeError))


def test_conjugate_views_import_where_stock_refuses(installed):
    z = torch.complex(torch.arange(4.0), torch.ones(4)).conj()
    np.testing.assert_array_equal(np.asarray(jnp.from_dlpack(z)), z.resolve_conj().numpy())
    with pytest.raises(BufferError, match="conjugate bit"):
        jnp.from_dlpack(z, copy=False)


@pytest.mark.parametrize("dtype", ["bool", "uint16", "float8_e4m3fn"])
def test_negative_views_torch_cannot_negate_are_refused(dtype):
    """PyTorch has no negation for these dtypes.  On the CPU its own
    __dlpack_device__ already raises for such a view (stock and installed
    alike); a CUDA tensor's does not, and reaches this refusal."""
    t = torch._neg_view(torch.ones(3, dtype=getattr(torch, dtype)))
    with pytest.raises(BufferError, match="cannot resolve") as e:
        peers.resolve(t, None)
    assert isinstance(e.value, jax.errors.JaxRuntimeError)
    plain = torch.ones(3)
    assert peers.resolve(plain, None) == (plain, False)


def test_the_truth_sees_the_bits():
    """The harness's own reference: a wrong sign would pass unnoticed."""
    t = torch._neg_view(torch.arange(1.0, 4.0))
    np.testing.assert_array_equal(truth(t), [-1.0, -2.0, -3.0])
    assert D.wrong(jnp.asarray([1.0, 2.0, 3.0]), truth(t)) == "values are not the producer's"
    assert not jax_overlay.installed()


def _export_cases(dtype):
    """JAX CPU arrays read by PyTorch, through DLPack and through NumPy."""
    def x():  # on the CPU also where the default device is a GPU
        return jnp.asarray(D.values((8, 16), dtype), device=jax.devices("cpu")[0])
    reads = {
        "torch.from_dlpack": lambda: torch.from_dlpack(x()),
        "torch.from_dlpack(.T)": lambda: torch.from_dlpack(x().T),
        "torch.from_dlpack(0-d)": lambda: torch.from_dlpack(x()[0, 0]),
        "torch.from_dlpack(empty)": lambda: torch.from_dlpack(x()[:0]),
        "torch.utils.dlpack.from_dlpack(capsule)":
            lambda: torch.utils.dlpack.from_dlpack(x().__dlpack__()),
        "torch.as_tensor": lambda: torch.as_tensor(x()),
        "torch.tensor": lambda: torch.tensor(x()),
        "torch.asarray": lambda: torch.asarray(x()),
    }
    for name, read in reads.items():
        yield name, lambda read=read: truth(read()), None


# torch.asarray reads a JAX CPU array through the buffer protocol, read-only,
# and says so once per process, stock and installed alike.
@pytest.mark.filterwarnings("ignore:The given buffer is not writable")
@pytest.mark.parametrize("dtype", D.DTYPES, ids=str)
def test_torch_reads_exports_as_on_stock(dtype):
    with rt.x64(True):
        _check(*D.differential(_export_cases(dtype)))


def test_zero_size_lazy_views_match_stock():
    """A zero-size conjugate or negative view has no values for the bit to
    change: it imports as stock imports it, copy=False included (found by
    the GPU fuzz's PyTorch family, run on CPU tensors)."""
    views = {"_neg_view": lambda: torch._neg_view(torch.ones(0)),
             "_neg_view 2-d": lambda: torch._neg_view(torch.ones(3, 0)),
             "conj": lambda: torch.ones(0, dtype=torch.complex64).conj()}
    cases = [(f"{entry}({name}, copy={copy})",
              lambda e=fn, v=view, c=copy: e(v(), c, None), None)
             for name, view in views.items() for copy in (None, False, True)
             for entry, fn in D.IMPORTS.items()]
    diffs, counts = D.differential(cases)
    assert not diffs, "\n".join(diffs)
    assert counts["stock ok"] > 0
