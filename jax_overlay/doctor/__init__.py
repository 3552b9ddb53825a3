"""Room: the doctor.  `python -m jax_overlay doctor`: what this machine has, and a live round
trip on every interchange path it can run, with stock JAX and with
jax_overlay installed, in one table.

Rows are (direction, peer, protocol, memory): imports (peer -> JAX) and
exports (JAX -> peer) with NumPy on the host, and CuPy, PyTorch and Numba on
the GPU, over the CUDA Array Interface (CAI), legacy DLPack (the producer has
the pre-2023 ``__dlpack__(stream=None)``) and DLPack 1.x, on host, device,
pinned host and managed memory.  Each row runs the same user-level call
twice: with stock JAX (``jax_overlay.uninstall()``) and with jax_overlay
installed (``install()``).  CAI rows hand the consumer a view that has only
``__cuda_array_interface__``, so it cannot pick DLPack instead.

Columns, for each side:

* works: the call returned the source's values;
* zero-copy: the result has the source's data pointer;
* stream (stream-safe): `--trials` times, the producer's kernel is still
  running when the call is made (a CuPy kernel or PyTorch's sleep on the
  producer's own stream, then a write of k; for exports, a JAX computation
  that writes k); the result is then read on the GPU (a JAX reduction, or the
  consumer's own).  "yes": no stale read, and the call returned while the
  producer was still busy (for exports: when JAX's export method returned);
  "stale i/n": i reads saw old data; "waits": never stale, but the host
  waited for the producer every time; "fails": the call raised; "n/a": no
  stream is involved (host memory, or a producer that exports none);
* us: median of single-call durations, idle producer, after a warm-up.

Exit status: 0 when every row has the result jax_overlay promises for it
(skipped and n/a rows are fine), 1 otherwise.

``--json`` prints one object (schema ``SCHEMA``):

* ``schema``: ``"jax_overlay.doctor/2"``; ``exit_code``: as above;
* ``environment``: the keys in ``ENV_KEYS`` (versions are strings or null when
  not installed; ``devices`` a list of ``{"platform", "id", "kind"}``;
  ``gpu``: null when GPU rows can run, else why not);
* ``rows``: objects with the keys in ``ROW_KEYS``: ``n`` (row number),
  ``direction`` ("import" | "export"), ``peer``, ``protocol`` (one of
  ``PROTOCOLS``), ``memory``, ``call`` (the user-level call), ``status`` (one
  of ``STATUSES``), ``reason`` (why skipped, n/a, failed; else null),
  ``expect`` (null, or ``{"works", "zero_copy", "stream_safe"}``, each a bool
  or null for "no promise"), ``stock`` and ``overlay`` (null when the row did
  not run, else objects with the keys in ``SIDE_KEYS``: ``works``,
  ``zero_copy``, ``stream_safe``, ``host_waits`` (bools or null), ``trials``
  (null or ``{"n", "stale", "in_flight"}``), ``latency_us`` (number or null),
  ``capsule`` ("versioned" | "legacy" | null: the DLPack capsule exchanged),
  ``error`` and ``note`` (strings or null)).

Statuses: "ok" (jax_overlay did what it promises, or the row promises
nothing and works), "FAILED" (a promise was broken: counts for the exit
status), "ERROR" (the doctor could not set the row up: counts too),
"unsupported" (a row that promises nothing did not work), "skipped" (cannot
run here: no GPU, a peer not installed), "n/a" (the path does not exist, or
the peer refuses it with stock JAX and with jax_overlay alike).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import json
import platform
import re
import statistics
import subprocess
import sys
import time
from typing import Callable

import numpy as np

SCHEMA = "jax_overlay.doctor/2"



def _gpu_peers():
    """The registered peers besides NumPy (listed on its own): their
    versions are the environment's."""
    from ..peers import REGISTRY
    return [p for name, p in REGISTRY.items() if name != "numpy"]


ENV_KEYS = ("jax_overlay", "python", "platform", "numpy", "jax", "jaxlib",
            "jax_cuda_plugin", *(p.name for p in _gpu_peers()), "libcuda",
            "cuda_driver_api", "nvidia_driver", "devices", "gpu",
            "jax_overlay_installed")
ROW_KEYS = ("n", "direction", "peer", "protocol", "memory", "call", "status",
            "reason", "expect", "stock", "overlay")
SIDE_KEYS = ("works", "zero_copy", "stream_safe", "host_waits", "trials",
             "latency_us", "capsule", "error", "note")
PROTOCOLS = ("CAI", "DLPack legacy", "DLPack 1.x")
STATUSES = ("ok", "FAILED", "ERROR", "unsupported", "skipped", "n/a")
FAILING = ("FAILED", "ERROR")

HOST_NO_STREAM = "host memory: no stream to order on"
CAI_ON_HOST = ("the CUDA Array Interface describes CUDA memory; host arrays "
               "travel by DLPack (or NumPy's __array_interface__)")


class Skip(Exception):
    """The row cannot run on this machine (no GPU, a peer not installed)."""


class NotApplicable(Exception):
    """The path does not exist (the CUDA Array Interface on the host, a peer
    without the protocol)."""


@dataclasses.dataclass(frozen=True)
class Expect:
    """What jax_overlay promises for a row: None means no promise."""
    works: bool = True
    zero_copy: bool | None = True
    stream_safe: bool | None = None


@dataclasses.dataclass
class Case:
    """One live path, built afresh for each side (stock, then jax_overlay).

    source, source_ptr, expected: the peer's array (imports) or the JAX
      array (exports), its data pointer and its values.
    convert: exports only: the consumer's call; imports use the row's
      protocol's JAX call.
    result_ptr, read: the result's data pointer and NumPy values.
    minmax: the result's (min, max), computed on the GPU (by JAX for
      imports, by the consumer for exports).
    trial: k -> (source, context, busy): enqueues producer work that writes k
      everywhere and is still running on return; the call runs inside
      `context`; busy() says whether that work still runs.
    sync: waits for all the producer's work.
    no_trial: why there is no in-flight test.  note: said in the row.
    keep: what must outlive the case (a memory pool)."""
    source: object
    source_ptr: int
    expected: np.ndarray
    result_ptr: Callable
    read: Callable
    convert: Callable | None = None
    minmax: Callable | None = None
    trial: Callable | None = None
    sync: Callable = lambda: None
    no_trial: str | None = None
    note: str | None = None
    keep: object = None


@dataclasses.dataclass
class Row:
    direction: str                 # "import" (peer -> JAX) or "export" (JAX -> peer)
    peer: str
    protocol: str                  # one of PROTOCOLS
    memory: str
    call: str                      # the user-level call, for people
    build: Callable[[], Case]      # raises Skip or NotApplicable
    expect: Expect | None = Expect()


def not_applicable(reason):
    def build():
        raise NotApplicable(reason)
    return build


# --- protocol views ---------------------------------------------------------

class CAIView:
    """Only the CUDA Array Interface of `obj`, so a consumer that knows DLPack
    too cannot take it instead.  `probe`, if given, runs right after `obj`'s
    property first returns (exports: is the computation still running?)."""

    def __init__(self, obj, probe=None):
        self.obj, self.probe, self.after = obj, probe, None

    @property
    def __cuda_array_interface__(self):
        cai = self.obj.__cuda_array_interface__
        if self.probe is not None and self.after is None:
            self.after = self.probe()
        return cai


class DLPackView:
    """`obj`'s DLPack, offered as a legacy producer offers it (legacy=True:
    the pre-2023 ``__dlpack__(stream=None)``, so a consumer that passes
    ``max_version`` gets TypeError and must retry the legacy call) or passed
    through.  Records which capsule it handed out, whether `obj` itself
    raised, and runs `probe` like CAIView."""

    def __init__(self, obj, *, legacy=False, probe=None, record=True):
        self.obj, self.legacy, self.probe, self.record = obj, legacy, probe, record
        self.after = self.capsule = self.producer_error = None
        self.refused = False

    def __dlpack__(self, stream=None, **kwargs):
        if self.legacy and kwargs:
            self.refused = True
            raise TypeError(f"__dlpack__() got unexpected keyword arguments {sorted(kwargs)} "
                            "(a legacy DLPack producer)")
        try:
            cap = self.obj.__dlpack__(stream=stream, **kwargs)
        except Exception as e:
            self.producer_error = e
            raise
        if self.record:
            self.capsule = _capsule_kind(cap)
        if self.probe is not None and self.after is None:
            self.after = self.probe()
        return cap

    def __dlpack_device__(self):
        return self.obj.__dlpack_device__()


def _capsule_kind(cap):
    from .. import _xla_ext as ext
    try:
        return "versioned" if ext.capsule_info(cap)["versioned"] else "legacy"
    except Exception:  # noqa: BLE001 - a capsule we cannot read: say nothing
        return None


def _view(row, obj, *, probe=None, record=True):
    if row.protocol == "CAI":
        return CAIView(obj, probe)
    return DLPackView(obj, legacy=row.protocol == "DLPack legacy", probe=probe, record=record)


def _convert(row, case):
    """The user-level call: JAX's public import for imports (looked up at
    call time, so install() takes effect), the consumer's for exports."""
    if row.direction == "export":
        return case.convert
    import jax
    import jax.dlpack  # noqa: F401
    import jax.numpy as jnp
    if row.protocol == "CAI":
        return lambda obj: jnp.asarray(obj)
    return lambda obj: jax.dlpack.from_dlpack(obj)


# --- measuring one side -------------------------------------------------------

def describe(e):
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    text = text if len(text) <= 160 else text[:157] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def timed_calls(fn, args):
    """fn(a) for each a in `args`, each call timed on its own: (results,
    durations in ns).  Results stay alive, so none is freed inside a timed
    call."""
    results, durations = [], []
    clock = time.perf_counter_ns
    for a in args:
        t0 = clock()
        r = fn(a)
        t1 = clock()
        results.append(r)
        durations.append(t1 - t0)
    return results, durations


def latency_us(fn, arg, calls):
    """Median duration of `calls` single calls fn(arg) after a warm-up, in
    microseconds."""
    for _ in range(max(5, calls // 10)):
        fn(arg)
    _, durations = timed_calls(fn, [arg] * calls)
    return round(statistics.median(durations) / 1e3, 2)


def _in_flight(row, case, convert, n):
    """(stream_safe, host_waits, trials, error) of `n` in-flight trials."""
    stale = in_flight = done = 0
    error = None
    try:
        for k in range(1, n + 1):
            source, context, busy = case.trial(k)
            probe = busy if row.direction == "export" else None
            view = _view(row, source, probe=probe, record=False)
            with context:
                result = convert(view)
            pending = view.after if probe is not None else busy()
            in_flight += bool(pending)
            stale += tuple(case.minmax(result)) != (k, k)
            done += 1
            del result
    except Exception as e:  # noqa: BLE001 - a failing trial is a finding
        error = f"in flight: {describe(e)}"
    finally:
        try:
            case.sync()
        except Exception as e:  # noqa: BLE001
            error = error or f"waiting for the producer: {describe(e)}"
    trials = {"n": done, "stale": stale, "in_flight": in_flight}
    if error:
        return False, None, trials, error
    return stale == 0, in_flight == 0, trials, None


def _side(row, case, trials, calls):
    """(side record, whether the peer refused the exchange)."""
    side = dict.fromkeys(SIDE_KEYS)
    side["note"] = case.note
    convert = _convert(row, case)
    view = _view(row, case.source)
    try:
        result = convert(view)
        values = np.asarray(case.read(result))
    except Exception as e:  # noqa: BLE001 - the doctor reports, never raises
        side["works"], side["error"] = False, describe(e)
        # Imports: the peer's own __dlpack__ raised.  Exports: the consumer
        # never retried a legacy producer's call.
        refused = (getattr(view, "producer_error", None) is not None if row.direction == "import"
                   else getattr(view, "refused", False) and view.capsule is None
                   and view.producer_error is None)
        return side, refused
    side["capsule"] = getattr(view, "capsule", None)
    if row.protocol == "DLPack 1.x" and side["capsule"] == "legacy":
        side["note"] = "a legacy capsule was exchanged (no DLPack 1.x on one side)"
    side["works"] = values.shape == case.expected.shape and bool(np.array_equal(values, case.expected))
    if not side["works"]:
        side["error"] = f"wrong values: {values.ravel()[:4]} instead of {case.expected.ravel()[:4]}"
        return side, False
    ptr = case.result_ptr(result)  # None: the consumer makes its own array (a kernel's output)
    side["zero_copy"] = None if ptr is None else ptr == case.source_ptr
    del result
    if case.trial is None:
        side["note"] = side["note"] or case.no_trial
    else:
        (side["stream_safe"], side["host_waits"], side["trials"],
         side["error"]) = _in_flight(row, case, convert, trials)
    try:
        arg = case.source if row.protocol == "DLPack 1.x" else _view(row, case.source, record=False)
        side["latency_us"] = latency_us(convert, arg, calls)
    except Exception as e:  # noqa: BLE001
        side["error"] = side["error"] or f"timing: {describe(e)}"
    return side, False


def _broken_promise(expect, side):
    """Why jax_overlay's side misses what `expect` promises, or None."""
    if expect.works and not side["works"]:
        return f"jax_overlay: {side['error']}"
    if not side["works"]:
        return None
    if expect.zero_copy is not None and side["zero_copy"] != expect.zero_copy:
        return "jax_overlay copied" if expect.zero_copy else "jax_overlay made a view where a copy is needed"
    if expect.stream_safe and side["trials"] is not None:
        if side["error"]:
            return f"jax_overlay: {side['error']}"
        t = side["trials"]
        if t["stale"]:
            return f"jax_overlay read stale data in {t['stale']} of {t['n']} in-flight trials"
        if side["host_waits"]:
            return "jax_overlay's call waited on the host for the producer in every in-flight trial"
    return None


def evaluate(row, n, trials, calls):
    """One row's record: both sides measured, then the verdict."""
    from .. import _install
    rec = {"n": n, "direction": row.direction, "peer": row.peer, "protocol": row.protocol,
           "memory": row.memory, "call": row.call, "status": None, "reason": None,
           "expect": dataclasses.asdict(row.expect) if row.expect else None,
           "stock": None, "overlay": None}
    refused = {}
    try:
        for name in ("stock", "overlay"):
            if name == "overlay":
                _install.install()
            else:
                _install.uninstall()
            rec[name], refused[name] = _side(row, row.build(), trials, calls)
    except Skip as e:
        rec["status"], rec["reason"] = "skipped", str(e)
        return rec
    except NotApplicable as e:
        rec["status"], rec["reason"] = "n/a", str(e)
        return rec
    except Exception as e:  # noqa: BLE001 - a row that cannot be set up is reported
        rec["status"], rec["reason"] = "ERROR", f"setting up the row: {describe(e)}"
        return rec
    finally:
        _install.uninstall()
    if refused["stock"] and refused["overlay"]:
        who = row.peer if row.direction == "import" else f"{row.peer} (the consumer)"
        rec["status"], rec["reason"] = "n/a", f"{who} refuses it: {rec['overlay']['error']}"
    elif row.expect is None:
        rec["status"] = "ok" if rec["overlay"]["works"] else "unsupported"
        rec["reason"] = None if rec["overlay"]["works"] else "no promise made for this path"
    else:
        broken = _broken_promise(row.expect, rec["overlay"])
        rec["status"], rec["reason"] = ("FAILED", broken) if broken else ("ok", None)
    return rec


# --- environment ----------------------------------------------------------------

@functools.cache
def gpu_skip_reason():
    """None when GPU rows can run (libcuda and a JAX CUDA backend), else why not."""
    from .. import _xla_ext as ext
    try:
        ext.load_driver()
    except BufferError as e:
        return f"no GPU: {e}"
    try:
        import jax
        jax.devices("cuda")
    except Exception as e:  # noqa: BLE001 - any failure means no CUDA backend
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return f"no GPU: JAX has no CUDA backend ({first})"
    return None


def need_gpu():
    if gpu_skip_reason():
        raise Skip("no GPU")


def need(module):
    """The module, or Skip saying it is not installed (or not usable)."""
    top = module.split(".")[0]
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and e.name.split(".")[0] == top:
            raise Skip(f"{top} not installed") from None
        raise Skip(f"{top} not usable: {describe(e)}") from None
    except Exception as e:  # noqa: BLE001
        raise Skip(f"{top} not usable: {describe(e)}") from None


def _distributions():
    """{normalised distribution name: version} of what is installed."""
    from importlib import metadata
    out: dict[str, str] = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            out.setdefault(re.sub(r"[-_.]+", "-", name).lower(), dist.version)
    return out


def nvidia_driver():
    """The NVIDIA kernel driver's version, or None."""
    try:
        with open("/proc/driver/nvidia/version") as f:
            m = re.search(r"Kernel Module\s+(?:for \S+\s+)?(\d[\w.]*)", f.read())
        if m:
            return m.group(1)
    except OSError:
        pass
    try:
        p = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20)
        return p.stdout.split()[0] if p.returncode == 0 and p.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def environment():
    import jax
    import jaxlib
    from .. import __version__
    from .. import _install
    from .. import _xla_ext as ext
    dists = _distributions()

    def version(*names, prefix=None):
        for name in names:
            if name in dists:
                return dists[name]
        if prefix:
            hits = sorted(n for n in dists if n.startswith(prefix))
            if hits:
                return f"{dists[hits[0]]} ({hits[0]})"
        return None

    plugins = sorted(n for n in dists if re.fullmatch(r"jax-cuda\d+-(plugin|pjrt)", n))
    env = {
        "jax_overlay": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(terse=True),
        "numpy": np.__version__,
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "jax_cuda_plugin": ", ".join(f"{n} {dists[n]}" for n in plugins) or None,
        # A peer's distribution, or a build of it named after it ("cupy-cuda13x").
        **{p.name: version(p.distribution, prefix=p.distribution + "-") for p in _gpu_peers()},
        "libcuda": None, "cuda_driver_api": None,
        "nvidia_driver": nvidia_driver(),
        "devices": [],
        "gpu": gpu_skip_reason(),
        "jax_overlay_installed": _install.installed(),
    }
    if version("numba-cuda") and "numba" in env:
        env["numba"] = f"{env['numba']} (numba-cuda {version('numba-cuda')})"
    try:
        ext.load_driver()
        api = ext.driver_version()
        env["libcuda"] = f"loaded, {ext.device_count()} device(s)"
        env["cuda_driver_api"] = f"{api // 1000}.{api % 1000 // 10}"
    except BufferError as e:
        env["libcuda"] = f"not loaded: {e}"
    for backend in ("cpu", "cuda"):
        with contextlib.suppress(Exception):
            env["devices"] += [{"platform": d.platform, "id": d.id, "kind": d.device_kind}
                               for d in jax.devices(backend)]
    return env


# --- the rows ---------------------------------------------------------------------

def _jax_ptr(x):
    return x.unsafe_buffer_pointer()


def _cpu_device():
    import jax
    try:
        return jax.devices("cpu")[0]
    except RuntimeError as e:
        raise Skip(f"JAX has no CPU backend here ({describe(e)})") from None


def _numpy_source(memory):
    """A NumPy array (aligned, as JAX's CPU client wants for a view)."""
    from .producers import aligned_empty
    _cpu_device()
    a = aligned_empty((64, 32), np.float32)
    a[...] = np.arange(a.size, dtype=np.float32).reshape(a.shape)
    src = a[:, ::2] if memory == "host, strided" else a
    if memory == "host, read-only":
        a.flags.writeable = False
    return Case(source=src, source_ptr=src.ctypes.data, expected=np.array(src),
                result_ptr=_jax_ptr, read=np.asarray, no_trial=HOST_NO_STREAM)


def _jax_on_cpu():
    import jax
    host = np.arange(2048, dtype=np.float32).reshape(64, 32)
    x = jax.device_put(host, _cpu_device())
    x.block_until_ready()
    return Case(source=x, source_ptr=x.unsafe_buffer_pointer(), expected=host,
                convert=np.from_dlpack, result_ptr=lambda a: a.ctypes.data,
                read=np.asarray, no_trial=HOST_NO_STREAM)


def host_rows():
    rows = []
    for memory in ("host", "host, read-only", "host, strided"):
        for protocol in ("DLPack legacy", "DLPack 1.x"):
            rows.append(Row("import", "NumPy", protocol, memory, "jax.dlpack.from_dlpack(a)",
                            functools.partial(_numpy_source, memory),
                            Expect(zero_copy=memory != "host, strided")))
    rows.append(Row("import", "NumPy", "CAI", "host", "jnp.asarray(a)",
                    not_applicable(CAI_ON_HOST), None))
    for protocol in ("DLPack legacy", "DLPack 1.x"):
        rows.append(Row("export", "NumPy", protocol, "host", "np.from_dlpack(x)", _jax_on_cpu))
    rows.append(Row("export", "NumPy", "CAI", "host", "np.asarray(x)",
                    not_applicable(CAI_ON_HOST), None))
    return rows


def all_rows():
    from . import _gpu as _doctor_gpu
    return host_rows() + _doctor_gpu.rows()


# --- output -------------------------------------------------------------------------

def _yes(v):
    return "" if v is None else "yes" if v else "no"


def _stream_cell(side):
    if side is None or not side["works"]:
        return ""
    t = side["trials"]
    if t is None:
        return "n/a"
    if side["error"] and side["error"].startswith(("in flight", "waiting")):
        return "fails"
    if t["stale"]:
        return f"stale {t['stale']}/{t['n']}"
    return "waits" if side["host_waits"] else "yes"


def _cells(side):
    if side is None:
        return ["", "", "", ""]
    us = "" if side["latency_us"] is None else f"{side['latency_us']:.1f}"
    return [_yes(side["works"]), _yes(side["zero_copy"]), _stream_cell(side), us]


HEADER = ["#", "path", "protocol", "memory", "works", "0-copy", "stream", "us",
          "works", "0-copy", "stream", "us", "status"]


def table_rows(report):
    """The table's cells; skip reasons inline, other reasons in the notes."""
    out = []
    for r in report["rows"]:
        status = f"skipped: {r['reason']}" if r["status"] == "skipped" else r["status"]
        path = f"{r['peer']} -> JAX" if r["direction"] == "import" else f"JAX -> {r['peer']}"
        sides = (None, None) if r["status"] == "n/a" else (r["stock"], r["overlay"])
        out.append([str(r["n"]), path, r["protocol"], r["memory"], *_cells(sides[0]),
                    *_cells(sides[1]), status])
    return out


def footnotes(report):
    """Why rows are n/a, failed or unsupported, and each side's errors and
    notes (once when both sides say the same; host memory having no stream
    goes without saying)."""
    lines = []
    for r in report["rows"]:
        if r["status"] in ("n/a", "FAILED", "ERROR", "unsupported") and r["reason"]:
            lines.append(f"{r['n']:>3} {r['status']}: {r['reason']}")
        if r["status"] == "n/a" or r["stock"] is None:
            continue
        for key in ("error", "note"):
            said = {name: r[name][key] for name in ("stock", "overlay")}
            said = {k: v for k, v in said.items() if v and v != HOST_NO_STREAM
                    and not (r["reason"] and v in r["reason"])}
            if len(said) == 2 and said["stock"] == said["overlay"]:
                lines.append(f"{r['n']:>3} both: {said['stock']}")
                continue
            lines += [f"{r['n']:>3} {'stock' if k == 'stock' else 'jax_overlay'}: {v}"
                      for k, v in said.items()]
    return lines


def summary(report):
    counts: dict[str, int] = {}
    for r in report["rows"]:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    parts = [f"{counts[s]} {s}" for s in STATUSES if counts.get(s)]
    return f"{len(report['rows'])} rows: {', '.join(parts)}; exit status {report['exit_code']}"


def _env_lines(env):
    def v(x):
        return "not installed" if x is None else str(x)
    devices = ", ".join(f"{d['platform']}:{d['id']} ({d['kind']})" for d in env["devices"]) or "none"
    return [
        ("jax_overlay", f"{env['jax_overlay']} (installed before this run: {env['jax_overlay_installed']})"),
        ("python", f"{env['python']} on {env['platform']}"),
        ("numpy", env["numpy"]),
        ("jax / jaxlib", f"{env['jax']} / {env['jaxlib']}"),
        ("jax CUDA plugin", v(env["jax_cuda_plugin"])),
        *((p.name, v(env[p.name])) for p in _gpu_peers()),
        ("libcuda", env["libcuda"]),
        ("CUDA driver API", v(env["cuda_driver_api"]) if env["cuda_driver_api"] else "-"),
        ("NVIDIA driver", env["nvidia_driver"] or "-"),
        ("devices", devices),
        ("GPU rows", env["gpu"] or "run"),
    ]


def render_plain(report, out):
    out.write("jax_overlay doctor\n")
    for k, v in _env_lines(report["environment"]):
        out.write(f"  {k:<16} {v}\n")
    rows = [HEADER] + table_rows(report)
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER) - 1)]
    stock_at = sum(w + 2 for w in widths[:4])
    overlay_at = stock_at + sum(w + 2 for w in widths[4:8])
    out.write("\n" + " " * (2 + stock_at) + "stock JAX".ljust(overlay_at - stock_at)
              + "jax_overlay installed\n")
    right = {0, 7, 11}
    for r in rows:
        cells = [c.rjust(widths[i]) if i in right else c.ljust(widths[i])
                 for i, c in enumerate(r[:-1])]
        out.write("  " + "  ".join(cells) + "  " + r[-1] + "\n")
    notes = footnotes(report)
    if notes:
        out.write("\nnotes (by row):\n" + "".join(f"  {n}\n" for n in notes))
    out.write("\n" + summary(report) + "\n")


def render_rich(report, out):
    from rich.console import Console
    from rich.table import Table
    console = Console(file=out, width=max(170, Console(file=out).width))
    env = Table.grid(padding=(0, 2))
    for k, v in _env_lines(report["environment"]):
        env.add_row(k, str(v))
    console.print("[bold]jax_overlay doctor[/bold]")
    console.print(env)
    t = Table(show_lines=False, header_style="bold")
    for i, h in enumerate(HEADER):
        side = "stock\n" if 4 <= i < 8 else "overlay\n" if 8 <= i < 12 else "\n"
        t.add_column(side + (h if h != "us" else "µs"), justify="right" if i in (0, 7, 11) else "left",
                     no_wrap=i != 12, min_width=16 if i == 12 else None)
    colour = {"ok": "green", "FAILED": "bold red", "ERROR": "bold red", "unsupported": "yellow"}
    for r, rec in zip(table_rows(report), report["rows"]):
        c = colour.get(rec["status"])
        t.add_row(*r[:-1], f"[{c}]{r[-1]}[/{c}]" if c else r[-1])
    console.print(t)
    for n in footnotes(report):
        console.print(n, markup=False, highlight=False)
    console.print(summary(report), markup=False, highlight=False)


def run(*, as_json=False, plain=False, trials=20, calls=200, out=None, rows=None, json_file=None):
    """Measures every row; writes the report (and the JSON report to
    `json_file` too, if given); returns the exit status."""
    out = sys.stdout if out is None else out
    from .. import _install
    was_installed = _install.installed()
    env = environment()
    try:
        records = [evaluate(row, i + 1, trials, calls)
                   for i, row in enumerate(all_rows() if rows is None else rows)]
    finally:
        if was_installed:
            _install.install()
        else:
            _install.uninstall()
    code = 1 if any(r["status"] in FAILING for r in records) else 0
    report = {"schema": SCHEMA, "environment": env, "rows": records, "exit_code": code}
    if json_file:
        with open(json_file, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
    if as_json:
        json.dump(report, out, indent=2)
        out.write("\n")
    elif not plain and _has_rich():
        render_rich(report, out)
    else:
        render_plain(report, out)
    return code


def _has_rich():
    return importlib.util.find_spec("rich") is not None


def description() -> str:
    """The command's help text: the module doc's first paragraph, without
    its "Room:" label (a note for the code's readers)."""
    return re.sub(r"^Room: [^.]*\.\s*", "", __doc__.split("\n\n")[0])


def add_arguments(p):
    p.add_argument("--json", action="store_true",
                   help=f"print one JSON object (schema {SCHEMA}; its fields: "
                   "help(jax_overlay.doctor))")
    p.add_argument("--json-file", metavar="PATH", help="also write the JSON report to PATH")
    p.add_argument("--plain", action="store_true", help="plain text even where rich is installed")
    p.add_argument("--trials", type=int, default=20, metavar="N",
                   help="in-flight trials per row and side (default 20)")
    p.add_argument("--calls", type=int, default=200, metavar="N",
                   help="timed calls per row and side (default 200)")
    return p


def main(argv=None, out=None):
    """`python -m jax_overlay doctor [--json] [--plain] [--trials N] [--calls N]`;
    returns the exit status."""
    args = add_arguments(argparse.ArgumentParser(
        prog="python -m jax_overlay doctor", description=description())).parse_args(argv)
    return run(as_json=args.json, plain=args.plain, trials=args.trials, calls=args.calls, out=out,
               json_file=args.json_file)
