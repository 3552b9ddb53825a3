"""Where, if anywhere, the host waits while a producer's kernel is still
running: one import, deleting an import, dispatching JAX work on it, and
many imports queued behind one busy stream.

    python benchmarks/probe_inflight.py [--json FILE]
"""

from __future__ import annotations

import gc
import json

import harness  # first: XLA's allocator setting, before jax loads

import cupy as cp
import jax

import jax_overlay
from _cai import WithStream
from _internals import _runtime as rt, _xla_ext as ext, spin_fill

imp = jax_overlay.from_cuda_array_interface
ms = harness.since_ms


def main():
    args = harness.arguments(__doc__, json_file=True).parse_args()
    s = cp.cuda.Stream(non_blocking=True)
    a = cp.zeros(1 << 20, cp.float32)
    f = jax.jit(lambda v: v * 2)
    f(imp(a)).block_until_ready()  # compiled for a committed import: no compile below
    cp.cuda.Device().synchronize()
    out = {}

    spin_fill(cp.empty(1, cp.float32), 0.0, ms=500.0, stream=s)
    t0 = harness.clock()
    x = imp(WithStream(a, s.ptr))
    out["import while busy, ms"] = ms(t0)
    t0 = harness.clock()
    y = f(x)
    out["jit dispatch on it while busy, ms"] = ms(t0)
    t0 = harness.clock()
    del x
    out["del the import while busy, ms"] = ms(t0)
    t0 = harness.clock()
    del y
    gc.collect()
    out["del the jit result while busy, ms"] = ms(t0)
    out["producer still busy after these"] = not s.done
    s.synchronize()

    # The route jax_overlay does not take: PJRT's external-ready stream made
    # to wait for the producer, handed to jaxlib's import (what stock
    # jax.dlpack.from_dlpack does).  On jaxlib 0.11.2 the first jit use of
    # such an import waited ~480 ms of a 500 ms producer kernel.
    dev = jax.devices("cuda")[0]
    ready = int(dev.get_stream_for_external_ready_events())
    view = ext.parse_cai(a.__cuda_array_interface__)
    spin_fill(cp.empty(1, cp.float32), 0.0, ms=500.0, stream=s)
    ext.order_after(0, s.ptr, ready)
    x = rt.capsule_to_array(ext.capsule_from_cai(view, a, 2, 0), dev, ready, None, 2)
    t0 = harness.clock()
    y = f(x)
    out["external-ready route: jit dispatch on it while busy, ms"] = ms(t0)
    s.synchronize()
    del x, y

    spin_fill(cp.empty(1, cp.float32), 0.0, ms=3000.0, stream=s)
    kept, first_slow = [], None
    t_all = harness.clock()
    for i in range(3000):
        t0 = harness.clock()
        kept.append(imp(WithStream(a, s.ptr)))
        if first_slow is None and harness.clock() - t0 > 2_000_000:
            first_slow = (i, ms(t0))
            break
    out["queued imports before one blocked (index, ms)"] = first_slow
    out["queue probe wall ms"] = ms(t_all)
    s.synchronize()
    del kept
    print(json.dumps(out, indent=1))
    harness.save(args.json, dict(out, meta=harness.meta()))


if __name__ == "__main__":
    main()
