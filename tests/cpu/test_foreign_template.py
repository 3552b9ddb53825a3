"""The GPU frameworks' shared template (`peers._base.GpuAdapter`) on the CPU: a
stand-in framework whose arrays are NumPy arrays over XLA's host buffers
runs through the real path (`foreign`, `buffer_callback`, the callback, the
template's views, tokens, stream wrappers and output checks), so what the
template does apart from PyTorch, CuPy and Numba is checked where CI runs.
Only the placement rules are lifted: the template refuses host buffers,
which `test_ordinal_*` checks on its own."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_overlay
from jax_overlay import _foreign
from jax_overlay.peers import _base

CPU = jax.devices("cpu")[0]


class _Holder:
    """What a framework's array holds: XLA's memory at a pointer, and the
    call's token (as PyTorch's capsule owner or CuPy's UnownedMemory do)."""

    def __init__(self, ptr, shape, dtype, writeable, token):
        self.token = token
        self.__array_interface__ = {"data": (ptr, not writeable), "shape": shape,
                                    "typestr": dtype.str, "version": 3}


class Host(_base.GpuAdapter):
    name, array_type = "host", "numpy.ndarray"

    def __init__(self):
        super().__init__()
        self.log = []

    def wrap(self, handle, ordinal):
        self.log.append(("wrap", threading.get_ident()))
        return ("stream", handle, ordinal)

    def enter(self, ctx, ordinal, traced=False):
        # XLA's CPU runtime has no stream (ctx.stream raises there): 0.
        stream = self.stream(0, ordinal)
        self.log.append("enter")
        return stream, stream

    def exit(self, state):
        self.log.append("exit")

    def ordinal(self, buffers):
        return 0  # host buffers: the template's own refusal is tested below

    def np_dtype(self, view):
        return view.dtype

    def empty(self, shape, dtype):
        return np.empty(shape, dtype)

    def over(self, ptr, shape, dtype, size, ordinal, writeable, token):
        # base: the holder, so every view derived from it holds the token.
        return np.asarray(_Holder(ptr, shape, dtype, writeable, token))

    def facts(self, got):
        if not isinstance(got, np.ndarray):
            return None, None
        return got.shape, got.dtype

    def copy_into(self, view, got, stream):
        np.copyto(view, got)


@pytest.fixture
def host(monkeypatch):
    adapter = Host()
    monkeypatch.setattr(_foreign, "_adapter", lambda framework: adapter)
    monkeypatch.setattr(_foreign, "_check_placement", lambda args, framework: None)
    return adapter


def fn_of(fn, spec=lambda *xs: xs[0], **kw):
    return jax_overlay.foreign(fn, framework="torch", result_shape_dtypes=spec, **kw)


def on_cpu(x):
    return jax.device_put(x, CPU)


def test_views_are_xla_buffers_and_outputs_are_copied_in(host):
    seen = []

    def fn(x, y):
        seen.append((x.flags.writeable, x.__array_interface__["data"][0]))
        return x * 2 + y
    x = on_cpu(jnp.arange(6.0, dtype=jnp.float32).reshape(2, 3))
    y = on_cpu(jnp.ones((2, 3), jnp.float32))
    got = jax.jit(fn_of(fn))(x, y)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(x) * 2 + 1)
    assert host.log.count("enter") == host.log.count("exit") == 1
    # The inputs are read-only views of XLA's own buffers: the argument's.
    assert seen == [(False, x.unsafe_buffer_pointer())]


def test_out_true_writes_through_the_templates_views(host):
    def fn(x, *, out):
        np.multiply(x, 3, out=out["a"])
        out["b"][...] = x.sum()

    def spec(x):
        return {"a": x, "b": jax.ShapeDtypeStruct((), x.dtype)}
    x = on_cpu(jnp.arange(4.0, dtype=jnp.float32))
    got = jax.jit(fn_of(fn, spec, out=True))(x)
    np.testing.assert_array_equal(np.asarray(got["a"]), np.asarray(x) * 3)
    assert float(got["b"]) == 6.0


def test_zero_size_and_a_python_scalar_for_a_0d_output(host):
    z = on_cpu(jnp.zeros((0, 3), jnp.float32))
    got = jax.jit(fn_of(lambda a: a + 1))(z)
    assert got.shape == (0, 3)
    s = jax.jit(fn_of(lambda a: 7.0, lambda a: jax.ShapeDtypeStruct((), jnp.float32)))(
        on_cpu(jnp.ones(2)))
    assert float(s) == 7.0


@pytest.mark.parametrize("ret,words", [
    (lambda x: x[:2], r"float32\[2\].*says float32\[3\]"),
    (lambda x: x.astype(np.float64), r"float64\[3\].*says float32\[3\]"),
    (lambda x: [1.0, 2.0, 3.0], "structure"),
    (lambda x: "text", r"output 0 .* is a str; framework='host' returns numpy.ndarray"),
])
def test_wrong_outputs_are_named(host, ret, words):
    with pytest.raises(Exception, match=words):
        fn_of(ret)(on_cpu(jnp.ones(3, jnp.float32))).block_until_ready()


def test_a_view_kept_through_a_derived_view_fails_the_call(host):
    kept = []

    def fn(x):
        kept.append(x[1:][::2])  # derived from a derived view: holds the token
        return x + 1
    with pytest.raises(Exception, match="kept a view"):
        fn_of(fn)(on_cpu(jnp.ones(5, jnp.float32))).block_until_ready()
    kept.clear()

    def cycle(x):
        loop = [x]
        loop.append(loop)  # a view in a reference cycle, collectable: not kept
        return x + 1
    np.testing.assert_array_equal(np.asarray(fn_of(cycle)(on_cpu(jnp.ones(3)))), 2)


def test_one_stream_wrapper_per_thread(host):
    f = jax.jit(fn_of(lambda x: x + 1))
    x = on_cpu(jnp.ones(3, jnp.float32))
    for _ in range(3):
        f(x).block_until_ready()
    done = []
    t = threading.Thread(target=lambda: done.append(np.asarray(f(x))))
    t.start()
    t.join()
    np.testing.assert_array_equal(done[0], 2)
    wraps = [e for e in host.log if isinstance(e, tuple)]
    # XLA may run callbacks on its own threads; each thread wraps once.
    assert len(wraps) == len({ident for _, ident in wraps}) >= 1


class _Buf:
    def __init__(self, kind, dev):
        self.kind, self.dev = kind, dev

    def __dlpack_device__(self):
        return self.kind, self.dev


def test_ordinal_takes_one_cuda_device():
    gpu = _base.GpuAdapter()
    gpu.name = "torch"
    assert gpu.ordinal((_Buf(2, 1), _Buf(2, 1))) == 1
    assert gpu.ordinal(()) == 0
    with pytest.raises(_foreign.ForeignError, match="GPUs 0 and 1"):
        gpu.ordinal((_Buf(2, 0), _Buf(2, 1)))


@pytest.mark.parametrize("kind,words", [
    (3, r"buffer 1 of this call is in pinned host memory.*with_memory_kind\('device'\)"),
    (1, r"buffer 1 of this call is in DLPack device 1 .*framework='numpy'"),
])
def test_ordinal_refuses_host_buffers_with_what_to_do(kind, words):
    gpu = _base.GpuAdapter()
    gpu.name = "torch"
    with pytest.raises(_foreign.ForeignError, match=words):
        gpu.ordinal((_Buf(2, 0), _Buf(kind, 0)))


def test_join_and_leave_fence_the_callers_stream_both_ways(monkeypatch):
    """join(): XLA's stream after the caller's work, leave(): the caller's
    stream after fn's; neither while XLA's stream is captured, nor where
    the caller's stream is XLA's own."""
    fences = []
    monkeypatch.setattr(_base.ext, "order_after",
                        lambda ordinal, producer, consumer: fences.append((ordinal, producer, consumer)))

    class Caller(_base.GpuAdapter):
        def caller(self, ordinal):
            return 7
    a = Caller()
    assert a.join(1, 11, traced=True) is None
    assert a.join(1, 7, traced=False) is None
    a.leave(1, 11, None)
    assert fences == []
    caller = a.join(1, 11, traced=False)
    assert (caller, fences) == (7, [(1, 7, 11)])
    a.leave(1, 11, caller)
    assert fences == [(1, 7, 11), (1, 11, 7)]
