"""foreign(..., vjp="autograd") keeps the forward's autograd graph for the
backward call (peers.torch.SavedAutograd), on the CPU backend with
PyTorch's CPU build: fn runs once per training step, gradients match
jax.grad of the same model in JAX, the graph that runs is always the
forward's own (never another's: a wrong one would be silent), and graphs
are released when their backward runs or past config.saved_graphs, never
kept.  The GPU side (the ticket read on XLA's stream, memory over 10,000
steps) is tests/gpu/test_foreign_gpu.py."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

from torch_or_skip import torch as _torch  # noqa: E402

torch = _torch()
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jax_overlay  # noqa: E402
import workloads  # noqa: E402
from workloads import counted, grads_close, in_threads, jax_mlp, torch_mlp  # noqa: E402

CPU = jax.devices("cpu")[0]
SCALAR = jax.ShapeDtypeStruct((), np.float32)


def on_cpu(x):
    return jax.device_put(x, CPU)


def mlp_params(seed=0):
    return [on_cpu(a) for a in workloads.mlp_params(128, 32, 64, seed=seed, scale=0.2)]


def test_training_matches_jax_over_100_steps_and_fn_runs_once_a_step():
    """value_and_grad + SGD under jit, 100 steps, against the same model in
    JAX; fn runs once a step (recompute=True: twice), and no graph waits
    after a step."""
    fn, calls = counted(torch_mlp)
    f = jax_overlay.foreign(fn, framework="torch", result_shape_dtypes=SCALAR, vjp="autograd")

    step = workloads.sgd
    x, *p = mlp_params()
    q = list(p)
    ours, theirs = step(f), step(jax_mlp)
    for i in range(100):
        v, p = jax.block_until_ready(ours(x, *p))
        w, q = theirs(x, *q)
        assert len(calls) == i + 1
        assert f.saved.waiting() == 0
    np.testing.assert_allclose(float(v), float(w), rtol=1e-5)
    for a, b in zip(p, q):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    assert float(v) < 0.5 * float(ours(*mlp_params())[0])  # it did learn

    fn2, calls2 = counted(torch_mlp)
    r = jax_overlay.foreign(fn2, framework="torch", result_shape_dtypes=SCALAR, vjp="autograd",
                            recompute=True)
    v2, _ = jax.block_until_ready(step(r)(*mlp_params()))
    assert len(calls2) == 2
    np.testing.assert_allclose(float(v2), float(ours(*mlp_params())[0]), rtol=1e-6)


def test_inputs_the_graph_saves_are_read_from_the_backward_call():
    """Tensors saved by the graph that view an input (x for x * w, a
    transpose, an integer index, the input itself returned) are not kept
    past the forward call (no kept-view error), and read right later."""
    cases = [
        (lambda x, w, i: (x * w).sum(), lambda x, w, i: (x * w).sum()),
        (lambda x, w, i: (x.t() @ w).sum(), lambda x, w, i: (x.T @ w).sum()),
        (lambda x, w, i: (x[i.long()] * w[i.long()]).sum(),
         lambda x, w, i: (x[i] * w[i]).sum()),
        (lambda x, w, i: x, lambda x, w, i: x),
        (lambda x, w, i: x.t(), lambda x, w, i: x.T),
    ]
    x = on_cpu(jnp.arange(12.0, dtype=jnp.float32).reshape(3, 4) / 7)
    w = on_cpu(jnp.linspace(-1, 1, 12, dtype=jnp.float32).reshape(3, 4))
    i = on_cpu(jnp.array([2, 0, 2], jnp.int32))
    for theirs, ours in cases:
        f = jax_overlay.foreign(theirs, framework="torch", vjp="autograd",
                                result_shape_dtypes=lambda x, w, i, o=ours: jax.eval_shape(o, x, w, i))
        for loss in (lambda g: lambda *a: (g(*a) ** 2).sum(),):
            got = jax.jit(jax.grad(loss(f), argnums=(0, 1)))(x, w, i)
            want = jax.grad(loss(ours), argnums=(0, 1))(x, w, i)
            grads_close(got, want)  # the transpose's rows of w cancel to ~0
        assert f.saved.waiting() == 0


def test_each_backward_gets_its_own_forwards_graph():
    """Forwards of one function kept as jax.vjp closures, their backwards
    run in another order, one of them twice: every cotangent is its own
    forward's (a graph used once is gone, so the second call runs fn
    again, and is right too)."""
    fn, calls = counted(lambda x: torch.sin(x) * x)
    f = jax_overlay.foreign(fn, framework="torch", result_shape_dtypes=lambda x: x,
                            vjp="autograd")
    xs = [on_cpu(jnp.linspace(0, 1, 8, dtype=jnp.float32) * (k + 1)) for k in range(5)]
    vjps = [jax.vjp(f, x)[1] for x in xs]
    assert len(calls) == 5 and f.saved.waiting() == 5
    ct = on_cpu(jnp.ones(8, jnp.float32))
    for k in (3, 0, 4, 1, 2, 3):
        (got,) = vjps[k](ct)
        want = jax.grad(lambda v: (jnp.sin(v) * v).sum())(xs[k])
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    assert len(calls) == 6  # the second backward of forward 3 ran fn again
    assert f.saved.waiting() == 0


def test_two_calls_in_one_jit_and_a_scan():
    """Two calls of one function in one program, and one per step of a
    scan (each step's ticket stacked by XLA): each backward its own graph."""
    from jax import lax
    fn, calls = counted(lambda x: torch.tanh(x) * 2)
    f = jax_overlay.foreign(fn, framework="torch", result_shape_dtypes=lambda x: x,
                            vjp="autograd")

    def two(g):
        return lambda x: (g(x) * g(x * 3 + 1)).sum()

    def steps(g):
        return lambda x: lax.scan(lambda c, _: (g(c) * 0.5, None), x, None, length=4)[0].sum()
    x = on_cpu(jnp.linspace(-1, 1, 16, dtype=jnp.float32))
    ref = lambda v: jnp.tanh(v) * 2  # noqa: E731
    for make in (two, steps):
        calls.clear()
        got = jax.jit(jax.grad(make(f)))(x)
        want = jax.grad(make(ref))(x)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
        assert len(calls) == (2 if make is two else 4)
        assert f.saved.waiting() == 0


def test_graphs_waiting_are_bounded_and_released():
    """Forwards whose backward never runs keep at most config.saved_graphs
    graphs; the activations a graph holds go with it, and with its
    backward; an evicted graph's backward runs fn again, right."""
    alive: list = []

    def fn(x):
        h = torch.exp(x)  # saved by exp's backward: PyTorch's own memory
        alive.append(weakref.ref(h.untyped_storage()))  # its memory, whoever views it
        return h * 3
    f = jax_overlay.foreign(fn, framework="torch", result_shape_dtypes=lambda x: x,
                            vjp="autograd")
    x = on_cpu(jnp.linspace(0, 1, 4, dtype=jnp.float32))
    keep = jax_overlay.config.saved_graphs
    vjps = [jax.vjp(f, x * (k + 1))[1] for k in range(keep + 8)]
    gc.collect()
    assert f.saved.waiting() == keep
    held = [r() is not None for r in alive]
    assert held == [False] * 8 + [True] * keep
    ct = on_cpu(jnp.ones(4, jnp.float32))
    for k in (0, keep + 7):  # evicted, and kept
        (got,) = vjps[k](ct)
        np.testing.assert_allclose(np.asarray(got), 3 * np.exp(np.asarray(x) * (k + 1)),
                                   rtol=1e-5)
    gc.collect()
    assert f.saved.waiting() == keep - 1
    assert alive[keep + 7]() is None
    del vjps
    old = jax_overlay.config.saved_graphs
    try:
        jax_overlay.config.saved_graphs = 0
        fn0, calls = counted(lambda x: x * x)
        g = jax_overlay.foreign(fn0, framework="torch", result_shape_dtypes=lambda x: x,
                                vjp="autograd")
        np.testing.assert_allclose(np.asarray(jax.grad(lambda v: g(v).sum())(x)), 2 * np.asarray(x))
        assert len(calls) == 2 and g.saved.waiting() == 0
    finally:
        jax_overlay.config.saved_graphs = old


def test_jacrev_and_vmap():
    """jax.jacrev (one forward, a backward per output row) and a per-example
    gradient under vmap(sequential): right values, nothing left waiting."""
    f = jax_overlay.foreign(lambda x: torch.sin(x) * x, framework="torch",
                            result_shape_dtypes=lambda x: x, vjp="autograd",
                            vmap_method="sequential")
    x = on_cpu(jnp.linspace(0, 1, 5, dtype=jnp.float32))
    np.testing.assert_allclose(np.asarray(jax.jit(jax.jacrev(f))(x)),
                               np.asarray(jax.jacrev(lambda v: jnp.sin(v) * v)(x)),
                               rtol=1e-5, atol=1e-6)
    xs = on_cpu(jnp.linspace(0, 1, 15, dtype=jnp.float32).reshape(3, 5))
    got = jax.jit(jax.vmap(jax.grad(lambda v: f(v).sum())))(xs)
    want = jax.vmap(jax.grad(lambda v: (jnp.sin(v) * v).sum()))(xs)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    assert f.saved.waiting() == 0


def test_threads_each_get_their_own_gradients():
    """8 threads train on one function at once: each thread's gradients are
    its own inputs'."""
    f = jax_overlay.foreign(torch_mlp, framework="torch", result_shape_dtypes=SCALAR,
                            vjp="autograd")
    vg = jax.jit(jax.value_and_grad(f, argnums=1))
    ref = jax.jit(jax.value_and_grad(jax_mlp, argnums=1))

    def work(seed):
        p = mlp_params(seed)
        want = ref(*p)
        for _ in range(20):
            got = vg(*p)
            np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-5)
            np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]),
                                       rtol=1e-4, atol=1e-6)
    errors = in_threads(work, 8)
    assert not errors, errors[0]
    assert f.saved.waiting() == 0


def test_recompute_is_checked_when_made():
    with pytest.raises(ValueError, match="recompute=True chooses how vjp='autograd'"):
        jax_overlay.foreign(torch.sin, framework="torch", result_shape_dtypes=lambda x: x,
                            recompute=True)
    with pytest.raises(TypeError, match="recompute must be True or False"):
        jax_overlay.foreign(torch.sin, framework="torch", result_shape_dtypes=lambda x: x,
                            vjp="autograd", recompute=1)
    with pytest.raises(ValueError, match="JAX_OVERLAY_SAVED_GRAPHS='-1'"):
        import os

        from jax_overlay._config import Config
        os.environ["JAX_OVERLAY_SAVED_GRAPHS"] = "-1"
        try:
            Config()
        finally:
            del os.environ["JAX_OVERLAY_SAVED_GRAPHS"]


@pytest.mark.parametrize("recompute", [False, True])
def test_only_the_inputs_jax_differentiates_get_gradients(recompute):
    """grad over some arguments: PyTorch computes no gradient for the others
    (custom_vjp's symbolic zeros say which), and they come back as zeros
    where asked for; a cotangent JAX leaves zero (an unused output) is
    given as zeros."""
    probe, ran = workloads.backward_probe()

    f = jax_overlay.foreign(lambda x, w: (probe(x) * w, w * 2), framework="torch",
                            result_shape_dtypes=lambda x, w: (x, w), vjp="autograd",
                            recompute=recompute)
    x = on_cpu(jnp.linspace(0, 1, 6, dtype=jnp.float32))
    w = on_cpu(jnp.linspace(1, 2, 6, dtype=jnp.float32))
    gw = jax.jit(jax.grad(lambda x, w: f(x, w)[0].sum(), argnums=1))(x, w)
    np.testing.assert_allclose(np.asarray(gw), np.asarray(x), rtol=1e-6)
    assert ran == []
    gx, gw = jax.jit(jax.grad(lambda x, w: f(x, w)[0].sum(), argnums=(0, 1)))(x, w)
    np.testing.assert_allclose(np.asarray(gx), np.asarray(w), rtol=1e-6)
    assert ran == [1]
    (g,) = jax.grad(lambda x, w: f(x, w)[1].sum(), argnums=(0,))(x, w)  # x unused there
    np.testing.assert_array_equal(np.asarray(g), 0.0)


@pytest.mark.parametrize("mode", [{}, {"recompute": True}, {"replay": True}],
                         ids=["saved", "recompute", "replay"])
def test_complex_gradients_follow_jaxs_convention(mode):
    """PyTorch's backward computes the conjugate Wirtinger derivative, JAX's
    vjp its conjugate: vjp="autograd" gives JAX's, for a real loss, a
    holomorphic and a non-holomorphic complex output (a complex cotangent),
    and a lazy conjugate of an input that the graph saves (a reference
    through as_strided would drop its bit)."""
    cases, x, y = workloads.complex_cases()
    x, y = on_cpu(x), on_cpu(y)
    for theirs, ours in cases:
        f = jax_overlay.foreign(theirs, framework="torch", vjp="autograd",
                                result_shape_dtypes=lambda x, y, o=ours: jax.eval_shape(o, x, y),
                                **mode)
        out, back = jax.vjp(f, x, y)
        want_out, want_back = jax.vjp(ours, x, y)
        np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), rtol=1e-6)
        ct = jnp.ones_like(want_out) * (0.5 - 1.5j if jnp.iscomplexobj(want_out) else 1.0)
        for a, b in zip(back(ct), want_back(ct)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
