"""Room: the doctor's probes.  What this machine has (the report's
environment: versions, libcuda, the NVIDIA driver, JAX's devices), what a
row needs before it can run (a GPU, a peer), and the host rows: NumPy
arrays into JAX and JAX arrays out to NumPy, on the CPU backend."""

from __future__ import annotations

import contextlib
import functools
import importlib
import platform
import re
import subprocess

import numpy as np

from ._model import (CAI_ON_HOST, HOST_NO_STREAM, Case, Expect, Row, Skip, describe,
                     not_applicable)


def _gpu_peers():
    """The registered peers besides NumPy (listed on its own): their
    versions are the environment's."""
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
        import jax
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
    except ModuleNotFoundError as e:
        if e.name and e.name.split(".")[0] == top:
            raise Skip(f"{top} not installed") from None
        raise Skip(f"{top} not usable: {describe(e)}") from None
    except Exception as e:  # noqa: BLE001
        raise Skip(f"{top} not usable: {describe(e)}") from None


def need_cupy():
    """CuPy, on a GPU (else Skip); need_torch and need_numba (numba.cuda) alike."""
    need_gpu()
    return need("cupy")


def need_torch():
    need_gpu()
    torch = need("torch")
    if not torch.cuda.is_available():
        raise Skip("torch has no CUDA here")
    return torch


def need_numba():
    need_gpu()
    cuda = need("numba.cuda")
    if not cuda.is_available():
        raise Skip("numba has no CUDA here")
    return cuda


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
    try:
        with open("/proc/driver/nvidia/version") as f:
            m = re.search(r"Kernel Module\s+(?:for \S+\s+)?(\d[\w.]*)", f.read())
        if m:
            return m.group(1)
    except OSError:
        pass
    try:
        p = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20)
        return p.stdout.split()[0] if p.returncode == 0 and p.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def environment():
    import jax
    import jaxlib
    from .. import __version__
    from .. import _install
    from .. import _xla_ext as ext
    dists = _distributions()

    def version(*names, prefix=None):
        for name in names:
            if name in dists:
                return dists[name]
        if prefix:
            hits = sorted(n for n in dists if n.startswith(prefix))
            if hits:
                return f"{dists[hits[0]]} ({hits[0]})"
        return None

    plugins = sorted(n for n in dists if re.fullmatch(r"jax-cuda\d+-(plugin|pjrt)", n))
    env = {
        "jax_overlay": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(terse=True),
        "numpy": np.__version__,
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "jax_cuda_plugin": ", ".join(f"{n} {dists[n]}" for n in plugins) or None,
        # A peer's distribution, or a build of it named after it ("cupy-cuda13x").
        **{p.name: version(p.distribution, prefix=p.distribution + "-") for p in _gpu_peers()},
        "libcuda": None, "cuda_driver_api": None,
        "nvidia_driver": nvidia_driver(),
        "devices": [],
        "gpu": gpu_skip_reason(),
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


# --- the rows ---------------------------------------------------------------------

def jax_ptr(x):
    return x.unsafe_buffer_pointer()


def _cpu_device():
    import jax
    try:
        return jax.devices("cpu")[0]
    except RuntimeError as e:
        raise Skip(f"JAX has no CPU backend here ({describe(e)})") from None


def _numpy_source(memory):
    """A NumPy array (aligned, as JAX's CPU client wants for a view)."""
    from .producers import aligned_empty
    _cpu_device()
    a = aligned_empty((64, 32), np.float32)
    a[...] = np.arange(a.size, dtype=np.float32).reshape(a.shape)
    src = a[:, ::2] if memory == "host, strided" else a
    if memory == "host, read-only":
        a.flags.writeable = False
    return Case(source=src, source_ptr=src.ctypes.data, expected=np.array(src),
                result_ptr=jax_ptr, read=np.asarray, no_trial=HOST_NO_STREAM)


def _jax_on_cpu():
    import jax
    host = np.arange(2048, dtype=np.float32).reshape(64, 32)
    x = jax.device_put(host, _cpu_device())
    x.block_until_ready()
    return Case(source=x, source_ptr=x.unsafe_buffer_pointer(), expected=host,
                convert=np.from_dlpack, result_ptr=lambda a: a.ctypes.data,
                read=np.asarray, no_trial=HOST_NO_STREAM)


def host_rows():
    rows = []
    for memory in ("host", "host, read-only", "host, strided"):
        for protocol in ("DLPack legacy", "DLPack 1.x"):
            rows.append(Row("import", "NumPy", protocol, memory, "jax.dlpack.from_dlpack(a)",
                            functools.partial(_numpy_source, memory),
                            Expect(zero_copy=memory != "host, strided")))
    rows.append(Row("import", "NumPy", "CAI", "host", "jnp.asarray(a)",
                    not_applicable(CAI_ON_HOST), None))
    for protocol in ("DLPack legacy", "DLPack 1.x"):
        rows.append(Row("export", "NumPy", protocol, "host", "np.from_dlpack(x)", _jax_on_cpu))
    rows.append(Row("export", "NumPy", "CAI", "host", "np.asarray(x)",
                    not_applicable(CAI_ON_HOST), None))
    return rows
