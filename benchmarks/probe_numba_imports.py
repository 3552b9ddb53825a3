"""Numba device arrays from cuda.to_device, imported at once and read to the
host, 60 times per route, idle and with tests/gpu/load.py loading the GPU:
jax_overlay.from_cuda_array_interface, stock jnp.asarray, installed
jnp.asarray and jax.device_put; with the array's CAI stream and whether
that stream was busy at the import.  Diagnoses issue 39's loaded run, where
installed imports of such arrays read values that were not the producer's
(tests/gpu/test_dropin_gpu.py::test_numba_imports_match_stock).  GPU only.

    python benchmarks/probe_numba_imports.py
"""
import subprocess, sys
import numpy as np
from numba import cuda
import jax, jax.numpy as jnp
import jax_overlay
from jax_overlay import _xla_ext as ext
print("numba", __import__("numba").__version__, "numba-cuda", getattr(__import__("numba.cuda"), "__version__", "?"))
host = np.arange(128, dtype=np.float32).reshape(8, 16)
def go(tag):
    bad = {"ours cai": 0, "stock asarray": 0, "installed asarray": 0, "installed device_put": 0}
    busy = 0
    for i in range(60):
        for k in bad:
            m = cuda.to_device(host + i)
            cai = m.__cuda_array_interface__
            if i == 0 and k == "ours cai": print(tag, "cai", {a: cai[a] for a in ("stream", "version", "data")})
            busy += not ext.stream_idle(0, cai.get("stream") or 1)  # None: the legacy stream
            if k == "ours cai":
                x = jax_overlay.from_cuda_array_interface(m)
            elif k == "stock asarray":
                x = jnp.asarray(m)
            else:
                jax_overlay.install()
                x = jnp.asarray(m) if k == "installed asarray" else jax.device_put(m)
                jax_overlay.uninstall()
            h = np.asarray(x)
            bad[k] += not np.array_equal(h, host + i)
            del x, m
    print(tag, "wrong of 60:", bad, "its stream (None: legacy) busy at import:", busy, flush=True)
go("idle")
load = subprocess.Popen([sys.executable, "tests/gpu/load.py"], stdout=subprocess.PIPE, text=True)
load.stdout.readline()
go("loaded")
load.kill()
