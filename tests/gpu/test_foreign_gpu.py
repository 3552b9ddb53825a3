"""jax_overlay.foreign on the GPU: PyTorch, CuPy and Numba code on views of
XLA's device buffers, on XLA's stream, inside jit.

The in-flight trials feed each foreign call an input whose producer is
still running (XLA's stream held by a 3 ms spin kernel, then a fill:
see producers.jax_fill), read it in the framework with no host wait, and
consume the output in the next XLA op of the same jit.  A read that ran
ahead of the producer sees the previous trial's values; the control shows
that a framework op put on another stream does exactly that."""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jax_overlay  # noqa: E402
from jax_overlay import _xla_ext as ext  # noqa: E402

from producers import jax_fill, numba_double  # noqa: E402

TRIALS = 1000
N = 1 << 16
SAME = lambda *xs: xs[0]  # noqa: E731


def _torch():
    return pytest.importorskip("torch")


def _handle(numba_stream):
    h = numba_stream.handle
    return h.value if hasattr(h, "value") else int(h)


def in_flight_trials(f, stream_busy):
    """TRIALS calls of jit(f(x) + 1) on inputs still being computed: returns
    (stale, pending) - wrong results, and calls whose fn found XLA's stream
    still busy (the input was in flight when fn read it)."""
    g = jax.jit(lambda x: (lambda y: jnp.stack([y.min(), y.max()]))(f(x) + 1))
    g(jax_fill(0.0, n=N)).block_until_ready()
    stale = 0
    for k in range(1, TRIALS + 1):
        lo, hi = np.asarray(g(jax_fill(float(k), steps=300, n=N)))
        stale += (lo, hi) != (2 * k + 1, 2 * k + 1)
    return stale, stream_busy[0]


def test_torch_in_flight_inputs_read_on_xlas_stream():
    torch = _torch()
    busy = [0]

    def fn(x):
        busy[0] += not torch.cuda.current_stream().query()
        assert torch.cuda.current_stream() == jax_overlay.foreign_stream()
        return x * 2
    f = jax_overlay.foreign(fn, framework="torch", result_shape_dtypes=SAME)
    stale, pending = in_flight_trials(f, busy)
    assert pending > TRIALS // 2, f"only {pending} of {TRIALS} inputs were in flight: proves nothing"
    assert stale == 0, f"{stale} of {TRIALS} PyTorch reads were stale"


def test_control_an_op_on_another_stream_reads_stale():
    """The detector works: the same op on a stream of PyTorch's own, not
    ordered after XLA's, reads the input before its producer wrote it."""
    torch = _torch()
    side = torch.cuda.Stream()

    def fn(x):
        with torch.cuda.stream(side):
            y = x * 2
        torch.cuda.current_stream().wait_stream(side)
        return y
    f = jax_overlay.foreign(fn, framework="torch", result_shape_dtypes=SAME)
    stale, _ = in_flight_trials(f, [0])
    assert stale > 0


def test_cupy_in_flight_inputs_read_on_xlas_stream():
    busy = [0]

    def fn(x):
        s = cp.cuda.get_current_stream()
        assert s.ptr == jax_overlay.foreign_stream().ptr
        busy[0] += not s.done
        return x * 2
    f = jax_overlay.foreign(fn, framework="cupy", result_shape_dtypes=SAME)
    stale, pending = in_flight_trials(f, busy)
    assert pending > TRIALS // 2
    assert stale == 0, f"{stale} of {TRIALS} CuPy reads were stale"


@pytest.mark.filterwarnings("error::DeprecationWarning")
@pytest.mark.parametrize("framework", ["torch", "cupy"])
def test_the_callers_stream_and_device_are_restored(framework):
    """XLA's stream is current inside fn only: after the call (eager and
    jitted, also when fn raised) the thread's own current stream is back,
    and the stream wrappers warn nothing (CuPy 14 deprecates
    ExternalStream's constructor)."""
    if framework == "torch":
        torch = _torch()
        own = torch.cuda.Stream()
        ctx, current = torch.cuda.stream(own), lambda: torch.cuda.current_stream().cuda_stream
    else:
        own = cp.cuda.Stream(non_blocking=True)
        ctx, current = own, lambda: cp.cuda.get_current_stream().ptr
    seen = []

    def fn(x):
        seen.append(current())
        return x + 1

    def fails(x):
        seen.append(current())
        return 1 / 0
    ok = jax_overlay.foreign(fn, framework=framework, result_shape_dtypes=SAME)
    bad = jax_overlay.foreign(fails, framework=framework, result_shape_dtypes=SAME)
    x = jnp.arange(8.0)
    with ctx:
        mine = current()
        for f in (ok, jax.jit(ok)):
            np.testing.assert_array_equal(np.asarray(f(x)), np.arange(8.0) + 1)
            assert current() == mine
        with pytest.raises(Exception, match="ZeroDivisionError"):
            jax.jit(bad)(x).block_until_ready()
        assert current() == mine
    assert seen and all(s != mine for s in seen), (seen, mine)


def test_cupy_stream_wrapper_never_destroys_the_handle():
    """cupy.cuda.Stream.from_external's Stream destroys its handle when it is
    collected; the wrapper for XLA's stream must not."""
    from jax_overlay.peers.cupy import PEER as _CUPY_PEER
    own = cp.cuda.Stream(non_blocking=True)
    for _ in range(3):
        w = _CUPY_PEER.stream(own.ptr, cp.cuda.Device().id)
        assert w.ptr == own.ptr
        del w
        gc.collect()
    with own:  # the handle still works
        a = cp.arange(1 << 16, dtype=cp.float32) * 2
    own.synchronize()
    assert float(a[-1]) == 2 * ((1 << 16) - 1)


@pytest.mark.parametrize("launch", ["foreign_stream", "default_stream"])
def test_numba_kernel_in_flight_inputs(launch):
    """A kernel launched on jax_overlay.foreign_stream(), or on Numba's
    default stream (fenced with events before and after fn)."""
    cuda, double = numba_double()
    busy = [0]

    def fn(x, out):
        s = jax_overlay.foreign_stream()
        busy[0] += not ext.stream_idle(0, _handle(s))
        if launch == "foreign_stream":
            double[(N + 255) // 256, 256, s](x, out)
        else:
            double[(N + 255) // 256, 256](x, out)
    f = jax_overlay.foreign(lambda x, out: fn(x, out), framework="numba",
                            result_shape_dtypes=SAME, out=True)
    stale, pending = in_flight_trials(f, busy)
    assert pending > TRIALS // 2
    assert stale == 0, f"{stale} of {TRIALS} Numba kernel reads were stale"


def test_numba_returned_device_array_is_copied_on_xlas_stream():
    cuda, double = numba_double()

    def fn(x):
        out = cuda.device_array(x.shape, x.dtype, stream=jax_overlay.foreign_stream())
        double[(x.size + 255) // 256, 256, jax_overlay.foreign_stream()](x, out)
        return out
    f = jax.jit(jax_overlay.foreign(fn, framework="numba", result_shape_dtypes=SAME))
    np.testing.assert_array_equal(np.asarray(f(jnp.arange(1000.0, dtype=jnp.float32))),
                                  np.arange(1000.0) * 2)


@pytest.mark.parametrize("framework", ["torch", "cupy", "numba"])
def test_in_place_on_in_flight_inputs_and_donated_buffers(framework):
    """input_output_aliases with out=True: fn doubles XLA's buffer in place,
    on inputs still being computed (no stale reads), and under a donating
    jit the output is the input's own device buffer."""
    if framework == "torch":
        torch = _torch()
        double = lambda x, out: out.mul_(2)  # noqa: E731
        idle = lambda: torch.cuda.current_stream().query()  # noqa: E731
    elif framework == "cupy":
        double = lambda x, out: cp.multiply(out, 2, out=out)  # noqa: E731
        idle = lambda: cp.cuda.get_current_stream().done  # noqa: E731
    else:
        _, kernel = numba_double()

        def double(x, out):
            kernel[(out.size + 255) // 256, 256, jax_overlay.foreign_stream()](out, out)
        idle = lambda: ext.stream_idle(0, _handle(jax_overlay.foreign_stream()))  # noqa: E731
    busy, ptrs = [0], []

    def fn(x, out):
        busy[0] += not idle()
        ptrs.append(x.__cuda_array_interface__["data"][0] == out.__cuda_array_interface__["data"][0])
        double(x, out)
    f = jax_overlay.foreign(fn, framework=framework, result_shape_dtypes=SAME, out=True,
                            input_output_aliases={0: 0})
    stale, pending = in_flight_trials(f, busy)
    assert pending > TRIALS // 2, f"only {pending} of {TRIALS} inputs were in flight: proves nothing"
    assert stale == 0, f"{stale} of {TRIALS} in-place {framework} updates were stale"
    x = jnp.arange(1 << 20, dtype=jnp.float32)
    before = x.unsafe_buffer_pointer()
    y = jax.jit(f, donate_argnums=0)(x)
    np.testing.assert_array_equal(np.asarray(y), np.arange(1 << 20, dtype=np.float32) * 2)
    assert x.is_deleted() and y.unsafe_buffer_pointer() == before
    assert ptrs[-1], "the donated call's input and output views were not one buffer"


@pytest.mark.parametrize("framework", ["torch", "cupy"])
def test_dtypes_0d_and_zero_size(framework):
    if framework == "torch":
        _torch()
    dtypes = [jnp.float32, jnp.float16, jnp.int32, jnp.uint8, jnp.bool_, jnp.complex64]
    if framework == "torch":
        dtypes.append(jnp.bfloat16)
    for dtype in dtypes:
        for shape in [(), (0, 3), (5, 7)]:
            x = (jnp.arange(int(np.prod(shape)), dtype=jnp.float32) % 3).reshape(shape).astype(dtype)
            f = jax.jit(jax_overlay.foreign(lambda x: x + x, framework=framework,
                                            result_shape_dtypes=SAME))
            got = f(x)
            assert got.dtype == x.dtype and got.shape == shape
            assert bool(jnp.array_equal(got, x + x)), (dtype, shape)


def test_torch_outputs_each_way_they_are_written():
    """PyTorch's outputs reach XLA's buffers right whether they take the one
    cuMemcpy (fn's own dense tensor of the exact dtype and shape) or a view
    and copy_ (everything else): lazy conjugates and negations, transposes,
    CPU tensors, another dtype's bytes, an input returned as it is, with
    and without the input aliased to the output."""
    torch = _torch()
    c = (jnp.arange(6.0) + 1j * jnp.arange(6.0)).astype(jnp.complex64).reshape(2, 3)
    x = jnp.arange(12.0, dtype=jnp.float32).reshape(3, 4)
    sq = jnp.arange(16.0, dtype=jnp.float32).reshape(4, 4)
    cases = [
        ("dense", x, lambda t: t * 2, np.asarray(x) * 2),
        ("lazy conjugate", c, lambda t: t.conj(), np.conj(np.asarray(c))),
        ("lazy negation", c, lambda t: torch._neg_view(t), -np.asarray(c)),
        ("transposed", sq, lambda t: t.t(), np.asarray(sq).T),
        ("on the CPU", x, lambda t: (t * 3).cpu(), np.asarray(x) * 3),
        ("the input itself", x, lambda t: t, np.asarray(x)),
        ("an offset view", jnp.arange(8.0, dtype=jnp.float32),
         lambda t: torch.cat([t, t])[3:11], np.r_[np.arange(3.0, 8.0), np.arange(3.0)]),
    ]
    for name, a, fn, want in cases:
        f = jax.jit(jax_overlay.foreign(fn, framework="torch", result_shape_dtypes=SAME))
        got = f(a)
        assert got.dtype == a.dtype and got.shape == a.shape, name
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=name)
    # The output buffer is the input's: fn returning it copies nothing.
    g = jax.jit(jax_overlay.foreign(lambda t: t, framework="torch", result_shape_dtypes=SAME,
                                    input_output_aliases={0: 0}), donate_argnums=0)
    np.testing.assert_array_equal(np.asarray(g(x + 0)), np.asarray(x))
    # A wrong dtype or shape is still refused, naming both.
    for fn in (lambda t: t.double(), lambda t: t[:2]):
        with pytest.raises(Exception, match="result_shape_dtypes says"):  # XLA's runtime error
            jax.jit(jax_overlay.foreign(fn, framework="torch", result_shape_dtypes=SAME))(
                x).block_until_ready()


def test_torch_out_true_and_python_scalar_outputs():
    torch = _torch()

    def fn(x, out):
        torch.mul(x, 3, out=out)
    f = jax.jit(jax_overlay.foreign(fn, framework="torch", result_shape_dtypes=SAME, out=True))
    np.testing.assert_array_equal(np.asarray(f(jnp.arange(5.0))), np.arange(5.0) * 3)
    s = jax_overlay.foreign(lambda x: 2.5, framework="torch",
                            result_shape_dtypes=jax.ShapeDtypeStruct((), jnp.float32))
    assert float(s(jnp.ones(3))) == 2.5


def test_torch_under_vmap():
    _torch()
    f = jax_overlay.foreign(lambda x: x.flip(-1), framework="torch", result_shape_dtypes=SAME,
                            vmap_method="sequential")
    xs = jnp.arange(12.0).reshape(3, 4)
    np.testing.assert_array_equal(np.asarray(jax.jit(jax.vmap(f))(xs)), np.asarray(xs)[:, ::-1])
    g = jax_overlay.foreign(lambda x: x.flip(-1), framework="torch", result_shape_dtypes=SAME,
                            vmap_method="expand_dims")
    np.testing.assert_array_equal(np.asarray(jax.vmap(g)(xs)), np.asarray(xs)[:, ::-1])


def test_torch_autograd_vjp_matches_jax_grad():
    torch = _torch()

    def torch_f(x, w, n):
        return (torch.sin(x) * w + x ** 2 * w.sum()) * n

    def jax_f(x, w, n):
        return (jnp.sin(x) * w + x ** 2 * w.sum()) * n
    f = jax_overlay.foreign(torch_f, framework="torch", result_shape_dtypes=SAME, vjp="autograd")
    x = jnp.linspace(-1, 1, 64, dtype=jnp.float32)
    w = jnp.cos(x)
    n = jnp.arange(64, dtype=jnp.int32) % 3
    loss = lambda f: lambda x, w: (f(x, w, n) ** 2).sum()  # noqa: E731
    want = jax.grad(loss(jax_f), argnums=(0, 1))(x, w)
    got = jax.jit(jax.grad(loss(f), argnums=(0, 1)))(x, w)
    for g, e in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=2e-5, atol=1e-5)
    _, gn = jax.grad(lambda x, n: f(x, w, n).sum(), argnums=(0, 1), allow_int=True)(x, n)
    assert gn.dtype == jax.dtypes.float0


def test_eight_threads_call_jitted_foreign_functions():
    torch = _torch()
    ft = jax.jit(jax_overlay.foreign(lambda x: torch.sqrt(x) + 1, framework="torch",
                                     result_shape_dtypes=SAME))
    fc = jax.jit(jax_overlay.foreign(lambda x: cp.sqrt(x) + 2, framework="cupy",
                                     result_shape_dtypes=SAME))
    errors = []

    def worker(t):
        try:
            for i in range(100):
                v = float((t * 100 + i) ** 2)
                x = jnp.full(4096, v, jnp.float32)
                f, add = (ft, 1) if (t + i) % 2 else (fc, 2)
                got = np.asarray(f(x))
                if not (got == np.sqrt(v) + add).all():
                    errors.append((t, i, got[:3]))
        except Exception as e:  # noqa: BLE001
            errors.append((t, repr(e)))
    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors[:5]


@pytest.mark.parametrize("framework", ["torch", "cupy", "numba"])
def test_a_kept_view_is_detected(framework):
    if framework == "torch":
        _torch()
    if framework == "numba":
        numba_double()
    kept = []

    def fn(x, out):
        kept.append(x[1:])  # a view of XLA's input buffer, past the call
        out[:] = x[:]
    f = jax_overlay.foreign(fn, framework=framework, result_shape_dtypes=SAME, out=True)
    with pytest.raises(Exception, match="kept a view"):
        f(jnp.ones(8)).block_until_ready()
    kept.clear()

    def copies(x, out):
        kept.append({"torch": lambda: x.clone(), "cupy": lambda: x.copy(),
                     "numba": lambda: x.copy_to_host()}[framework]())
        out[:] = x[:]
    g = jax_overlay.foreign(copies, framework=framework, result_shape_dtypes=SAME, out=True)
    np.testing.assert_array_equal(np.asarray(g(jnp.ones(8))), 1)


@pytest.mark.parametrize("framework", ["torch", "cupy"])
def test_errors_reach_the_caller(framework):
    if framework == "torch":
        _torch()

    def boom(x):
        raise ValueError("boom in fn")
    with pytest.raises(Exception, match=r"ValueError: boom in fn \(raised by the foreign function"):
        jax.jit(jax_overlay.foreign(boom, framework=framework, result_shape_dtypes=SAME))(
            jnp.ones(3)).block_until_ready()
    short = jax_overlay.foreign(lambda x: x[:2], framework=framework, result_shape_dtypes=SAME)
    with pytest.raises(Exception, match=r"output 0 .* float32\[2\], but result_shape_dtypes says float32\[3\]"):
        short(jnp.ones(3)).block_until_ready()
    wrong = jax_overlay.foreign(lambda x: np.ones(3, np.float32), framework=framework,
                                result_shape_dtypes=SAME)
    with pytest.raises(Exception, match="is a ndarray"):
        wrong(jnp.ones(3)).block_until_ready()
    # The process still works after each.
    ok = jax_overlay.foreign(lambda x: x + 1, framework=framework, result_shape_dtypes=SAME)
    np.testing.assert_array_equal(np.asarray(ok(jnp.ones(3))), 2)


def test_pinned_inputs_are_refused_and_cpu_inputs_go_where_the_framework_runs():
    torch = _torch()
    seen = []

    def fn(x):
        seen.append(x.device.type)
        return x * 2
    f = jax_overlay.foreign(fn, framework="torch", result_shape_dtypes=SAME)
    dev = jax.devices()[0]
    pinned = jax.device_put(jnp.ones(4), jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host"))
    with pytest.raises(ValueError, match="pinned host memory.*with_memory_kind"):
        f(pinned)
    # PyTorch runs on the CPU backend too, as CPU tensors, beside the GPU.
    cpu = jax.devices("cpu")[0]
    y = jax.jit(f)(jax.device_put(jnp.ones(4), cpu))
    assert y.devices() == {cpu} and seen == ["cpu"]
    np.testing.assert_array_equal(np.asarray(y), 2)
    y = f(jnp.ones(4))
    assert y.devices() == {dev} and seen == ["cpu", "cuda"]
    assert torch.cuda.current_stream().cuda_stream == torch.cuda.default_stream().cuda_stream
    with pytest.raises(ValueError, match="input 0 is on cpu"):
        jax_overlay.foreign(lambda x: x, framework="cupy", result_shape_dtypes=SAME)(
            jax.device_put(jnp.ones(4), cpu))


@pytest.mark.parametrize("framework", ["torch", "cupy"])
def test_steps_of_a_scan_read_the_step_before(framework):
    """200 steps of a lax.scan, each a foreign op on XLA's stream reading the
    carry the step before wrote (no host sync between steps), then
    PyTorch's autograd once per step of a shorter scan, both against the
    same scan in JAX."""
    from jax import lax
    if framework == "torch":
        torch = _torch()
        op = lambda v: torch.tanh(v) * 1.5 + 0.25  # noqa: E731
    else:
        op = lambda v: cp.tanh(v) * 1.5 + 0.25  # noqa: E731
    f = jax_overlay.foreign(op, framework=framework, result_shape_dtypes=SAME)

    def steps(fn, n):
        return lambda x: lax.scan(lambda c, _: (fn(c), None), x, None, length=n)[0]
    x = jnp.linspace(-2, 2, 1 << 16, dtype=jnp.float32)
    got = jax.jit(steps(f, 200))(x)
    want = jax.jit(steps(lambda v: jnp.tanh(v) * 1.5 + 0.25, 200))(x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-6)
    if framework == "torch":
        g = jax_overlay.foreign(op, framework="torch", result_shape_dtypes=SAME, vjp="autograd")
        loss = lambda fn: lambda x: steps(fn, 8)(x).sum()  # noqa: E731
        np.testing.assert_allclose(
            np.asarray(jax.jit(jax.grad(loss(g)))(x)),
            np.asarray(jax.grad(loss(lambda v: jnp.tanh(v) * 1.5 + 0.25))(x)), rtol=2e-5, atol=2e-6)


def test_numpy_takes_uncommitted_arrays_as_jax_places_them():
    """On a GPU machine, framework="numpy" with a committed CPU input takes
    an uncommitted array JAX made on its default device (the GPU) and moves
    it to the CPU, as JAX does; eager grad's cotangent is such an array.
    Uncommitted arrays alone run on the GPU: refused, naming it."""
    cpu = jax.devices("cpu")[0]
    f = jax_overlay.foreign(lambda x, y: x + y, framework="numpy",
                            result_shape_dtypes=lambda x, y: x, vjp=lambda x, y, ct: (ct, ct))
    x = jax.device_put(jnp.arange(3.0), cpu)
    y = jnp.ones(3)
    assert not y.committed and y.devices() != {cpu}
    out = f(x, y)
    assert out.devices() == {cpu}
    np.testing.assert_array_equal(np.asarray(out), np.arange(3.0) + 1)
    g = jax.grad(lambda v: f(v, x).sum())(x)
    assert g.devices() == {cpu}
    np.testing.assert_array_equal(np.asarray(g), np.ones(3))
    with pytest.raises(ValueError, match="input 0 is on gpu, and framework='numpy' runs on the CPU"):
        f(jnp.ones(3), jnp.ones(3))
