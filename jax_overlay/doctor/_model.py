"""Room: the doctor's data model and its measurements.  A Row (path, protocol,
memory, what jax_overlay promises) builds a live Case for each side, handed
to the call through a view of one protocol (CAIView, DLPackView); each side
is measured (works, zero-copy, in-flight trials, latency), then the verdict
(evaluate).  The JSON report's keys and statuses are named here."""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from typing import Callable

import numpy as np

from .. import _xla_ext as ext

SCHEMA = "jax_overlay.doctor/2"
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
    """The path does not exist (CAI on the host, a peer without the protocol)."""


@dataclasses.dataclass(frozen=True)
class Expect:
    """What jax_overlay promises for a row: None means no promise."""
    works: bool = True
    zero_copy: bool | None = True
    stream_safe: bool | None = None


@dataclasses.dataclass
class Case:
    """One live path, built afresh for each side (stock, then jax_overlay)."""
    source: object                   # the peer's array (imports) or the JAX array (exports)
    source_ptr: int                  # its data pointer
    expected: np.ndarray             # its values
    result_ptr: Callable             # the result's data pointer
    read: Callable                   # the result's NumPy values
    convert: Callable | None = None  # exports only: the consumer's call (imports: the protocol's JAX call)
    minmax: Callable | None = None   # the result's (min, max), on the GPU (by JAX, or the consumer)
    # k -> (source, context, busy): enqueues producer work that writes k everywhere and still
    # runs on return; the call runs inside `context`; busy() says whether that work still runs.
    trial: Callable | None = None
    sync: Callable = lambda: None    # waits for all the producer's work
    no_trial: str | None = None      # why there is no in-flight test
    note: str | None = None          # said in the row
    keep: object = None              # what must outlive the case (a memory pool)


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


# --- the views a call gets: one protocol only --------------------------------------

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
            with contextlib.suppress(Exception):  # a capsule we cannot read: say nothing
                self.capsule = "versioned" if ext.capsule_info(cap)["versioned"] else "legacy"
        if self.probe is not None and self.after is None:
            self.after = self.probe()
        return cap

    def __dlpack_device__(self):
        return self.obj.__dlpack_device__()


def _view(row, obj, *, probe=None, record=True):
    if row.protocol == "CAI":
        return CAIView(obj, probe)
    return DLPackView(obj, legacy=row.protocol == "DLPack legacy", probe=probe, record=record)


def _convert(row, case):
    """The user-level call: JAX's public import for imports (looked up at
    call time, so install() takes effect), the consumer's for exports."""
    if row.direction == "export":
        return case.convert
    import jax.dlpack
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
    """fn(a) for each a in `args`, each call timed on its own: (results, durations
    in ns).  Results stay alive, so none is freed inside a timed call."""
    results, durations = [], []
    clock = time.perf_counter_ns
    for a in args:
        t0 = clock()
        r = fn(a)
        durations.append(clock() - t0)
        results.append(r)
    return results, durations


def latency_us(fn, arg, calls):
    """Median of `calls` single calls fn(arg) after a warm-up, in µs."""
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
    return (False, None, trials, error) if error else (stale == 0, in_flight == 0, trials, None)


def _side(row, case, trials, calls):
    """(side record, whether the peer refused the exchange)."""
    side = dict.fromkeys(SIDE_KEYS) | {"note": case.note}
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
            (_install.install if name == "overlay" else _install.uninstall)()
            rec[name], refused[name] = _side(row, row.build(), trials, calls)
    except Skip as e:
        rec["status"], rec["reason"] = "skipped", str(e)
    except NotApplicable as e:
        rec["status"], rec["reason"] = "n/a", str(e)
    except Exception as e:  # noqa: BLE001 - a row that cannot be set up is reported
        rec["status"], rec["reason"] = "ERROR", f"setting up the row: {describe(e)}"
    finally:
        _install.uninstall()
    if rec["status"]:
        return rec
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
