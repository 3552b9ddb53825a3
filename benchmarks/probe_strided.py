"""The strided import's copy, route by route, against memcpy in the same run:
jax_overlay's kernel (the default on CUDA) and the XLA gather it replaced,
on layouts of a given size.  GB/s of bytes delivered, median of repeats.

    python benchmarks/probe_strided.py [--mib 1024] [--repeats 15] [--json F]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import cupy as cp
import jax

import jax_overlay


def seconds(fn, repeats):
    fn()
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def layouts(n):
    """name -> a CuPy view of about n float32 items delivered."""
    cols = 1024
    return {
        "a[:, ::2] (1-d, every other item)": lambda: cp.ones((n // cols, 2 * cols), cp.float32)[:, ::2],
        "a[:, :1024] of 1536 columns (rows with gaps)": lambda: cp.ones((n // cols, 1536), cp.float32)[:, :cols],
        "a[:, ::2] of 2049 columns (2-d)": lambda: cp.ones((n // cols, 2049), cp.float32)[:, :2048:2],
        "a.T[::2] (transposed slice)": lambda: cp.ones((2 * cols, n // cols), cp.float32).T[:, ::2],
        "a[::2, :3] (3-item rows)": lambda: cp.ones((2 * (n // 3), 3), cp.float32)[::2],
        "misaligned 1-d (bytes)": lambda: cp.ones(n + 1, cp.float32)[1:],
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--json")
    args = ap.parse_args()
    n = args.mib * 2**20 // 4
    src = cp.ones(n, cp.float32)
    dst = cp.empty_like(src)

    def memcpy():
        cp.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, n * 4,
                                    cp.cuda.runtime.memcpyDeviceToDevice, 0)
        cp.cuda.runtime.streamSynchronize(0)

    d2d = n * 4 / seconds(memcpy, args.repeats) / 1e9
    del src, dst
    print(f"{jax.devices()[0].device_kind}, {args.mib} MiB delivered; memcpy {d2d:.0f} GB/s")
    rows = {"memcpy_gbps": d2d, "layouts": {}}
    for name, make in layouts(n).items():
        v = make()
        size = v.size * 4
        got = {}
        for route, on in (("kernel", True), ("gather", False)):
            jax_overlay.config.strided_kernel = on
            try:
                def run():
                    jax_overlay.from_cuda_array_interface(v).block_until_ready()
                got[route] = size / seconds(run, args.repeats) / 1e9
            except Exception as err:  # noqa: BLE001
                got[route] = None
                print(f"  {name}: {route} failed: {type(err).__name__}: {err}"[:300])
            finally:
                jax_overlay.config.strided_kernel = True
        rows["layouts"][name] = got
        print(f"  {name:46s} kernel {got['kernel'] or 0:7.0f} GB/s ({(got['kernel'] or 0) / d2d:4.0%})"
              f"   gather {got['gather'] or 0:7.0f} GB/s ({(got['gather'] or 0) / d2d:4.0%})")
        del v
        cp.get_default_memory_pool().free_all_blocks()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
