"""Why an idle import costs more in the "idle vs in flight" table than in
the latency matrix: the same calls, timed side by side in one process, on
CuPy's default stream and on a user stream, inside and outside the stream's
context, split into the producer's property, the native plan and jaxlib's
import.

    python benchmarks/probe_stream_cost.py [--json out.json]
"""

from __future__ import annotations

import sys

import harness  # first: XLA's allocator setting, before jax loads

sys.path.insert(0, harness.ROOT)  # this tree's jax_overlay, as run_all.py measures it

import cupy as cp  # noqa: E402

import jax_overlay  # noqa: E402
from _internals import _runtime as rt, _xla_ext as ext  # noqa: E402


def median_us(fn, arg):
    harness.warm(fn, arg)
    return round(harness.median_us(fn, arg), 2)


def main(argv=None):
    args = harness.arguments(__doc__, json_file=True).parse_args(argv)
    a = cp.arange(1 << 20, dtype=cp.float32)
    s = cp.cuda.Stream(non_blocking=True)
    dev = rt.gpu_device(a.device.id)
    compute = rt.compute_stream(dev)
    cai_legacy = a.__cuda_array_interface__
    with s:
        cai_user = a.__cuda_array_interface__
    out = {"streams": {"legacy": cai_legacy["stream"], "user": cai_user["stream"]}}
    cases = {
        "CuPy a.__cuda_array_interface__": (lambda o: o.__cuda_array_interface__, lambda: a),
        "plan_cai_import (stream 1)": (lambda c: ext.plan_cai_import(c, a, False), lambda: cai_legacy),
        "plan_cai_import (user stream)": (lambda c: ext.plan_cai_import(c, a, False), lambda: cai_user),
        "order_after (legacy, idle)": (lambda h: ext.order_after(a.device.id, h, compute), lambda: 1),
        "order_after (user, idle)": (lambda h: ext.order_after(a.device.id, h, compute), lambda: s.ptr),
        "from_cuda_array_interface(a), default stream": (jax_overlay.from_cuda_array_interface, lambda: a),
        "from_dlpack(a), default stream": (jax_overlay.from_dlpack, lambda: a),
        "CuPy a.__dlpack__(compute), default stream": (
            lambda o: o.__dlpack__(stream=compute, max_version=(1, 1)), lambda: a),
    }
    for name, (fn, arg) in cases.items():
        out[name] = median_us(fn, arg)
    with s:
        for name, fn in {
                "from_cuda_array_interface(a), in the user stream's context": jax_overlay.from_cuda_array_interface,
                "from_dlpack(a), in the user stream's context": jax_overlay.from_dlpack,
                "CuPy a.__dlpack__(compute), in the user stream's context":
                    lambda o: o.__dlpack__(stream=compute, max_version=(1, 1)),
                "CuPy a.__cuda_array_interface__, in the user stream's context":
                    lambda o: o.__cuda_array_interface__}.items():
            out[name] = median_us(fn, lambda: a)
    print(harness.listing(out, ("case", "us")))
    out["meta"] = harness.meta()
    harness.save(args.json, out)


if __name__ == "__main__":
    main()
