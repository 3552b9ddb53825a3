"""Test helpers (never in the wheel): one training step written twice, in
PyTorch and in JAX, for the tests and the benchmark of ``foreign(...,
vjp="autograd")`` (tests/cpu/test_foreign_saved_graph.py,
tests/gpu/test_foreign_saved_graph_gpu.py, tests/gpu/replay_worker.py,
benchmarks/bench_train_step.py): an MLP with one tanh hidden layer, 10
outputs and, as its loss, the mean square of its output; a probe of
PyTorch's backward and complex-gradient cases, shared by the CPU and GPU
autograd tests, and the gradient comparison the CPU autograd tests share.
PyTorch is imported on first use."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np

LR = 0.1


def torch_mlp(x, w1, b1, w2, b2):
    import torch
    h = torch.tanh(x @ w1 + b1)
    return ((h @ w2 + b2) ** 2).mean()


def jax_mlp(x, w1, b1, w2, b2):
    h = jnp.tanh(x @ w1 + b1)
    return ((h @ w2 + b2) ** 2).mean()


def mlp_params(batch=128, features=256, hidden=512, *, seed=0, scale=None):
    """[x, w1, b1, w2, b2], float32 on JAX's default device: standard
    normal, the weights times `scale` (default: 1/sqrt(fan-in))."""
    k = jax.random.split(jax.random.PRNGKey(seed), 3)
    s1, s2 = (features ** -0.5, hidden ** -0.5) if scale is None else (scale, scale)
    return [jax.random.normal(k[0], (batch, features)),
            jax.random.normal(k[1], (features, hidden)) * s1,
            jnp.zeros(hidden), jax.random.normal(k[2], (hidden, 10)) * s2, jnp.zeros(10)]


def sgd(loss):
    """jit(one step): value_and_grad of `loss` over the weights, then SGD;
    returns (loss, new weights)."""
    @jax.jit
    def step(x, *p):
        v, g = jax.value_and_grad(loss, argnums=(1, 2, 3, 4))(x, *p)
        return v, [a - LR * b for a, b in zip(p, g)]
    return step


def grads_close(got, want, rtol=1e-5, atol=1e-6):
    """Each leaf of `got` against `want`'s, atol relative to the leaf's
    largest entry: an entry that the two frameworks compute as a
    cancellation (a transpose's row of w summing to ~0) carries the
    rounding of its terms, not its own (a CI run: 3.8e-6 against 2.8e-6
    beside entries of 357)."""
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        b = np.asarray(b)
        np.testing.assert_allclose(np.asarray(a), b, rtol=rtol,
                                   atol=atol * max(1.0, float(np.abs(b).max(initial=0.0))))


def counted(fn):
    """(fn, the list each of its calls appends to)."""
    calls: list = []

    def wrapped(*args):
        calls.append(1)
        return fn(*args)
    return wrapped, calls


def in_threads(work, n):
    """Runs work(0), ..., work(n - 1) in n threads at once; returns the
    exceptions they raised."""
    errors: list = []

    def run(i):
        try:
            work(i)
        except Exception as e:  # noqa: BLE001 - returned to the caller
            errors.append(e)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def backward_probe():
    """(an identity PyTorch function, the list its backward appends to):
    whether PyTorch differentiated what passed through it."""
    import torch
    ran: list = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 1

        @staticmethod
        def backward(ctx, g):
            ran.append(1)
            return g
    return Probe.apply, ran


def complex_cases():
    """(PyTorch, JAX) pairs over complex x, y: a real loss with a lazy
    conjugate of an input, a holomorphic and a non-holomorphic complex
    output; and the inputs."""
    import torch
    cases = [
        (lambda x, y: (x.conj() * y).real.sum() + (x.conj() * x).real.sum(),
         lambda x, y: (jnp.conj(x) * y).real.sum() + (jnp.conj(x) * x).real.sum()),
        (lambda x, y: x * x * y, lambda x, y: x * x * y),
        (lambda x, y: x.conj() * y + torch.sin(x), lambda x, y: jnp.conj(x) * y + jnp.sin(x)),
    ]
    x = jnp.array([1 + 2j, 3 - 1j, 0.5 + 0.5j], jnp.complex64)
    y = jnp.array([2 - 1j, -1 + 1j, 1j], jnp.complex64)
    return cases, x, y
