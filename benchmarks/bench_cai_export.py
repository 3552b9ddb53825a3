"""Median cost of the CAI export: the property and `cupy.asarray(jax_array)`
end to end, stock JAX vs jax_overlay, in one process.

    python benchmarks/bench_cai_export.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import cupy as cp  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

import jax_overlay  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from bench_cai_import import REPEATS, ROUNDS, median_us as timed  # noqa: E402


def median_us(fn, make_arg):
    return round(timed(fn, make_arg), 2)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    args = p.parse_args()
    x = jnp.arange(1 << 20, dtype=jnp.float32)
    x.block_until_ready()
    res = {}
    prop = lambda a: a.__cuda_array_interface__  # noqa: E731
    res["stock property (ready)"] = median_us(prop, lambda: x)
    res["stock cupy.asarray(jax) (ready)"] = median_us(cp.asarray, lambda: x)
    jax_overlay.install()
    res["jax_overlay property (ready)"] = median_us(prop, lambda: x)
    res["jax_overlay cupy.asarray(jax) (ready)"] = median_us(cp.asarray, lambda: x)

    @jax.jit
    def very_slow(v):
        return lax.fori_loop(0, 200000, lambda i, v: jnp.sqrt(v * v + 1.0) - 0.5, v)

    very_slow(x).block_until_ready()
    y = very_slow(x)  # seconds of GPU work: every export below finds it pending
    res["jax_overlay property (computation in flight)"] = median_us(prop, lambda: y)
    res["array still pending after the in-flight exports"] = not y.is_ready()
    y.block_until_ready()
    jax_overlay.uninstall()
    from jax_overlay import _exports
    from jax_overlay import _xla_ext as ext
    ptr = x.unsafe_buffer_pointer()
    floors = {
        "floor: x.unsafe_buffer_pointer()": lambda a: a.unsafe_buffer_pointer(),
        "floor: memory_kind(ptr)": lambda a: ext.memory_kind(ptr),
        "floor: x.is_ready()": lambda a: a.is_ready(),
        "floor: x.dtype": lambda a: a.dtype,
        "floor: x.shape": lambda a: a.shape,
        "floor: layout -> strides": lambda a: _exports._strides(a, 4),
        "floor: x._pjrt_layout": lambda a: getattr(a, "_pjrt_layout", None),
    }
    for name, fn in floors.items():
        res[name] = median_us(fn, lambda: x)
    res["has _pjrt_layout"] = hasattr(x, "_pjrt_layout")
    meta = {"gpu": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
            "jax": jax.__version__, "cupy": cp.__version__,
            "statistic": f"median of {ROUNDS} round means of {REPEATS} calls, us"}
    for k, v in res.items():
        print(f"{k:<50} {v}")
    print(json.dumps(meta))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results_us": res}, f, indent=2)


if __name__ == "__main__":
    main()
