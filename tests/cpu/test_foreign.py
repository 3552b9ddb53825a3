"""jax_overlay.foreign with framework="numpy" on the CPU backend: NumPy code
on views of XLA's buffers inside jit, eagerly, under vmap and under grad
(given a vjp), with pytrees, every dtype, 0-d and zero-size arrays, and the
errors a user can make."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_overlay
from jax_overlay import _runtime as rt

from multidevice import check, on, params

CPU = jax.devices("cpu")[0]
SAME = lambda *xs: xs[0] if len(xs) == 1 else xs  # noqa: E731 - outputs shaped as the inputs


def numpy_fn(fn, spec=SAME, **kw):
    return jax_overlay.foreign(fn, framework="numpy", result_shape_dtypes=spec, **kw)


def on_cpu(x):
    return jax.device_put(x, CPU)


def test_jit_eager_and_composition():
    f = numpy_fn(lambda x: np.sin(x) * 3)
    x = on_cpu(jnp.linspace(-2, 2, 7, dtype=jnp.float32))
    want = np.sin(np.asarray(x)) * 3
    np.testing.assert_allclose(np.asarray(f(x)), want, rtol=1e-6)
    y = jax.jit(lambda x: f(x) * 2 + f(x + 1))(x)
    np.testing.assert_allclose(np.asarray(y), want * 2 + np.sin(np.asarray(x) + 1) * 3, rtol=1e-6)


def test_pytrees_of_several_inputs_and_outputs():
    def fn(a, pair):
        b, c = pair["b"], pair["c"]
        return {"sum": a + b, "prod": (a * b).astype(np.float64), "n": np.int32(c.size)}

    def spec(a, pair):
        return {"sum": a, "prod": jax.ShapeDtypeStruct(a.shape, np.float64),
                "n": jax.ShapeDtypeStruct((), np.int32)}
    f = numpy_fn(fn, spec)
    a = on_cpu(jnp.arange(6, dtype=jnp.float32).reshape(2, 3))
    b = a + 1
    c = on_cpu(jnp.zeros((4, 5), jnp.int8))
    with rt.x64(True):
        out = jax.jit(f)(a, {"b": b, "c": c})
    assert set(out) == {"sum", "prod", "n"}
    np.testing.assert_array_equal(np.asarray(out["sum"]), np.asarray(a + b))
    assert out["prod"].dtype == np.float64
    np.testing.assert_array_equal(np.asarray(out["prod"]), np.asarray(a) * np.asarray(b))
    assert int(out["n"]) == 20


DTYPES = [np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64,
          np.uint64, np.float16, np.float32, np.float64, np.complex64, np.complex128,
          ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0), (5,), (2, 3, 4)], ids=str)
def test_every_dtype_0d_and_zero_size_round_trip(dtype, shape):
    """The views carry the exact bytes both ways: a bit-reversing copy."""
    dtype = np.dtype(dtype)
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8)
    if dtype == np.bool_:
        raw = raw % 2
    host = raw.view(dtype).reshape(shape)
    f = numpy_fn(lambda x: x[::-1].copy() if x.ndim else x.copy())
    with rt.x64(True):
        x = on_cpu(jnp.asarray(host))
        y = jax.jit(f)(x)
    assert y.dtype == dtype and y.shape == shape
    want = host[::-1] if host.ndim else host
    assert np.asarray(y).tobytes() == np.ascontiguousarray(want).tobytes()


def test_out_true_writes_into_xla_buffers():
    seen = []

    def fn(x, *, out):
        seen.append(out.flags.writeable)
        np.multiply(x, 2, out=out)

    f = numpy_fn(fn, out=True)
    x = on_cpu(jnp.arange(5.0, dtype=jnp.float32))
    np.testing.assert_array_equal(np.asarray(jax.jit(f)(x)), np.asarray(x) * 2)
    assert seen == [True]


def test_out_true_with_a_pytree_of_outputs_and_inputs():
    """out= is shaped as result_shape_dtypes, the inputs as passed (a None
    leaf in them is no buffer)."""
    def fn(x, extra, *, out):
        assert extra["none"] is None
        np.add(x, extra["y"], out=out["sum"])
        np.subtract(x, extra["y"], out=out["diff"][0])

    def spec(x, extra):
        return {"sum": x, "diff": [x]}
    f = numpy_fn(fn, spec, out=True)
    x = on_cpu(jnp.arange(4.0, dtype=jnp.float32))
    got = jax.jit(f)(x, {"y": x * 3, "none": None})
    np.testing.assert_array_equal(np.asarray(got["sum"]), np.asarray(x) * 4)
    np.testing.assert_array_equal(np.asarray(got["diff"][0]), np.asarray(x) * -2)


def test_out_true_must_not_return_a_value():
    f = numpy_fn(lambda x, *, out: x + 1, out=True)
    with pytest.raises(Exception, match="returns None"):
        f(on_cpu(jnp.ones(3))).block_until_ready()


def _ptr(buf):
    return buf.__array_interface__["data"][0]


def test_in_place_on_a_donated_input_allocates_nothing():
    """input_output_aliases: the output is the input's own buffer where jit
    donates it, and out=True updates it in place.  (Donation lets XLA reuse
    the buffer; XLA:CPU of jax 0.11.2 copied an 8-element one, and reused
    4 MiB ones in every jax tried.)"""
    seen = []

    def fn(x, *, out):
        seen.append((_ptr(x), _ptr(out), x.flags.writeable, out.flags.writeable))
        np.testing.assert_array_equal(out, x)  # the output starts with the input's values
        np.multiply(out, 2, out=out)

    f = numpy_fn(fn, out=True, input_output_aliases={0: 0})
    x = on_cpu(jnp.arange(1 << 20, dtype=jnp.float32))
    want = np.asarray(x) * 2
    before = x.unsafe_buffer_pointer()
    y = jax.jit(f, donate_argnums=0)(x)
    np.testing.assert_array_equal(np.asarray(y), want)
    assert x.is_deleted() and y.unsafe_buffer_pointer() == before
    assert seen == [(before, before, False, True)]


def test_in_place_without_donation_leaves_the_input_as_it_was():
    def fn(x, *, out):
        out += 1
    f = numpy_fn(fn, out=True, input_output_aliases={0: 0})
    g = jax.jit(lambda v: f(v) * 10)
    x = on_cpu(jnp.arange(4, dtype=jnp.int32))
    for call in (f, jax.jit(f), g):
        got = np.asarray(call(x))
        np.testing.assert_array_equal(np.asarray(x), np.arange(4))  # XLA copied it first
        np.testing.assert_array_equal(got, (np.arange(4) + 1) * (10 if call is g else 1))


def test_aliases_name_flat_leaves_of_pytrees():
    """Input 2 (the pytree's third leaf) becomes output 1; output 0 is new."""
    def fn(a, pair, *, out):
        np.add(a, pair["b"], out=out[0])
        np.subtract(out[1], a, out=out[1])

    def spec(a, pair):
        return (jax.ShapeDtypeStruct(a.shape, a.dtype), pair["c"])
    f = numpy_fn(fn, spec, out=True, input_output_aliases={2: 1})
    a = on_cpu(jnp.arange(3.0))
    b, c = a * 10, a + 100
    s, d = jax.jit(f, donate_argnums=1)(a, {"b": b, "c": c})
    np.testing.assert_array_equal(np.asarray(s), np.arange(3.0) * 11)
    np.testing.assert_array_equal(np.asarray(d), np.full(3, 100.0))


def test_aliases_returned_outputs_and_vmap_and_grad():
    """Without out=True the returned array is copied over the aliased
    buffer; vmap and a vjp work as without aliases."""
    def vjp(x, ct):
        return (ct * 3,)
    f = numpy_fn(lambda x: x * 3, input_output_aliases={0: 0}, vjp=vjp,
                 vmap_method="sequential")
    x = on_cpu(jnp.arange(6.0, dtype=jnp.float32).reshape(2, 3))
    np.testing.assert_array_equal(np.asarray(jax.jit(f)(x)), np.asarray(x) * 3)
    np.testing.assert_array_equal(np.asarray(jax.vmap(f)(x)), np.asarray(x) * 3)
    g = jax.grad(lambda v: jnp.sum(f(v) * v))(x)
    np.testing.assert_allclose(np.asarray(g), np.asarray(x) * 6)  # d(3v·v)/dv


def test_aliases_under_vmap_of_an_unbatched_input():
    """Batching one input only: "sequential" and "broadcast_all" give the
    aliased output its values per element; "expand_dims" would alias a
    (1, n) input to a (3, n) output, which XLA refuses as a ValueError at
    lowering, not a crash."""
    def fn(x, y, *, out):
        np.add(out, y, out=out)

    def f(method):
        return numpy_fn(fn, lambda x, y: x, out=True, input_output_aliases={0: 0},
                        vmap_method=method)
    x, ys = on_cpu(jnp.arange(4.0)), on_cpu(jnp.arange(12.0).reshape(3, 4))
    for method in ("sequential", "broadcast_all"):
        got = jax.vmap(f(method), in_axes=(None, 0))(x, ys)
        np.testing.assert_array_equal(np.asarray(got), np.arange(4.0) + np.arange(12.0).reshape(3, 4))
    with pytest.raises(ValueError, match="output_operand_alias"):
        jax.vmap(f("expand_dims"), in_axes=(None, 0))(x, ys)
    got = jax.vmap(f("expand_dims"))(ys, ys)  # both batched: fine
    np.testing.assert_array_equal(np.asarray(got), np.arange(12.0).reshape(3, 4) * 2)


@pytest.mark.parametrize("aliases, error, match", [
    ([(0, 0)], TypeError, "must be a dict"),
    ({0.0: 0}, TypeError, "input index 0.0 is a float"),
    ({0: True}, TypeError, "output index True is a bool"),
    ({2: 0}, ValueError, "input 2 does not exist; this call has 2 input leaves"),
    ({0: 1}, ValueError, "output 1 does not exist; this call has 1 output leaves"),
    ({0: 0, 1: 0}, ValueError, "output 0 is given both input 0 and input 1"),
    ({1: 0}, ValueError, r"input 1 is int32\[3\] and output 0 is float32\[3\]"),
])
def test_bad_aliases_are_refused_before_the_call(aliases, error, match):
    f = numpy_fn(lambda x, y: x, lambda x, y: x, input_output_aliases=aliases)
    x, y = on_cpu(jnp.ones(3, jnp.float32)), on_cpu(jnp.ones(3, jnp.int32))
    with pytest.raises(error, match=match):
        f(x, y)
    with pytest.raises(error, match=match):
        jax.jit(f)(x, y)


def test_vmap_methods():
    calls = []

    def fn(x):
        calls.append(x.shape)
        return np.cumsum(x, axis=-1).astype(x.dtype)

    xs = on_cpu(jnp.arange(12.0, dtype=jnp.float32).reshape(3, 4))
    want = np.cumsum(np.asarray(xs), axis=-1)
    seq = numpy_fn(fn, vmap_method="sequential")
    np.testing.assert_array_equal(np.asarray(jax.vmap(seq)(xs)), want)
    assert calls == [(4,)] * 3
    calls.clear()
    vec = numpy_fn(fn, vmap_method="expand_dims")
    np.testing.assert_array_equal(np.asarray(jax.jit(jax.vmap(vec))(xs)), want)
    assert calls == [(3, 4)]
    with pytest.raises(Exception, match="vmap"):
        jax.vmap(numpy_fn(fn))(xs)  # no vmap_method: JAX's own error


def test_grad_through_a_numpy_vjp_matches_jax():
    def fwd(x, w):
        return np.tanh(x * w)

    def vjp(x, w, ct):
        d = (1 - np.tanh(x * w) ** 2) * ct
        return d * w, (d * x).sum(keepdims=True).reshape(w.shape).astype(w.dtype)

    f = numpy_fn(fwd, lambda x, w: x, vjp=vjp)
    x = on_cpu(jnp.linspace(-1, 1, 6, dtype=jnp.float32))
    w = on_cpu(jnp.float32(0.7) * jnp.ones((), jnp.float32))

    def loss(f):
        return lambda x, w: (f(x, w) ** 2).sum()
    got = jax.jit(jax.grad(loss(f), argnums=(0, 1)))(x, w)
    want = jax.grad(loss(lambda x, w: jnp.tanh(x * w)), argnums=(0, 1))(x, w)
    for g, h in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(h), rtol=1e-5, atol=1e-6)
    # and under vmap of grad, sequentially
    fs = numpy_fn(fwd, lambda x, w: x, vjp=vjp, vmap_method="sequential")
    xs = jnp.stack([x, 2 * x])
    got = jax.vmap(jax.grad(loss(fs)), in_axes=(0, None))(xs, w)
    want = jax.vmap(jax.grad(loss(lambda x, w: jnp.tanh(x * w))), in_axes=(0, None))(xs, w)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_exception_in_fn_reaches_the_caller():
    def fn(x):
        raise KeyError("no such column")
    f = numpy_fn(fn)
    with pytest.raises(Exception) as e:
        jax.jit(f)(on_cpu(jnp.ones(3))).block_until_ready()
    text = str(e.value)
    assert "ForeignError" in text and "KeyError" in text and "no such column" in text
    # Called eagerly, fn's class and message come first, in an error that is
    # ours and XLA's runtime error at once.
    with pytest.raises(jax_overlay.ForeignError) as e:
        f(on_cpu(jnp.ones(3))).block_until_ready()
    assert isinstance(e.value, jax.errors.JaxRuntimeError)
    assert str(e.value).startswith("KeyError: 'no such column' (raised by the foreign function"), e.value
    # The runtime is still usable afterwards.
    np.testing.assert_array_equal(np.asarray(jnp.ones(3) + 1), 2)


def test_what_foreign_has_an_argument_for_is_named():
    f = numpy_fn(lambda x: x * 2)
    x = on_cpu(jnp.ones(3))
    with pytest.raises(ValueError, match=r"<lambda>' has no derivative: pass foreign\(\.\.\., vjp=\.\.\.\)"):
        jax.grad(lambda x: f(x).sum())(x)
    with pytest.raises(ValueError, match=r"has no derivative"):
        jax.jit(jax.grad(lambda x: f(x).sum()))(x)
    with pytest.raises(NotImplementedError, match=r"made without vmap_method=: pass foreign\(\.\.\., vmap_method"):
        jax.vmap(f)(on_cpu(jnp.ones((2, 3))))
    # A bad vmap_method is refused when the function is made, not when batched.
    with pytest.raises(ValueError, match=r"vmap_method='bogus': pass one of 'sequential'"):
        numpy_fn(lambda x: x, vmap_method="bogus")


def test_a_vjp_may_return_a_bare_cotangent_for_one_input():
    f = numpy_fn(lambda x: np.sin(x), vjp=lambda x, ct: np.cos(x) * ct)  # no tuple
    x = on_cpu(jnp.linspace(-1, 1, 5, dtype=jnp.float32))
    np.testing.assert_allclose(np.asarray(jax.grad(lambda x: f(x).sum())(x)),
                               np.cos(np.asarray(x)), rtol=1e-6)
    two = numpy_fn(lambda a, b: a * b, lambda a, b: a,
                   vjp=lambda a, b, ct: a * ct)  # a bare array for two inputs
    with pytest.raises(Exception, match=r"the vjp '.*<lambda>' returned a ndarray for 2 inputs; return a tuple"):
        jax.grad(lambda a: two(a, a).sum())(x).block_until_ready()
    three = numpy_fn(lambda a, b: a * b, lambda a, b: a, vjp=lambda a, b, ct: (ct, ct, ct))
    with pytest.raises(Exception, match=r"returned 3 cotangents for 2 inputs"):
        jax.grad(lambda a: three(a, a).sum())(x).block_until_ready()


@pytest.mark.parametrize("ret,words", [
    (lambda x: x[:2], r"float32\[2\].*says float32\[3\]"),
    (lambda x: x.astype(np.float64), r"float64\[3\].*says float32\[3\]"),
    (lambda x: (x, x), "structure"),
    (lambda x: [x], "structure"),  # a list of one, where one array is declared
    (lambda x: None, "structure"),
])
def test_wrong_outputs_raise_from_the_first_call(ret, words):
    f = numpy_fn(ret)
    with pytest.raises(Exception, match=words):
        f(on_cpu(jnp.ones(3, jnp.float32))).block_until_ready()


def test_inputs_are_read_only_views():
    def fn(x):
        x[0] = 99  # would write into JAX's (immutable) input buffer
        return x
    x = on_cpu(jnp.arange(3.0, dtype=jnp.float32))
    with pytest.raises(Exception, match="read-only"):
        numpy_fn(fn)(x).block_until_ready()
    np.testing.assert_array_equal(np.asarray(x), [0, 1, 2])


def test_a_kept_view_is_detected():
    kept = []

    def fn(x):
        kept.append(x[1:])  # a view of XLA's buffer, past the call
        return x + 1
    with pytest.raises(Exception, match="kept a view"):
        numpy_fn(fn)(on_cpu(jnp.ones(4, jnp.float32))).block_until_ready()

    def copies(x):
        kept.append(np.array(x))  # a copy is fine
        return x + 1
    np.testing.assert_array_equal(np.asarray(numpy_fn(copies)(on_cpu(jnp.ones(4)))), 2)


def test_bad_arguments():
    with pytest.raises(ValueError, match="framework='jax'"):
        jax_overlay.foreign(abs, framework="jax", result_shape_dtypes=SAME)
    with pytest.raises(ValueError, match="vjp='backprop'.*'autograd'"):
        jax_overlay.foreign(abs, framework="torch", result_shape_dtypes=SAME, vjp="backprop")
    with pytest.raises(ValueError, match="'autograd', for framework='torch'"):
        jax_overlay.foreign(abs, framework="numpy", result_shape_dtypes=SAME, vjp="autograd")
    with pytest.raises(TypeError, match="vjp must be callable"):
        jax_overlay.foreign(abs, framework="numpy", result_shape_dtypes=SAME, vjp=3)
    with pytest.raises(TypeError, match="callable"):
        jax_overlay.foreign(3, framework="numpy", result_shape_dtypes=SAME)
    f = jax_overlay.foreign(abs, framework="numpy", result_shape_dtypes=[(3,)])
    with pytest.raises(TypeError, match=r"result_shape_dtypes\[0\].*ShapeDtypeStruct"):
        f(on_cpu(jnp.ones(3)))


def test_one_callback_per_signature(monkeypatch):
    """Eager calls of the same signature reuse one buffer_callback (one
    compilation); a new shape makes a second."""
    from jax.experimental import buffer_callback as bc
    made = []
    real = bc.buffer_callback

    def spy(*a, **k):
        made.append(1)
        return real(*a, **k)
    monkeypatch.setattr(bc, "buffer_callback", spy)
    calls = []

    def fn(x):
        calls.append(1)
        return x * 2
    f = numpy_fn(fn)
    assert f.__wrapped__ is fn
    for _ in range(5):
        f(on_cpu(jnp.ones(8, jnp.float32))).block_until_ready()
    assert len(calls) == 5 and len(made) == 1
    f(on_cpu(jnp.ones(9, jnp.float32))).block_until_ready()
    assert len(made) == 2


@pytest.mark.parametrize("name", ["cupy", "numba"])
def test_gpu_frameworks_refuse_cpu_arrays_before_importing_anything(name):
    f = jax_overlay.foreign(lambda x: x, framework=name, result_shape_dtypes=SAME)
    with pytest.raises(ValueError, match=f"input 0 is on cpu, and framework='{name}' runs on CUDA"):
        f(on_cpu(jnp.ones(3)))


def test_numpy_refuses_gpu_buffers_under_jit(monkeypatch):
    """A traced input's placement is only known in the call: the buffers'
    DLPack device, checked there (here a CPU buffer posing as a GPU one)."""
    from jax_overlay import _foreign, peers

    class Gpu:
        def __dlpack_device__(self):
            return (2, 0)
    with pytest.raises(_foreign.ForeignError, match="framework='numpy' runs on host buffers"):
        peers.numpy.PEER.adapter().ordinal([Gpu()])


@pytest.mark.parametrize("name", ["torch", "cupy", "numba"])
def test_a_missing_framework_says_which(name):
    try:
        __import__({"numba": "numba.cuda"}.get(name, name))
        pytest.skip(f"{name} imports here")
    except ImportError:
        pass
    from jax_overlay import _foreign
    with pytest.raises(ImportError, match=f"framework='{name}' needs"):
        _foreign._adapter(name)


def test_foreign_stream_is_the_calls_and_only_inside_one():
    with pytest.raises(RuntimeError, match="only defined while a foreign function runs"):
        jax_overlay.foreign_stream()
    seen = []

    def fn(x):
        seen.append(jax_overlay.foreign_stream())
        return x
    numpy_fn(fn)(on_cpu(jnp.ones(2))).block_until_ready()
    assert seen == [None]
    with pytest.raises(RuntimeError):
        jax_overlay.foreign_stream()


def test_integer_inputs_get_float0_cotangents():
    """The vjp's cotangents for integer inputs are ignored: custom_vjp gets
    float0 zeros for them, whatever the vjp returned."""
    f = numpy_fn(lambda x, n: (x * n).astype(x.dtype), lambda x, n: x,
                 vjp=lambda x, n, ct: ((ct * n).astype(x.dtype), np.full_like(n, 7)))
    g = jax.grad(lambda x: f(x, on_cpu(jnp.arange(3))).sum())(on_cpu(jnp.ones(3)))
    np.testing.assert_array_equal(np.asarray(g), [0, 1, 2])
    gx, gn = jax.grad(lambda x, n: f(x, n).sum(), argnums=(0, 1), allow_int=True)(
        on_cpu(jnp.ones(3)), on_cpu(jnp.arange(3)))
    assert gn.dtype == jax.dtypes.float0


def test_eight_threads_calling_jitted_foreign_functions():
    """Each thread's calls see their own inputs, their own kept-view tokens
    and foreign_stream() stack; one thread's failing calls (a kept view)
    fail only its own."""
    import threading
    kept = []

    def fn(x, k):
        assert jax_overlay.foreign_stream() is None  # NumPy's, inside a call
        if int(k) < 0:
            kept.append(x)  # this thread's calls keep a view: they must fail
        return x * k
    f = jax.jit(numpy_fn(fn, lambda x, k: x))
    results, errors = {}, {}
    start = threading.Barrier(8)

    def work(t):
        start.wait()
        k = on_cpu(jnp.asarray(np.float32(-1 if t == 7 else t)))
        x = on_cpu(jnp.arange(64.0, dtype=jnp.float32) + t)
        got = []
        for _ in range(50):
            try:
                got.append(np.asarray(f(x, k)))
            except Exception as e:  # noqa: BLE001 - thread 7's, checked below
                errors.setdefault(t, []).append(str(e))
        results[t] = got
    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for t in range(7):
        assert t not in errors, errors.get(t, [""])[0][:300]
        want = (np.arange(64.0, dtype=np.float32) + t) * t
        assert len(results[t]) == 50 and all(np.array_equal(g, want) for g in results[t])
    assert len(errors[7]) == 50 and all("kept a view" in e for e in errors[7])
    kept.clear()  # views of freed buffers: never read


# --- several devices (a subprocess with N CPU devices: multidevice.py) -------

@on(2)
def case_sharded_input_is_refused_one_device_input_runs_there(n):
    cpus = jax.devices("cpu")[:n]
    mesh = jax.sharding.Mesh(np.array(cpus), ("x",))
    sharded = jax.device_put(jnp.arange(8.0, dtype=jnp.float32),
                             jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x")))
    f = numpy_fn(lambda x: x * 2)
    with pytest.raises(ValueError, match=f"input 0 is sharded over {n} devices.*shard_map"):
        f(sharded)
    last = jax.device_put(jnp.arange(4.0, dtype=jnp.float32), cpus[-1])
    out = f(last)
    assert out.devices() == {cpus[-1]}
    np.testing.assert_array_equal(np.asarray(out), np.arange(4.0) * 2)


@pytest.mark.parametrize("n,case", params(globals()))
def test_multidevice(n, case):
    check(__file__, n, case)


def test_inside_control_flow_remat_and_donation():
    """A foreign call inside lax.scan, cond, while_loop and fori_loop, under
    grad through a scan (its vjp once per step), under jax.checkpoint, and
    with its input donated."""
    from jax import lax
    f = numpy_fn(lambda x: np.sin(x) * 2, vjp=lambda x, ct: (np.cos(x) * 2 * ct,))
    x = on_cpu(jnp.linspace(0, 1, 8, dtype=jnp.float32))
    want = np.asarray(x)
    for _ in range(5):
        want = np.sin(want) * 2 * 0.5
    got, _ = jax.jit(lambda x: lax.scan(lambda c, _: (f(c) * 0.5, None), x, None, length=5))(x)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)
    cond = jax.jit(lambda x, p: lax.cond(p, f, lambda v: v, x))
    np.testing.assert_allclose(np.asarray(cond(x, True)), np.sin(np.asarray(x)) * 2, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(cond(x, False)), np.asarray(x))
    loop = jax.jit(lambda x: lax.while_loop(lambda s: s[1] < 3,
                                            lambda s: (f(s[0]) * 0.5, s[1] + 1), (x, 0))[0])
    fori = jax.jit(lambda x: lax.fori_loop(0, 3, lambda i, v: f(v) * 0.5, x))
    np.testing.assert_allclose(np.asarray(loop(x)), np.asarray(fori(x)), rtol=1e-6)

    def steps(fn):
        return lambda x: lax.scan(lambda c, _: (fn(c) * 0.5, None), x, None, length=3)[0].sum()
    g = jax.jit(jax.grad(steps(f)))(x)
    np.testing.assert_allclose(np.asarray(g), np.asarray(jax.grad(steps(lambda v: jnp.sin(v) * 2))(x)),
                               rtol=1e-5)
    g = jax.grad(jax.checkpoint(lambda x: f(x).sum()))(x)
    np.testing.assert_allclose(np.asarray(g), np.cos(np.asarray(x)) * 2, rtol=1e-5)
    y = jax.jit(lambda v: f(v) + 1, donate_argnums=0)(on_cpu(jnp.ones(8, jnp.float32)))
    np.testing.assert_allclose(np.asarray(y), np.sin(1.0) * 2 + 1, rtol=1e-6)
