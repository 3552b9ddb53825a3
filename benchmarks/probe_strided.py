"""The strided import's copy, route by route, against memcpy in the same run:
jax_overlay's kernel (the default on CUDA) and the XLA gather it replaced,
on layouts of a given size.  GB/s of bytes delivered, median of repeats:

* kernel alone: the kernel launched outside XLA exactly as the custom call
  launches it, timed with CUDA events (what the copy itself costs);
* synchronised: one import, then block_until_ready, as run_all times copies;
* pipelined: 8 imports back to back, then one wait (memcpy likewise), so
  that one completion wait is spread over 8 copies.

    python benchmarks/probe_strided.py [--mib 1024] [--repeats 15] [--json F]
"""

from __future__ import annotations

import harness  # first: XLA's allocator setting, before jax loads

import cupy as cp
import jax

import jax_overlay
from _internals import _strided, _view, _vocab, _xla_ext as ext

PIPELINE = 8


def kernel_alone(v, repeats):
    """GB/s of the kernel by itself on CuPy view `v` (float32), or None
    when the kernel does not take the layout."""
    spec = ext.parse_cai(v.__cuda_array_interface__)  # the layout the import sees
    item = spec.itemsize
    strides = spec.strides if spec.strides is not None else _view._row_major(v.shape)
    base, count, unit, offset = _strided.plan(spec.data, spec.low, spec.span, item, 0,
                                              _vocab.GPU_ALIGNMENT)
    plan = _strided.kernel_plan(v.shape, [s * (item // unit) for s in strides], offset, item, unit)
    if plan is None:
        return None
    out = cp.empty(v.shape, v.dtype)
    stream = cp.cuda.Stream(non_blocking=True)
    cp.cuda.Device().synchronize()
    took = harness.event_seconds(
        lambda s: ext.launch_strided_copy(plan, count, out.data.ptr, base, s.ptr), stream, repeats)
    if not bool(cp.array_equal(out, v)):
        raise AssertionError("the kernel alone copied wrong data")
    return v.size * item / took / 1e9


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
    ap = harness.arguments(__doc__, json_file=True, repeats=15)
    ap.add_argument("--mib", type=int, default=1024)
    args = ap.parse_args()
    n = args.mib * 2**20 // 4
    src = cp.ones(n, cp.float32)
    dst = cp.empty_like(src)

    def memcpy(times=1):
        for _ in range(times):
            cp.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, n * 4,
                                        cp.cuda.runtime.memcpyDeviceToDevice, 0)
        cp.cuda.runtime.streamSynchronize(0)

    d2d = n * 4 / harness.seconds(memcpy, args.repeats) / 1e9
    d2d_pipe = PIPELINE * n * 4 / harness.seconds(lambda: memcpy(PIPELINE), args.repeats) / 1e9
    del src, dst
    print(f"{jax.devices()[0].device_kind}, {args.mib} MiB delivered; memcpy {d2d:.0f} GB/s "
          f"synchronised, {d2d_pipe:.0f} GB/s pipelined ({PIPELINE} then one wait)")
    rows = {"memcpy_gbps": d2d, "memcpy_pipelined_gbps": d2d_pipe, "layouts": {}}
    imp = jax_overlay.from_cuda_array_interface
    for name, make in layouts(n).items():
        v = make()
        size = v.size * 4
        got = {"kernel alone": kernel_alone(v, args.repeats)}
        for route, on in (("kernel", True), ("gather", False)):
            jax_overlay.config.strided_kernel = on
            try:
                def one():
                    imp(v).block_until_ready()

                def pipelined():
                    for x in [imp(v) for _ in range(PIPELINE)]:
                        x.block_until_ready()
                got[route] = size / harness.seconds(one, args.repeats) / 1e9
                got[route + " pipelined"] = PIPELINE * size / harness.seconds(pipelined, args.repeats) / 1e9
            except Exception as err:  # noqa: BLE001
                got[route] = got[route + " pipelined"] = None
                print(f"  {name}: {route} failed: {type(err).__name__}: {err}"[:300])
            finally:
                jax_overlay.config.strided_kernel = True
        rows["layouts"][name] = got

        def pct(key, ref):
            return f"{got[key] or 0:6.0f} ({(got[key] or 0) / ref:4.0%})"
        print(f"  {name}\n    kernel alone {pct('kernel alone', d2d)}; synchronised: kernel "
              f"{pct('kernel', d2d)}, gather {pct('gather', d2d)}; pipelined: kernel "
              f"{pct('kernel pipelined', d2d_pipe)}, gather {pct('gather pipelined', d2d_pipe)}")
        del v
        cp.get_default_memory_pool().free_all_blocks()
    rows["meta"] = harness.meta()
    harness.save(args.json, rows)


if __name__ == "__main__":
    main()
