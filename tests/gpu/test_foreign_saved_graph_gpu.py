"""foreign(..., vjp="autograd") with the forward's autograd graph kept for
the backward call, on the GPU: a training step of an MLP (256 -> 512 -> 10,
batch 128, float32: value_and_grad + SGD under jit) against the same model
in JAX over 100 steps; inputs still in flight when the forward reads them
and when the backward reads its ticket and the saved inputs; PyTorch's and
JAX's memory flat over 10,000 steps, and bounded when backwards never come;
threads training at once; complex gradients in JAX's convention."""

from __future__ import annotations

import gc

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jax_overlay  # noqa: E402

from jax_overlay.doctor import jax_fill  # noqa: E402
from workloads import (  # noqa: E402
    complex_cases, counted, in_threads, jax_mlp, mlp_params, sgd, torch_mlp)

SCALAR = jax.ShapeDtypeStruct((), np.float32)


def params(seed=0):
    return mlp_params(seed=seed, scale=0.05)


def test_training_matches_jax_and_recompute_over_100_steps():
    """100 steps: fn runs once a step; the parameters match the same model
    in JAX (full-precision matmuls) and, closely, the recomputing
    backward, which runs the same PyTorch kernels."""
    fn, calls = counted(torch_mlp)
    f = jax_overlay.foreign(fn, framework="torch", result_shape_dtypes=SCALAR, vjp="autograd")
    r = jax_overlay.foreign(torch_mlp, framework="torch", result_shape_dtypes=SCALAR,
                            vjp="autograd", recompute=True)
    x, *p = params()
    q, s = list(p), list(p)
    ours, redo = sgd(f), sgd(r)
    with jax.default_matmul_precision("highest"):
        theirs = sgd(jax_mlp)
        first = float(theirs(x, *q)[0])
        for i in range(100):
            v, p = jax.block_until_ready(ours(x, *p))
            w, q = theirs(x, *q)
            u, s = redo(x, *s)
            assert len(calls) == i + 1
            assert f.saved.waiting() == 0
    np.testing.assert_allclose(float(v), float(w), rtol=1e-3)
    np.testing.assert_allclose(float(v), float(u), rtol=1e-5)
    for a, b, c in zip(p, q, s):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-3, atol=1e-4)
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=1e-5, atol=1e-6)
    assert float(v) < 0.5 * first  # it learned


def test_in_flight_inputs_forward_and_backward():
    """The input is still being computed (XLA's stream held ~3 ms) when the
    forward reads it, and the forward still running when the backward
    reads the ticket and the saved input: 300 trials, 0 wrong gradients."""
    f = jax_overlay.foreign(lambda x: x * x, framework="torch",
                            result_shape_dtypes=lambda x: x, vjp="autograd")
    g = jax.jit(jax.grad(lambda x: f(x).sum()))
    g(jax_fill(0.0)).block_until_ready()
    wrong = 0
    for k in range(1, 301):
        got = np.asarray(g(jax_fill(float(k), steps=300)))
        wrong += not (got == 2.0 * k).all()
    assert wrong == 0, f"{wrong} of 300 gradients were wrong"
    assert f.saved.waiting() == 0


def test_memory_flat_over_10000_steps_and_bounded_without_backwards():
    """10,000 training steps: PyTorch's allocated bytes and JAX's live
    arrays the same after as after the first 100.  Then 200 forwards whose
    backward does not run: config.saved_graphs graphs wait, and PyTorch
    holds their activations only; their backwards release them."""
    f = jax_overlay.foreign(torch_mlp, framework="torch", result_shape_dtypes=SCALAR,
                            vjp="autograd")
    step = sgd(f)
    x, *p = params()
    for _ in range(100):
        v, p = step(x, *p)
    jax.block_until_ready(p)
    torch.cuda.synchronize()
    gc.collect()
    base_torch, base_jax = torch.cuda.memory_allocated(), len(jax.live_arrays())
    for _ in range(10_000):
        v, p = step(x, *p)
    jax.block_until_ready(p)
    torch.cuda.synchronize()
    gc.collect()
    assert f.saved.waiting() == 0
    assert torch.cuda.memory_allocated() == base_torch
    assert len(jax.live_arrays()) == base_jax
    assert np.isfinite(float(v))

    vjps = [jax.vjp(f, x, *p)[1] for _ in range(200)]
    jax.block_until_ready(p)
    torch.cuda.synchronize()
    gc.collect()
    keep = jax_overlay.config.saved_graphs
    assert f.saved.waiting() == keep
    held = torch.cuda.memory_allocated() - base_torch
    # Each graph holds the hidden layer (128 x 512 float32, before and after
    # tanh) and the output (128 x 10): about 0.5 MiB; 200 would be 100 MiB.
    assert 0 < held <= keep * (1 << 20), held
    for backward in vjps[-keep:]:  # the graphs still kept: each runs and goes
        jax.block_until_ready(backward(jnp.ones((), jnp.float32)))
    del vjps
    torch.cuda.synchronize()
    gc.collect()
    assert f.saved.waiting() == 0
    assert torch.cuda.memory_allocated() == base_torch


def test_threads_train_at_once():
    """4 threads, 50 steps each on one function, each checked against its
    own parameters' gradients."""
    f = jax_overlay.foreign(torch_mlp, framework="torch", result_shape_dtypes=SCALAR,
                            vjp="autograd")
    vg = jax.jit(jax.value_and_grad(f, argnums=(1, 3)))
    redo = jax.jit(jax.value_and_grad(jax_overlay.foreign(
        torch_mlp, framework="torch", result_shape_dtypes=SCALAR, vjp="autograd",
        recompute=True), argnums=(1, 3)))

    def work(seed):
        p = params(seed)
        want = redo(*p)
        for _ in range(50):
            got = vg(*p)
            np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-6)
            for a, b in zip(got[1], want[1]):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5,
                                           atol=1e-7)
    errors = in_threads(work, 4)
    assert not errors, errors[0]
    assert f.saved.waiting() == 0


@pytest.mark.parametrize("mode", [{}, {"recompute": True}, {"replay": True}],
                         ids=["saved", "recompute", "replay"])
def test_complex_gradients_follow_jaxs_convention(mode):
    """On CUDA tensors: JAX's vjp (the conjugate of PyTorch's backward) for a
    real loss, a holomorphic and a non-holomorphic complex output, with a
    lazy conjugate of an input saved by the graph; replay here without
    command buffers (the saved tensors as residuals, fn run each call)."""
    cases, x, y = complex_cases()
    for theirs, ours in cases:
        f = jax_overlay.foreign(theirs, framework="torch", vjp="autograd",
                                result_shape_dtypes=lambda x, y, o=ours: jax.eval_shape(o, x, y),
                                **mode)
        out, back = jax.vjp(f, x, y)
        want_out, want_back = jax.vjp(ours, x, y)
        np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), rtol=1e-5)
        ct = jnp.ones_like(want_out) * (0.5 - 1.5j if jnp.iscomplexobj(want_out) else 1.0)
        for a, b in zip(back(ct), want_back(ct)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
