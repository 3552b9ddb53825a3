"""Where the blocked training step's time goes (issue 40): the MLP step of
bench_train_step.py (value_and_grad + SGD, one step at a time, waited for)
for JAX, foreign replay (the saved tensors as residuals) and foreign
replay recompute, each under PyTorch's profiler (CUPTI): per step, the
GPU's kernels and copies (count, and the time they ran), and the step's
wall time, so that what is not the GPU's work (launch, host, waits) is
the difference.  Names of the ten costliest GPU operations per case.

    python benchmarks/probe_train_step.py [--steps 50] [--json FILE]

Needs a GPU; XLA_FLAGS gets --xla_gpu_graph_min_graph_size=1 (as the
bench), for every case."""

from __future__ import annotations

import collections
import os
import sys
import time

import harness  # first: XLA's allocator setting, before jax loads

harness.graph_small_programs()

import jax  # noqa: E402
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import bench_train_step  # noqa: E402

CASES = ("jax", "foreign replay", "foreign replay recompute")


def gpu_events(prof):
    """The profile's GPU operations: (name, µs) for each kernel, copy and
    set, from the trace's device-side events."""
    out = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out.append((e.name, e.time_range.elapsed_us()))
    return out


def main():
    p = harness.arguments(__doc__, json_file=True)
    p.add_argument("--steps", type=int, default=50)
    args = p.parse_args()
    if jax.devices()[0].platform != "gpu":
        sys.exit("probe_train_step needs a GPU")
    made = bench_train_step.cases(128, 256, 512, check=False)
    res: dict = {}
    for name in CASES:
        step = made[name]
        for _ in range(20):  # traces, compiles
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step()
            wall = (time.perf_counter() - t0) / args.steps * 1e6
        events = gpu_events(prof)
        busy = sum(us for _, us in events) / args.steps
        by_name: collections.Counter = collections.Counter()
        count: collections.Counter = collections.Counter()
        for n, us in events:
            by_name[n] += us / args.steps
            count[n] += 1
        res[name] = {
            "wall_us_per_step": wall, "gpu_ops_per_step": len(events) / args.steps,
            "gpu_busy_us_per_step": busy, "not_gpu_us_per_step": wall - busy,
            "top": [(n[:90], round(us, 2), count[n] / args.steps)
                    for n, us in by_name.most_common(10)]}
    meta = harness.meta()
    lines = [f"# MLP 256-512-10 step, blocked, {args.steps} steps under PyTorch's profiler "
             f"(CUPTI; its own cost is in the wall time); {meta.get('device')}, "
             f"jax {jax.__version__}, torch {torch.__version__}, "
             f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}",
             harness.table(["case", "wall us", "GPU ops", "GPU busy us", "rest us"], [
                 (k, f"{v['wall_us_per_step']:.1f}", f"{v['gpu_ops_per_step']:.1f}",
                  f"{v['gpu_busy_us_per_step']:.1f}", f"{v['not_gpu_us_per_step']:.1f}")
                 for k, v in res.items()])]
    for k, v in res.items():
        lines.append(f"\n{k}: the ten costliest GPU operations, µs per step (count per step)")
        lines += [f"  {us:8.2f}  {c:5.1f}x  {n}" for n, us, c in v["top"]]
    print("\n".join(lines))
    if args.json:
        harness.save(args.json, {"results": res, "meta": meta})


if __name__ == "__main__":
    main()
