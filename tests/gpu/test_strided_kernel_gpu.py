"""The strided copy kernel (xla_ext/strided_kernel.cc) as an XLA custom call:
bit-exact against CuPy's own compact copy and against the XLA gather it
replaces, for every item size, layout and both pointer alignments; ordered
after in-flight producers; its plan checked by the handler before launch."""

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402

import jax_overlay  # noqa: E402
from jax_overlay import _strided  # noqa: E402
import forge as T  # noqa: E402

from producers import INFLIGHT_MS, WithStream, cycles, is_stale, spin_fill  # noqa: E402

imp = jax_overlay.from_cuda_array_interface


def both_routes(importer, v):
    """(kernel result, gather result) of importing `v`."""
    with T.CopyRoutes() as counts:
        k = importer(v)
        assert counts["kernel"] == 1, "the kernel route was not taken"
        jax_overlay.config.strided_kernel = False
        try:
            g = importer(v)
        finally:
            jax_overlay.config.strided_kernel = True
        assert counts["kernel"] == 1, "the gather route took the kernel"
    return k, g


LAYOUTS = {
    "every other column": lambda a: a[:, ::2],
    "reversed": lambda a: a[::-1, ::-1],
    "window": lambda a: a[3:40, 5:11],
    "transposed slice": lambda a: a.T[::3],
    "broadcast row": lambda a: cp.broadcast_to(a[0], (7, a.shape[1])),
    "3-d slice": lambda a: a.reshape(8, 8, 18)[1::2, ::-1, 2:15:3],
    "4-d (gather)": lambda a: a.reshape(2, 4, 8, 18)[:, ::3, 1:, ::5],
    "misaligned": lambda a: a.reshape(-1)[1:],
    "misaligned strided": lambda a: a.reshape(-1)[1:1 + 64 * 8].reshape(64, 8)[:, ::3],
}


@pytest.fixture
def x64():
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", False)


def random_base(dtype, shape=(64, 18)):
    raw = np.random.default_rng(7).integers(0, 256, size=int(np.prod(shape)) * dtype.itemsize,
                                            dtype=np.uint8)
    if dtype.kind == "b":
        raw %= 2
    return cp.asarray(raw).view(dtype).reshape(shape)


def bits(x):
    a = np.asarray(x)
    return a.view(f"u{min(a.dtype.itemsize, 8)}")


@pytest.mark.parametrize("dtype", ["bool", "int8", "uint16", "float16", "float32", "int64",
                                   "float64", "complex64", "complex128"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_kernel_matches_cupy_and_the_gather_bit_for_bit(layout, dtype, x64):
    """Random bytes (NaN payloads included) in every layout: the kernel's
    result is CuPy's compact copy and the XLA gather's, bit for bit (64-bit
    types with jax_enable_x64, so that no conversion follows the copy)."""
    v = LAYOUTS[layout](random_base(np.dtype(dtype)))
    want = cp.asnumpy(cp.ascontiguousarray(v))
    if v.flags.c_contiguous and v.data.ptr % 16 == 0:  # 16-byte items one on
        x = imp(v)
        assert x.unsafe_buffer_pointer() == v.data.ptr, "an aligned compact view copied"
        np.testing.assert_array_equal(bits(x), bits(want))
        return
    if layout == "4-d (gather)":
        with T.CopyRoutes() as counts:
            x = imp(v)
        assert counts == {"kernel": 0, "gather": 1}, "four unmergeable dimensions take the gather"
        np.testing.assert_array_equal(bits(x), bits(want))
        return
    k, g = both_routes(imp, v)
    assert k.dtype == g.dtype == want.dtype and k.shape == g.shape == want.shape
    np.testing.assert_array_equal(bits(k), bits(want))
    np.testing.assert_array_equal(bits(k), bits(g))


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("layout", ["every other column", "transposed slice", "broadcast row",
                                    "misaligned"])
def test_kernel_moves_types_cai_cannot_name_through_dlpack(layout, dtype):
    """bfloat16 and float8 from PyTorch (DLPack): the same kernel, bit for
    bit against the gather."""
    torch = pytest.importorskip("torch")
    raw = torch.randint(0, 256, (64 * 18 * (2 if dtype == "bfloat16" else 1),),
                        dtype=torch.uint8, device="cuda")
    t = raw.view(getattr(torch, dtype)).reshape(64, 18)
    v = {"every other column": lambda a: a[:, ::2], "transposed slice": lambda a: a.T[::3],
         "broadcast row": lambda a: a[0].expand(7, 18),
         "misaligned": lambda a: a.reshape(-1)[1:]}[layout](t)
    want = v.contiguous().view(torch.uint8 if dtype != "bfloat16" else torch.int16).cpu().numpy()
    k, g = both_routes(jax_overlay.from_dlpack, v)
    assert k.dtype == np.dtype(getattr(ml_dtypes, dtype)) and k.shape == tuple(v.shape)
    np.testing.assert_array_equal(bits(k), want.view(bits(k).dtype))
    np.testing.assert_array_equal(bits(k), bits(g))


def test_kernel_routes_layouts_it_takes():
    a = cp.arange(24, dtype=cp.float32).reshape(2, 3, 4)
    assert _strided.kernel_status(jax.devices("cuda")[0]) == ""
    # Merged to one dimension: an evenly stepping 3-d slice is a 1-d stride.
    assert _strided.kernel_plan((2, 3, 2), (12, 4, 2), 0, 4, 4) == (4, 0, 12, 12, 2, 1, 0, 0)
    x = imp(a[:, :, ::2])
    np.testing.assert_array_equal(np.asarray(x), cp.asnumpy(a[:, :, ::2]))


def test_kernel_is_ordered_after_inflight_producers():
    """The copy reads the producer's memory only after the producer's
    stream is done with it: legacy, per-thread and user streams."""
    a = cp.zeros((512, 1024), cp.float32)
    user = cp.cuda.Stream(non_blocking=True)
    stale = 0
    for stream, handle in ((cp.cuda.Stream.null, 1), (cp.cuda.Stream.ptds, 2), (user, user.ptr)):
        for k in range(1, 41):
            spin_fill(a, float(k), ms=INFLIGHT_MS, stream=stream)
            x = imp(WithStream(a[::2, ::-3], handle))
            stale += is_stale(x, k)
    assert stale == 0


def test_kernel_copies_envelopes_past_2_31_items():
    """Every other byte of 2**31 + 64: the gather's 32-bit indices cannot
    address the envelope; the kernel's 64-bit addresses can."""
    n = 2**31 + 64
    a = cp.empty(n, cp.uint8)
    a[:] = 0
    a[-64::2] = cp.arange(1, 33, dtype=cp.uint8)
    x = imp(a[::2])
    tail = np.asarray(x[-32:])
    np.testing.assert_array_equal(tail, np.arange(1, 33, dtype=np.uint8))
    assert int(jnp.max(x[:-32])) == 0
    del x
    jax_overlay.config.strided_kernel = False
    try:
        with pytest.raises(BufferError, match="64-bit"):
            imp(a[::2])
    finally:
        jax_overlay.config.strided_kernel = True


def test_handler_refuses_a_plan_outside_the_envelope():
    """A plan reaching past its input is an error from the handler, raised
    in Python, not an out-of-bounds read."""
    env = jnp.zeros(100, jnp.float32)
    fn = _strided._kernel_fn((10, 20), np.dtype("float32"), (4, 0, 200, 20, 1, 10, 20, 0))
    with pytest.raises(Exception, match="envelope of 100 items"):
        fn(env).block_until_ready()
    fn = _strided._kernel_fn((10,), np.dtype("float32"), (3, 0, 10, 10, 1, 1, 0, 0))
    with pytest.raises(Exception, match="unit = 3"):
        fn(env).block_until_ready()
    # And the runtime goes on working.
    np.testing.assert_array_equal(np.asarray(imp(cp.arange(8, dtype=cp.float32)[::2])), [0, 2, 4, 6])


def test_kernel_after_producer_memory_is_reused():
    """The producer dies right after the import; its pool reuses the block
    for new data; the copy holds what the producer held."""
    pool_a = cp.arange(256 * 256, dtype=cp.float32).reshape(256, 256)
    want = cp.asnumpy(pool_a[:, ::2])
    x = imp(pool_a[:, ::2])
    del pool_a
    junk = [cp.full((256, 256), -1, cp.float32) for _ in range(4)]
    cp.cuda.Device().synchronize()
    np.testing.assert_array_equal(np.asarray(x), want)
    del junk


def test_kernel_alone_on_a_cupy_stream():
    """The binding the benchmarks time: the same plan check and launch as
    the custom call, on a caller's stream."""
    a = cp.arange(64 * 18, dtype=cp.float32).reshape(64, 18)
    v = a[::-2, 1::3]
    plan = _strided.kernel_plan(v.shape, (-36, 3), 63 * 18 + 1, 4, 4)
    out = cp.zeros(v.shape, cp.float32)
    s = cp.cuda.Stream(non_blocking=True)
    # `a` and `out` are written on the legacy stream, which a non-blocking
    # stream does not wait for (under load the zeros landed after the copy).
    cp.cuda.Device().synchronize()
    from jax_overlay import _xla_ext as ext
    ext.launch_strided_copy(plan, a.size, out.data.ptr, a.data.ptr, s.ptr)
    s.synchronize()
    np.testing.assert_array_equal(cp.asnumpy(out), cp.asnumpy(v))
    with pytest.raises(ValueError, match="envelope of 100 items"):
        ext.launch_strided_copy(plan, 100, out.data.ptr, a.data.ptr, s.ptr)
    with pytest.raises(ValueError, match="stream = 0"):
        ext.launch_strided_copy(plan, a.size, out.data.ptr, a.data.ptr, 0)
