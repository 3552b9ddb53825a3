"""Every performance number in one command, on a GPU machine:

    python benchmarks/run_all.py --out benchmarks/results

writes <gpu>-<date>.json (schema in benchmarks/report.py) and a PNG chart
next to it (matplotlib, an optional dependency: without it, no chart and a
message), and prints the tables that tools/make_perf_table.py puts in
docs/PERFORMANCE.md (and, summarised, in the README).  `--json PATH` writes the results to PATH and the chart to PATH's
.png instead (how tools/gpu_suite.sh calls benchmarks).

* latency matrix: imports into JAX from CuPy, PyTorch and Numba and exports to
  each, over the CAI and DLPack: stock JAX vs jax_overlay vs the peers' own
  conversions, idle producers, in one process; median of 7 round means of
  500 calls (harness.median_us);
* idle vs in flight: every in-flight round starts behind a fresh kernel on
  the producer's stream (a JAX computation for exports); then, behind one
  long kernel, each call is timed on its own: the longest call, and whether
  the producer was still running after the last one (no host blocking);
* sizes 4 B .. 1 GiB: zero-copy latency (flat), and the copy paths (strided
  import by our kernel and by the XLA gather, copy=True, pinned -> device)
  in GB/s against memcpy of the same bytes (device to device; host to device
  for the pinned path), timed to completion, median of repeats: one copy at
  a time, and the device copies also 8 back to back with one wait (memcpy
  likewise), the copy's own rate;
* floors: the pieces on their own (the peers' protocol methods, jax_overlay's
  native parts, jaxlib's DLPack import) and where an import's time goes.

About two minutes on an H200.  Every measurement that fails is recorded as
"fails: ..." and the run goes on.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import gc
import importlib
import os
import statistics
import sys
import time

import harness  # first: XLA's allocator setting, before jax loads
from harness import REPEATS, ROUND_MEANS, ROUNDS, log, median_us

sys.path.insert(0, harness.ROOT)  # this tree's jax_overlay: the results carry its source digest


def _parser():
    p = harness.arguments(__doc__)
    p.add_argument("--out", help="folder for <gpu>-<date>.json and .png "
                                 "(default benchmarks/results, unless --json is given)")
    p.add_argument("--json", help="results file; the chart goes to its .png")
    return p


if __name__ == "__main__" and {"-h", "--help"} & set(sys.argv[1:]):
    _parser().parse_args()  # the help, and exit: it needs no GPU library
try:
    import cupy as cp  # noqa: E402
    import cupyx  # noqa: E402
except ImportError as e:
    raise SystemExit(f"run_all.py measures GPU interchange: it needs CuPy and a GPU ({e}); "
                     "on a GPU machine, pip install cupy-cuda13x (or the build for its CUDA)")
import jax  # noqa: E402
import jax.dlpack  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jax_overlay  # noqa: E402
from jax_overlay import doctor  # noqa: E402

import report  # noqa: E402
from _cai import HostCAI  # noqa: E402
from _internals import _runtime as rt, _xla_ext as ext, cupy_stream, jax_fill, spin_fill, torch_sleep  # noqa: E402

N = 1 << 20             # float32 elements of the latency matrix's arrays (4 MiB)
ROUND_MS = 150          # the producer's kernel before each in-flight round
PROBE_MS = 500          # the kernel during which every call is timed on its own
PROBE_CALLS = 500       # CuPy's own __dlpack__ blocks after ~1021 pending syncs
SIZES = [4, 64, 1 << 10, 16 << 10, 256 << 10, 4 << 20, 64 << 20, 256 << 20, 1 << 30]
COPY_SIZES = [s for s in SIZES if s >= 1 << 10]
SIZE_REPEATS, SIZE_ROUNDS = 200, 5


def _optional(name):
    try:
        return importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 - an absent peer leaves its rows out
        log(f"{name}: not usable ({doctor.describe(e)})")
        return None


torch = _optional("torch")
if torch is not None and not torch.cuda.is_available():
    torch = None
numba_cuda = _optional("numba.cuda")
if numba_cuda is not None and not numba_cuda.is_available():
    numba_cuda = None


def _installed(on):
    if on:
        jax_overlay.install()
    else:
        jax_overlay.uninstall()


def _uses_install(direction, who):
    """Exports reach jax_overlay only through install(); imports have the
    package's own functions ("jax_overlay") and JAX's, installed."""
    return who == "jax_overlay installed" or (who == "jax_overlay" and direction == "export")


# --- busy producers -----------------------------------------------------------

class CupyBusy:
    """A spinning kernel on a CuPy stream (or an external one)."""

    def __init__(self, stream, name):
        self.stream, self.name = stream, name
        self.scratch = cp.empty(1, cp.float32)

    def start(self, ms):
        spin_fill(self.scratch, 0.0, ms=ms, stream=self.stream)

    def running(self):
        return not self.stream.done

    def wait(self):
        self.stream.synchronize()


class TorchBusy:
    def __init__(self, stream, name):
        self.stream, self.name = stream, name

    def start(self, ms):
        torch_sleep(ms, self.stream)

    def running(self):
        return not self.stream.query()

    def wait(self):
        self.stream.synchronize()


class JaxBusy:
    """A JAX computation still running: `x` is its output, pending."""

    name = "JAX computation"

    def __init__(self):
        jax_fill(0.0, steps=1000).block_until_ready()  # compiled
        t0 = time.perf_counter()
        self.x = jax_fill(1.0, steps=1000)
        self.x.block_until_ready()
        per_step = max((time.perf_counter() - t0) / 1000, 1e-7)
        self.steps = {ms: max(1000, int(ms * 1e-3 / per_step)) for ms in (ROUND_MS, PROBE_MS)}
        for ms in self.steps:  # compiled before any timed round
            self.start(ms)
            self.wait()
        log(f"JAX busy producer: {per_step * 1e6:.1f} us per step, steps {self.steps}")

    def start(self, ms):
        self.x = jax_fill(1.0, steps=self.steps[ms])

    def running(self):
        return not self.x.is_ready()

    def wait(self):
        self.x.block_until_ready()


# --- measurements ---------------------------------------------------------------

class Run:
    def __init__(self):
        self.latency, self.inflight, self.floors = [], [], []
        self.breakdown, self.errors = [], []
        self.sizes = None

    def lat(self, group, direction, who, call, fn, make_arg):
        """One cell of the latency matrix, idle producer."""
        e = {"group": group, "direction": direction, "who": who, "call": call, "us": None, "error": None}
        _installed(_uses_install(direction, who))
        try:
            harness.warm(fn, make_arg)
            e["us"] = round(median_us(fn, make_arg), 2)
        except Exception as err:  # noqa: BLE001 - a failing call is a finding
            e["error"] = f"fails: {doctor.describe(err)}"
        finally:
            jax_overlay.uninstall()
        self.latency.append(e)
        log(f"  {group:<26} {who:<22} {call:<44} {e['us'] if e['error'] is None else e['error']}")

    def flight(self, group, direction, who, call, fn, make_arg, busy, context=None):
        """Idle, then every round behind a fresh kernel, then the probe: one
        long kernel, each call timed on its own."""
        e = {"group": group, "direction": direction, "who": who, "call": call,
             "producer": busy.name, "idle_us": None, "inflight_us": None,
             "busy_after_every_round": None, "round_ms": ROUND_MS, "probe": None, "error": None}
        _installed(_uses_install(direction, who))
        try:
            with context if context is not None else contextlib.nullcontext():
                busy.wait()
                harness.warm(fn, make_arg)
                e["idle_us"] = round(median_us(fn, make_arg), 2)
                flags = []

                def after():
                    flags.append(busy.running())
                    busy.wait()

                e["inflight_us"] = round(median_us(fn, make_arg, before_round=lambda: busy.start(ROUND_MS),
                                                   after_round=after), 2)
                e["busy_after_every_round"] = all(flags)
                busy.start(PROBE_MS)
                kept, durations = doctor.timed_calls(fn, [make_arg() for _ in range(PROBE_CALLS)])
                still = busy.running()
                busy.wait()
                del kept
                e["probe"] = {"calls": PROBE_CALLS, "kernel_ms": PROBE_MS,
                              "median_call_us": round(statistics.median(durations) / 1e3, 2),
                              "max_call_us": round(max(durations) / 1e3, 1), "producer_busy_after": still}
        except Exception as err:  # noqa: BLE001
            e["error"] = f"fails: {doctor.describe(err)}"
        finally:
            with contextlib.suppress(Exception):
                busy.wait()
            jax_overlay.uninstall()
        self.inflight.append(e)
        p = e["probe"] or {}
        log(f"  in flight {who:<22} {call:<44} idle {e['idle_us']} in flight {e['inflight_us']} "
            f"max call {p.get('max_call_us')} us, busy after {p.get('producer_busy_after')} {e['error'] or ''}")

    def floor(self, part, name, fn, make_arg, **hooks):
        f = {"part": part, "name": name, "us": None, "error": None}
        try:
            harness.warm(fn, make_arg)
            f["us"] = round(median_us(fn, make_arg, **hooks), 2)
        except Exception as err:  # noqa: BLE001
            f["error"] = f"fails: {doctor.describe(err)}"
        self.floors.append(f)
        log(f"  floor {name:<48} {f['us'] if f['error'] is None else f['error']}")


def latency_matrix(run, a, t, d, x):
    """Imports of CuPy `a`, PyTorch `t`, Numba `d` arrays; exports of JAX `x`."""
    imp_cai, imp_dl = jax_overlay.from_cuda_array_interface, jax_overlay.from_dlpack
    asarray = lambda o: jnp.asarray(o)  # noqa: E731 - looked up per call: install() applies
    from_dlpack = lambda o: jax.dlpack.from_dlpack(o)  # noqa: E731
    device_put = lambda o: jax.device_put(o)  # noqa: E731
    sources = [("CuPy", "a", a), ("PyTorch", "t", t), ("Numba", "d", d)]
    for peer, name, src in sources:
        if src is None:
            continue
        arg = lambda src=src: src  # noqa: E731
        g = f"{peer} → JAX, CAI"
        run.lat(g, "import", "stock", f"jnp.asarray({name})", asarray, arg)
        run.lat(g, "import", "jax_overlay", f"jax_overlay.from_cuda_array_interface({name})", imp_cai, arg)
        if not hasattr(src, "__dlpack__"):
            run.lat(g, "import", "jax_overlay installed", f"jnp.asarray({name})", asarray, arg)
        for other, oname, osrc in sources:
            if osrc is not None and other != peer:
                if other == "CuPy":
                    run.lat(g, "import", "peer", f"cupy.asarray({name})", cp.asarray, arg)
                if other == "PyTorch":
                    run.lat(g, "import", "peer", f'torch.as_tensor({name}, device="cuda")',
                            lambda o: torch.as_tensor(o, device="cuda"), arg)
                if other == "Numba":
                    run.lat(g, "import", "peer", f"numba.cuda.as_cuda_array({name})",
                            numba_cuda.as_cuda_array, arg)
        if not hasattr(src, "__dlpack__"):
            continue
        g = f"{peer} → JAX, DLPack"
        run.lat(g, "import", "stock", f"jax.dlpack.from_dlpack({name})", from_dlpack, arg)
        run.lat(g, "import", "jax_overlay", f"jax_overlay.from_dlpack({name})", imp_dl, arg)
        run.lat(g, "import", "jax_overlay installed", f"jax.dlpack.from_dlpack({name})", from_dlpack, arg)
        run.lat(g, "import", "jax_overlay installed", f"jnp.asarray({name})", asarray, arg)
        if peer == "PyTorch":
            run.lat(g, "import", "jax_overlay installed", f"jax.device_put({name})", device_put, arg)
        if peer != "CuPy":
            run.lat(g, "import", "peer", f"cupy.from_dlpack({name})", cp.from_dlpack, arg)
        if peer != "PyTorch" and torch is not None:
            run.lat(g, "import", "peer", f"torch.from_dlpack({name})", torch.from_dlpack, arg)

    jx = lambda: x  # noqa: E731
    consumers = [("CuPy", "cupy.asarray", cp.asarray, "cupy.from_dlpack", cp.from_dlpack)]
    if torch is not None:
        consumers.append(("PyTorch", 'torch.as_tensor({}, device="cuda")',
                          lambda o: torch.as_tensor(o, device="cuda"), "torch.from_dlpack", torch.from_dlpack))
    if numba_cuda is not None:
        consumers.append(("Numba", "numba.cuda.as_cuda_array", numba_cuda.as_cuda_array,
                          "numba.cuda.from_dlpack", getattr(numba_cuda, "from_dlpack", None)))
    for peer, cai_call, cai_fn, dl_call, dl_fn in consumers:
        for protocol, call, fn in (("CAI", cai_call, cai_fn), ("DLPack", dl_call, dl_fn)):
            if fn is None:
                continue
            fmt = (lambda n: call.format(n)) if "{}" in call else (lambda n: f"{call}({n})")
            g = f"JAX → {peer}, {protocol}"
            run.lat(g, "export", "stock", fmt("x"), fn, jx)
            run.lat(g, "export", "jax_overlay", fmt("x"), fn, jx)
            for other, name, src in sources:
                if src is not None and other != peer and (protocol == "CAI" or hasattr(src, "__dlpack__")):
                    run.lat(g, "export", "peer", fmt(name), fn, lambda src=src: src)
    g = "export property, CAI"
    prop = lambda o: o.__cuda_array_interface__  # noqa: E731
    run.lat(g, "export", "stock", report.EXPORT_PROPERTY, prop, jx)
    run.lat(g, "export", "jax_overlay", report.EXPORT_PROPERTY, prop, jx)

    def fresh():  # a new ready array per call: the first read of each array
        y = x + 0
        y.block_until_ready()
        return y
    run.lat(g, "export", "stock", report.EXPORT_PROPERTY_FIRST, prop, fresh)
    run.lat(g, "export", "jax_overlay", report.EXPORT_PROPERTY_FIRST, prop, fresh)
    for peer, name, src in sources:
        if src is not None:
            run.lat(g, "export", "peer", f"{name}.__cuda_array_interface__ ({peer})", prop, lambda src=src: src)
    g = "export property, DLPack"
    dl = lambda o: o.__dlpack__(stream=1, max_version=(1, 1))  # noqa: E731
    run.lat(g, "export", "stock", "x.__dlpack__(stream=1, max_version=(1, 1))", dl, jx)
    run.lat(g, "export", "jax_overlay", "x.__dlpack__(stream=1, max_version=(1, 1))", dl, jx)
    for peer, name, src in sources[:2]:
        if src is not None:
            run.lat(g, "export", "peer", f"{name}.__dlpack__(stream=1, max_version=(1, 1)) ({peer})",
                    dl, lambda src=src: src)


def in_flight(run, a, t):
    """Idle vs in flight, and the longest call behind a long kernel."""
    s = cp.cuda.Stream(non_blocking=True)
    busy = CupyBusy(s, "CuPy user stream")
    with_a = lambda: a  # noqa: E731
    run.flight("CuPy → JAX, CAI", "import", "stock", "jnp.asarray(a)", lambda o: jnp.asarray(o),
               with_a, busy, s)
    run.flight("CuPy → JAX, CAI", "import", "jax_overlay", "jax_overlay.from_cuda_array_interface(a)",
               jax_overlay.from_cuda_array_interface, with_a, busy, s)
    run.flight("CuPy → JAX, DLPack", "import", "stock", "jax.dlpack.from_dlpack(a)",
               lambda o: jax.dlpack.from_dlpack(o), with_a, busy, s)
    run.flight("CuPy → JAX, DLPack", "import", "jax_overlay", "jax_overlay.from_dlpack(a)",
               jax_overlay.from_dlpack, with_a, busy, s)
    if torch is not None:
        ts = torch.cuda.Stream()
        tbusy = TorchBusy(ts, "PyTorch side stream")
        run.flight("PyTorch → JAX, DLPack", "import", "stock", "jax.dlpack.from_dlpack(t)",
                   lambda o: jax.dlpack.from_dlpack(o), lambda: t, tbusy, torch.cuda.stream(ts))
        run.flight("PyTorch → JAX, DLPack", "import", "jax_overlay", "jax_overlay.from_dlpack(t)",
                   jax_overlay.from_dlpack, lambda: t, tbusy, torch.cuda.stream(ts))
    if numba_cuda is not None:
        _guarded(run, "Numba in flight", lambda: _numba_in_flight(run))
    _guarded(run, "exports in flight", lambda: _exports_in_flight(run))


def _guarded(run, what, fn):
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the next part still runs
        run.errors.append(f"{what}: {doctor.describe(err)}")
        log(f"  {what} stopped: {doctor.describe(err)}")


def _numba_in_flight(run):
    """A Numba array bound to a Numba stream exports that stream; CuPy's
    kernel keeps that stream busy."""
    ns = numba_cuda.stream()
    d = numba_cuda.device_array(N, np.float32, stream=ns)
    handle = d.__cuda_array_interface__.get("stream")
    if not handle:
        run.errors.append("Numba exported no stream for an array bound to one: no in-flight row")
        return
    nbusy = CupyBusy(cupy_stream(cp, handle), "Numba stream")
    run.flight("Numba → JAX, CAI", "import", "jax_overlay", "jax_overlay.from_cuda_array_interface(d)",
               jax_overlay.from_cuda_array_interface, lambda: d, nbusy)


def _exports_in_flight(run):
    jb = JaxBusy()
    pending = lambda: jb.x  # noqa: E731
    prop = lambda o: o.__cuda_array_interface__  # noqa: E731
    run.flight("export property, CAI", "export", "stock", report.EXPORT_PROPERTY, prop, pending, jb)
    run.flight("export property, CAI", "export", "jax_overlay", report.EXPORT_PROPERTY, prop, pending, jb)
    run.flight("JAX → CuPy, DLPack", "export", "jax_overlay", "cupy.from_dlpack(x)", cp.from_dlpack,
               pending, jb)
    if torch is not None:
        run.flight("JAX → PyTorch, DLPack", "export", "stock", "torch.from_dlpack(x)", torch.from_dlpack,
                   pending, jb)
        run.flight("JAX → PyTorch, DLPack", "export", "jax_overlay", "torch.from_dlpack(x)",
                   torch.from_dlpack, pending, jb)


def floors(run, a, t, x):
    ordinal = a.device.id
    dev = rt.gpu_device(ordinal)
    compute = rt.compute_stream(dev)
    ready = int(dev.get_stream_for_external_ready_events())
    cai = a.__cuda_array_interface__
    view = ext.parse_cai(cai)
    busy = CupyBusy(cp.cuda.Stream(non_blocking=True), "CuPy user stream")
    ptr = x.unsafe_buffer_pointer()
    versioned = lambda o: o.__dlpack__(stream=compute, max_version=(1, 1))  # noqa: E731
    run.floor("peer", "CuPy a.__cuda_array_interface__", lambda o: o.__cuda_array_interface__, lambda: a)
    run.floor("peer", "CuPy a.__dlpack__", versioned, lambda: a)
    run.floor("peer", "CuPy a.__dlpack_device__", lambda o: o.__dlpack_device__(), lambda: a)
    if torch is not None:
        run.floor("peer", "PyTorch t.__dlpack__", versioned, lambda: t)
        run.floor("peer", "PyTorch t.__dlpack_device__", lambda o: o.__dlpack_device__(), lambda: t)
    run.floor("jax_overlay native", "plan_cai_import", lambda c: ext.plan_cai_import(c, a, False),
              lambda: cai)
    run.floor("jax_overlay native", "plan_dlpack_import", ext.plan_dlpack_import, lambda: versioned(a))
    run.floor("jax_overlay native", "order_after, idle producer",
              lambda s: ext.order_after(ordinal, s, compute), lambda: busy.stream.ptr)
    run.floor("jax_overlay native", "order_after, busy producer",
              lambda s: ext.order_after(ordinal, s, compute), lambda: busy.stream.ptr,
              before_round=lambda: busy.start(ROUND_MS), after_round=busy.wait)
    run.floor("jaxlib", "DLPack import, no stream event",
              lambda c: rt.capsule_to_array(c, dev, None, None, 2),
              lambda: ext.capsule_from_cai(view, a, 2, ordinal))
    run.floor("jaxlib", "DLPack import, PJRT stream event",
              lambda c: rt.capsule_to_array(c, dev, ready, None, 2),
              lambda: ext.capsule_from_cai(view, a, 2, ordinal))
    run.floor("jaxlib", "x.unsafe_buffer_pointer()", lambda v: v.unsafe_buffer_pointer(), lambda: x)
    run.floor("jax_overlay native", "memory_kind(ptr)", ext.memory_kind, lambda: ptr)
    run.floor("jaxlib", "x.is_ready()", lambda v: v.is_ready(), lambda: x)
    # An array's first export: what jaxlib's part costs on a new array.
    fresh = lambda: (x + 0).block_until_ready()  # noqa: E731
    run.floor("jaxlib", "x.unsafe_buffer_pointer(), new x", lambda v: v.unsafe_buffer_pointer(), fresh)
    run.floor("jaxlib", "x.is_ready(), new x", lambda v: v.is_ready(), fresh)
    dl = "jax_overlay.from_dlpack"
    run.breakdown = [
        {"call": f"{dl}(a) (CuPy)", "total": f"CuPy → JAX, DLPack|jax_overlay|{dl}(a)",
         "parts": ["CuPy a.__dlpack_device__", "CuPy a.__dlpack__", "plan_dlpack_import",
                   "DLPack import, no stream event"]},
        {"call": "jax_overlay.from_cuda_array_interface(a) (CuPy)",
         "total": "CuPy → JAX, CAI|jax_overlay|jax_overlay.from_cuda_array_interface(a)",
         "parts": ["CuPy a.__cuda_array_interface__", "plan_cai_import", "DLPack import, no stream event"]},
        {"call": f"{dl}(t) (PyTorch)", "total": f"PyTorch → JAX, DLPack|jax_overlay|{dl}(t)",
         "parts": ["PyTorch t.__dlpack_device__", "PyTorch t.__dlpack__", "plan_dlpack_import",
                   "DLPack import, no stream event"]},
        {"call": "stock jax.dlpack.from_dlpack(a) (CuPy)",
         "total": "CuPy → JAX, DLPack|stock|jax.dlpack.from_dlpack(a)",
         "parts": ["CuPy a.__dlpack_device__", "CuPy a.__dlpack__", "DLPack import, PJRT stream event"]},
        {"call": "stock jax.dlpack.from_dlpack(t) (PyTorch)",
         "total": "PyTorch → JAX, DLPack|stock|jax.dlpack.from_dlpack(t)",
         "parts": ["PyTorch t.__dlpack_device__", "PyTorch t.__dlpack__",
                   "DLPack import, PJRT stream event"]},
        {"call": "jax_overlay x.__cuda_array_interface__, first read of a new x",
         "total": f"export property, CAI|jax_overlay|{report.EXPORT_PROPERTY_FIRST}",
         "parts": ["x.unsafe_buffer_pointer(), new x", "memory_kind(ptr)",
                   "x.is_ready(), new x"]},
    ]


def _free():
    gc.collect()
    cp.get_default_memory_pool().free_all_blocks()
    cp.get_default_pinned_memory_pool().free_all_blocks()


def _check(cond, what):
    if not cond:
        raise AssertionError(what)


def sizes(run):
    dev = jax.devices("cuda")[0]
    on_device = rt.memory_sharding(dev, "device")
    zc = {"jax_overlay.from_dlpack(a)": (jax_overlay.from_dlpack, "a"),
          "jax_overlay.from_cuda_array_interface(a)": (jax_overlay.from_cuda_array_interface, "a"),
          "stock jax.dlpack.from_dlpack(a)": (lambda o: jax.dlpack.from_dlpack(o), "a"),
          "jax_overlay.cuda_array_interface(x)": (jax_overlay.cuda_array_interface, "x")}
    if torch is not None:
        zc["peer torch.from_dlpack(a)"] = (torch.from_dlpack, "a")
    out = {"bytes": SIZES, "zero_copy_us": {k: [] for k in zc}, "zero_copy_verified": [],
           "copy_bytes": COPY_SIZES, "copy_gbps": {k: [] for k in _COPY_NAMES},
           "copy_repeats": []}
    for size in SIZES:
        n = size // 4
        a = cp.zeros(n, cp.float32)
        x = jnp.zeros(n, jnp.float32)
        x.block_until_ready()
        cp.cuda.runtime.deviceSynchronize()
        args = {"a": a, "x": x}
        for name, (fn, which) in zc.items():
            arg = args[which]
            try:
                harness.warm(fn, lambda: arg, 20)
                v = round(median_us(fn, lambda: arg, repeats=SIZE_REPEATS, rounds=SIZE_ROUNDS), 2)
            except Exception as err:  # noqa: BLE001
                v = None
                run.errors.append(f"zero-copy {name} at {size} B: {doctor.describe(err)}")
            out["zero_copy_us"][name].append(v)
        try:
            out["zero_copy_verified"].append(
                jax_overlay.from_dlpack(a).unsafe_buffer_pointer() == a.data.ptr
                and jax_overlay.from_cuda_array_interface(a).unsafe_buffer_pointer() == a.data.ptr)
        except Exception as err:  # noqa: BLE001
            out["zero_copy_verified"].append(False)
            run.errors.append(f"zero-copy check at {size} B: {doctor.describe(err)}")
        log(f"  zero-copy {size:>10} B: " + ", ".join(f"{v[-1]}" for v in out["zero_copy_us"].values()))
        del a, x, args
        _free()
    for size in COPY_SIZES:
        repeats = 30 if size <= 4 << 20 else 10 if size <= 256 << 20 else 5
        out["copy_repeats"].append(repeats)
        for name, gbps in _copies(size, repeats, on_device, run).items():
            out["copy_gbps"][name].append(gbps)
        log(f"  copies {size:>10} B: " + ", ".join(f"{k} {v[-1] and round(v[-1], 1)}"
                                                  for k, v in out["copy_gbps"].items()))
        _free()
    run.sizes = out


_COPY_NAMES = (report.D2D, report.STRIDED, report.STRIDED_GATHER, report.COPY_TRUE, report.PINNED,
               report.H2D, report.D2D_B2B, report.STRIDED_B2B, report.STRIDED_GATHER_B2B,
               report.COPY_TRUE_B2B)


def _copies(size, repeats, on_device, run):
    """GB/s of each copy path for `size` bytes delivered."""
    n = size // 4
    cols = min(n, 1024)
    src = cp.ones(n, cp.float32)
    dst = cp.empty_like(src)
    base = cp.ones((n // cols, 2 * cols), cp.float32)
    strided = base[:, ::2]  # every other column: one copy, on the GPU
    pinned = cupyx.empty_pinned((n,), np.float32)
    pinned[:] = 1.0
    cp.cuda.runtime.deviceSynchronize()

    def memcpy(times=1):
        for _ in range(times):
            cp.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, size,
                                        cp.cuda.runtime.memcpyDeviceToDevice, 0)
        cp.cuda.runtime.streamSynchronize(0)

    def h2d():
        cp.cuda.runtime.memcpyAsync(dst.data.ptr, pinned.ctypes.data, size,
                                    cp.cuda.runtime.memcpyHostToDevice, 0)
        cp.cuda.runtime.streamSynchronize(0)

    def strided_import(times=1):
        xs = [jax_overlay.from_cuda_array_interface(strided) for _ in range(times)]
        return [x.block_until_ready() for x in xs][-1]

    def strided_gather(times=1):
        jax_overlay.config.strided_kernel = False
        try:
            return strided_import(times)
        finally:
            jax_overlay.config.strided_kernel = True

    def copy_true(times=1):
        xs = [jax_overlay.from_dlpack(src, copy=True) for _ in range(times)]
        return [x.block_until_ready() for x in xs][-1]

    host_view = None

    def pinned_put():
        return jax.device_put(host_view, on_device).block_until_ready()

    def first_checks():
        nonlocal host_view
        for route in (strided_import, strided_gather):
            r = route()
            _check(r.shape == strided.shape and float(jnp.min(r)) == float(jnp.max(r)) == 1.0,
                   f"{route.__name__}: wrong result")
            _check(r.unsafe_buffer_pointer() != strided.data.ptr, f"{route.__name__} did not copy")
        r = copy_true()
        _check(r.unsafe_buffer_pointer() != src.data.ptr, "copy=True did not copy")
        host_view = jax_overlay.from_cuda_array_interface(HostCAI(pinned))
        _check(host_view.sharding.memory_kind == "pinned_host"
               and host_view.unsafe_buffer_pointer() == pinned.ctypes.data,
               f"pinned import is not a pinned_host view ({host_view.sharding.memory_kind})")
        r = pinned_put()
        _check(r.sharding.memory_kind == "device" and float(jnp.min(r)) == 1.0, "pinned -> device: wrong result")

    gbps = dict.fromkeys(_COPY_NAMES)
    try:
        first_checks()
    except Exception as err:  # noqa: BLE001
        run.errors.append(f"copies at {size} B: {doctor.describe(err)}")
        return gbps
    b2b = functools.partial
    for name, op, times in ((report.D2D, memcpy, 1), (report.STRIDED, strided_import, 1),
                            (report.STRIDED_GATHER, strided_gather, 1), (report.COPY_TRUE, copy_true, 1),
                            (report.PINNED, pinned_put, 1), (report.H2D, h2d, 1),
                            (report.D2D_B2B, b2b(memcpy, report.PIPELINE), report.PIPELINE),
                            (report.STRIDED_B2B, b2b(strided_import, report.PIPELINE), report.PIPELINE),
                            (report.STRIDED_GATHER_B2B, b2b(strided_gather, report.PIPELINE), report.PIPELINE),
                            (report.COPY_TRUE_B2B, b2b(copy_true, report.PIPELINE), report.PIPELINE)):
        try:
            seconds = harness.seconds(op, repeats, before=cp.cuda.runtime.deviceSynchronize)  # device idle
            gbps[name] = round(times * size / seconds / 1e9, 2)
        except Exception as err:  # noqa: BLE001
            run.errors.append(f"{name} at {size} B: {doctor.describe(err)}")
    return gbps


# --- results ------------------------------------------------------------------

def meta(seconds):
    env = doctor.environment()
    gpu = jax.devices("cuda")[0].device_kind
    return {
        "gpu": gpu, "gpu_short": report.short_gpu_name(gpu),
        "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
        "driver": env["nvidia_driver"], "cuda_driver_api": env["cuda_driver_api"],
        "jax": env["jax"], "jaxlib": env["jaxlib"], "jax_cuda_plugin": env["jax_cuda_plugin"],
        "cupy": cp.__version__, "torch": torch.__version__ if torch is not None else None,
        "numba": env["numba"], "numpy": np.__version__, "python": env["python"],
        "jax_overlay": jax_overlay.__version__, "git": harness.git_rev(),
        "source_digest": report.source_digest(harness.ROOT),
        "statistic": (f"latency: median of {ROUNDS} round means of {REPEATS} calls; sizes: median of "
                      f"{SIZE_ROUNDS} round means of {SIZE_REPEATS} calls; copies: median of 5-30 "
                      "timed, synchronised copies"),
        "repeats": REPEATS, "rounds": ROUNDS, "seconds": round(seconds, 1),
    }


def main():
    args = _parser().parse_args()
    t_start = time.perf_counter()
    run = Run()
    n = N
    a = cp.arange(n, dtype=cp.float32)
    t = torch.arange(n, dtype=torch.float32, device="cuda") if torch is not None else None
    d = numba_cuda.to_device(np.arange(n, dtype=np.float32)) if numba_cuda is not None else None
    x = jnp.arange(n, dtype=jnp.float32) + 0
    x.block_until_ready()
    cp.cuda.runtime.deviceSynchronize()
    if torch is not None:
        torch.cuda.synchronize()
    for name, section in (("latency matrix", lambda: latency_matrix(run, a, t, d, x)),
                          ("idle vs in flight", lambda: in_flight(run, a, t)),
                          ("floors", lambda: floors(run, a, t, x)),
                          ("sizes", lambda: sizes(run))):
        log(f"== {name}")
        try:
            section()
        except Exception as err:  # noqa: BLE001 - the other sections still run
            run.errors.append(f"{name}: {doctor.describe(err)}")
            log(f"  {name} stopped: {doctor.describe(err)}")
        finally:
            jax_overlay.uninstall()
    results = {"schema": report.SCHEMA, "meta": meta(time.perf_counter() - t_start),
               "latency": run.latency, "inflight": run.inflight, "floors": run.floors,
               "breakdown": run.breakdown, "sizes": run.sizes, "errors": run.errors,
               "round_means": ROUND_MEANS}
    paths = []
    if args.json:
        paths.append(args.json)
    if args.out or not args.json:
        folder = args.out or os.path.join(harness.HERE, "results")
        os.makedirs(folder, exist_ok=True)
        paths.append(os.path.join(folder, report.results_stem(results["meta"]) + ".json"))
    for path in paths:
        harness.save(path, results)
        try:
            why = report.chart(results, os.path.splitext(path)[0] + ".png")
        except Exception as err:  # noqa: BLE001 - the numbers are saved already
            why = f"no chart: {doctor.describe(err)}"
        log(f"wrote {path}" + (f"; {why}" if why else f" and {os.path.splitext(path)[0]}.png"))
    try:
        print(report.markdown(results, "full"))
    except Exception as err:  # noqa: BLE001
        log(f"tables: {doctor.describe(err)}")
    for e in run.errors:
        log(f"error: {e}")
    log(f"run_all: {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
