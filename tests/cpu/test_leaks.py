"""Leak checks: many import/export round trips on the CPU with the process's
resident memory stable and every producer's reference count back to where
it started.

Rounds: JAX_OVERLAY_LEAK_ROUNDS per path (CI: 10,000; the dedicated run in
tools/leaks.sh: 100,000).  Exact checks first: every native tensor released
(ext.live_tensors()) and the producer's refcount back to its baseline.  Then
resident memory (/proc/self/statm): each path runs a warm-up and half its
rounds, then the second half, which may grow RSS by at most RSS_SLACK.  A
leak grows linearly in both halves; caches and allocator arenas fill up and
stop (the first ~100,000 jaxlib imports in a pytest process grow RSS by
~17 MiB, then nothing: the module fixture gets past that before measuring).
Every round allocates (a capsule, a JAX array, for the copy paths a fresh
64x64 buffer), so a leak of any of them shows.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import sys

import jax
import numpy as np
import pytest

import jax_overlay
from jax_overlay import _dlpack as E
import forge as T
from jax_overlay import _xla_ext as ext

ROUNDS = int(os.environ.get("JAX_OVERLAY_LEAK_ROUNDS") or 10_000)
WARMUP = 1000
# Second-half growth allowed: allocator noise measured 0-0.2 MiB here; a
# leaked 16 KiB copy per round passes it within 512 rounds.
RSS_SLACK = 4 << 20
CPU = jax.devices("cpu")[0]
# Under AddressSanitizer (tools/sanitize.sh preloads it) freed memory waits in
# ASan's quarantine, so resident memory moves by tens of MiB either way and
# says nothing about leaks: there only the exact checks apply.
with open("/proc/self/maps") as _maps:
    UNDER_ASAN = "libasan" in _maps.read()


def rss_bytes():
    """Resident memory after a full collection: what no collection can give
    back.  Without one, garbage waiting for the oldest generation counts too:
    stock jaxlib's `x.is_ready()` on a CPU array (0.12.0.1) grows RSS by about
    48 B a call until a full collection frees it, and a CAI export of a host
    array calls it every time."""
    gc.collect()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


class LegacyProducer:
    """A DLPack producer that predates max_version: the legacy capsule path."""

    def __init__(self, array):
        self.array = array

    def __dlpack__(self, *, stream=None, **kwargs):
        if kwargs:
            raise TypeError("__dlpack__() got an unexpected keyword argument")
        return self.array.__dlpack__(stream=stream)

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


def data(shape=(64, 64)):
    a = T.aligned_empty(shape, np.float32)
    a[...] = np.arange(a.size, dtype=np.float32).reshape(shape)
    return a


def cai_view():
    """CAI import, zero-copy view of host memory."""
    producer = T.HostCAI(data())
    return producer, producer.array, lambda: T.import_host(producer)


def cai_copy():
    """CAI import of a strided array: one XLA gather into a fresh buffer."""
    base = data((64, 128))
    view = base[:, ::2]
    producer = T.HostCAI(view, strides=view.strides)
    return producer, view, lambda: T.import_host(producer)


def dlpack_versioned():
    """DLPack import of a NumPy array, which answers max_version=(1, 1)
    with a versioned capsule."""
    producer = data()
    return producer, producer, lambda: jax_overlay.from_dlpack(producer)


def dlpack_legacy():
    producer = LegacyProducer(data())
    return producer, producer.array, lambda: jax_overlay.from_dlpack(producer)


def dlpack_copy():
    """DLPack import with copy=True: a fresh buffer each round."""
    producer = data()
    return producer, producer, lambda: jax_overlay.from_dlpack(producer, copy=True)


def dlpack_export():
    """to_dlpack of a JAX array, consumed by NumPy (a versioned capsule)."""
    x = jax.device_put(data(), CPU)
    x.block_until_ready()
    want = np.asarray(x).copy()

    def round_trip():
        return np.from_dlpack(T.DLPackHolder(E.to_dlpack(x, max_version=(1, 1))))

    return x, want, round_trip


def cai_export():
    """The CAI dict of a JAX array, imported back (the host path reads it)."""
    x = jax.device_put(data(), CPU)
    x.block_until_ready()
    want = np.asarray(x).copy()

    class Holder:
        def __init__(self):
            self.__cuda_array_interface__ = T.host_cai(x)
            self.x = x  # the exporter's rule: hold the exporting object

    def round_trip():
        return T.import_host(Holder())

    return x, want, round_trip


PATHS = [cai_view, cai_copy, dlpack_versioned, dlpack_legacy, dlpack_copy,
         dlpack_export, cai_export]


@pytest.fixture(scope="module", autouse=True)
def past_the_plateau():
    """jaxlib's first imports in a process grow RSS up to a plateau (see the
    module docstring): get there before any path is measured."""
    p = T.HostCAI(data())
    for _ in range(150_000):
        T.import_host(p)
    gc.collect()


@pytest.mark.parametrize("path", PATHS, ids=[p.__name__ for p in PATHS])
def test_round_trips_do_not_leak(path):
    producer, want, round_trip = path()
    want = np.asarray(want).copy()

    def rounds(n):
        for i in range(n):
            out = round_trip()
            if i % 1000 == 0:  # correctness on the way, not only at the end
                np.testing.assert_array_equal(np.asarray(out), want)
            del out

    def released():
        # A copy's source is released by XLA's thread once the copy is done.
        return sys.getrefcount(producer) == refs and ext.live_tensors() == live

    gc.collect()
    refs, live = sys.getrefcount(producer), ext.live_tensors()
    rounds(WARMUP)
    T.settle(released, "not released after the warm-up")
    rss0 = rss_bytes()
    rounds(ROUNDS // 2)
    T.settle(released, "not released after the first half")
    rss1 = rss_bytes()
    rounds(ROUNDS - ROUNDS // 2)
    T.settle(released, "not released after the second half")
    rss2 = rss_bytes()
    report = {"path": path.__name__, "rounds": ROUNDS, "rss_growth_bytes": rss2 - rss1,
              "rss_growth_first_half_bytes": rss1 - rss0,
              "producer_refcount_delta": sys.getrefcount(producer) - refs,
              "live_tensor_delta": ext.live_tensors() - live}
    if os.environ.get("JAX_OVERLAY_LEAK_REPORT"):
        with open(os.environ["JAX_OVERLAY_LEAK_REPORT"], "a") as f:
            f.write(json.dumps(report) + "\n")
    if not UNDER_ASAN:
        assert report["rss_growth_bytes"] <= RSS_SLACK, report
