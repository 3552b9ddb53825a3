"""foreign(..., vjp="autograd", replay=True) passes the tensors fn's graph
saves to the backward call as residuals (peers.torch.Autograd's residual
path), so that the backward runs no forward kernels and reads nothing on
the host; on the CPU backend with PyTorch's CPU build, where XLA has no
command buffers and the forward runs fn on every call: gradients match
JAX's for every kind of saved tensor (an input or a view of one, PyTorch's
own memory, integer and boolean tensors, a scalar), with one buffer passed
as two inputs, two calls in one program, a scan, jacrev, vmap and
threads; the backward never runs fn; the template keeps no activation;
and where the meta run cannot tell what the graph saves, or a forward's
graph differs from it, or a custom Function keeps a tensor out of
save_for_backward, the backward runs fn again and is right.  The GPU
(traces, replays) is tests/gpu/test_foreign_replay_gpu.py."""

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


def replayed(fn, spec=SCALAR, **kw):
    return jax_overlay.foreign(fn, framework="torch", result_shape_dtypes=spec,
                               vjp="autograd", replay=True, **kw)


def on_residuals(f):
    """Whether every key of `f` took the residual path: what the graph saves
    was found, a template made, no forward disagreed, and every backward
    ran a template's."""
    a = f.saved
    return (bool(a.found) and all(v is not None for v in a.found.values())
            and not a.broken and {k for k, _ in a.templates} == set(a.found)
            and a.backwards["template"] > 0 and a.backwards["recompute"] == 0)


def close(got, want, rtol=1e-5, atol=1e-6):
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


def test_training_matches_jax_and_the_backward_never_runs_fn():
    """value_and_grad + SGD under jit, 100 steps, against the same model in
    JAX: fn runs once on meta tensors and once per forward, never in the
    backward (replay=True with recompute=True: twice a step)."""
    fn, calls = counted(torch_mlp)
    f = replayed(fn)
    x, *p = [on_cpu(a) for a in workloads.mlp_params(128, 32, 64, seed=0, scale=0.2)]
    q = list(p)
    ours, theirs = workloads.sgd(f), workloads.sgd(jax_mlp)
    first = float(theirs(x, *q)[0])
    for i in range(100):
        v, p = jax.block_until_ready(ours(x, *p))
        w, q = theirs(x, *q)
        assert len(calls) == 1 + (i + 1)
    close((v, p), (w, q), rtol=1e-4)
    assert float(v) < 0.5 * first
    assert on_residuals(f) and f.saved.waiting() == 0
    ((key, sizes),) = [(k, v[0]) for k, v in f.saved.found.items()]
    assert sizes == (128 * 64 * 4, 128 * 10 * 4)  # tanh's output, the output layer's

    fn2, calls2 = counted(torch_mlp)
    r = replayed(fn2, recompute=True)
    jax.block_until_ready(workloads.sgd(r)(x, *p))
    assert len(calls2) == 2 and not r.saved.found


CASES = {
    # an input, a transpose of one, integer indices, the input returned
    "input": (lambda x, w, i: (x * w).sum(), lambda x, w, i: (x * w).sum()),
    "transpose": (lambda x, w, i: (x.t() @ w).sum(), lambda x, w, i: (x.T @ w).sum()),
    "index": (lambda x, w, i: (x[i.long()] * w[i.long()]).sum(),
              lambda x, w, i: (x[i] * w[i]).sum()),
    "identity": (lambda x, w, i: x * 1, lambda x, w, i: x * 1),
    # PyTorch's memory: an activation, an int64 index (argmax), a boolean
    # mask, a 0-d tensor, a saved view of an intermediate
    "activation": (lambda x, w, i: torch.exp(torch.tanh(x) * w),
                   lambda x, w, i: jnp.exp(jnp.tanh(x) * w)),
    "int64": (lambda x, w, i: torch.gather(x * w, 1, (x - w).argmax(1, keepdim=True)),
              lambda x, w, i: jnp.take_along_axis(x * w, (x - w).argmax(1, keepdims=True), 1)),
    "mask": (lambda x, w, i: torch.where(x > 0.5, x * w, w), lambda x, w, i: jnp.where(x > 0.5, x * w, w)),
    "scalar": (lambda x, w, i: (x * w).sum() * (x * x).sum(),
               lambda x, w, i: (x * w).sum() * (x * x).sum()),
    "view": (lambda x, w, i: (torch.sin(x * w).t() @ w).sum(),
             lambda x, w, i: (jnp.sin(x * w).T @ w).sum()),
}


@pytest.mark.parametrize("name", list(CASES))
def test_every_kind_of_saved_tensor(name):
    theirs, ours = CASES[name]
    fn, calls = counted(theirs)
    f = replayed(fn, spec=lambda x, w, i: jax.eval_shape(ours, x, w, i))
    x = on_cpu(jnp.arange(12.0, dtype=jnp.float32).reshape(3, 4) / 7)
    w = on_cpu(jnp.linspace(-1, 1, 12, dtype=jnp.float32).reshape(3, 4))
    i = on_cpu(jnp.array([2, 0, 2], jnp.int32))

    def loss(g):
        return lambda *a: (g(*a) ** 2).sum()
    step = jax.jit(jax.grad(loss(f), argnums=(0, 1)))
    for k in range(3):  # one template, three inputs
        grads_close(step(x + k, w, i), jax.grad(loss(ours), argnums=(0, 1))(x + k, w, i),
                    rtol=1e-4)  # transpose: a row of w sums to ~0
    assert on_residuals(f), (f.saved.found, f.saved.broken)
    assert len(calls) == 1 + 3


def test_one_buffer_as_two_inputs_and_then_two():
    """f(x, x): both inputs one buffer, the saved ones told apart by their
    leaf, not their address; the same template then serves f(x, y)."""
    f = replayed(lambda a, b: (a * torch.sin(b)).sum())

    def ref(a, b):
        return (a * jnp.sin(b)).sum()
    x = on_cpu(jnp.linspace(-1, 1, 6, dtype=jnp.float32))
    y = on_cpu(jnp.linspace(0, 2, 6, dtype=jnp.float32))
    both = jax.jit(jax.grad(f, argnums=(0, 1)))
    close(both(x, x), jax.grad(ref, argnums=(0, 1))(x, x))
    close(jax.jit(jax.grad(lambda v: f(v, v)))(x), jax.grad(lambda v: ref(v, v))(x))
    close(both(x, y), jax.grad(ref, argnums=(0, 1))(x, y))
    close(both(y, x), jax.grad(ref, argnums=(0, 1))(y, x))
    assert on_residuals(f)


def test_two_calls_in_one_jit_and_a_scan():
    """Two calls in one program, and one per step of a scan (each step's
    saved tensors stacked by XLA): each backward reads its own."""
    from jax import lax
    fn, calls = counted(lambda x: torch.tanh(x) * 2)
    f = replayed(fn, spec=lambda x: x)

    def two(g):
        return lambda x: (g(x) * g(x * 3 + 1)).sum()

    def steps(g):
        return lambda x: lax.scan(lambda c, _: (g(c) * 0.5, None), x, None, length=4)[0].sum()
    x = on_cpu(jnp.linspace(-1, 1, 16, dtype=jnp.float32))
    for make in (two, steps):
        calls.clear()
        close(jax.jit(jax.grad(make(f)))(x), jax.grad(make(lambda v: jnp.tanh(v) * 2))(x))
        assert len(calls) <= (2 if make is two else 4) + 1  # the meta run, once
    assert on_residuals(f)


def test_jacrev_and_vmap():
    """jacrev (one forward, a backward per row, all reading its saved
    tensors) and a per-example gradient under vmap(sequential)."""
    f = replayed(lambda x: torch.sin(x) * x, spec=lambda x: x, vmap_method="sequential")
    x = on_cpu(jnp.linspace(0, 1, 5, dtype=jnp.float32))
    close(jax.jit(jax.jacrev(f))(x), jax.jacrev(lambda v: jnp.sin(v) * v)(x))
    xs = on_cpu(jnp.linspace(0, 1, 15, dtype=jnp.float32).reshape(3, 5))
    close(jax.jit(jax.vmap(jax.grad(lambda v: f(v).sum())))(xs),
          jax.vmap(jax.grad(lambda v: (jnp.sin(v) * v).sum()))(xs))
    assert on_residuals(f)


def test_threads_each_get_their_own_gradients():
    """8 threads train on one function at once (one template, its views
    set for one backward at a time): each thread's gradients are its own."""
    f = replayed(torch_mlp)
    vg = jax.jit(jax.value_and_grad(f, argnums=1))
    ref = jax.jit(jax.value_and_grad(jax_mlp, argnums=1))

    def work(seed):
        p = [on_cpu(a) for a in workloads.mlp_params(128, 32, 64, seed=seed, scale=0.2)]
        want = ref(*p)
        for _ in range(20):
            close(vg(*p), want, rtol=1e-4)
    errors = in_threads(work, 8)
    assert not errors, errors[0]
    assert on_residuals(f)


def test_the_template_keeps_no_activation():
    """The tensors fn's graph saves are copied out as residuals: the
    template holds none of PyTorch's memory, nor XLA's (its leaves are
    stand-ins), and there is one template per inputs' shapes."""
    alive: list = []

    def fn(x):
        h = torch.exp(x)
        alive.append(weakref.ref(h.untyped_storage()))
        return h * 3
    f = replayed(fn, spec=lambda x: x)
    x = on_cpu(jnp.linspace(0, 1, 4, dtype=jnp.float32))
    g = jax.jit(jax.grad(lambda v: f(v).sum()))
    for k in range(5):
        close(g(x * k), 3 * np.exp(np.asarray(x) * k))
    gc.collect()
    assert alive and all(r() is None for r in alive)
    (graph,) = f.saved.templates.values()
    assert all(t.untyped_storage().nbytes() <= t.element_size() for t in graph.wrt)
    assert graph.views == []
    g(on_cpu(jnp.ones(7, jnp.float32)))
    assert len(f.saved.templates) == 2


def test_value_reads_fall_back_to_recompute():
    """fn reading a value cannot run on meta tensors: the backward runs fn
    again, and is right."""
    fn, calls = counted(lambda x: torch.sin(x) * (2.0 if float(x.sum().detach()) > 0 else 3.0))
    f = replayed(fn, spec=lambda x: x)
    x = on_cpu(jnp.linspace(0, 1, 4, dtype=jnp.float32))
    v, g = jax.jit(jax.value_and_grad(lambda v: f(v).sum()))(x)
    close((v, g), (2 * np.sin(np.asarray(x)).sum(), 2 * np.cos(np.asarray(x))))
    assert list(f.saved.found.values()) == [None] and not f.saved.templates
    assert len(calls) == 3  # the meta run (failed), the forward, the backward's


def test_a_custom_function_keeping_a_tensor_on_ctx_falls_back():
    """A custom Function that keeps a tensor as a ctx attribute (no hook
    sees it): a template would read it as traced, so the backward runs fn
    again; through save_for_backward it takes the residual path."""
    class OnCtx(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.x = x
            return x * x

        @staticmethod
        def backward(ctx, g):
            return 2 * g * ctx.x

    class Saved(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return 2 * g * x
    x = on_cpu(jnp.linspace(0, 1, 4, dtype=jnp.float32))
    for fn, path in ((OnCtx.apply, False), (Saved.apply, True)):
        f = replayed(lambda v, fn=fn: fn(torch.sin(v)), spec=lambda v: v)
        g = jax.jit(jax.grad(lambda v: f(v).sum()))
        for k in range(3):
            xk = x + k
            close(g(xk), 2 * np.sin(np.asarray(xk)) * np.cos(np.asarray(xk)))
        assert on_residuals(f) is path


def test_a_forward_whose_graph_differs_from_the_meta_run_falls_back():
    """A graph that differs by device (here: by a test of the device, as an
    operation PyTorch dispatches differently would): the forward notices,
    and its backward and every later one run fn again, right."""
    f = replayed(lambda x: torch.sin(x) if x.device.type == "meta" else torch.cos(x),
             spec=lambda x: x)
    x = on_cpu(jnp.linspace(0, 1, 4, dtype=jnp.float32))
    # value_and_grad: a forward whose outputs only the unused value reads
    # and that saves nothing of its own, XLA drops.
    g = jax.jit(jax.value_and_grad(lambda v: f(v).sum()))
    for k in range(2):
        close(g(x + k), (np.cos(np.asarray(x) + k).sum(), -np.sin(np.asarray(x) + k)))
    assert f.saved.broken and not f.saved.templates


def test_a_tensor_made_on_a_fixed_device_falls_back():
    """A saved tensor fn makes on a named device (not its inputs'): where
    it lies in the real run is unknown on meta tensors, so it falls back."""
    f = replayed(lambda x: x * torch.linspace(1, 2, 4, requires_grad=True), spec=lambda x: x)
    x = on_cpu(jnp.linspace(0, 1, 4, dtype=jnp.float32))
    close(jax.jit(jax.grad(lambda v: (f(v) ** 2).sum()))(x),
          2 * np.asarray(x) * np.linspace(1, 2, 4) ** 2, rtol=1e-5)
    assert not on_residuals(f)


def test_only_the_inputs_jax_differentiates_get_gradients():
    """argnums picks `need`: one template per choice, PyTorch computing no
    gradient for the others."""
    probe, ran = workloads.backward_probe()
    f = replayed(lambda x, w: (probe(x) * torch.tanh(w)).sum())
    x = on_cpu(jnp.linspace(0, 1, 6, dtype=jnp.float32))
    w = on_cpu(jnp.linspace(1, 2, 6, dtype=jnp.float32))
    gw = jax.jit(jax.grad(f, argnums=1))(x, w)
    close(gw, np.asarray(x) / np.cosh(np.asarray(w)) ** 2)
    assert ran == []
    gx, gw = jax.jit(jax.grad(f, argnums=(0, 1)))(x, w)
    close(gx, np.tanh(np.asarray(w)))
    assert ran == [1]
    assert len(f.saved.templates) == 2 and on_residuals(f)


def test_a_template_serves_only_its_own_stream(monkeypatch):
    """PyTorch runs a backward node on its forward's stream: a backward on
    another stream than the template's (here stubbed) runs fn again, so
    that a trace captures its work on its own stream."""
    from jax_overlay.peers import torch as peer
    streams = iter([1, 2, 2, 2])  # forward, backward, forward, backward
    monkeypatch.setattr(peer, "_stream_of", lambda flat: next(streams))
    fn, calls = counted(lambda x: torch.sin(x) * x)
    f = replayed(fn, spec=lambda x: x)
    x = on_cpu(jnp.linspace(0, 1, 4, dtype=jnp.float32))
    g = jax.jit(jax.value_and_grad(lambda v: f(v).sum()))
    want = jax.value_and_grad(lambda v: (jnp.sin(v) * v).sum())(x)
    close(g(x), want)
    assert len(calls) == 3  # meta, forward, the backward's (stream 2 has no template)
    close(g(x), want)
    assert len(calls) == 4  # the forward only: stream 2's template served
    assert sorted(s for _, s in f.saved.templates) == [1, 2]
