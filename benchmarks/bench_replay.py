"""Small foreign calls on the GPU, replayed or not, against what a user
would pick instead: one process, alternating rounds, each call dispatched
and waited for (end to end).  Every case runs under the same XLA_FLAGS,
which allow command buffers for programs of any size
(--xla_gpu_graph_min_graph_size=1, added when absent: replay needs it).

  gelu+sum, 1K float32 (PyTorch):
    torch eager        gelu(x).sum() and synchronize (jax-free control)
    jax                jit(jax.nn.gelu(x, approximate=False).sum())
    foreign            jit(foreign(fn, framework="torch"))
    foreign replay     the same with replay=True
    pure_callback      jit(jax.pure_callback(fn on host copies, as CPU tensors))
    torch2jax          wrap_torch2jax.torch2jax(fn), where it installs
  kept results: foreign and foreign replay with each call's result kept
    (200 at a time), so every call writes a new output buffer; how many
    times fn's Python ran in all (rounds x calls, and the warm-up)
  five inputs: the same fn summed over five 1K inputs, foreign and replayed
    (against one input: a call's cost per leaf)
  CuPy, 1K float32: tanh(x).sum(): cupy eager (control), jax, foreign,
    foreign replay
  Numba, 1K float32: a kernel y = 2x + 1 into XLA's output (out=True):
    numba eager (launch + synchronize; control), jax, foreign, foreign replay

Reported: µs per call (median over rounds), and per round each case's
ratio to its group's eager control and to jax (medians over rounds).

    python benchmarks/bench_replay.py [--rounds 7] [--calls 300] [--out DIR]
writes DIR/replay-bench.txt and .json.
"""

from __future__ import annotations

import os
import sys

import harness  # first: XLA's allocator setting, before jax loads

harness.graph_small_programs()  # before jax loads, too

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jax_overlay  # noqa: E402

N = 1024
SCALAR = jax.ShapeDtypeStruct((), np.float32)


def _waited(f, *args):
    def run():
        jax.block_until_ready(f(*args))
    return run


def _kept(f, *args):
    """Each call's result kept (results.append(f(x))), 200 at a time, as a
    user collecting outputs does: every call writes a new output buffer, so
    replay sees new addresses (issue 40's churn row)."""
    kept = []

    def run():
        kept.append(f(*args))
        jax.block_until_ready(kept[-1])
        if len(kept) >= 200:
            kept.clear()
    return run


# How many times the counted fn's Python ran, per arm: a replayed call runs
# none, a trace one.
RUNS: dict = {}


def _counted(fn, name):
    RUNS[name] = 0

    def counted(*a):
        RUNS[name] += 1
        return fn(*a)
    return counted


def torch_group():
    import torch
    x = jnp.linspace(-1, 1, N, dtype=jnp.float32)
    xs = [x + i for i in range(5)]
    tx = torch.linspace(-1, 1, N, device="cuda")

    def fn(x):
        return torch.nn.functional.gelu(x).sum()

    def fn5(a, b, c, d, e):
        g = torch.nn.functional.gelu
        return g(a).sum() + g(b).sum() + g(c).sum() + g(d).sum() + g(e).sum()

    def eager():
        fn(tx)
        torch.cuda.synchronize()

    def on_host(a):
        return np.asarray(fn(torch.from_numpy(np.asarray(a))).numpy(), np.float32)
    plain = jax.jit(jax_overlay.foreign(fn, framework="torch", result_shape_dtypes=SCALAR))
    rep = jax.jit(jax_overlay.foreign(fn, framework="torch", result_shape_dtypes=SCALAR,
                                      replay=True))
    plain5 = jax.jit(jax_overlay.foreign(fn5, framework="torch", result_shape_dtypes=SCALAR))
    rep5 = jax.jit(jax_overlay.foreign(fn5, framework="torch", result_shape_dtypes=SCALAR,
                                       replay=True))
    native = jax.jit(lambda x: jax.nn.gelu(x, approximate=False).sum())
    pure = jax.jit(lambda x: jax.pure_callback(on_host, SCALAR, x))
    plain_k = jax.jit(jax_overlay.foreign(_counted(fn, "foreign, kept results"),
                                          framework="torch", result_shape_dtypes=SCALAR))
    rep_k = jax.jit(jax_overlay.foreign(_counted(fn, "foreign replay, kept results"),
                                        framework="torch", result_shape_dtypes=SCALAR,
                                        replay=True))
    # The experiment for a fix: fn's output an XLA temporary (a pair, of
    # which the jit returns one element, copied by XLA into the result), so
    # its address may stay put while the kept results' do not.
    pair = jax.ShapeDtypeStruct((2,), np.float32)
    rep_sliced = jax.jit(lambda v: jax_overlay.foreign(
        _counted(lambda t: fn(t).reshape(1).expand(2).contiguous(),
                 "foreign replay, kept results, sliced"),
        framework="torch", result_shape_dtypes=pair, replay=True)(v)[0])
    # The second experiment: fn's output consumed by a call XLA cannot put in
    # a CUDA graph (a foreign call without replay), so the graph ends before
    # the kept result's allocation; does its trace then stay valid?
    clone = jax_overlay.foreign(lambda t: t.clone(), framework="torch",
                                result_shape_dtypes=SCALAR)
    rep_outside = jax.jit(lambda v: clone(jax_overlay.foreign(
        _counted(fn, "foreign replay, kept results, copied outside the graph"),
        framework="torch", result_shape_dtypes=SCALAR, replay=True)(v)))
    # The same with the native copy kernel (an FFI call XLA may not capture,
    # no Python) as the graph's end: the candidate fix's own cost.  An
    # experiment: if it fails, the group's other arms still run.
    fenced = {}
    try:
        from jax_overlay import _strided
        why = _strided.kernel_status(jax.devices()[0])
        if why:
            raise RuntimeError(why)
        fence = _strided._kernel_fn((1,), np.dtype(np.float32),
                                    _strided.kernel_plan((1,), (1,), 0, 4, 4))

        def fenced_arm(name):
            f = jax.jit(lambda v: fence(jax_overlay.foreign(
                _counted(fn, name), framework="torch", result_shape_dtypes=SCALAR,
                replay=True)(v).reshape(1)).reshape(()))
            np.testing.assert_allclose(float(f(x)), float(native(x)), rtol=1e-4, atol=1e-4)
            return f
        fenced["foreign replay, kept results, native copy outside the graph"] = _kept(
            fenced_arm("foreign replay, kept results, native copy outside the graph"), x)
        fenced["foreign replay, native copy outside the graph"] = _waited(
            fenced_arm("foreign replay, native copy outside the graph"), x)
    except Exception as e:  # noqa: BLE001 - reported, the rest runs
        print(f"native copy arms unavailable: {type(e).__name__}: {e}", file=sys.stderr)
    arms = {"torch eager": eager, "jax": _waited(native, x), "foreign": _waited(plain, x),
            "foreign replay": _waited(rep, x), "pure_callback": _waited(pure, x),
            "foreign, kept results": _kept(plain_k, x),
            "foreign replay, kept results": _kept(rep_k, x),
            "foreign replay, kept results, sliced": _kept(rep_sliced, x),
            "foreign replay, kept results, copied outside the graph": _kept(rep_outside, x),
            **fenced,
            "foreign, 5 inputs": _waited(plain5, *xs),
            "foreign replay, 5 inputs": _waited(rep5, *xs)}
    want = float(native(x))
    for f in (plain, rep, pure, plain_k, rep_k, rep_sliced, rep_outside):
        np.testing.assert_allclose(float(f(x)), want, rtol=1e-4, atol=1e-4)
    want5 = sum(float(native(a)) for a in xs)
    for f in (plain5, rep5):
        np.testing.assert_allclose(float(f(*xs)), want5, rtol=1e-4)
    unavailable = {}
    try:
        import wrap_torch2jax
        t2j = jax.jit(wrap_torch2jax.torch2jax(fn, tx, depth=0))
        np.testing.assert_allclose(float(t2j(x)), want, rtol=1e-4, atol=1e-4)
        arms["torch2jax"] = _waited(t2j, x)
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        unavailable["torch2jax"] = f"{type(e).__name__}: {e}"[:200]
    return "torch eager", arms, unavailable


def cupy_group():
    import cupy
    x = jnp.linspace(-1, 1, N, dtype=jnp.float32)
    cx = cupy.linspace(-1, 1, N, dtype=cupy.float32)

    def fn(x):
        return cupy.tanh(x).sum()

    def eager():
        fn(cx)
        cupy.cuda.Device().synchronize()
    plain = jax.jit(jax_overlay.foreign(fn, framework="cupy", result_shape_dtypes=SCALAR))
    rep = jax.jit(jax_overlay.foreign(fn, framework="cupy", result_shape_dtypes=SCALAR,
                                      replay=True))
    native = jax.jit(lambda x: jnp.tanh(x).sum())
    for f in (plain, rep):
        np.testing.assert_allclose(float(f(x)), float(native(x)), rtol=1e-4, atol=1e-4)
    return "cupy eager", {"cupy eager": eager, "cupy jax": _waited(native, x),
                          "cupy foreign": _waited(plain, x),
                          "cupy foreign replay": _waited(rep, x)}, {}


def numba_group():
    from numba import cuda

    @cuda.jit
    def kernel(x, y):
        i = cuda.grid(1)
        if i < x.size:
            y[i] = 2 * x[i] + 1
    x = jnp.linspace(-1, 1, N, dtype=jnp.float32)
    nx = cuda.to_device(np.asarray(x))
    ny = cuda.device_array_like(nx)

    def fn(x, *, out):
        kernel[(N + 255) // 256, 256, jax_overlay.foreign_stream()](x, out)

    def eager():
        kernel[(N + 255) // 256, 256](nx, ny)
        cuda.synchronize()
    spec = jax.ShapeDtypeStruct((N,), np.float32)
    plain = jax.jit(jax_overlay.foreign(fn, framework="numba", result_shape_dtypes=spec,
                                        out=True))
    rep = jax.jit(jax_overlay.foreign(fn, framework="numba", result_shape_dtypes=spec,
                                      out=True, replay=True))
    native = jax.jit(lambda x: 2 * x + 1)
    for f in (plain, rep):
        np.testing.assert_allclose(np.asarray(f(x)), np.asarray(native(x)), rtol=1e-6)
    return "numba eager", {"numba eager": eager, "numba jax": _waited(native, x),
                           "numba foreign": _waited(plain, x),
                           "numba foreign replay": _waited(rep, x)}, {}


def _torch_reserved():
    """PyTorch's reserved GPU memory in MiB, None where it is not in use."""
    torch = sys.modules.get("torch")
    return torch.cuda.memory_reserved() / 2**20 if torch is not None else None


def main():
    p = harness.arguments(__doc__, out=".", rounds=7, calls=300)
    args = p.parse_args()
    groups, unavailable = [], {}
    for make in (torch_group, cupy_group, numba_group):
        try:
            control, arms, missing = make()
        except Exception as e:  # noqa: BLE001 - a library absent here: reported
            unavailable[make.__name__] = f"{type(e).__name__}: {e}"[:200]
            continue
        groups.append((control, arms))
        unavailable.update(missing)
    arms = [harness.Arm(name, lambda fn=fn: harness.per_call_us(fn, args.calls), warm=fn,
                        control=name == control)
            for control, made in groups for name, fn in made.items()]
    reserved = _torch_reserved()
    samples = harness.alternate(arms, args.rounds)
    res: dict = {"us": {}, "x_eager": {}, "x_jax": {}, "unavailable": unavailable}
    for control, made in groups:
        native = next(k for k in made if k.endswith("jax"))
        for k in made:
            res["us"][k] = harness.med(samples[k])
            res["x_eager"][k] = harness.med(harness.ratios(samples, k, control))
            res["x_jax"][k] = harness.med(harness.ratios(samples, k, native))
    for a, b in (("foreign, 5 inputs", "foreign"), ("foreign replay, 5 inputs", "foreign replay"),
                 ("foreign replay", "foreign"), ("foreign", "torch2jax"),
                 ("foreign replay", "torch2jax"),
                 ("foreign replay, kept results", "foreign, kept results"),
                 ("foreign replay, kept results, native copy outside the graph",
                  "foreign, kept results"),
                 ("foreign replay, native copy outside the graph", "foreign replay")):
        if a in samples and b in samples:
            res[f"{a} / {b}"] = harness.med(harness.ratios(samples, a, b))
    res["samples"] = samples
    # fn's Python runs per call of the counted arms (warm-ups included).
    res["fn runs"] = dict(RUNS)
    # What the traces' memory grew by over the timed rounds (PyTorch's
    # reserved memory, MiB): a pool per new set of output addresses.
    if reserved is not None:
        res["torch reserved MiB"] = {"before": reserved, "after": _torch_reserved()}
    meta = harness.meta(imports=("cupy", "numba", "torch"))
    lines = [f"# small foreign calls, µs per call (dispatch to ready), {args.rounds} alternating "
             f"rounds of {args.calls} calls; {meta.get('device')}, jax {jax.__version__}, "
             f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}",
             harness.table(["case", "us", "x eager", "x jax"], [
                 (k, f"{res['us'][k]:.1f}", f"{res['x_eager'][k]:.3f}", f"{res['x_jax'][k]:.3f}")
                 for k in res["us"]]),
             *[f"{k}: {v:.3f} (median of per-round ratios)" for k, v in res.items()
               if " / " in k],
             *[f"{k}: fn ran {n} times" for k, n in RUNS.items()],
             *([f"PyTorch reserved memory over the timed rounds: "
                f"{reserved:.1f} -> {res['torch reserved MiB']['after']:.1f} MiB"]
               if reserved is not None else []),
             *[f"{k}: unavailable: {why}" for k, why in unavailable.items()]]
    text = "\n".join(lines)
    print(text)
    harness.save(os.path.join(args.out, "replay-bench.json"), {"results": res, "meta": meta})
    harness.save(os.path.join(args.out, "replay-bench.txt"), text + "\n")


if __name__ == "__main__":
    main()
