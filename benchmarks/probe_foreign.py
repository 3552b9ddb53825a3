"""Where a foreign call's time goes: jax_overlay.foreign against the bare
jax.experimental.buffer_callback doing the same work on jaxlib's own
Buffers, the same jit without any callback, and jax.pure_callback, in one
jit each, same process, alternating rounds, end to end (dispatch to ready).
foreign - bare callback is jax_overlay's own share (pytrees, views, tokens,
the stream context, checks); bare callback - plain jit is the mechanism's
floor.  "control" is the same work with no JAX at all (NumPy, or PyTorch
with a synchronize), in every round: host drift shows in it; "control in
place" the op on the framework's own array, in place.

  --backend cpu        framework "numpy" on the CPU backend
  --backend cpu-torch  framework "torch" on the CPU backend (CPU tensors)
  --backend gpu        framework "torch" on the GPU (needs PyTorch with CUDA)

    python benchmarks/probe_foreign.py [--backend cpu] [--rounds 15] [--calls 300] [--n 1024]
        [--pipelined] [--profile CALLS [--top 30]] [--json FILE]

"empty buffer_callback" is XLA calling into Python that does nothing: with
"jit, no callback" it splits a call's floor into dispatch and mechanism.
The allocator settings (XLA_PYTHON_CLIENT_*) are printed with the table:
run once per setting, each its own process.

"jit, no callback, donated" is the plain jit with its input donated (each
call's output is the next call's input): no fresh output is allocated, so
against the plain jit it prices XLA's allocation of the output.  "in place,
donated" is foreign's out=True with input_output_aliases={0: 0}, donated
the same way: fn doubles XLA's buffer in place, nothing allocated or copied.
--pipelined also times each case with the calls dispatched back to back and
one wait at the end: the device's time per call where that is the larger
(a large op), the host's where not.  End to end less pipelined is what a
lone call waits beyond the work itself.
"""

from __future__ import annotations

import copy
import cProfile
import functools
import io
import pstats
import statistics

import harness  # first: XLA's allocator setting, before jax loads

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.buffer_callback import buffer_callback

import jax_overlay
from _internals import Adapter, _foreign

# Time spent inside the Python callback, per case: what the mechanism costs
# around it is the end-to-end time less this.
_INSIDE: dict = {}
_PROFILE: list = []  # a cProfile.Profile while profiling, else empty
_MODE = [""]  # appended to the case's name in _INSIDE: " pipelined" while timed so


def _timed(name, cb):
    def timed(*a):
        prof = _PROFILE[0] if _PROFILE else None
        if prof is not None:
            prof.enable()
        t0 = harness.clock()
        try:
            cb(*a)
        finally:
            _INSIDE.setdefault(name + _MODE[0], []).append((harness.clock() - t0) / 1e9)
            if prof is not None:
                prof.disable()
    return timed


def _named(name, make):
    """_foreign._make_callback, its callback timed under `name`."""
    def make_timed(*a, **k):
        return _timed(name, make(*a, **k))
    return make_timed


def _nothing(ctx, out, a):
    pass


def _cpu_cases(x, spec):
    def bare(ctx, out, a):
        np.copyto(np.asarray(out), np.asarray(a) * 2)

    def into(a, out):
        np.multiply(a, 2, out=out)  # returns out: with out=True fn returns None

    def in_place(a, out):  # out is a's buffer
        np.multiply(out, 2, out=out)
    h, h2 = np.asarray(x).copy(), np.asarray(x).copy()

    def control():
        return h * 2

    def control_in_place():
        return np.multiply(h2, 2, out=h2)
    return (("numpy", bare, lambda a: a * 2, into, in_place, control, control_in_place),
            f"jax {jax.__version__}, CPU backend")


def _torch_cases(x, gpu):
    """PyTorch's cases: on the GPU (XLA's stream made PyTorch's) or on the
    CPU backend (CPU tensors, no stream)."""
    import torch
    import torch.utils.dlpack
    streams = {}

    def work(out, a):
        # XLA's capsules taken as they are (nothing holds them).
        o = torch.utils.dlpack.from_dlpack(out.__dlpack__())
        o.copy_(torch.utils.dlpack.from_dlpack(a.__dlpack__()) * 2)

    def bare(ctx, out, a):
        # As lean as a hand-written callback gets: a cached stream wrapper,
        # torch.Stream's own C++ `with` (torch.cuda.stream() costs tens of
        # µs more).
        if not gpu:
            return work(out, a)
        s = streams.get(ctx.stream)
        if s is None:
            s = streams[ctx.stream] = torch.cuda.ExternalStream(ctx.stream)
        with s:
            work(out, a)

    def into(a, out):
        torch.mul(a, 2, out=out)

    def in_place(a, out):  # out is a's buffer
        out.mul_(2)
    t, t2 = (torch.from_numpy(np.asarray(x).copy()) for _ in range(2))
    if gpu:
        t, t2 = t.cuda(), t2.cuda()

    def control():  # the op alone, no JAX (on the GPU, main() waits with a synchronize)
        return t * 2

    def control_in_place():
        return t2.mul_(2)
    env = (f"{torch.cuda.get_device_name()}, jax {jax.__version__}, torch {torch.__version__}"
           if gpu else f"jax {jax.__version__}, torch {torch.__version__}, CPU backend")
    return ("torch", bare, lambda a: a * 2, into, in_place, control, control_in_place), env


def _through_view(fn, framework, spec):
    """foreign's call with its output written as before the native copy: a
    view of XLA's buffer and the library's own copy (Adapter.write), the
    same callback otherwise: the A/B of PyTorch's one-cuMemcpy output."""
    adapter = copy.copy(_foreign._adapter(framework))
    adapter.write = functools.partial(Adapter.write, adapter)
    one = jax.tree_util.tree_structure((0,))
    cb = _foreign._make_callback(fn, adapter, one, jax.tree_util.tree_structure(0), False)
    f = buffer_callback(_timed(f"foreign {framework}, output through copy_", cb), [spec])
    return jax.jit(lambda v: f(v)[0])  # flat outputs, as foreign's own call


def _chained(f):
    """jit(f) with its input donated, as a step of a chain: each call's
    output is the next call's input (the values double; the work does not
    depend on them), so XLA allocates no output."""
    g = jax.jit(f, donate_argnums=0)
    chain = [None]

    def step(v):
        if chain[0] is None:
            chain[0] = v + 0  # a buffer of its own to donate
        chain[0] = g(chain[0])
        return chain[0]
    return step


def _sample(f, wait, x, calls, mode, piped):
    """One round of a case: µs per call, `calls` calls end to end (one at a
    time), or dispatched back to back with one wait at the end (piped)."""
    def sample():
        _MODE[0] = mode
        t0 = harness.clock()
        if piped:
            for _ in range(calls):
                y = f(x)
            wait(y)
        else:
            for _ in range(calls):
                wait(f(x))
        return (harness.clock() - t0) / calls / 1e3
    return sample


def main():
    p = harness.arguments(__doc__, json_file=True, rounds=15, calls=300)
    p.add_argument("--backend", choices=("cpu", "cpu-torch", "gpu"), default="cpu")
    p.add_argument("--n", type=int, default=1024)
    p.add_argument("--pipelined", action="store_true",
                   help="also time the calls dispatched back to back, one wait at the end")
    p.add_argument("--profile", type=int, default=0, metavar="CALLS",
                   help="then profile the foreign callback over CALLS calls")
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args()
    x = jnp.linspace(-1, 1, args.n, dtype=jnp.float32)
    if args.backend != "gpu":
        x = jax.device_put(x, jax.devices("cpu")[0])
    spec = jax.ShapeDtypeStruct(x.shape, x.dtype)
    (framework, bare, fn, into, in_place, control, control_in_place), env = (
        _cpu_cases(x, spec) if args.backend == "cpu" else _torch_cases(x, args.backend == "gpu"))
    make = _foreign._make_callback
    cases = {
        "control (no jax)": lambda v: control(),
        "control in place (no jax)": lambda v: control_in_place(),
        "jit, no callback": jax.jit(lambda v: v * 2),
        "jit, no callback, donated": _chained(lambda v: v * 2),
        # The mechanism alone: XLA calls into Python, which does nothing
        # (the output is left as XLA allocated it: timing only).
        "empty buffer_callback": jax.jit(buffer_callback(_timed("empty buffer_callback", _nothing),
                                                         spec)),
        "bare buffer_callback": jax.jit(buffer_callback(_timed("bare buffer_callback", bare), spec)),
        f"foreign {framework}": jax.jit(jax_overlay.foreign(
            fn, framework=framework, result_shape_dtypes=spec)),
        f"foreign {framework} out=True": jax.jit(jax_overlay.foreign(
            into, framework=framework, result_shape_dtypes=spec, out=True)),
        f"foreign {framework} in place, donated": _chained(jax_overlay.foreign(
            in_place, framework=framework, result_shape_dtypes=spec, out=True,
            input_output_aliases={0: 0})),
        "pure_callback": jax.jit(lambda v: jax.pure_callback(lambda h: np.asarray(h) * 2, spec, v)),
    }
    if framework == "torch":  # (on the CPU backend both take copy_: a control)
        cases[f"foreign {framework}, output through copy_"] = _through_view(fn, framework, spec)
    try:  # the foreign callbacks are made on the first call: time them
        for k, f in cases.items():
            _foreign._make_callback = _named(k, make)
            y = f(x)
            if k not in ("empty buffer_callback", "control in place (no jax)"):
                if not isinstance(y, (jax.Array, np.ndarray)):
                    y = y.cpu()  # the PyTorch control
                np.testing.assert_allclose(np.asarray(y), np.asarray(x) * 2)
    finally:
        _foreign._make_callback = make
    _INSIDE.clear()
    controls = ("control (no jax)", "control in place (no jax)")
    ready = {k: (lambda y: y) if k in controls else (lambda y: y.block_until_ready())
             for k in cases}
    if args.backend == "gpu":
        import torch
        for k in controls:
            ready[k] = lambda y: torch.cuda.synchronize()
    modes = {"": False, " pipelined": True} if args.pipelined else {"": False}
    names = list(cases)
    samples = harness.alternate(
        [harness.Arm(k + m, _sample(cases[k], ready[k], x, args.calls, m, piped), control=k in controls)
         for k in cases for m, piped in modes.items()], args.rounds,
        lambda r: [k + m for k in harness.rotated(names, r) for m in modes])
    _MODE[0] = ""
    alloc = harness.allocator()
    print(f"# {args.n} float32, {env}, {args.rounds} alternating rounds of {args.calls} calls "
          "(dispatch to ready; 'pipelined': back to back, one wait); 'x bare callback' is "
          "against the bare callback timed the same way; 'in Python' is the median time "
          "inside the callback; "
          f"allocator settings {alloc}")
    report, rows = {}, []
    for k, ts in samples.items():
        ratio = harness.med(harness.ratios(
            samples, k, "bare buffer_callback" + (" pipelined" if k.endswith(" pipelined") else "")))
        inside = statistics.median(_INSIDE[k]) * 1e6 if k in _INSIDE else None
        report[k] = {"us": harness.med(ts), "x_bare": ratio, "in_python_us": inside}
        rows.append((k, f"{report[k]['us']:.1f}", f"{ratio:.2f}", "-" if inside is None else f"{inside:.1f}"))
    print(harness.table(["case", "us", "x bare callback", "in Python us"], rows))
    harness.save(args.json, {"elements": args.n, "env": env, "allocator": alloc, "rounds": args.rounds,
                             "calls": args.calls, "cases": report, "meta": harness.meta()})
    if args.profile:
        # Where the foreign callback's own time goes (cProfile inflates it;
        # the shares are what matter).
        f = cases[f"foreign {framework}"]
        prof = cProfile.Profile()
        _PROFILE.append(prof)
        for _ in range(args.profile):
            f(x).block_until_ready()
        _PROFILE.clear()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(args.top)
        print(f"# cProfile of {args.profile} calls of foreign {framework}, inside the callback")
        print(buf.getvalue())


if __name__ == "__main__":
    main()
