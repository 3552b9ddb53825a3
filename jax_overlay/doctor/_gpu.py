"""Room: the doctor's GPU rows: CuPy, PyTorch and Numba arrays into JAX, and JAX
arrays out to them, over the CUDA Array Interface and DLPack, on device,
pinned host and managed memory; an in-flight producer wherever the memory
has a stream.  Peers are imported when a row is built, never before."""

from __future__ import annotations

import contextlib
import functools
import importlib

import numpy as np

from .. import _runtime as rt
from ..peers import cupy as _cupy_peer
from ._model import PROTOCOLS, Case, Expect, NotApplicable, Row, Skip
from ._probes import jax_fill, jax_ptr, need, need_gpu, spin_fill, torch_sleep

N = 1 << 16        # float32 elements of the doctor's arrays (256 KiB)
TRIAL_MS = 1.0     # how long the producer stays busy in one in-flight trial
PINNED_NO_STREAM = "pinned host memory, written by the host: no producer stream"
MANAGED_BY_HOST = "managed memory written by the host here: no producer stream"
TORCH_CAI = ("PyTorch exports CAI version 2, without a stream: no consumer can "
             "order after its pending work (use DLPack)")
SAFE = Expect(stream_safe=True)


def need_cupy():
    """CuPy, on a GPU (else Skip)."""
    need_gpu()
    return need("cupy")


def _need_cuda(module, cuda):
    """`module` on a GPU, where cuda(module).is_available() (else Skip)."""
    need_gpu()
    m = need(module)
    if not cuda(m).is_available():
        raise Skip(f"{module.split('.')[0]} has no CUDA here")
    return m


need_torch = functools.partial(_need_cuda, "torch", lambda torch: torch.cuda)
need_numba = functools.partial(_need_cuda, "numba.cuda", lambda cuda: cuda)


def _cai_ptr(a):
    return a.__cuda_array_interface__["data"][0]


@functools.cache
def _minmax():
    import jax
    import jax.numpy as jnp
    return jax.jit(lambda v: jnp.stack([jnp.min(v), jnp.max(v)]).astype(jnp.float32))


def jax_minmax(x):
    """(min, max) of a JAX array, computed on its device by JAX."""
    return tuple(np.asarray(_minmax()(x)).tolist())


def _numba_minmax(d):
    h = d.copy_to_host()
    return float(h.min()), float(h.max())


# --- imports ------------------------------------------------------------------

def _cupy_import(memory):
    cp = need_cupy()
    pool = None
    if memory == "managed":
        pool = cp.cuda.MemoryPool(cp.cuda.malloc_managed)
        with cp.cuda.using_allocator(pool.malloc):
            base = cp.arange(N, dtype=cp.float32)
    elif memory == "device, strided":
        base = cp.arange(N, dtype=cp.float32).reshape(128, N // 128)
    else:
        base = cp.arange(N, dtype=cp.float32)
    a = base[:, ::2] if memory == "device, strided" else base
    s = cp.cuda.Stream(non_blocking=True)
    cp.cuda.runtime.deviceSynchronize()

    def trial(k):
        # CuPy's current stream is s during the call: its CAI exports s, and
        # its __dlpack__ orders the consumer's stream after s.
        spin_fill(base, float(k), ms=TRIAL_MS, stream=s)
        return a, s, lambda: not s.done

    return Case(source=a, source_ptr=a.data.ptr, expected=cp.asnumpy(a), result_ptr=jax_ptr,
                read=np.asarray, minmax=jax_minmax, trial=trial, sync=s.synchronize, keep=pool)


def _torch_import(memory, cai=False):
    torch = need_torch()
    if memory == "pinned":
        t = torch.arange(N, dtype=torch.float32).pin_memory()
        return Case(source=t, source_ptr=t.data_ptr(), expected=t.numpy().copy(),
                    result_ptr=jax_ptr, read=np.asarray, no_trial=PINNED_NO_STREAM)
    t = torch.arange(N, dtype=torch.float32, device="cuda")
    s = torch.cuda.Stream()
    torch.cuda.synchronize()

    def trial(k):
        torch_sleep(TRIAL_MS, s)
        with torch.cuda.stream(s):
            t.fill_(float(k))
        return t, torch.cuda.stream(s), lambda: not s.query()

    return Case(source=t, source_ptr=t.data_ptr(), expected=t.cpu().numpy(), result_ptr=jax_ptr,
                read=np.asarray, minmax=jax_minmax, trial=trial, sync=s.synchronize,
                note=TORCH_CAI if cai else None)


def _numba_import(memory, protocol="CAI"):
    cuda = need_numba()
    host = np.arange(N, dtype=np.float32)
    if memory in ("pinned", "managed"):
        m = (cuda.mapped_array if memory == "pinned" else cuda.managed_array)(N, np.float32)
        m[:] = host
        cuda.synchronize()
        return Case(source=m, source_ptr=_cai_ptr(m), expected=host, result_ptr=jax_ptr,
                    read=np.asarray,
                    no_trial=PINNED_NO_STREAM if memory == "pinned" else MANAGED_BY_HOST)
    d = cuda.to_device(host)
    cuda.synchronize()
    if protocol != "CAI" and not hasattr(d, "__dlpack__"):
        raise NotApplicable("Numba's device arrays have no __dlpack__")
    case = Case(source=d, source_ptr=_cai_ptr(d), expected=host, result_ptr=jax_ptr,
                read=np.asarray, minmax=jax_minmax)
    # In flight: an array bound to a Numba stream (its CAI exports that
    # stream), written there by CuPy's kernel: this numba-cuda may be unable
    # to compile kernels of its own.
    try:
        cp = importlib.import_module("cupy")
    except Exception:  # noqa: BLE001
        case.no_trial = "the in-flight test needs CuPy for the producer kernel"
        return case
    s = cuda.stream()
    busy = cuda.device_array(N, np.float32, stream=s)
    handle = busy.__cuda_array_interface__.get("stream")
    if not handle:
        case.no_trial = "this Numba exports no stream for an array bound to a stream"
        return case
    alias = cp.asarray(busy)
    on_s = _cupy_peer.PEER.stream(handle, -1)  # -1: the current device

    def trial(k):
        spin_fill(alias, float(k), ms=TRIAL_MS, stream=on_s)
        return busy, contextlib.nullcontext(), lambda: not on_s.done

    case.trial, case.sync, case.keep = trial, on_s.synchronize, (s, alias)
    return case


# --- exports ------------------------------------------------------------------

def _cupy_consumer(protocol):
    cp = need_cupy()
    # Values are read by a CuPy kernel first, as CuPy code reads a view
    # (of device or pinned memory), then copied from device memory.
    return (cp.asarray if protocol == "CAI" else cp.from_dlpack, lambda c: c.data.ptr,
            lambda c: cp.asnumpy(c + 0), lambda c: (float(c.min()), float(c.max())))


def _torch_consumer(protocol):
    torch = need_torch()
    convert = (lambda o: torch.as_tensor(o, device="cuda")) if protocol == "CAI" else torch.from_dlpack
    return (convert, lambda t: t.data_ptr(), lambda t: t.cpu().numpy(),
            lambda t: (t.min().item(), t.max().item()))


def _numba_consumer(protocol):
    cuda = need_numba()
    convert = cuda.as_cuda_array if protocol == "CAI" else getattr(cuda, "from_dlpack", None)
    if convert is None:
        raise NotApplicable("numba.cuda has no from_dlpack")
    return convert, _cai_ptr, lambda d: d.copy_to_host(), _numba_minmax


def _torch_cpu_consumer(protocol):
    """PyTorch refuses kDLCUDAHost, even its own pinned tensors: a
    pinned_host array reaches it as a CPU tensor of the same memory, through
    a kDLCPU capsule (dl_device=(1, 0)), which waits for a pending write."""
    torch = need_torch()
    return (lambda x: torch.from_dlpack(x.__dlpack__(dl_device=(1, 0))), lambda t: t.data_ptr(),
            lambda t: t.numpy(), None)


def _numba_kernel_consumer(protocol):
    """A @cuda.jit kernel given the JAX array itself: Numba types the
    argument through its protocols and launches on its default stream."""
    cuda = need_numba()
    try:
        kernel = _numba_copy_kernel(cuda)
    except AttributeError as e:  # numba-cuda's own NumPy incompatibility
        raise Skip(f"this numba-cuda cannot compile kernels under NumPy {np.__version__} ({e})") from e

    def run(x):  # x: the row's JAX array of N float32, behind its protocol
        out = cuda.device_array(N, np.float32)
        kernel[(N + 255) // 256, 256](x, out)
        return out

    # The kernel writes its own output: no pointer to compare (zero-copy n/a).
    return run, lambda d: None, lambda d: d.copy_to_host(), _numba_minmax


@functools.cache
def _numba_copy_kernel(cuda):
    @cuda.jit
    def copy(src, dst):
        i = cuda.grid(1)
        if i < src.size:
            dst[i] = src[i]
    copy[1, 32](cuda.to_device(np.ones(4, np.float32)), cuda.device_array(4, np.float32))
    return copy


def _numpy_consumer(protocol):
    return (lambda o: np.from_dlpack(o, device="cpu"), lambda a: a.ctypes.data, np.asarray, None)


def _jax_trial(k):
    x = jax_fill(k)
    return x, contextlib.nullcontext(), lambda: not x.is_ready()


def _export(consumer, protocol, memory):
    def build():
        import jax
        need_gpu()
        convert, result_ptr, read, minmax = consumer(protocol)
        host = np.arange(N, dtype=np.float32)
        kind = "pinned_host" if memory == "pinned" else "device"
        x = jax.device_put(host, rt.memory_sharding(jax.devices("cuda")[0], kind))
        x.block_until_ready()
        case = Case(source=x, source_ptr=x.unsafe_buffer_pointer(), expected=host,
                    convert=convert, result_ptr=result_ptr, read=read, minmax=minmax)
        if memory == "pinned":
            case.no_trial = PINNED_NO_STREAM
        else:
            jax_fill(0.0).block_until_ready()  # compiled before the trials
            case.trial = _jax_trial
        return case
    return build


# --- the rows -------------------------------------------------------------------

EXPORT_CALLS = {
    ("CuPy", "CAI"): "cupy.asarray(x)", ("CuPy", "DLPack"): "cupy.from_dlpack(x)",
    ("PyTorch", "CAI"): 'torch.as_tensor(x, device="cuda")', ("PyTorch", "DLPack"): "torch.from_dlpack(x)",
    ("Numba", "CAI"): "numba.cuda.as_cuda_array(x)", ("Numba", "DLPack"): "numba.cuda.from_dlpack(x)",
    ("NumPy", "DLPack"): 'np.from_dlpack(x, device="cpu")',
    ("PyTorch CPU", "DLPack"): "torch.from_dlpack(x.__dlpack__(dl_device=(1, 0)))",
    ("Numba kernel", "CAI"): "kernel[blocks, threads](x, out)",
}
CONSUMERS = {"CuPy": _cupy_consumer, "PyTorch": _torch_consumer, "Numba": _numba_consumer,
             "NumPy": _numpy_consumer, "PyTorch CPU": _torch_cpu_consumer,
             "Numba kernel": _numba_kernel_consumer}


def _import_row(peer, protocol, memory, build, expect):
    call = "jnp.asarray(a)" if protocol == "CAI" else "jax.dlpack.from_dlpack(a)"
    return Row("import", peer, protocol, memory, call, build, expect)


def _export_row(peer, protocol, memory, expect):
    call = EXPORT_CALLS[(peer, "CAI" if protocol == "CAI" else "DLPack")]
    return Row("export", peer, protocol, memory, call, _export(CONSUMERS[peer], protocol, memory), expect)


def rows():
    P = functools.partial
    pinned = Expect(zero_copy=rt.PINNED_VIEW)  # jaxlib < 0.10.2 copies pinned memory
    out = [_import_row("CuPy", p, "device", P(_cupy_import, "device"), SAFE) for p in PROTOCOLS]
    for memory, expect in (("device, strided", Expect(zero_copy=False, stream_safe=True)),
                           ("managed", SAFE)):
        out += [_import_row("CuPy", p, memory, P(_cupy_import, memory), expect)
                for p in ("CAI", "DLPack 1.x")]
    out += [_import_row("PyTorch", p, "device", P(_torch_import, "device", cai=p == "CAI"),
                        Expect() if p == "CAI" else SAFE) for p in PROTOCOLS]
    out += [_import_row("PyTorch", p, "pinned", P(_torch_import, "pinned"), pinned) for p in PROTOCOLS[1:]]
    out += [_import_row("Numba", "CAI", "device", P(_numba_import, "device"), SAFE),
            _import_row("Numba", "DLPack 1.x", "device", P(_numba_import, "device", "DLPack 1.x"), None),
            _import_row("Numba", "CAI", "pinned", P(_numba_import, "pinned"), pinned),
            _import_row("Numba", "CAI", "managed", P(_numba_import, "managed"), Expect())]
    out += [_export_row("CuPy", p, "device", SAFE) for p in PROTOCOLS]
    out += [_export_row("PyTorch", p, "device", SAFE) for p in PROTOCOLS]
    out += [_export_row("Numba", "CAI", "device", SAFE),
            _export_row("Numba", "DLPack 1.x", "device", None),
            _export_row("NumPy", "DLPack 1.x", "pinned", Expect()),
            _export_row("CuPy", "CAI", "pinned", Expect()),
            _export_row("Numba kernel", "CAI", "device", Expect(zero_copy=None, stream_safe=True)),
            _export_row("PyTorch", "DLPack 1.x", "pinned", None),
            _export_row("PyTorch CPU", "DLPack 1.x", "pinned", Expect())]
    return out
