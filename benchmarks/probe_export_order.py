"""Exports to a consumer's own stream, ordered two ways, under the GPU
stress's export trials (benchmarks/stress_gpu.py):

* jaxlib: jaxlib's DLPack export with the consumer's stream (PJRT makes that
  stream wait for the array's definition event), what jax_overlay did first;
* ours: jax_overlay's order_stream_after: jaxlib's export with XLA's compute
  stream (it returns once the definition event is recorded, so the
  computation is enqueued), then an event recorded on the compute stream
  that the consumer's stream waits for.

    python benchmarks/probe_export_order.py --path dlpack_export_cupy --order jaxlib [--trials N]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
_spec = importlib.util.spec_from_file_location("stress_gpu", os.path.join(HERE, "stress_gpu.py"))
stress = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(stress)


def jaxlib_direct(x, stream):
    from jax._src.lib import _jax
    return _jax.buffer_to_dlpack_managed_tensor(x, stream=stream)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--path", required=True)
    p.add_argument("--order", choices=["jaxlib", "ours"], required=True)
    p.add_argument("--trials", type=int, default=10_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json")
    args = p.parse_args(argv)
    from jax_overlay import _runtime as rt
    if args.order == "jaxlib":
        rt.order_stream_after = jaxlib_direct
    report = stress.run(args.trials, args.seed, paths=[args.path], controls=0,
                        log=lambda *a: print(*a, file=sys.stderr, flush=True))
    r = report["paths"].get(args.path, {})
    print(args.path, args.order, {k: v for k, v in r.items() if k not in ("bad_trials",)})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"order": args.order, **report}, f, indent=1)


if __name__ == "__main__":
    main()
