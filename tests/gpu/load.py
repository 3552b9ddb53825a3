"""Another process keeping the GPU busy, as in production: 8192 x 8192
float32 matmuls in a loop on a CuPy stream of its own, two in flight at a
time so the GPU never idles between them.

    python tests/gpu/load.py [--seconds S] [--n 8192]

Prints "ready" (flushed) once the first matmul has finished, then runs
until S seconds have passed, its parent has died, or it is killed.  The
GPU suite's `gpu_load` fixture and the probes start it; nothing here
imports jax_overlay."""

from __future__ import annotations

import argparse
import os
import sys
import time


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=3600.0)
    p.add_argument("--n", type=int, default=8192)
    args = p.parse_args()
    import cupy as cp

    parent = os.getppid()
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        a = cp.random.random((args.n, args.n), dtype=cp.float32)
        b = cp.random.random((args.n, args.n), dtype=cp.float32)
        c = [cp.empty_like(a), cp.empty_like(a)]
        cp.matmul(a, b, out=c[0])
        stream.synchronize()
    print("ready", flush=True)
    deadline = time.monotonic() + args.seconds
    done = [stream.record(), stream.record()]
    i = 0
    with stream:
        while time.monotonic() < deadline and os.getppid() == parent:
            # The matmul two back has finished before the next is queued:
            # two in flight, so the GPU always has the next one.
            done[i % 2].synchronize()
            cp.matmul(a, b, out=c[i % 2])
            done[i % 2] = stream.record()
            i += 1
    stream.synchronize()
    print(f"matmuls {i}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
