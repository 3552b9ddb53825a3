"""GPU producers for the suite: CuPy, Numba and PyTorch arrays, a kernel that
keeps a stream busy and then writes, and CAI wrappers with chosen streams."""

from __future__ import annotations

import cupy as cp

SPIN_SRC = r"""
extern "C" __global__ void spin_fill(float* out, long long n, long long cycles, float value) {
  long long start = clock64();
  while (clock64() - start < cycles) { }
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
       i += (long long)blockDim.x * gridDim.x) {
    out[i] = value;
  }
}
"""
_spin = cp.RawKernel(SPIN_SRC, "spin_fill")
CLOCK_HZ = 1.98e9  # H200 boost clock; only sizes the delay, never a result


def spin_fill(arr, value, *, ms=1.0, stream=None):
    """Enqueues on `stream`: wait about `ms` on the GPU, then arr[:] = value."""
    n = arr.size
    stream = stream or cp.cuda.get_current_stream()
    with stream:
        _spin((min(1024, (n + 255) // 256),), (256,),
              (arr, cp.int64(n), cp.int64(int(ms * 1e-3 * CLOCK_HZ)), cp.float32(value)))


class WithStream:
    """Re-exports another array's CAI with a chosen v3 stream."""

    def __init__(self, base, stream):
        self.base = base
        self.cai = dict(base.__cuda_array_interface__, version=3, stream=stream)

    @property
    def __cuda_array_interface__(self):
        return self.cai


STREAMS = {
    "legacy": lambda: (cp.cuda.Stream.null, 1),
    "per_thread": lambda: (cp.cuda.Stream.ptds, 2),
    "user": lambda: ((s := cp.cuda.Stream(non_blocking=True)), s.ptr),
}
