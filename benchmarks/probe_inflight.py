"""Where, if anywhere, the host waits while a producer's kernel is still
running: one import, deleting an import, dispatching JAX work on it, and
many imports queued behind one busy stream.

    python benchmarks/probe_inflight.py
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import cupy as cp  # noqa: E402
import jax  # noqa: E402

import jax_overlay  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "gpu"))
from producers import WithStream, spin_fill  # noqa: E402

imp = jax_overlay.from_cuda_array_interface


def ms(t0):
    return round((time.perf_counter() - t0) * 1e3, 3)


def main():
    s = cp.cuda.Stream(non_blocking=True)
    a = cp.zeros(1 << 20, cp.float32)
    f = jax.jit(lambda v: v * 2)
    f(imp(a)).block_until_ready()  # compiled for a committed import: no compile below
    cp.cuda.Device().synchronize()
    out = {}

    spin_fill(cp.empty(1, cp.float32), 0.0, ms=500.0, stream=s)
    t0 = time.perf_counter()
    x = imp(WithStream(a, s.ptr))
    out["import while busy, ms"] = ms(t0)
    t0 = time.perf_counter()
    y = f(x)
    out["jit dispatch on it while busy, ms"] = ms(t0)
    t0 = time.perf_counter()
    del x
    out["del the import while busy, ms"] = ms(t0)
    t0 = time.perf_counter()
    del y
    gc.collect()
    out["del the jit result while busy, ms"] = ms(t0)
    out["producer still busy after these"] = not s.done
    s.synchronize()

    # The route jax_overlay does not take: PJRT's external-ready stream made
    # to wait for the producer, handed to jaxlib's import (what stock
    # jax.dlpack.from_dlpack does).  On jaxlib 0.11.2 the first jit use of
    # such an import waited ~480 ms of a 500 ms producer kernel.
    from jax_overlay import _runtime as rt
    from jax_overlay import _xla_ext as ext
    dev = jax.devices("cuda")[0]
    ready = int(dev.get_stream_for_external_ready_events())
    view = ext.parse_cai(a.__cuda_array_interface__)
    spin_fill(cp.empty(1, cp.float32), 0.0, ms=500.0, stream=s)
    ext.order_after(0, s.ptr, ready)
    x = rt.capsule_to_array(ext.capsule_from_cai(view, a, 2, 0), dev, ready, None, 2)
    t0 = time.perf_counter()
    y = f(x)
    out["external-ready route: jit dispatch on it while busy, ms"] = ms(t0)
    s.synchronize()
    del x, y

    spin_fill(cp.empty(1, cp.float32), 0.0, ms=3000.0, stream=s)
    kept, first_slow = [], None
    t_all = time.perf_counter()
    for i in range(3000):
        t0 = time.perf_counter()
        kept.append(imp(WithStream(a, s.ptr)))
        if first_slow is None and time.perf_counter() - t0 > 2e-3:
            first_slow = (i, ms(t0))
            break
    out["queued imports before one blocked (index, ms)"] = first_slow
    out["queue probe wall ms"] = ms(t_all)
    s.synchronize()
    del kept
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
