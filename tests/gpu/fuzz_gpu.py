"""GPU producer families for the drop-in fuzz (tests/fuzz_dropin.py): CuPy
arrays, PyTorch tensors and Numba arrays of random dtype, rank (0-4, zero
sizes among them), layout, memory kind, state, stream, current device and
wrapper, each with `truth`, the values the host should read, so that stock's
stale or freed reads are counted as "stock unsafe" and installed's must be
right.  run_side, judge and reproducer are fuzz_dropin's own.

Importing this module registers the families in fuzz_dropin.FAMILIES and
imports no GPU library: each is imported when its family first runs, and a
family whose library does not import (or sees no GPU) is skipped, with why,
by run_range.  Their cases come from streams of their own
(fuzz_dropin.case(seed, index, family)), so CPU cases replay as before.

A producer's states:
  idle       made, uploaded and synchronized before the call;
  in flight  its memory holds other bytes (each byte's complement) until a
             delay kernel (about IN_FLIGHT_MS) and then a copy of the true
             bytes, both on its stream (legacy, per-thread or a user one),
             are done; the call runs with that stream current (CuPy,
             PyTorch) or bound to the array (Numba), as the protocols ask;
  freed      after the call the harness drops the producer and uploads the
             complement into a block of the same size (the allocator's
             freed block, mostly) before the result is read.
Layouts are made over one flat allocation by the strides of NumPy's view of
the same layout, so the device view and the host truth are the same view
(Numba's mapped and managed arrays, whose views lose their device memory,
are C only).

    python tools/fuzz_dropin.py --gpu [cupy,torch,numba] --cases N --json OUT
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import os
import re

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

import fuzz_dropin as F

# Test only: JAX_OVERLAY_FUZZ_TORCH_DEVICE=cpu makes the PyTorch family's
# "cuda" tensors CPU tensors, so that its producers, views, truths and
# releases run where no GPU is (no streams: the in-flight cases are not run).
TORCH_DEVICE = os.environ.get("JAX_OVERLAY_FUZZ_TORCH_DEVICE", "cuda")

IN_FLIGHT_MS = 1.0  # the delay before the true bytes land: far longer than a call
STATES = ("idle", "idle", "in flight", "in flight", "freed")
HOST_STATES = ("idle", "idle", "freed")  # host memory: no stream to be in flight on
STREAMS = ("legacy", "per-thread", "user")
LAYOUTS = ("C", "F", "step", "neg", "broadcast", "misaligned")
# "other GPU": the producer on GPU 1 while GPU 0 is current (idle or freed
# only: CuPy's and PyTorch's current stream belong to the current device).
CURRENT = ("unset",) * 4 + ("producer's",) * 3 + ("other GPU",)
# A CAI re-export's stream: any claim is right for an idle or freed producer;
# one in flight is re-exported with the stream it is on.
CAI_CLAIMS = ("cai own", "cai v2", "cai stream=None", "cai stream=1", "cai stream=2")
# A DLPack-only wrapper's __dlpack_device__: its own, or another (CUDA 1,
# CPU, CUDA host, CUDA managed); lies only for idle or freed producers.
DLPACK_CLAIMS = {"dlpack own": F.OWN, "dlpack device=(2, 1)": (2, 1),
                 "dlpack device=(1, 0)": (1, 0), "dlpack device=(3, 0)": (3, 0),
                 "dlpack device=(13, 0)": (13, 0)}

NATIVE = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
          "float16", "float32", "float64", "complex64", "complex128")


def _gpu0():
    return jax.devices()[0]


# device= on the GPU also takes the CPU and pinned host memory.
DEVICE = F.Pool({**F.DEVICE.valid,
                 "devices('cpu')[0]": lambda: jax.devices("cpu")[0],
                 "SingleDeviceSharding(devices()[0], memory_kind='pinned_host')":
                     lambda: SingleDeviceSharding(_gpu0(), memory_kind="pinned_host")},
                F.DEVICE.edge)
KEYWORDS = {e: {k: DEVICE if k == "device" else pool for k, pool in F.KEYWORDS[e].items()}
            for e in F.IMPORTS}


# --- layouts: NumPy's view of one flat allocation --------------------------------

def _base_shape(shape, layout):
    nd = len(shape)
    if layout == "F":
        return shape[::-1]
    if layout == "step" and nd:
        return (2 * shape[0],) + shape[1:]
    if layout == "broadcast" and nd:
        return (1,) + shape[1:]
    if layout == "misaligned":  # one item on: the data pointer loses its alignment
        return (int(np.prod(shape, dtype=np.int64)) + 1,)
    return shape


def host_view(flat, shape, layout):
    """`layout` of `shape` over the flat array (layouts that need an axis are
    C for rank 0)."""
    b = flat.reshape(_base_shape(shape, layout))
    nd = len(shape)
    if layout == "F":
        return b.T
    if layout == "step" and nd:
        return b[::2]
    if layout == "neg" and nd:
        return b[(slice(None, None, -1),) * nd]
    if layout == "broadcast" and nd:
        return np.broadcast_to(b, shape)
    if layout == "misaligned":
        return b[1:].reshape(shape)
    return b


def _geometry(view, flat):
    """(byte offset into the flat allocation, byte strides) of a view."""
    offset = view.__array_interface__["data"][0] - flat.__array_interface__["data"][0]
    return (offset if view.size else 0), view.strides


def _c_strides(shape, itemsize):
    return tuple(int(np.prod(shape[i + 1:], dtype=np.int64)) * itemsize
                 for i in range(len(shape)))


def _norm(geometry, shape):
    """(pointer, strides) with the strides of extent-1 axes, which carry no
    meaning (libraries normalize them), left out."""
    ptr, strides = geometry
    return ptr, tuple(s for s, d in zip(strides, shape) if d != 1)


def _scrub(e):
    first = (str(e).splitlines() or [""])[0]
    return f"{type(e).__name__}: {re.sub(r'0x[0-9a-fA-F]+|[0-9]{4,}', '?', first)[:90]}"


# --- the libraries, behind one small interface ------------------------------------
# upload(flat, kind, stream, dev, shape) -> a new allocation holding `flat`;
# view(base, offset, shape, strides, handle, kind); geometry(x) -> (pointer,
# byte strides); stream(name, dev) -> (stream, CAI handle); current(stream):
# a context making it current; delay/copy enqueue on a stream; pending(stream);
# device(dev): a context making GPU `dev` current; sync(dev); collect().

class Cupy:
    def __init__(self):
        import cupy as cp
        self.cp = cp
        if cp.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("CuPy sees no GPU")

    def gpus(self):
        return self.cp.cuda.runtime.getDeviceCount()

    def device(self, dev):
        return self.cp.cuda.Device(dev)

    @functools.cache
    def stream(self, name, dev):
        cp = self.cp
        with cp.cuda.Device(dev):
            if name == "legacy":
                return cp.cuda.Stream.null, 1
            if name == "per-thread":
                return cp.cuda.Stream.ptds, 2
            s = cp.cuda.Stream(non_blocking=True)
            return s, s.ptr

    def current(self, stream):
        return stream

    def upload(self, flat, kind, stream, dev, shape):
        cp = self.cp
        with cp.cuda.Device(dev), stream:
            if kind == "managed":
                mem = cp.cuda.malloc_managed(max(flat.nbytes, 1))
                a = cp.ndarray(flat.shape, flat.dtype, memptr=mem)
            else:
                a = cp.empty(flat.shape, flat.dtype)
            if flat.size:
                a.set(flat, stream=stream)
        return a

    def view(self, base, offset, shape, strides, handle, kind):
        return self.cp.ndarray(shape, base.dtype, memptr=base.data + offset, strides=strides)

    def geometry(self, x):
        return x.data.ptr, x.strides

    def delay(self, stream, handle, ms, dev):
        from jax_overlay.doctor import spin_fill
        spin_fill(_cupy_scratch(self.cp, dev), 0.0, ms=ms, stream=stream)

    def copy(self, dst, src, stream):
        dst.data.copy_from_device_async(src.data, dst.nbytes, stream)

    def pending(self, stream):
        return not stream.done

    def sync(self, dev):
        self.cp.cuda.Device(dev).synchronize()

    def collect(self):
        pass


@functools.cache
def _cupy_scratch(cp, dev):
    with cp.cuda.Device(dev):
        return cp.empty(1, cp.float32)


class Torch:
    def __init__(self):
        import torch
        self.torch = torch
        self.on_cpu = TORCH_DEVICE == "cpu"
        if not self.on_cpu and not torch.cuda.is_available():
            raise RuntimeError("PyTorch sees no GPU")

    def gpus(self):
        return 1 if self.on_cpu else self.torch.cuda.device_count()

    def device(self, dev):
        return contextlib.nullcontext() if self.on_cpu else self.torch.cuda.device(dev)

    @functools.cache
    def stream(self, name, dev):
        torch = self.torch
        if self.on_cpu:
            return None, None
        if name == "legacy":  # PyTorch's default stream is the legacy one
            return torch.cuda.default_stream(dev), 1
        if name == "per-thread":
            return torch.cuda.ExternalStream(2, device=torch.device("cuda", dev)), 2
        s = torch.cuda.Stream(device=dev)
        return s, s.cuda_stream

    def current(self, stream):
        return self.torch.cuda.stream(stream)

    def dtype(self, np_dtype):
        td = getattr(self.torch, np_dtype.name, None)
        if not isinstance(td, self.torch.dtype):
            raise F.Unavailable("no dtype", reason=f"torch: no {np_dtype.name}")
        return td

    def upload(self, flat, kind, stream, dev, shape):
        torch = self.torch
        td = self.dtype(flat.dtype)
        if flat.dtype.name in NATIVE:
            t = torch.from_numpy(flat)
        else:  # bfloat16, float8: NumPy's bits, PyTorch's dtype
            t = torch.from_numpy(flat.view(np.int16 if flat.itemsize == 2 else np.uint8)).view(td)
        t = t.clone()  # its own memory, not NumPy's
        if kind == "pinned":
            return t.pin_memory()
        if kind == "cpu" or self.on_cpu:
            return t
        with torch.cuda.stream(stream):
            return t.to(torch.device("cuda", dev))

    def view(self, base, offset, shape, strides, handle, kind):
        item = base.element_size()
        return base.as_strided(shape, [s // item for s in strides], offset // item)

    def geometry(self, x):
        return x.data_ptr(), tuple(s * x.element_size() for s in x.stride())

    def delay(self, stream, handle, ms, dev):
        from jax_overlay.doctor import torch_sleep
        torch_sleep(ms, stream)

    def copy(self, dst, src, stream):
        with self.torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def pending(self, stream):
        return not stream.query()

    def sync(self, dev):
        if not self.on_cpu:
            self.torch.cuda.synchronize(dev)

    def collect(self):
        pass

    @functools.cache
    def negates(self, dtype):
        """Whether PyTorch can resolve a negative view of `dtype` (bool,
        unsigned and float8 it cannot: their values exist nowhere, refused
        installed, tests/gpu/test_dropin_gpu.py)."""
        dev = "cpu" if self.on_cpu else "cuda"
        try:
            self.torch._neg_view(self.torch.zeros(2, dtype=self.dtype(dtype), device=dev)) \
                .resolve_neg()
        except (RuntimeError, TypeError, NotImplementedError):
            return False
        return True


class Numba:
    def __init__(self):
        from numba import cuda
        self.cuda = cuda
        if not cuda.is_available():
            raise RuntimeError("Numba sees no GPU")

    def gpus(self):
        return len(self.cuda.gpus)

    def device(self, dev):
        return self.cuda.gpus[dev]

    @functools.cache
    def stream(self, name, dev):
        cuda = self.cuda
        with cuda.gpus[dev]:
            s = {"legacy": cuda.legacy_default_stream, "per-thread": cuda.per_thread_default_stream,
                 "user": cuda.stream}[name]()
        return s, int(s)

    def current(self, stream):  # Numba has no current stream: its arrays carry theirs
        return contextlib.nullcontext()

    def upload(self, flat, kind, stream, dev, shape):
        cuda = self.cuda
        with cuda.gpus[dev]:
            if kind == "device":
                return cuda.to_device(flat, stream=stream)
            # Views of mapped and managed arrays lose their device memory
            # (NumPy makes them): these are allocated in their shape, C only.
            alloc = cuda.mapped_array if kind == "mapped" else cuda.managed_array
            m = alloc(shape, flat.dtype)
            m[...] = flat.reshape(shape)
            return m

    def view(self, base, offset, shape, strides, handle, kind):
        if kind != "device":
            return base
        ptr, _ = self.geometry(base)
        desc = {"shape": shape, "strides": strides, "typestr": base.dtype.str,
                "data": (ptr + offset, False), "version": 3, "stream": handle}
        # Bound to the stream its bytes are written on: its CAI says so.
        return self.cuda.from_cuda_array_interface(desc, owner=base, sync=False)

    def geometry(self, x):
        cai = x.__cuda_array_interface__
        strides = cai.get("strides") or _c_strides(cai["shape"], np.dtype(cai["typestr"]).itemsize)
        return cai["data"][0], tuple(strides)

    def delay(self, stream, handle, ms, dev):
        """Numba cannot compile kernels under every NumPy (2.5): CuPy's spin
        kernel, or PyTorch's sleep, on Numba's stream."""
        try:
            import cupy as cp
        except ImportError:
            cp = None
        if cp is not None:
            from jax_overlay.doctor import spin_fill
            from jax_overlay.peers.cupy import PEER as _CUPY_PEER
            spin_fill(_cupy_scratch(cp, dev), 0.0, ms=ms, stream=_CUPY_PEER.stream(handle, dev))
            return
        try:
            import torch
        except ImportError:
            raise F.Unavailable("no delay kernel", reason="numba: in flight needs CuPy or "
                                "PyTorch for its delay kernel") from None
        from jax_overlay.doctor import torch_sleep
        from jax_overlay.peers.torch import PEER as _TORCH_PEER
        torch_sleep(ms, _TORCH_PEER.stream(handle, dev))

    def copy(self, dst, src, stream):
        dst.copy_to_device(src, stream=stream)

    def pending(self, stream):
        # Numba's Stream has no query(): the driver's, through the test hook.
        from jax_overlay import _xla_ext as ext
        h = stream.handle
        handle = h.value if hasattr(h, "value") else int(h)
        return not ext.stream_idle(self.cuda.get_current_device().id, handle or 0)

    def sync(self, dev):
        with self.cuda.gpus[dev]:
            self.cuda.synchronize()

    def collect(self):
        """Numba frees dead arrays in batches: the dropped producer now."""
        self.cuda.current_context().deallocations.clear()


# --- PyTorch's lazy views: (the tensor's, the truth's) ---------------------------

TORCH_VIEWS = {
    "plain": (lambda t: t, lambda h: h),
    "conj": (lambda t: t.conj(), np.conj),
    "conj().imag": (lambda t: t.conj().imag, lambda h: np.negative(h.imag)),
    "neg": (lambda t: __import__("torch")._neg_view(t), np.negative),
    "requires_grad": (lambda t: t.requires_grad_(True), lambda h: h),
}


def _torch_views(dtype):
    kind = np.dtype(F.DTYPE_NAMES[dtype]).kind
    if kind == "c":
        return ("plain",) * 3 + ("conj", "conj().imag", "neg", "requires_grad")
    if dtype in ("float16", "float32", "float64", "bfloat16"):
        return ("plain",) * 3 + ("neg", "requires_grad")
    if kind in "if":  # signed ints, float8 (PyTorch may not negate these: counted)
        return ("plain",) * 3 + ("neg",)
    return ("plain",)


# --- families -------------------------------------------------------------------

@functools.cache
def _lib(name):
    return {"cupy": Cupy, "torch": Torch, "numba": Numba}[name]()


def _pick(rng, seq):
    return seq[rng.integers(len(seq))]


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    kinds: tuple                    # repeated for weight
    host_kinds: tuple               # those in host memory: never in flight, no stream
    dtypes: tuple
    layouts: tuple = LAYOUTS
    entries: tuple = F.IMPORTS
    keywords: dict = dataclasses.field(default_factory=lambda: KEYWORDS)
    counts: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def unavailable(self):
        try:
            _lib(self.name)
        except Exception as e:  # not installed, or no GPU: the family is skipped
            return _scrub(e)
        return None

    def draw(self, rng):
        kind = _pick(rng, self.kinds)
        on_host = kind in self.host_kinds
        dtype = _pick(rng, self.dtypes)
        shape = _pick(rng, F.SHAPES)
        layout = _pick(rng, self.layouts)
        if self.name == "numba" and on_host:
            layout = "C"
        state = _pick(rng, HOST_STATES if on_host else STATES)
        stream = "-" if on_host else _pick(rng, STREAMS)
        current = _pick(rng, CURRENT[:-1] if on_host or state == "in flight" else CURRENT)
        params = [("kind", kind), ("dtype", dtype), ("shape", shape), ("layout", layout),
                  ("state", state), ("stream", stream), ("current", current)]
        view = "plain"
        if self.name == "torch":
            view = _pick(rng, _torch_views(dtype))
            params.append(("view", view))
        # The wrappers: a CAI alone (device memory), DLPack alone (not
        # Numba's device arrays, which export none).  Neither over a lazy
        # PyTorch view: no dict carries its bit, and PyTorch's __dlpack__
        # exports a negative view's memory as it is; what the wrapper says
        # is then not the tensor's values, and no consumer can know.
        wraps = ("raw",) * 4
        lazy = view not in ("plain", "requires_grad")
        if not on_host and not lazy:
            wraps += ("cai",)
        if (on_host or self.name != "numba") and not lazy:
            wraps += ("dlpack", "dlpack legacy")
        wrap = _pick(rng, wraps)
        if wrap == "cai":
            wrap = "cai stream=producer's" if state == "in flight" else _pick(rng, CAI_CLAIMS)
        elif wrap == "dlpack":
            lies = state != "in flight" and rng.random() < 0.5
            wrap = _pick(rng, tuple(DLPACK_CLAIMS)[1:]) if lies else "dlpack own"
        params.append(("wrap", wrap))
        return tuple(params)

    def produce(self, case):
        try:
            return self._produce(case)
        except F.Unavailable:
            raise
        except (AttributeError, NameError, KeyError, IndexError, AssertionError):
            raise  # the harness's own bug: a harness error, not a skip
        except Exception as e:  # the library cannot make it (a dtype, a view): counted
            raise F.Unavailable(str(e), reason=f"{self.name}: {_scrub(e)}") from e

    def _produce(self, case):
        p = dict(case.params)
        lib = _lib(self.name)
        dtype = F.DTYPE_NAMES[p["dtype"]]
        shape, layout, kind, state = p["shape"], p["layout"], p["kind"], p["state"]
        dev = 1 if p["current"] == "other GPU" else 0
        if dev >= lib.gpus():
            raise F.Unavailable("one GPU", reason=f"{self.name}: the producer's GPU not current "
                                f"needs 2 GPUs, this machine has {lib.gpus()}")
        on_host = kind in self.host_kinds
        rng = np.random.default_rng((case.seed, case.index, 1))
        flat = F._values(dtype, int(np.prod(_base_shape(shape, layout), dtype=np.int64)), rng)
        other = (~flat.view(np.uint8)).view(dtype)  # every byte differs from the truth
        hv = host_view(flat, shape, layout)
        offset, strides = _geometry(hv, flat)
        view_op, truth_op = TORCH_VIEWS[p.get("view", "plain")]
        truth = truth_op(np.array(hv))
        if p.get("view") == "neg" and not lib.negates(dtype):
            raise F.Unavailable("no negation", reason=f"torch: no negation of {dtype.name}")
        in_flight = state == "in flight"
        stream, handle = (None, None) if on_host else lib.stream(p["stream"], dev)
        if in_flight and stream is None:
            raise F.Unavailable("no stream", reason=f"{self.name} on the CPU (test only): "
                                "nothing is in flight")
        src = None
        with lib.device(dev):
            lib.sync(dev)  # nothing of the last run still running
            base = lib.upload(other if in_flight else flat, kind, stream, dev, shape)
            if in_flight:
                src = lib.upload(flat, kind, stream, dev, shape)
            lib.sync(dev)
            if in_flight:  # zero sizes too: the stream is busy all the same
                lib.delay(stream, handle, IN_FLIGHT_MS, dev)
                if flat.nbytes:
                    lib.copy(base, src, stream)
            v = lib.view(base, offset, shape, strides, handle, kind)
        ptr = lib.geometry(base)[0]
        if hv.size and _norm(lib.geometry(v), shape) != _norm((ptr + offset, strides), shape):
            # The library's own description of the view is not the memory meant.
            raise F.Unavailable("layout", reason=f"{self.name}: cannot lay out {layout} ({kind})")
        v = view_op(v)
        obj = self._wrap(v, p["wrap"], handle)
        around = self._around(lib, p["current"], stream, in_flight, dev)
        release = None
        if state == "freed":
            release = self._release(lib, other, kind, stream, dev, shape)
        return F.Produced(obj, truth, [(ptr, ptr + max(flat.nbytes, 1))],
                          keep=(v, base, src, stream), around=around, release=release)

    @staticmethod
    def _wrap(v, wrap, handle):
        if wrap == "raw":
            return v
        if wrap.startswith("dlpack"):
            kind = F.LegacyProto if wrap == "dlpack legacy" else F.Proto
            return kind(v, DLPACK_CLAIMS.get(wrap, F.OWN))
        claim = wrap.removeprefix("cai ")
        if claim == "own":
            return F.CAI(v, lambda a: a.__cuda_array_interface__)
        if claim == "v2":
            return F.CAI(v, lambda a: {k: x for k, x in a.__cuda_array_interface__.items()
                                       if k != "stream"} | {"version": 2})
        stream = {"stream=None": None, "stream=1": 1, "stream=2": 2,
                  "stream=producer's": handle}[claim]
        # Read when the consumer asks (PyTorch's raises for requires_grad there).
        return F.CAI(v, lambda a: {**a.__cuda_array_interface__, "version": 3, "stream": stream})

    @contextlib.contextmanager
    def _around(self, lib, current, stream, in_flight, dev):
        """The call's context: GPU 0 current (the producer's, or for "other
        GPU" not), the producer's stream current where it has one, and
        whether the producer was still in flight when the call returned."""
        with contextlib.ExitStack() as ctx:
            if current != "unset":
                ctx.enter_context(lib.device(0))
            if stream is not None and current != "other GPU":
                ctx.enter_context(lib.current(stream))
            yield
            if in_flight:
                self.counts["in flight: calls returned"] += 1
                # A statistic only: the harness's own query never becomes the
                # call's outcome (numba-cuda 0.30's Stream had no query(): on
                # the H100, 2026-12-05, that AttributeError was judged as an
                # exception-class difference in 352 cases).
                try:
                    self.counts["in flight: still pending after the call"] += lib.pending(stream)
                except Exception as e:  # noqa: BLE001
                    self.counts[f"in flight: pending unknown ({type(e).__name__})"] += 1

    def _release(self, lib, other, kind, stream, dev, shape):
        def release(produced):
            produced.obj = produced.keep = None  # the harness's last references
            lib.collect()
            with lib.device(dev):
                produced.keep = lib.upload(other, kind, stream, dev, shape)
                lib.sync(dev)
        return release


FAMILIES = (
    Family("cupy", ("device",) * 3 + ("managed",), (), NATIVE),
    Family("torch", ("cuda",) * 6 + ("pinned", "cpu"), ("pinned", "cpu"),
           NATIVE + ("bfloat16", "float8_e4m3fn", "float8_e5m2"),
           layouts=tuple(x for x in LAYOUTS if x != "neg")),  # PyTorch has no negative strides
    Family("numba", ("device",) * 4 + ("mapped", "managed"), ("mapped", "managed"), NATIVE),
)
NAMES = tuple(f.name for f in FAMILIES)
F.FAMILIES.update({f.name: f for f in FAMILIES})


def versions():
    """The GPU libraries' versions, for the CLI's figures."""
    out = {}
    for name in ("cupy", "torch", "numba"):
        try:
            out[name] = __import__(name).__version__
        except Exception as e:  # not installed
            out[name] = f"missing: {type(e).__name__}"
    return out
