"""foreign(..., replay=True) cases, run in a process of their own by
test_foreign_replay_gpu.py: XLA reads XLA_FLAGS once, when its GPU backend
starts, and these cases need command buffers for programs of any size
(--xla_gpu_graph_min_graph_size=1, which the test sets).

  python replay_worker.py CASE [CASE ...]   prints "RESULT CASE {json}" per case
"""

from __future__ import annotations

import json
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import jax_overlay
from jax_overlay import _foreign

CALLS = 1000
N = 1 << 20  # floats: the allocating cases' arrays, 4 MiB each


def counted(fn):
    runs: list = []

    def wrapped(*args, **kwargs):
        runs.append(1)
        return fn(*args, **kwargs)
    return wrapped, runs


def _heavy():
    """A slow producer: its output is still being computed when the
    foreign call is enqueued behind it."""
    m = jax.random.normal(jax.random.PRNGKey(0), (4096, 4096), jnp.float32)

    @jax.jit
    def make(i):
        return jnp.full(1024, i, jnp.float32) + (m @ m)[0, :1024] * 0.0
    return make


def case_inflight():
    """1,000 calls whose inputs are still being written by a slow kernel,
    a fresh input each call, each output checked while the next call runs;
    then 1,000 calls on one input."""
    import torch
    fn, runs = counted(lambda x: torch.sin(x) * 2 + 1)
    f = jax_overlay.foreign(fn, framework="torch", replay=True,
                            result_shape_dtypes=lambda x: x)
    g = jax.jit(lambda x: f(x) * 1.0)
    make = _heavy()
    wrong, prev = 0, None
    for i in range(CALLS + 1):
        out = g(make(i)) if i < CALLS else None
        if prev is not None:  # read while the next call's producer runs
            j, o = prev
            wrong += not np.allclose(np.asarray(o), np.sin(np.float32(j)) * 2 + 1, rtol=1e-5)
        prev = (i, out)
    fresh = len(runs)
    x = make(3)
    want = np.sin(np.asarray(x)) * 2 + 1
    del runs[:]
    same_wrong = sum(not np.allclose(np.asarray(g(x)), want, rtol=1e-5) for _ in range(CALLS))
    return {"calls": CALLS, "wrong": wrong, "python_runs": fresh,
            "same_input_wrong": same_wrong, "same_input_python_runs": len(runs)}


def _torch_parts():
    import torch

    def fn(x):
        t = torch.sin(x) * 2  # temporaries from PyTorch's caching allocator
        return t + 1

    def copies(x):
        torch.cuda.empty_cache()  # what the library holds free goes back to CUDA
        t = torch.from_dlpack(x)
        return [t.clone() for _ in range(8)]

    def intact(k, want):
        torch.cuda.synchronize()
        return bool(np.array_equal(k.cpu().numpy(), want))
    return fn, copies, intact


def _cupy_parts():
    import cupy

    def fn(x):
        t = cupy.sin(x) * 2
        return t + 1

    def copies(x):
        cupy.get_default_memory_pool().free_all_blocks()
        c = cupy.from_dlpack(x)
        return [c.copy() for _ in range(8)]

    def intact(k, want):
        cupy.cuda.Device().synchronize()
        return bool(np.array_equal(cupy.asnumpy(k), want))
    return fn, copies, intact


def _allocating(framework, pooled):
    """fn allocates temporaries while traced.  After the trace the
    library gives what it holds free back to CUDA (torch.cuda.empty_cache,
    CuPy's free_all_blocks), and the user copies an array, which CUDA may
    place where the trace's temporaries were; replays must not write into
    the copies.  The control (pooled=False) traces fn in the library's own
    memory."""
    from jax_overlay.peers._base import relaxed_capture
    fn, copies, intact = (_torch_parts if framework == "torch" else _cupy_parts)()
    adapter = _foreign._adapter(framework)
    if not pooled:  # the control: a trace in the library's own memory
        adapter.capture = lambda memory: relaxed_capture()
    fn, runs = counted(fn)
    f = jax_overlay.foreign(fn, framework=framework, replay=True,
                            result_shape_dtypes=lambda x: x)
    g = jax.jit(lambda x: f(x) + 0.0)
    x = jnp.linspace(0, 1, N, dtype=jnp.float32)
    want = np.sin(np.asarray(x)) * 2 + 1
    try:
        for _ in range(3):  # run, trace, replay
            g(x).block_until_ready()
        traced = len(runs)
        store = copies(x)
        wrong = sum(not np.allclose(np.asarray(g(x)), want, rtol=1e-5, atol=1e-6)
                    for _ in range(CALLS))
        overwritten = sum(not intact(k, np.asarray(x)) for k in store)
    finally:
        adapter.__dict__.pop("capture", None)
    return {"calls": CALLS + 3, "python_runs": len(runs), "runs_before_the_copies": traced,
            "wrong": wrong, "copies_overwritten": overwritten, "of": len(store)}


def case_torch_pooled():
    return _allocating("torch", True)


def case_torch_unpooled():
    return _allocating("torch", False)


def case_kept():
    """1,000 calls whose results are all kept (each a new allocation): how
    often fn is traced, and every result right."""
    import torch
    fn, runs = counted(lambda x: torch.nn.functional.gelu(x) * 2)
    f = jax.jit(jax_overlay.foreign(fn, framework="torch", replay=True,
                                    result_shape_dtypes=lambda x: x))
    x = jnp.linspace(-1, 1, 1024, dtype=jnp.float32)
    want = np.asarray(jax.nn.gelu(x, approximate=False)) * 2
    kept = [f(x) for _ in range(CALLS)]
    wrong = sum(not np.allclose(np.asarray(k), want, rtol=1e-5, atol=1e-6) for k in kept)
    kept_runs = len(runs)
    return {"calls": CALLS, "wrong": wrong, "python_runs": kept_runs,
            "distinct_outputs": len({k.unsafe_buffer_pointer() for k in kept})}


def case_kept_memory():
    """300 calls whose results are all kept, fn allocating 8 MiB of
    temporaries: a trace each call, each result right, and the traces'
    memory (PyTorch's reserved) after 20 calls and after all 300."""
    import torch
    fn, runs = counted(lambda x: torch.sin(x) * 2 + 1)
    f = jax.jit(jax_overlay.foreign(fn, framework="torch", replay=True,
                                    result_shape_dtypes=lambda x: x))
    x = jnp.linspace(0, 1, N, dtype=jnp.float32)
    want = np.sin(np.asarray(x)) * 2 + 1
    kept = [f(x) for _ in range(20)]
    jax.block_until_ready(kept)
    early = torch.cuda.memory_reserved()
    kept += [f(x) for _ in range(280)]
    jax.block_until_ready(kept)
    late = torch.cuda.memory_reserved()
    wrong = sum(not np.allclose(np.asarray(k), want, rtol=1e-5, atol=1e-6) for k in kept)
    return {"calls": len(kept), "wrong": wrong, "python_runs": len(runs),
            "distinct_outputs": len({k.unsafe_buffer_pointer() for k in kept}),
            "reserved_after_20_mib": early / 2**20, "reserved_after_300_mib": late / 2**20}


# Counts how many probes run at once: each raises `active` for about a
# millisecond and records the most it saw in `peak`.
_PROBE = r"""
extern "C" __global__ void probe(int* active, int* peak, long long spin) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  atomicMax(peak, atomicAdd(active, 1) + 1);
  long long t0 = clock64();
  while (clock64() - t0 < spin) {}
  atomicMax(peak, atomicAdd(active, 0));
  atomicSub(active, 1);
}
"""


def case_commands_at_once():
    """Two replayed foreign calls of one program on independent inputs, each
    a 1 ms probe kernel: the most that ran at the same time over 50 calls,
    and whether jax_overlay reads XLA's flags as commands one at a time."""
    import cupy
    probe = cupy.RawKernel(_PROBE, "probe")
    active, peak = cupy.zeros(1, cupy.int32), cupy.zeros(1, cupy.int32)

    def fn(x):
        probe((1,), (1,), (active, peak, np.int64(2_000_000)))  # on XLA's stream
        return x + 1
    fn, runs = counted(fn)
    f = jax_overlay.foreign(fn, framework="cupy", replay=True, result_shape_dtypes=lambda x: x)
    g = jax.jit(lambda a, b: (f(a) * 2, f(b) * 3))
    a, b = jnp.zeros(1024, jnp.float32), jnp.ones(1024, jnp.float32)
    for _ in range(3):  # run, trace, replay
        jax.block_until_ready(g(a, b))
    cupy.cuda.Device().synchronize()
    peak[...] = 0
    cupy.cuda.Device().synchronize()
    outs = [g(a, b) for _ in range(50)]
    jax.block_until_ready(outs)
    cupy.cuda.Device().synchronize()
    wrong = sum(not (np.all(np.asarray(p) == 2) and np.all(np.asarray(q) == 6)) for p, q in outs)
    return {"peak": int(peak.get()[0]), "wrong": wrong, "python_runs": len(runs),
            "one_at_a_time": _foreign._commands_run_one_at_a_time()}


def case_cupy_pooled():
    return _allocating("cupy", True)


def case_cupy_unpooled():
    return _allocating("cupy", False)


def case_numba():
    """A Numba kernel on foreign_stream() into an array it allocates while
    traced, then the user's own Numba arrays allocated."""
    from numba import cuda

    @cuda.jit
    def twice(x, y):
        i = cuda.grid(1)
        if i < x.size:
            y[i] = 2 * x[i] + 1

    def fn(x):
        y = cuda.device_array_like(x)
        twice[(x.size + 255) // 256, 256, jax_overlay.foreign_stream()](x, y)
        return y
    fn, runs = counted(fn)
    f = jax_overlay.foreign(fn, framework="numba", replay=True,
                            result_shape_dtypes=lambda x: x)
    g = jax.jit(lambda x: f(x) + 0.0)
    x = jnp.linspace(0, 1, N, dtype=jnp.float32)
    want = 2 * np.asarray(x) + 1
    g(x).block_until_ready()
    keeps = [cuda.to_device(np.full(N, 7.0, np.float32)) for _ in range(8)]
    wrong = sum(not np.allclose(np.asarray(g(x)), want) for _ in range(CALLS))
    overwritten = sum(not (k.copy_to_host() == 7.0).all() for k in keeps)
    return {"calls": CALLS + 1, "python_runs": len(runs), "wrong": wrong,
            "copies_overwritten": overwritten, "of": len(keeps)}


def case_host_sync():
    """.item() inside fn while traced: the error, then the process goes on."""
    import torch

    def fn(x):
        return x + float(x.sum().item())
    f = jax_overlay.foreign(fn, framework="torch", replay=True,
                            result_shape_dtypes=lambda x: x)
    out: dict = {}
    g = jax.jit(lambda x: f(x) * 1.0)
    try:
        for _ in range(3):  # XLA's first run of a program is not captured
            jax.block_until_ready(g(jnp.ones(16)))
        out["raised"] = None
    except Exception as e:  # noqa: BLE001 - reported to the test
        out["raised"] = f"{type(e).__module__}.{type(e).__qualname__}"
        out["message"] = str(e)
    h = jax_overlay.foreign(lambda x: x * 2, framework="torch", replay=True,
                            result_shape_dtypes=lambda x: x)
    out["after_foreign"] = np.asarray(jax.jit(lambda x: h(x) + 0.0)(jnp.ones(4))).tolist()
    out["after_jit"] = float(jax.jit(lambda x: (x * 3).sum())(jnp.ones(4)))
    out["after_torch"] = float(torch.ones(4, device="cuda").sum())
    return out


def case_training():
    """100 SGD steps of the MLP with vjp="autograd" and replay=True,
    against the same model in JAX; fn's Python runs counted."""
    from workloads import jax_mlp, mlp_params, sgd, torch_mlp  # tests/: on PYTHONPATH (conftest)
    fn, runs = counted(torch_mlp)
    scalar = jax.ShapeDtypeStruct((), np.float32)
    f = jax_overlay.foreign(fn, framework="torch", result_shape_dtypes=scalar,
                            vjp="autograd", replay=True)
    x, *p = mlp_params(seed=0, scale=0.05)
    q = list(p)
    ours = sgd(f)
    with jax.default_matmul_precision("highest"):
        theirs = sgd(jax_mlp)
        first = float(theirs(x, *q)[0])
        for _ in range(100):
            v, p = ours(x, *p)
            w, q = theirs(x, *q)
        v, w = float(v), float(w)
    diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(p, q))
    return {"steps": 100, "python_runs": len(runs), "loss": v, "jax_loss": w,
            "first_loss": first, "max_param_diff": diff, **_residual_path(f)}


def _residual_path(f):
    """Whether f's backward read fn's saved tensors as residuals (found on
    meta tensors, no forward disagreeing, every backward call a template's,
    none running fn again), and their sizes."""
    a = f.saved
    return {"residuals": bool(a.found) and None not in a.found.values() and not a.broken
            and a.backwards["template"] > 0 and a.backwards["recompute"] == 0,
            "backwards": dict(a.backwards),
            "residual_bytes": [list(v[0]) for v in a.found.values() if v is not None]}


def case_residuals():
    """vjp="autograd" under replay, fn's saved tensors passed as residuals:
    value_and_grad of two calls in one program and of a 4-step scan (each
    step's residuals stacked by XLA), 50 calls each on inputs a slow kernel
    is still writing, every value and gradient read through the host and
    checked against the same program in JAX."""
    import torch
    from jax import lax
    fn, runs = counted(lambda x: torch.tanh(x) * 2)
    f = jax_overlay.foreign(fn, framework="torch", result_shape_dtypes=lambda x: x,
                            vjp="autograd", replay=True)
    m = jax.random.normal(jax.random.PRNGKey(0), (4096, 4096), jnp.float32)

    @jax.jit
    def make(i):  # in flight when the program that reads it is enqueued
        return jnp.linspace(-0.5, 1, 1024) * (1 + i / 25) + (m @ m)[0, :1024] * 0.0

    def two(g):
        return lambda x: (g(x) * g(x * 3 + 1)).sum()

    def steps(g):
        return lambda x: lax.scan(lambda c, _: (g(c) * 0.5, None), x, None, length=4)[0].sum()
    out = {}
    for name, build in (("two", two), ("scan", steps)):
        ours = jax.jit(jax.value_and_grad(build(f)))
        theirs = jax.jit(jax.value_and_grad(build(lambda v: jnp.tanh(v) * 2)))
        before, wrong = len(runs), 0
        for i in range(50):
            v, g = ours(make(i))
            w, h = theirs(make(i))
            if not (np.allclose(float(v), float(w), rtol=1e-4, atol=1e-4)
                    and np.allclose(np.asarray(g), np.asarray(h), rtol=1e-4, atol=1e-6)):
                wrong += 1
        out[name] = {"calls": 50, "wrong": wrong, "python_runs": len(runs) - before}
    return {**out, **_residual_path(f)}


def case_memory():
    """10,000 replayed calls of an allocating fn: PyTorch's and JAX's
    memory after the first 100 and after all."""
    import torch
    fn, runs = counted(lambda x: (torch.sin(x) * 2).sum())
    f = jax_overlay.foreign(fn, framework="torch", replay=True,
                            result_shape_dtypes=jax.ShapeDtypeStruct((), np.float32))
    g = jax.jit(lambda x: f(x) * 1.0)
    x = jnp.linspace(0, 1, 4096, dtype=jnp.float32)
    def window(calls):
        for _ in range(calls):
            r = g(x)
        r.block_until_ready()
        del r
        torch.cuda.synchronize()
        return (torch.cuda.memory_allocated(), torch.cuda.memory_reserved(),
                len(jax.live_arrays()), len(runs))
    first = window(100)
    middle = window(5_000)
    last = window(5_000)
    return {"calls": 10_100, "after_100": first, "after_5100": middle, "after_10100": last,
            "fields": ["torch allocated", "torch reserved", "jax live arrays", "python runs"]}


def main(names):
    for name in names:
        try:
            res = globals()[f"case_{name}"]()
        except Exception as e:  # noqa: BLE001 - the test shows it
            res = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        print(f"RESULT {name} {json.dumps(res)}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
