"""Multi-device cases on the CPU: JAX fixes its device count when its backend
starts, which the pytest process has long done, so cases that need N devices
run in a subprocess started with XLA_FLAGS=--xla_force_host_platform_device_count=N
and JAX_PLATFORMS=cpu.

A test module marks its cases with ``@on(2, 4)`` (functions named ``case_*``
taking N) and reports them with one parametrized test::

    @pytest.mark.parametrize("n,case", params(globals()))
    def test_multidevice(n, case):
        check(__file__, n, case)

The first test of a (module, N) pair runs all of that pair's cases in one
subprocess (one JAX start-up); each test then reports its own case's outcome.
Every case must also release every tensor it made (as the `balanced` fixture).

Also here: host memory playing GPU producers on GPU ordinals that CPU devices
stand for (``cpus_as_gpus``), for the placement logic of the import paths.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import types
import tempfile
import traceback

import jax
import numpy as np
import pytest

import jax_overlay
from jax_overlay import _dlpack
from jax_overlay import _runtime as rt
import forge as T
from jax_overlay import _xla_ext as ext

KDLCPU, KDLCUDA = 1, 2


def on(*counts):
    """Runs the case with each of these device counts."""
    def mark(fn):
        fn.device_counts = counts
        return fn
    return mark


def _cases(namespace):
    return [(name, fn) for name, fn in namespace.items()
            if name.startswith("case_") and callable(fn)]


def params(namespace):
    """pytest params (N, case name) for the cases of a module's globals()."""
    return [pytest.param(n, name, id=f"{n}dev-{name[len('case_'):]}")
            for name, fn in _cases(namespace) for n in fn.device_counts]


@functools.cache
def _run(path, n):
    package_root = str(pathlib.Path(jax_overlay.__file__).resolve().parent.parent)
    flags = os.environ.get("XLA_FLAGS", "")
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={n}".strip(),
               # The same jax_overlay as this process, whatever the worker's cwd.
               PYTHONPATH=os.pathsep.join(
                   p for p in (package_root, os.environ.get("PYTHONPATH")) if p))
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "results.json"
        r = subprocess.run([sys.executable, __file__, path, str(n), str(out)],
                           capture_output=True, text=True, timeout=300, env=env)
        results = json.loads(out.read_text()) if out.exists() else {}
    return results, r.returncode, r.stderr[-4000:]


def check(path, n, case):
    results, rc, stderr = _run(str(pathlib.Path(path).resolve()), n)
    outcome = results.get(case)
    if outcome is None:
        pytest.fail(f"the {n}-device worker did not report {case} (exit {rc}):\n{stderr}",
                    pytrace=False)
    if outcome != "ok":
        pytest.fail(f"{case} with {n} devices:\n{outcome}", pytrace=False)


def _worker(path, n, out):
    found = jax.device_count()
    if found != n:
        raise SystemExit(f"XLA_FLAGS asked for {n} CPU devices, JAX has {found}")
    # The module's folder and the one above it, as pytest sees them (the
    # suites' shared helpers, tests/dropin.py, live there).
    sys.path[:0] = [str(pathlib.Path(path).parent), str(pathlib.Path(path).parent.parent)]
    spec = importlib.util.spec_from_file_location(pathlib.Path(path).stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    results = {}
    for name, fn in _cases(vars(module)):
        if n not in fn.device_counts:
            continue
        gc.collect()
        # The tensor count needs the native test hooks (a wheel has none:
        # there the cases run without it, as the in-place build checks it).
        live = ext.live_tensors() if T.has_hooks() else None
        try:
            fn(n)
            if live is not None:
                # As the `balanced` fixture: XLA's thread may release a
                # copy's source just after the case returns.
                T.settle(lambda: ext.live_tensors() <= live, "a tensor was leaked")
                assert ext.live_tensors() == live, "a tensor was freed twice"
            results[name] = "ok"
        except BaseException:  # noqa: BLE001 - every failure is the case's result
            results[name] = traceback.format_exc()
    pathlib.Path(out).write_text(json.dumps(results))


# --- GPU producers played by host memory ------------------------------------

def aligned(shape, dtype="float32", start=0):
    """Host memory XLA's CPU client can view (it copies unaligned buffers),
    filled with start, start + 1, ..."""
    a = T.aligned_empty(shape, dtype)
    a[...] = (np.arange(a.size) + start).reshape(shape)
    return a


class HostDLPack:
    """A DLPack producer over host memory that advertises `device`, e.g.
    (kDLCUDA, 1) for GPU 1; records the stream each export was asked for."""

    def __init__(self, array, device=(KDLCPU, 0)):
        self.array, self.device, self.streams = array, device, []
        self._holder = T.HostCAI(array)

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        self.streams.append(stream)
        return T.host_capsule(self._holder, versioned=max_version is not None)

    def __dlpack_device__(self):
        return self.device


class HostCAIOn:
    """A CAI producer over host memory whose pointer GPU `ordinal` owns
    (as far as ``cpus_as_gpus`` tells the import path)."""

    def __init__(self, array, ordinal, **cai):
        self.array, self.ordinal = array, ordinal
        self.__cuda_array_interface__ = T.HostCAI(array, **cai).__cuda_array_interface__


@contextlib.contextmanager
def installed():
    jax_overlay.install()
    try:
        yield
    finally:
        jax_overlay.uninstall()


class FakeGpus:
    """What ``cpus_as_gpus`` records: `switches`, the ordinals a producer's
    ``__dlpack__`` was made current for; `owners`, pointer -> ordinal for the
    zero-size CAI path's pointer query."""

    def __init__(self):
        self.switches, self.owners = [], {}


def host_import(real):
    """jaxlib's import for CPU devices standing in for GPUs: the ready
    stream a GPU import is ordered on is one the CPU client has no use for
    (it refuses any), so it is dropped after the caller chose it."""
    def capsule_to_array(cap, device, stream, copy, dl_type):
        return real(cap, device, None, copy, dl_type)
    return capsule_to_array


@contextlib.contextmanager
def cpus_as_gpus():
    """CUDA ordinal k is played by CPU device k: device lookups answer it,
    the ready stream on device k is the number 1000 + k, the native CAI
    plan reads host memory and reports the ordinal its producer names, and
    the device switch around a producer's ``__dlpack__`` is recorded (no
    driver here to switch)."""
    cpus = jax.devices("cpu")
    fake = FakeGpus()
    real_plan = ext.plan_cai_import

    def plan(cai, owner, host):
        # The host plan, as if the pointer belonged to the producer's "GPU".
        return types.SimpleNamespace(**{k: getattr(real_plan(cai, owner, True), k) for k in (
            "capsule", "view", "device_type", "range_start", "alignment", "busy")},
            ordinal=owner.ordinal)

    def on_device(ordinal, fn, *args):
        fake.switches.append(ordinal)
        return fn(*args)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rt, "gpu_device", lambda ordinal: cpus[ordinal])
        mp.setattr(rt, "ready_stream", lambda device: 1000 + device.id)
        mp.setattr(rt, "capsule_to_array", host_import(rt.capsule_to_array))
        mp.setattr(_dlpack, "_gpu_targets", {})
        mp.setattr(ext, "plan_cai_import", plan)
        mp.setattr(ext, "call_on_device", on_device)
        mp.setattr(ext, "device_count", lambda: len(cpus))
        mp.setattr(ext, "pointer_info", lambda ptr: types.SimpleNamespace(
            kind="device", ordinal=fake.owners[ptr], device_ptr=ptr, host_ptr=0,
            range_start=ptr, range_size=0))
        yield fake


if __name__ == "__main__":
    _worker(sys.argv[1], int(sys.argv[2]), sys.argv[3])
