"""Room: the doctor's probes.  What this machine has (the report's
environment: versions, libcuda, the NVIDIA driver, JAX's devices), what a
row needs (a GPU, a peer), the host rows (NumPy into JAX and JAX out to
NumPy, on the CPU backend), and producers still busy when their array
changes hands, for the GPU rows, tests and benchmarks: a CuPy kernel that
keeps a stream busy then writes, PyTorch's sleep, a JAX computation still
running after dispatch.  CuPy and PyTorch are imported on first use."""

from __future__ import annotations

import contextlib
import functools
import importlib
import platform
import re
import subprocess

import jax
import jax.numpy as jnp
from jax import lax

import numpy as np

from ..peers import cupy as _cupy_peer
from ._model import (CAI_ON_HOST, HOST_NO_STREAM, Case, Expect, Row, Skip, describe,
                     not_applicable)


def _gpu_peers():
    """The registered peers but NumPy (listed on its own): the environment's versions."""
    from ..peers import REGISTRY
    return [p for name, p in REGISTRY.items() if name != "numpy"]


ENV_KEYS = ("jax_overlay", "python", "platform", "numpy", "jax", "jaxlib",
            "jax_cuda_plugin", *(p.name for p in _gpu_peers()), "libcuda",
            "cuda_driver_api", "nvidia_driver", "devices", "gpu",
            "jax_overlay_installed")


@functools.cache
def gpu_skip_reason():
    """None when GPU rows can run (libcuda and a JAX CUDA backend), else why not."""
    from .. import _xla_ext as ext
    try:
        ext.load_driver()
    except BufferError as e:
        return f"no GPU: {e}"
    try:
        jax.devices("cuda")
    except Exception as e:  # noqa: BLE001 - any failure means no CUDA backend
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return f"no GPU: JAX has no CUDA backend ({first})"
    return None


def need_gpu():
    if gpu_skip_reason():
        raise Skip("no GPU")


def need(module):
    """The module, or Skip saying it is not installed (or not usable)."""
    top = module.split(".")[0]
    try:
        return importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - not installed, or it fails on import
        missing = isinstance(e, ModuleNotFoundError) and e.name and e.name.split(".")[0] == top
        raise Skip(f"{top} not installed" if missing else f"{top} not usable: {describe(e)}") from None


def _distributions():
    """{normalised distribution name: version} of what is installed."""
    from importlib import metadata
    out: dict[str, str] = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            out.setdefault(re.sub(r"[-_.]+", "-", name).lower(), dist.version)
    return out


def nvidia_driver():
    """The NVIDIA kernel driver's version, or None."""
    with contextlib.suppress(OSError), open("/proc/driver/nvidia/version") as f:
        m = re.search(r"Kernel Module\s+(?:for \S+\s+)?(\d[\w.]*)", f.read())
        if m:
            return m.group(1)
    try:
        p = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20)
        return p.stdout.split()[0] if p.returncode == 0 and p.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def environment():
    import jaxlib
    from .. import __version__
    from .. import _install
    from .. import _xla_ext as ext
    dists = _distributions()

    def version(name, prefix=None):
        if name in dists:
            return dists[name]
        hits = sorted(n for n in dists if prefix and n.startswith(prefix))
        return f"{dists[hits[0]]} ({hits[0]})" if hits else None

    plugins = sorted(n for n in dists if re.fullmatch(r"jax-cuda\d+-(plugin|pjrt)", n))
    env = {
        "jax_overlay": __version__,
        "python": platform.python_version(), "platform": platform.platform(terse=True),
        "numpy": np.__version__, "jax": jax.__version__, "jaxlib": jaxlib.__version__,
        "jax_cuda_plugin": ", ".join(f"{n} {dists[n]}" for n in plugins) or None,
        # A peer's distribution, or a build of it named after it ("cupy-cuda13x").
        **{p.name: version(p.distribution, prefix=p.distribution + "-") for p in _gpu_peers()},
        "libcuda": None, "cuda_driver_api": None,
        "nvidia_driver": nvidia_driver(), "devices": [], "gpu": gpu_skip_reason(),
        "jax_overlay_installed": _install.installed(),
    }
    if version("numba-cuda") and "numba" in env:
        env["numba"] = f"{env['numba']} (numba-cuda {version('numba-cuda')})"
    try:
        ext.load_driver()
        api = ext.driver_version()
        env["libcuda"] = f"loaded, {ext.device_count()} device(s)"
        env["cuda_driver_api"] = f"{api // 1000}.{api % 1000 // 10}"
    except BufferError as e:
        env["libcuda"] = f"not loaded: {e}"
    for backend in ("cpu", "cuda"):
        with contextlib.suppress(Exception):
            env["devices"] += [{"platform": d.platform, "id": d.id, "kind": d.device_kind}
                               for d in jax.devices(backend)]
    return env


# --- the host rows ----------------------------------------------------------------

def jax_ptr(x):
    return x.unsafe_buffer_pointer()


def aligned_empty(shape, dtype, alignment=256):
    """An empty NumPy array whose data starts `alignment`-byte aligned (JAX's
    CPU client views only aligned host memory)."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape)) * dtype.itemsize
    buf = np.empty(n + alignment, np.uint8)
    off = (-buf.ctypes.data) % alignment
    return buf[off:off + n].view(dtype).reshape(shape)


def _cpu_device():
    try:
        return jax.devices("cpu")[0]
    except RuntimeError as e:
        raise Skip(f"JAX has no CPU backend here ({describe(e)})") from None


def _numpy_source(memory):
    """A NumPy array (aligned, as JAX's CPU client wants for a view)."""
    _cpu_device()
    a = aligned_empty((64, 32), np.float32)
    a[...] = np.arange(a.size, dtype=np.float32).reshape(a.shape)
    src = a[:, ::2] if memory == "host, strided" else a
    if memory == "host, read-only":
        a.flags.writeable = False
    return Case(source=src, source_ptr=src.ctypes.data, expected=np.array(src),
                result_ptr=jax_ptr, read=np.asarray, no_trial=HOST_NO_STREAM)


def _jax_on_cpu():
    host = np.arange(2048, dtype=np.float32).reshape(64, 32)
    x = jax.device_put(host, _cpu_device())
    x.block_until_ready()
    return Case(source=x, source_ptr=x.unsafe_buffer_pointer(), expected=host,
                convert=np.from_dlpack, result_ptr=lambda a: a.ctypes.data,
                read=np.asarray, no_trial=HOST_NO_STREAM)


def host_rows():
    dlpack = ("DLPack legacy", "DLPack 1.x")
    return [*(Row("import", "NumPy", p, memory, "jax.dlpack.from_dlpack(a)",
                  functools.partial(_numpy_source, memory), Expect(zero_copy=memory != "host, strided"))
              for memory in ("host", "host, read-only", "host, strided") for p in dlpack),
            Row("import", "NumPy", "CAI", "host", "jnp.asarray(a)", not_applicable(CAI_ON_HOST), None),
            *(Row("export", "NumPy", p, "host", "np.from_dlpack(x)", _jax_on_cpu) for p in dlpack),
            Row("export", "NumPy", "CAI", "host", "np.asarray(x)", not_applicable(CAI_ON_HOST), None)]


# --- busy producers ---------------------------------------------------------------

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
CLOCK_HZ = 1.98e9  # H200 boost clock; only sizes the delay, never a result
JAX_N = 1 << 22


@functools.cache
def _spin():
    import cupy as cp
    return cp.RawKernel(SPIN_SRC, "spin_fill")


def cycles(ms):
    """GPU clock cycles in about `ms` milliseconds."""
    return int(ms * 1e-3 * CLOCK_HZ)


def spin_fill(arr, value, *, ms=1.0, stream=None):
    """Enqueues on `stream` (a CuPy stream; default the current one), after
    the legacy stream's work: wait about `ms` on the GPU, then
    arr[:] = value.  `arr`: contiguous float32."""
    import cupy as cp
    n = arr.size
    stream = stream or cp.cuda.get_current_stream()
    if stream.ptr not in (0, 1):
        # After what the legacy stream still has to do to `arr` (CuPy
        # allocates and zeroes on it): a non-blocking stream does not wait
        # for it, and under load the zeroing landed after the write.
        done = cp.cuda.Event(disable_timing=True)
        done.record(cp.cuda.Stream.null)
        stream.wait_event(done)
    with stream:
        _spin()((min(1024, (n + 255) // 256),), (256,),
                (arr, cp.int64(n), cp.int64(cycles(ms)), cp.float32(value)))


def torch_sleep(ms, stream):
    """Enqueues about `ms` of GPU sleep on a PyTorch stream."""
    import torch
    with torch.cuda.stream(stream):
        torch.cuda._sleep(cycles(ms))


@functools.partial(jax.jit, static_argnums=2)
def jax_busy(k, start, steps):
    """`steps` passes over `start` (laid out as it is), then `k` everywhere."""
    v = lax.fori_loop(0, steps, lambda i, v: jnp.sqrt(v * v + 1.0) - 0.5, start)
    return jnp.where(v > -1e30, k, 0.0).astype(jnp.float32)


@functools.cache
def seed(n=JAX_N):
    """Ones on the default device: the input of the busy computations."""
    return jnp.ones(n, jnp.float32)


@jax.jit
def _fill(k, start):
    return jnp.where(start > -1e30, k, 0.0).astype(jnp.float32)


@functools.cache
def _hold_target():
    import cupy as cp
    return cp.empty(1, cp.float32)


def jax_fill(k, *, steps=300, n=JAX_N):
    """A JAX array of `n` values exactly `k` that stays pending for about
    `steps` / 100 ms (300: 3 ms) after dispatch: a spin kernel holds XLA's
    compute stream, one fill kernel is dispatched behind it.  Not a loop of
    `steps` passes: in some processes the whole loop ran within the dispatch
    call (H200, jax 0.11.2: ready 0.1 ms after a 20000-step dispatch
    returned), and a producer done before its consumer reads proves
    nothing.  Without CuPy, the loop."""
    start = seed(n)
    try:
        importlib.import_module("cupy")  # the spin kernel's
    except ImportError:
        return jax_busy(float(k), start, steps)
    from .. import _runtime as rt
    device, = start.devices()
    held = _cupy_peer.PEER.stream(rt.compute_stream(device), -1)  # -1: the current device
    spin_fill(_hold_target(), 0.0, ms=steps / 100, stream=held)
    return _fill(float(k), start)


class WithStream:
    """Re-exports another array's CAI with a chosen v3 stream."""

    def __init__(self, base, stream):
        self.base = base
        self.cai = dict(base.__cuda_array_interface__, version=3, stream=stream)

    @property
    def __cuda_array_interface__(self):
        return self.cai
