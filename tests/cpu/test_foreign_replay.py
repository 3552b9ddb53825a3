"""foreign(..., replay=True) where CI runs: the arguments; the CPU backend,
where XLA has no command buffers and fn runs on every call; the traced
path of the callback (the adapter's capture(), what it keeps, the errors
naming replay=False) through the GPU template with the capture status
stubbed; Numba's keeping of allocations with a stand-in memory manager;
and vjp="autograd" with replay=True passing fn's saved tensors to the
backward as residuals (test_foreign_kept.py has the rest).  The GPU's own
behaviour (traces, replays, pools) is tests/gpu/test_foreign_replay_gpu.py."""

from __future__ import annotations

import contextlib
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_overlay
from jax_overlay import _foreign
from jax_overlay.errors import ForeignError
from jax_overlay.peers import _base
from test_foreign_template import Host

CPU = jax.devices("cpu")[0]


def on_cpu(x):
    return jax.device_put(x, CPU)


class Capturing(Host):
    """The template, with capture() recording what it is given."""

    def capture(self, memory):
        self.log.append("capture")
        self.memories.append(memory)

        @contextlib.contextmanager
        def pool():
            memory.append("trace")
            self.log.append("in pool")
            try:
                yield
            finally:
                self.log.append("out of pool")
        return pool()


@pytest.fixture
def traced(monkeypatch):
    """The template adapter, every call a trace (as on a GPU whose stream
    XLA captures)."""
    adapter = Capturing()
    adapter.memories = []
    monkeypatch.setattr(_foreign, "_adapter", lambda framework: adapter)
    monkeypatch.setattr(_foreign, "_check_placement", lambda args, framework: None)
    monkeypatch.setattr(_foreign, "_capturing", lambda ordinal, ctx: True)
    return adapter


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_replay_takes_a_bool(bad):
    with pytest.raises(TypeError, match="replay must be True or False"):
        jax_overlay.foreign(lambda x: x, framework="numpy", result_shape_dtypes=lambda x: x,
                            replay=bad)


def test_on_the_cpu_fn_runs_every_call():
    runs = []

    def fn(x):
        runs.append(1)
        return x * 2
    f = jax.jit(jax_overlay.foreign(fn, framework="numpy", result_shape_dtypes=lambda x: x,
                                    replay=True))
    x = on_cpu(jnp.arange(4.0))
    for i in range(5):
        np.testing.assert_array_equal(np.asarray(f(x + i)), (np.arange(4.0) + i) * 2)
    assert len(runs) == 5


def test_a_trace_runs_fn_inside_the_adapters_capture(traced):
    f = jax.jit(jax_overlay.foreign(lambda x: x + 1, framework="torch",
                                    result_shape_dtypes=lambda x: x, replay=True))
    x = on_cpu(jnp.arange(3.0, dtype=jnp.float32))
    np.testing.assert_array_equal(np.asarray(f(x)), [1.0, 2.0, 3.0])
    log = [e for e in traced.log if isinstance(e, str)]
    assert log == ["enter", "capture", "in pool", "out of pool", "exit"]


def test_without_replay_there_is_no_capture(traced):
    f = jax.jit(jax_overlay.foreign(lambda x: x + 1, framework="torch",
                                    result_shape_dtypes=lambda x: x))
    f(on_cpu(jnp.ones(2, jnp.float32))).block_until_ready()
    assert "capture" not in traced.log


@pytest.mark.parametrize("serial", [True, False], ids=["commands-one-at-a-time", "concurrent"])
def test_what_each_trace_keeps_stays_with_the_callback(traced, monkeypatch, serial):
    made = []
    real = _foreign._make_callback

    def spy(*args, **kwargs):
        cb = real(*args, **kwargs)
        made.append(cb)
        return cb
    monkeypatch.setattr(_foreign, "_make_callback", spy)
    monkeypatch.setattr(_foreign, "_commands_run_one_at_a_time", lambda: serial)
    f = jax.jit(jax_overlay.foreign(lambda x: x * 3, framework="torch",
                                    result_shape_dtypes=lambda x: x, replay=True))
    outs = [f(on_cpu(jnp.full(2, i, jnp.float32))) for i in range(3)]  # all alive: 3 outputs
    jax.block_until_ready(outs)
    (cb,) = made
    kept = next(c.cell_contents for c in cb.__closure__ if isinstance(c.cell_contents, dict))
    assert len(traced.memories) == 3  # a trace each call: the outputs moved
    if serial:
        # XLA runs one command at a time: every trace on the device shares
        # one memory (a pool made once), however often the outputs move.
        (memory,) = kept.values()
        assert all(m is memory for m in traced.memories)
        assert memory == ["trace"] * 3
        return
    # Concurrent commands: one memory per output buffer, each the list its
    # trace was given, and none dropped: the callback holds them while it lives.
    assert len(kept) == 3
    assert sorted(map(id, kept.values())) == sorted(map(id, traced.memories))
    assert all(m == ["trace"] for m in kept.values())
    ptrs = {o.unsafe_buffer_pointer() for o in outs}
    assert {k[1] for k in kept} == ptrs  # keyed by the output buffers' addresses


@pytest.mark.parametrize("flags, serial", [
    ("", True),
    ("--xla_gpu_graph_min_graph_size=1", True),
    ("--xla_gpu_command_buffer_scheduling_mode=LHS", True),
    ("--xla_gpu_command_buffer_scheduling_mode=SERIALIZE", True),
    ("--xla_gpu_command_buffer_scheduling_mode=CONCURRENT", False),
    ("--xla_gpu_graph_min_graph_size=1 --xla_gpu_command_buffer_scheduling_mode=concurrent_regions",
     False),
    ("--xla_gpu_graph_enable_concurrent_region=true", False),
    ("--xla_gpu_graph_enable_concurrent_region", False),
    ("--xla_gpu_graph_enable_concurrent_region=false", True),
    # The last of a flag wins, as in XLA.
    ("--xla_gpu_command_buffer_scheduling_mode=CONCURRENT "
     "--xla_gpu_command_buffer_scheduling_mode=LHS", True),
])
def test_concurrent_commands_are_read_from_xla_flags(monkeypatch, flags, serial):
    assert _read_under(monkeypatch, flags, _foreign._commands_run_one_at_a_time) is serial


def _read_under(monkeypatch, flags, reader):
    """A cached reader of XLA_FLAGS, read afresh under `flags`."""
    monkeypatch.setenv("XLA_FLAGS", flags)
    reader.cache_clear()
    try:
        return reader()
    finally:
        reader.cache_clear()


def test_an_error_while_traced_names_replay_false(traced):
    def fn(x):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
    f = jax_overlay.foreign(fn, framework="torch", result_shape_dtypes=lambda x: x,
                            replay=True)
    with pytest.raises(Exception) as info:
        jax.jit(f)(on_cpu(jnp.ones(2, jnp.float32))).block_until_ready()
    text = str(info.value)  # under jit, XLA's runtime error with fn's error in it
    assert "RuntimeError: CUDA error: operation not permitted" in text
    assert "replay=False" in text and ".item()" in text
    assert "out of pool" in traced.log and traced.log[-1] == "exit"


def test_a_wrong_output_while_traced_names_replay_false_too(traced):
    f = jax_overlay.foreign(lambda x: x[:1], framework="torch",
                            result_shape_dtypes=lambda x: x, replay=True)
    with pytest.raises(Exception, match=r"(?s)float32\[1\].*replay=False"):
        jax.jit(f)(on_cpu(jnp.ones(2, jnp.float32))).block_until_ready()


class _Memory:
    """A stand-in for Numba's memory manager."""

    def __init__(self):
        self.deferred = 0
        self.n = 0

    def memalloc(self, size):
        self.n += 1
        return ("mem", self.n, size)

    @contextlib.contextmanager
    def defer_cleanup(self):
        self.deferred += 1
        try:
            yield
        finally:
            self.deferred -= 1


def test_numba_allocations_while_traced_are_kept(monkeypatch):
    from jax_overlay.peers import numba as peer
    modes = []

    def exchange(mode):
        modes.append(mode)
        return 1 if mode == 2 else 2
    monkeypatch.setattr(_base.ext, "exchange_capture_mode", exchange)

    class Context:
        memory_manager = _Memory()
    mm = Context.memory_manager
    kept: list = []
    other: list = []
    with peer._keeping(Context, kept):
        assert mm.deferred == 1  # no frees while captured
        a = Context.memory_manager.memalloc(64)
        t = threading.Thread(target=lambda: other.append(mm.memalloc(32)))
        t.start()
        t.join()
    assert kept == [a]  # this thread's, kept; the other thread's passed through
    assert other == [("mem", 2, 32)]
    assert "memalloc" not in vars(mm) and mm.deferred == 0  # the class's own again
    assert modes == [2, 1]  # relaxed for the block, then the thread's own mode back


def test_numba_keeping_restores_a_patch_it_found(monkeypatch):
    from jax_overlay.peers import numba as peer
    monkeypatch.setattr(_base.ext, "exchange_capture_mode", lambda mode: 1)

    class Context:
        memory_manager = _Memory()
    mm = Context.memory_manager

    def theirs(size):
        return ("theirs", size)
    mm.memalloc = theirs
    kept: list = []
    with peer._keeping(Context, kept):
        mm.memalloc(8)
    assert kept == [("theirs", 8)] and mm.memalloc is theirs


def test_vjp_function_with_replay():
    f = jax_overlay.foreign(lambda x: x ** 2, framework="numpy",
                            result_shape_dtypes=lambda x: x, replay=True,
                            vjp=lambda x, ct: 2 * x * ct)
    g = jax.jit(jax.grad(lambda x: f(x).sum()))(on_cpu(jnp.arange(3.0)))
    np.testing.assert_array_equal(np.asarray(g), [0.0, 2.0, 4.0])


def test_autograd_with_replay_passes_the_saved_tensors_as_residuals():
    torch = pytest.importorskip("torch")
    runs = []

    def fn(x):
        runs.append(x.device.type)
        return (torch.sin(x) ** 2).sum()
    scalar = jax.ShapeDtypeStruct((), np.float32)
    f = jax_overlay.foreign(fn, framework="torch", result_shape_dtypes=scalar,
                            vjp="autograd", replay=True)
    x = on_cpu(jnp.linspace(0, 1, 8, dtype=jnp.float32))
    v, g = jax.jit(jax.value_and_grad(f))(x)
    np.testing.assert_allclose(float(v), (np.sin(np.asarray(x)) ** 2).sum(), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(g), np.sin(2 * np.asarray(x)), rtol=1e-5)
    # fn ran on meta tensors (what its graph saves: sin's input, x, and
    # the power's, sin(x)), then in the forward call; the backward call
    # ran the template's backward over the residual, not fn: no ticket
    # is read (a replayed trace could not), no graph waits.
    assert runs == ["meta", "cpu"]
    assert f.saved.waiting() == 0
    (found,) = f.saved.found.values()
    assert found[0] == (8 * 4,)


# Where XLA_FLAGS has XLA not trace again for moved temporaries
# (SKIP_TEMP, SKIP_PROFILED), a replayed call writes
# temporaries one element longer than its outputs and XLA copies the
# outputs out of them (so results the caller keeps do not move the trace):
# the padded path, here with the flag's reading stubbed.

@pytest.fixture
def padded(traced, monkeypatch):
    monkeypatch.setattr(_foreign, "_temporaries_stay_put", lambda: True)
    return traced


def _callback_shapes(f, *args):
    """The shapes of the buffers XLA gives the callback, from the jaxpr."""
    jaxpr = jax.make_jaxpr(f)(*args)
    eqns = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "buffer_callback"]
    if not eqns:  # inside the pjit of the foreign call
        inner = [e.params["jaxpr"] for e in jaxpr.jaxpr.eqns if "jaxpr" in e.params]
        eqns = [e for j in inner for e in j.jaxpr.eqns if e.primitive.name == "buffer_callback"]
    (e,) = eqns
    return [tuple(v.aval.shape) for v in e.outvars]


def test_padded_outputs_are_the_outputs_values(padded):
    def fn(x, y):
        return {"sum": x + y, "scalar": np.asarray(x.sum()), "empty": np.zeros((0, 3), np.int32),
                "flags": x > 2}

    def spec(x, y):
        return {"sum": x, "scalar": jax.ShapeDtypeStruct((), x.dtype),
                "empty": jax.ShapeDtypeStruct((0, 3), jnp.int32),
                "flags": jax.ShapeDtypeStruct(x.shape, jnp.bool_)}
    f = jax_overlay.foreign(fn, framework="torch", result_shape_dtypes=spec, replay=True)
    x = on_cpu(jnp.arange(35.0, dtype=jnp.float32).reshape(5, 7))
    y = on_cpu(jnp.ones((5, 7), jnp.float32))
    assert sorted(_callback_shapes(f, x, y)) == sorted([(1,), (36,), (36,), (2,)])
    got = jax.jit(f)(x, y)
    want = fn(np.asarray(x), np.asarray(y))
    for k in want:
        assert got[k].shape == want[k].shape and got[k].dtype == want[k].dtype, k
        np.testing.assert_array_equal(np.asarray(got[k]), want[k], err_msg=k)


def test_padded_out_true_views_have_the_outputs_shape(padded):
    seen = []

    def fn(x, *, out):
        seen.append(out.shape)
        np.multiply(x, 3, out=out)
    f = jax_overlay.foreign(fn, framework="torch", result_shape_dtypes=lambda x: x, out=True,
                            replay=True)
    x = on_cpu(jnp.arange(12.0, dtype=jnp.float32).reshape(3, 4))
    np.testing.assert_array_equal(np.asarray(jax.jit(f)(x)), np.asarray(x) * 3)
    assert seen == [(3, 4)]


def test_padded_wrong_outputs_name_the_outputs_own_shape(padded):
    f = jax_overlay.foreign(lambda x: x[:2], framework="torch",
                            result_shape_dtypes=lambda x: x, replay=True)
    with pytest.raises(Exception, match=r"float32\[2\].*says float32\[3\]"):
        jax.jit(f)(on_cpu(jnp.ones(3, jnp.float32))).block_until_ready()


def test_padded_under_sequential_vmap_and_not_where_it_cannot_be(padded):
    x = on_cpu(jnp.arange(12.0, dtype=jnp.float32).reshape(3, 4))
    seq = jax_overlay.foreign(lambda v: v[::-1].copy(), framework="torch",
                              result_shape_dtypes=lambda v: v, vmap_method="sequential",
                              replay=True)
    np.testing.assert_array_equal(np.asarray(jax.jit(jax.vmap(seq))(x)), np.asarray(x)[:, ::-1])
    assert _callback_shapes(seq, x[0]) == [(5,)]
    # Batched buffers (expand_dims), an aliased output, no replay, no flag:
    # the outputs as they are.
    exp = jax_overlay.foreign(lambda v: v[..., ::-1].copy(), framework="torch",
                              result_shape_dtypes=lambda v: v, vmap_method="expand_dims",
                              replay=True)
    np.testing.assert_array_equal(np.asarray(jax.jit(jax.vmap(exp))(x)), np.asarray(x)[:, ::-1])
    assert _callback_shapes(exp, x[0]) == [(4,)]
    aliased = jax_overlay.foreign(lambda v: v + 1, framework="torch",
                                  result_shape_dtypes=lambda v: v, input_output_aliases={0: 0},
                                  replay=True)
    assert _callback_shapes(aliased, x) == [(3, 4)]
    plain = jax_overlay.foreign(lambda v: v + 1, framework="torch",
                                result_shape_dtypes=lambda v: v)
    assert _callback_shapes(plain, x) == [(3, 4)]


@pytest.mark.parametrize("flags, put", [
    ("", False),
    ("--xla_gpu_graph_min_graph_size=1", False),
    ("--xla_gpu_temp_buffer_use_separate_color=true", False),  # did not keep the trace
    ("--xla_gpu_graph_min_graph_size=1 --xla_gpu_command_buffer_update_mode=SKIP_TEMP", True),
    ("--xla_gpu_command_buffer_update_mode=skip_profiled", True),
    ("--xla_gpu_command_buffer_update_mode=ALWAYS_UPDATE", False),
])
def test_fixed_temporaries_are_read_from_xla_flags(monkeypatch, flags, put):
    assert _read_under(monkeypatch, flags, _foreign._temporaries_stay_put) is put
