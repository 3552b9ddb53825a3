"""What the installed cuda.core offers and how its StridedMemoryView and
Buffer answer DLPack (the consumer stream they take, their devices), and
whether stock JAX imports them: the facts behind peers/cuda_core.py
(benchmarks/results/h200-2026-12-06-cuda-core-facts.txt).  GPU only.

    python benchmarks/probe_cuda_core_facts.py
"""
import inspect, sys
try:
    import cuda.core as cc
    print("cuda.core", getattr(cc, "__version__", "?"), cc.__file__)
except Exception as e:
    print("no cuda.core", e); sys.exit()
for modname in ("cuda.core", "cuda.core.utils", "cuda.core.experimental", "cuda.core.experimental.utils"):
    try:
        m = __import__(modname, fromlist=["x"])
        print(modname, [n for n in dir(m) if not n.startswith("_")])
    except Exception as e:
        print(modname, "ERR", e)
try:
    from cuda.core.utils import StridedMemoryView as SMV
except Exception:
    from cuda.core.experimental.utils import StridedMemoryView as SMV
print("SMV", SMV, [n for n in dir(SMV) if not n.startswith("__") or n in ("__dlpack__", "__dlpack_device__", "__cuda_array_interface__")])
print(SMV.__doc__)
for n in ("__init__", "__dlpack__", "from_dlpack", "from_cuda_array_interface", "from_any_interface", "from_buffer", "view", "copy_from", "copy_to"):
    f = getattr(SMV, n, None)
    if f is not None:
        print("---", n, getattr(f, "__doc__", None))
        try: print(inspect.signature(f))
        except Exception as e: print("sig?", e)
try:
    from cuda.core import Buffer, Device
except Exception:
    from cuda.core.experimental import Buffer, Device
print("Buffer", [n for n in dir(Buffer) if not n.startswith("_") or "dlpack" in n or "cuda_array" in n])
print("Buffer.__dlpack__ doc", Buffer.__dlpack__.__doc__)
import cupy as cp
d = Device(0); d.set_current()
s = d.create_stream()
b = d.memory_resource.allocate(4096, stream=s) if hasattr(d, "memory_resource") else d.allocate(4096, stream=s)
print("buffer", b, type(b))
for kw in ({}, {"stream": None}, {"stream": 1}, {"stream": int(s.handle) if hasattr(s, "handle") else 0}, {"max_version": (1, 0)}):
    try:
        cap = b.__dlpack__(**kw); print("buffer dlpack", kw, "ok", cap)
    except Exception as e:
        print("buffer dlpack", kw, type(e).__name__, e)
print("buffer dlpack_device", b.__dlpack_device__())
x = cp.arange(12, dtype=cp.float32).reshape(3, 4)[:, ::2]
for ctor in ("from_dlpack", "from_cuda_array_interface", "from_any_interface"):
    f = getattr(SMV, ctor, None)
    if f is None: continue
    try:
        v = f(x, stream_ptr=-1)
        print(ctor, "->", v, v.ptr, v.shape, v.strides, v.dtype, "exporting_obj", type(getattr(v, "exporting_obj", None)))
        for kw in ({}, {"stream": None}, {"stream": 1}, {"stream": 2}):
            try:
                cap = v.__dlpack__(**kw); print("  smv dlpack", kw, "ok", cap)
            except Exception as e:
                print("  smv dlpack", kw, type(e).__name__, e)
        print("  dlpack_device", getattr(v, "__dlpack_device__", lambda: None)())
        print("  cai", getattr(v, "__cuda_array_interface__", None))
    except Exception as e:
        print(ctor, "ERR", type(e).__name__, e)
try:
    v = SMV(x, stream_ptr=-1); print("ctor", v)
except Exception as e:
    print("ctor ERR", e)
import jax
try:
    v = SMV.from_dlpack(x, stream_ptr=-1) if hasattr(SMV, "from_dlpack") else SMV(x, stream_ptr=-1)
    print("jax from smv", jax.dlpack.from_dlpack(v))
except Exception as e:
    print("jax from smv ERR", type(e).__name__, e)
try:
    print("jax from buffer", jax.dlpack.from_dlpack(b))
except Exception as e:
    print("jax from buffer ERR", type(e).__name__, e)
