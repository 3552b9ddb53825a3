"""`python -m jax_overlay doctor`: what this machine has, and a live round
trip on every import path it can run."""

from __future__ import annotations

import importlib
import json
import platform
import sys
import time

import numpy as np


def _version(name):
    try:
        mod = importlib.import_module(name)
    except Exception:  # noqa: BLE001 - any import failure means "not usable"
        return None
    return getattr(mod, "__version__", "?")


def _environment():
    import jax
    from . import _install
    from . import _xla_ext as ext

    env = {
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": _version("jaxlib"),
        "numpy": np.__version__,
        "cupy": _version("cupy"),
        "torch": _version("torch"),
        "numba": _version("numba"),
        "jax_overlay_installed": _install.installed(),
    }
    try:
        ext.load_driver()
        env["libcuda"] = f"found, driver API {ext.driver_version()}, {ext.device_count()} device(s)"
    except BufferError as e:
        env["libcuda"] = f"not usable: {e}"
    env["devices"] = [str(d) for d in jax.devices()]
    return env


def _check(name, fn):
    t0 = time.perf_counter()
    try:
        detail = fn()
        status = "ok"
    except _Skip as s:
        status, detail = "skipped", str(s)
    except Exception as e:  # noqa: BLE001 - the doctor reports, never raises
        status, detail = "FAILED", f"{type(e).__name__}: {e}"
    return {"path": name, "status": status, "detail": detail,
            "ms": round((time.perf_counter() - t0) * 1e3, 2)}


class _Skip(Exception):
    pass


def _host_round_trip():
    from . import _testing as T
    a = T.aligned_empty((64, 32), np.float32)
    a[...] = np.arange(a.size).reshape(a.shape)
    x = T.import_host(T.HostCAI(a))
    if x.unsafe_buffer_pointer() != a.ctypes.data:
        raise AssertionError("the view is not zero-copy")
    s = T.import_host(T.HostCAI(a[::3, ::-2], strides=a[::3, ::-2].strides))
    if not (np.array_equal(np.asarray(x), a) and np.array_equal(np.asarray(s), a[::3, ::-2])):
        raise AssertionError("wrong values")
    return "CAI parser, capsule and strided copy on host memory: zero-copy, values match"


def _need_gpu():
    from . import _xla_ext as ext
    import jax
    try:
        ext.load_driver()
        jax.devices("cuda")
    except Exception as e:  # noqa: BLE001
        raise _Skip(f"no GPU ({str(e).splitlines()[0][:80]})") from None


def _gpu_round_trip(make, pointer_of):
    def run():
        _need_gpu()
        from . import from_cuda_array_interface
        obj = make()
        x = from_cuda_array_interface(obj)
        if x.unsafe_buffer_pointer() != pointer_of(obj):
            raise AssertionError("not zero-copy")
        if not np.array_equal(np.asarray(x), np.arange(4096, dtype=np.float32)):
            raise AssertionError("wrong values")
        return "zero-copy, values match"
    return run


def _cupy():
    try:
        import cupy as cp
    except Exception:  # noqa: BLE001
        raise _Skip("cupy not installed") from None
    return cp.arange(4096, dtype=cp.float32)


def _torch():
    try:
        import torch
    except Exception:  # noqa: BLE001
        raise _Skip("torch not installed") from None
    t = torch.arange(4096, dtype=torch.float32, device="cuda")
    torch.cuda.synchronize()
    return t


def _numba():
    try:
        from numba import cuda
    except Exception:  # noqa: BLE001
        raise _Skip("numba not installed") from None
    d = cuda.to_device(np.arange(4096, dtype=np.float32))
    cuda.synchronize()
    return d


def _cai_ptr(o):
    return o.__cuda_array_interface__["data"][0]


def run(as_json=False, out=sys.stdout):
    env = _environment()
    checks = [
        _check("host CAI -> JAX (cpu)", _host_round_trip),
        _check("CuPy -> JAX (CAI)", _gpu_round_trip(_cupy, _cai_ptr)),
        _check("PyTorch -> JAX (CAI)", _gpu_round_trip(_torch, _cai_ptr)),
        _check("Numba -> JAX (CAI)", _gpu_round_trip(_numba, _cai_ptr)),
    ]
    failed = [c for c in checks if c["status"] == "FAILED"]
    if as_json:
        json.dump({"environment": env, "checks": checks}, out, indent=2)
        out.write("\n")
    else:
        out.write("jax_overlay doctor\n")
        for k, v in env.items():
            out.write(f"  {k:<22} {v}\n")
        w = max(len(c["path"]) for c in checks)
        out.write("\n")
        for c in checks:
            out.write(f"  {c['path']:<{w}}  {c['status']:<8} {c['ms']:>8.2f} ms  {c['detail']}\n")
    return 1 if failed else 0
