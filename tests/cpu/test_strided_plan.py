"""The strided copy kernel's plan, checked without a GPU: the plan of every
layout, replayed with the kernel's own index arithmetic (its fast divisions
included), reads exactly what NumPy reads; the handler's plan check refuses
what would read outside the envelope; our declarations of XLA's FFI ABI
agree with the installed jaxlib's headers."""

import os
import shutil
import subprocess

import jax
import numpy as np
import pytest

from jax_overlay import _view
from jax_overlay import _strided
from jax_overlay import _vocab
from jax_overlay import _xla_ext as ext

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# --- the kernel's division --------------------------------------------------

DIVISORS = [1, 2, 3, 5, 7, 10, 18, 255, 256, 257, 1000, 1023, 1024, 1025, 65535,
            65537, 2**20 + 1, 2**30 - 1, 2**30, 2**30 + 1, 2**31 - 1]


@pytest.mark.parametrize("d", DIVISORS)
def test_fast_divisor_is_floor_division_for_every_31_bit_numerator(d):
    magic, shift = ext.fast_divisor(d)
    assert 0 < magic < 2**32 and 31 <= shift <= 62
    rng = np.random.default_rng(d)
    n = np.concatenate([
        np.arange(0, 4096, dtype=np.uint64),
        rng.integers(0, 2**31, 100_000, dtype=np.uint64),
        np.array([2**31 - 1, 2**31 - 2], np.uint64),
        # Every multiple of d near the top and its neighbours, where the
        # rounding of magic would show first.
        (np.arange(max(0, (2**31 - 1) // d - 2000), (2**31 - 1) // d + 1, dtype=np.uint64)
         [:, None] * np.uint64(d) + np.array([0, d - 1], np.uint64)).ravel(),
    ])
    n = n[n < 2**31]
    q = (n * np.uint64(magic)) >> np.uint64(shift)  # < 2**63: exact in uint64
    np.testing.assert_array_equal(q, n // np.uint64(d))


def test_fast_divisor_random_divisors():
    rng = np.random.default_rng(0)
    for d in rng.integers(1, 2**31, 300):
        magic, shift = ext.fast_divisor(int(d))
        n = rng.integers(0, 2**31, 5000, dtype=np.uint64)
        np.testing.assert_array_equal((n * np.uint64(magic)) >> np.uint64(shift),
                                      n // np.uint64(d))


# --- plans against NumPy ------------------------------------------------------

def replay(plan, envelope):
    """What the kernel writes, computed as the PTX computes it."""
    unit, offset, count, inner, s_inner, o2, s2, s1 = plan
    i = np.arange(count, dtype=np.uint64)
    mi, si = ext.fast_divisor(inner)
    mo, so = ext.fast_divisor(o2)
    q = (i * np.uint64(mi)) >> np.uint64(si)
    j = (i - q * np.uint64(inner)).astype(np.int64)
    a = (q * np.uint64(mo)) >> np.uint64(so)
    b = (q - a * np.uint64(o2)).astype(np.int64)
    idx = offset + j * s_inner + a.astype(np.int64) * s1 + b * s2
    return envelope[idx]


def import_plan(v):
    """The envelope and kernel plan copy_import builds for NumPy view `v`
    (plan None when the kernel does not take it): the layout from the
    native parser, as the CAI import gets it, then the same steps."""
    spec = ext.parse_cai(v.__array_interface__)
    strides = spec.strides if spec.strides is not None else _view._row_major(v.shape)
    base, count, unit, offset = _strided.plan(spec.data, spec.low, spec.span, spec.itemsize, 0,
                                              _vocab.GPU_ALIGNMENT)
    raw = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * (count * unit)).from_address(base))
    envelope = raw.view({1: "u1", 2: "u2", 4: "u4", 8: "u8", 16: "V16"}[unit])
    scale = spec.itemsize // unit
    plan = _strided.kernel_plan(v.shape, [s * scale for s in strides], offset, spec.itemsize, unit)
    return envelope, plan


def random_view(rng, owner):
    nd = int(rng.integers(1, 5))
    shape = [int(rng.integers(1, 7)) for _ in range(nd)]
    dtype = owner.dtype
    size = int(np.prod(shape))
    start = int(rng.integers(0, 3))
    a = owner[start:start + size].reshape(shape)
    index = []
    for n in shape:
        step = int(rng.choice([1, 1, 2, 3, -1, -2]))
        lo = int(rng.integers(0, n))
        index.append(slice(lo, None, step) if step > 0 else slice(None, lo, step) if lo else slice(None, None, step))
    v = a[tuple(index)]
    if rng.random() < 0.2 and v.size:
        v = np.broadcast_to(v[..., :1], v.shape[:-1] + (3,))
    if rng.random() < 0.3:
        v = v.transpose(rng.permutation(v.ndim))
    assert v.dtype == dtype
    return v


@pytest.mark.parametrize("dtype", ["u1", "bool", "i2", "f2", "f4", "i8", "f8", "c8", "c16"])
def test_plans_replayed_read_what_numpy_reads(dtype):
    rng = np.random.default_rng(list(np.dtype(dtype).str.encode()))
    dtype = np.dtype(dtype)
    # A 64-byte-aligned owner with room on both sides: envelopes are aligned
    # down to 16 bytes and must stay inside it.
    block = np.zeros(2**16 + 256, np.uint8)
    lead = -block.ctypes.data % 64 + 64
    owner_bytes = block[lead:lead + 2**16]
    owner_bytes[:] = rng.integers(0, 256, owner_bytes.size, dtype=np.uint8)
    taken = 0
    for _ in range(400):
        shift = int(rng.integers(0, dtype.itemsize)) if rng.random() < 0.3 else 0
        n = (owner_bytes.size - 64) // dtype.itemsize
        owner = owner_bytes[16 + shift:16 + shift + n * dtype.itemsize].view(dtype)
        v = random_view(rng, owner)
        if v.size == 0:
            continue
        envelope, plan = import_plan(v)
        if plan is None:
            continue
        taken += 1
        ext.check_strided_plan(plan, envelope.shape[0])
        got = replay(plan, envelope)
        want = np.ascontiguousarray(v).reshape(-1).view(np.uint8)
        np.testing.assert_array_equal(got.view(np.uint8), want)
    assert taken > 200


def test_plan_merges_what_steps_evenly_and_refuses_four_dimensions():
    # a[:, ::2] of a 4 x 9 float32: rows of 4 items 2 apart, 9 items on.
    assert _strided.kernel_plan((4, 4), (9, 2), 0, 4, 4) == (4, 0, 16, 4, 2, 4, 9, 0)
    # Of a 4 x 8 it is every other item: one dimension.
    assert _strided.kernel_plan((4, 4), (8, 2), 0, 4, 4) == (4, 0, 16, 16, 2, 1, 0, 0)
    # A 3-d slice stepping evenly is one dimension.
    assert _strided.kernel_plan((2, 3, 2), (12, 4, 2), 5, 4, 4) == (4, 5, 12, 12, 2, 1, 0, 0)
    # Size-one dimensions drop out; broadcast dimensions merge.
    assert _strided.kernel_plan((1, 5, 1, 3), (99, 0, 7, 0), 0, 8, 8) == (8, 0, 15, 15, 0, 1, 0, 0)
    assert _strided.kernel_plan((2, 2, 2, 2), (100, 30, 7, 2), 0, 4, 4) is None
    assert _strided.kernel_plan((0, 3), (3, 1), 0, 4, 4) is None
    assert _strided.kernel_plan((2**31,), (2,), 0, 1, 1) is None
    assert _strided.kernel_plan((4,), (2**31,), 0, 1, 1) is None


def test_misaligned_plan_moves_whole_elements_as_bytes():
    plan = _strided.kernel_plan((3, 4), (40, 8), 1, 4, 1)
    unit, offset, count, inner, s_inner, o2, s2, s1 = plan
    assert (unit, offset, count) == (1, 1, 48)
    # Innermost: the 4 bytes of an element, one apart.
    assert (inner, s_inner) == (4, 1)
    assert (o2, s2, s1) == (4, 8, 40)


@pytest.mark.parametrize("plan, envelope, field", [
    ((3, 0, 4, 4, 1, 1, 0, 0), 16, "unit = 3"),
    ((4, 0, -1, 4, 1, 1, 0, 0), 16, "count = -1"),
    ((4, 0, 2**31, 4, 1, 1, 0, 0), 2**40, "count = 2147483648"),
    ((4, 0, 4, 0, 1, 1, 0, 0), 16, "inner = 0"),
    ((4, 0, 6, 4, 1, 1, 0, 0), 16, "count = 6"),
    ((4, 0, 8, 4, 2**31, 2, 0, 0), 2**40, "s_inner = 2147483648"),
    ((4, 0, 16, 4, 1, 4, 4, 0), 15, "reads items 0 to 15 of an envelope of 15"),
    ((4, 2, 8, 4, -1, 2, 4, 0), 16, "reads items -1 to 6"),
])
def test_handler_plan_check_names_the_field(plan, envelope, field):
    with pytest.raises(ValueError) as e:
        ext.check_strided_plan(plan, envelope)
    assert field in str(e.value)


def test_plan_check_takes_a_plan_reaching_the_envelope_end():
    # Two rows of two blocks of four: items 0 .. 15, exactly the envelope.
    ext.check_strided_plan((4, 0, 16, 4, 1, 2, 4, 8), 16)
    with pytest.raises(ValueError, match="0 to 15 of an envelope of 15"):
        ext.check_strided_plan((4, 0, 16, 4, 1, 2, 4, 8), 15)


def test_plan_check_wants_eight_fields():
    with pytest.raises(ValueError, match="8 fields, not 7"):
        ext.check_strided_plan((4, 0, 4, 4, 1, 1, 0), 16)


# --- registration ---------------------------------------------------------------

def test_handler_capsule_checks_the_ffi_major_version():
    with pytest.raises(BufferError, match="XLA FFI 1.0"):
        ext.strided_copy_handler(1, 0)
    cap = ext.strided_copy_handler(*_strided._ffi_version())
    assert type(cap).__name__ == "PyCapsule"


def test_ffi_version_read_from_jaxlib_headers():
    major, minor = _strided._ffi_version()
    assert major == 0 and minor >= 1


def test_each_layout_is_planned_once_and_the_switch_replans():
    """The route of a strided copy is planned once per layout and device;
    a second producer of the same layout reuses it, another layout or the
    kernel switch plans anew, and every copy is still the right data."""
    import jax_overlay
    import forge as _testing

    _strided._route.cache_clear()
    owners = [_testing.aligned_empty((16, 256), np.float32) for _ in range(3)]
    for k, o in enumerate(owners):
        o[...] = np.arange(o.size, dtype=np.float32).reshape(o.shape) + 1000 * k

    def check(owner, view):
        np.testing.assert_array_equal(np.asarray(_testing.import_host(_testing.HostCAI(view))), view)

    with _testing.CopyRoutes() as counts:
        for o in owners[:2]:  # one layout, two producers
            check(o, o[:, ::2])
        assert _strided._route.cache_info().misses == 1
        assert _strided._route.cache_info().hits == 1
        check(owners[2], owners[2][:, ::4])
        assert _strided._route.cache_info().misses == 2
        jax_overlay.config.strided_kernel = False
        try:
            check(owners[2], owners[2][:, ::2])
        finally:
            jax_overlay.config.strided_kernel = True
        assert _strided._route.cache_info().misses == 3
    assert counts == {"kernel": 0, "gather": 4}  # no kernel on the CPU


def test_kernel_status_on_the_cpu_names_why():
    assert "CUDA only" in _strided.kernel_status(jax.devices("cpu")[0])


def test_ptx_has_one_entry_per_unit_size():
    ptx = ext.strided_copy_ptx()
    for unit in (1, 2, 4, 8, 16):
        assert f".visible .entry jxo_strided_copy_{unit}(" in ptx
    assert ptx.startswith(".version 6.0\n.target sm_50\n")


def test_our_ffi_declarations_match_jaxlib_headers():
    cxx = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler to check the declarations with")
    r = subprocess.run(
        [cxx, "-std=c++17", "-fsyntax-only", "-Werror", "-I", jax.ffi.include_dir(),
         "-I", os.path.join(ROOT, "xla_ext"), os.path.join(ROOT, "tests", "cc", "ffi_abi_check.cc")],
        capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
