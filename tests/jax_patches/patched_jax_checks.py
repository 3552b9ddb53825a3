"""Behaviour of the Python hunks of patches/jax, on the CPU, against a copy of
the jax release nearest the series' base (BASE's `wheel`) with those hunks
applied.

tools/check_jax_patches.py --wheel runs this file in a fresh interpreter whose
`jax` is that patched copy (JAX_PATCHED_COPY names it) and whose jaxlib is the
stock one of the same release.  The C++ hunks are not built here, so each test
uses jaxlib's real entry points where the stock jaxlib serves the behaviour
under test, and replaces one only where the hunk's behaviour is the routing
to it (the versioned export, a GPU import on a CPU-only machine).  Where a
hunk is gated on the new jaxlib (`jaxlib_extension_version`), the gate is
raised for the test and the stock value is tested too.

Test names start with the number of the patch they check; the checker
reports per patch from them.  Tests whose names say "still" guard behaviour
the series keeps and pass on the unpatched release too; every other test
fails there (tools/check_jax_patches.py --wheel --baseline shows it).
"""

import ctypes
import os
import pathlib

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax._src import dlpack as dlpack_src
from jax._src.lib import _jax
from jax._src.numpy import array_constructors
from jax._src.typing import DLDeviceType

PATCHED = os.environ.get("JAX_PATCHED_COPY")
if not PATCHED:
    raise RuntimeError(
        "patched_jax_checks.py runs under tools/check_jax_patches.py --wheel, "
        "which sets JAX_PATCHED_COPY to the patched copy of jax")
# Testing the installed, unpatched jax by mistake would say nothing.
assert pathlib.Path(jax.__file__).resolve().is_relative_to(
    pathlib.Path(PATCHED).resolve()), (jax.__file__, PATCHED)

# The gates of patches 0001 and 0003 (jaxlib_extension_version), as the
# checker read them from the series it checks: 480 and 482 for the series on
# jax main (patches/jax).
_GATES = dict(item.split("=") for item in os.environ.get("JAX_PATCH_GATES", "").split(",")
              if "=" in item)
CAI_JAXLIB = int(_GATES.get("0001", 480))
VERSIONED_JAXLIB = int(_GATES.get("0003", 482))


def _capsule_name(capsule):
    get_name = ctypes.pythonapi.PyCapsule_GetName
    get_name.restype = ctypes.c_char_p
    get_name.argtypes = [ctypes.py_object]
    return get_name(capsule).decode()


def _aligned(array, alignment=256):
    """A copy of `array` whose data pointer is `alignment`-aligned, which any
    XLA client can view."""
    buffer = np.empty(array.nbytes + alignment, np.uint8)
    start = -buffer.ctypes.data % alignment
    out = buffer[start:start + array.nbytes].view(array.dtype)
    out[...] = array.ravel()
    return out.reshape(array.shape)


class _Producer:
    """A DLPack producer over a NumPy array that records how it is called;
    `dl_device_type` is what it advertises.  It always returns a legacy
    capsule, which the specification allows whatever `max_version` says and
    which the stock jaxlib reads: the request is what the tests check."""

    def __init__(self, array, dl_device_type=DLDeviceType.kDLCPU):
        self.array = array
        self.dl_device_type = dl_device_type
        self.calls = []

    def __dlpack_device__(self):
        return self.dl_device_type, 0

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None,
                   copy=None):
        self.calls.append({"stream": stream, "max_version": max_version,
                           "copy": copy})
        return self.array.__dlpack__(stream=stream)


class _LegacyProducer(_Producer):
    """A producer that predates DLPack 1.0: no max_version or copy."""

    def __dlpack__(self, stream=None):
        self.calls.append({"stream": stream})
        return self.array.__dlpack__(stream=stream)


class _CaiOnly:
    """A producer with only the CUDA Array Interface (never dereferenced)."""

    def __init__(self, array):
        self.array = array

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.array.shape, "typestr": self.array.dtype.str,
                "data": (self.array.ctypes.data, False), "version": 3,
                "strides": None, "stream": None}


# 0001: CUDA Array Interface import ----------------------------------------


class _FakeGpuBackend:
    """The real default backend, saying it is CUDA."""

    platform_version = "cuda 12.9"

    def __init__(self, backend):
        self._backend = backend

    def __getattr__(self, name):
        return getattr(self._backend, name)


class _FakeCudaPlugin:
    def get_device_ordinal(self, pointer):
        return 0

    def wait_for_stream(self, stream, producer_stream):
        raise AssertionError("only the C++ import calls it")


def test_0001_cai_import_hands_owner_and_stream_waiter_to_jaxlib(monkeypatch):
    plugin = _FakeCudaPlugin()
    seen = {}

    def cuda_array_interface_to_buffer(**kwargs):
        seen.update(kwargs)
        return jnp.zeros(3)

    monkeypatch.setattr(array_constructors, "jaxlib_extension_version",
                        CAI_JAXLIB)
    backend = _FakeGpuBackend(array_constructors.xla_bridge.get_backend())
    monkeypatch.setattr(array_constructors.xla_bridge, "get_backend",
                        lambda *a: backend)
    monkeypatch.setattr(array_constructors, "cuda_plugin_extension", plugin)
    monkeypatch.setattr(array_constructors._jax,
                        "cuda_array_interface_to_buffer",
                        cuda_array_interface_to_buffer)
    producer = _CaiOnly(np.zeros(3, np.float32))
    jnp.asarray(producer)
    assert seen["owner"] is producer
    assert seen["wait_for_stream"] == plugin.wait_for_stream
    assert seen["device_id"] == 0
    assert seen["gpu_backend"] is backend


def test_0001_cai_import_with_stock_jaxlib_uses_its_signature():
    # The stock binding rejects the new keywords with TypeError; called as
    # it expects, it reaches its own check for a GPU plugin.
    assert array_constructors.jaxlib_extension_version < CAI_JAXLIB
    with pytest.raises(jax.errors.JaxRuntimeError, match="requires CUDA"):
        jnp.asarray(_CaiOnly(np.zeros(3, np.float32)))


# 0003: DLPack 1.x ---------------------------------------------------------


@pytest.fixture
def versioned_jaxlib(monkeypatch):
    monkeypatch.setattr(dlpack_src, "jaxlib_extension_version",
                        VERSIONED_JAXLIB)
    # The series derives DLPACK_VERSION from the gate when jax/_src/dlpack.py
    # is imported ((0, 8) below it): a jaxlib past the gate reads (1, 0).
    monkeypatch.setattr(dlpack_src, "DLPACK_VERSION", (1, 0))


def test_0003_import_asks_for_a_versioned_tensor(versioned_jaxlib):
    x = np.arange(6, dtype=np.float32)
    producer = _Producer(x)
    np.testing.assert_array_equal(jax.dlpack.from_dlpack(producer), x)
    assert producer.calls == [
        {"stream": None, "max_version": (1, 0), "copy": None}]


def test_0003_import_falls_back_to_the_legacy_call(versioned_jaxlib):
    x = np.arange(6, dtype=np.float32)
    producer = _LegacyProducer(x)
    np.testing.assert_array_equal(jax.dlpack.from_dlpack(producer), x)
    assert producer.calls == [{"stream": None}]


def test_0003_import_passes_copy_false_but_not_copy_true(versioned_jaxlib):
    x = _aligned(np.arange(6, dtype=np.float32))  # Viewable: copy=False.
    producer = _Producer(x)
    for copy in (False, True, None):
        y = jax.dlpack.from_dlpack(producer, copy=copy)
        np.testing.assert_array_equal(y, x)
    assert [call["copy"] for call in producer.calls] == [False, None, None]


def test_0003_stock_jaxlib_gets_legacy_capsules():
    assert dlpack_src.jaxlib_extension_version < VERSIONED_JAXLIB
    x = np.arange(6, dtype=np.float32)
    producer = _Producer(x)
    np.testing.assert_array_equal(jax.dlpack.from_dlpack(producer), x)
    assert producer.calls == [
        {"stream": None, "max_version": None, "copy": None}]
    # Export: max_version=(1, 0) is answered with a legacy capsule, which the
    # specification allows, since this jaxlib cannot build a versioned one.
    capsule = jnp.arange(4.0).__dlpack__(max_version=(1, 0))
    assert _capsule_name(capsule) == "dltensor"


@pytest.mark.parametrize("max_version, copy, expected", [
    (None, None, {}),
    ((0, 8), None, {}),
    ((1, 0), None, {"versioned": True, "copied": False}),
    ((1, 3), None, {"versioned": True, "copied": False}),
    ((2, 0), None, {"versioned": True, "copied": False}),
    ((1, 0), True, {"versioned": True, "copied": True}),
    ((1, 0), False, {"versioned": True, "copied": False}),
])
def test_0003_export_asks_jaxlib_for_the_negotiated_capsule(
        versioned_jaxlib, monkeypatch, max_version, copy, expected):
    seen = []

    def buffer_to_dlpack_managed_tensor(buffer, stream=None, **kwargs):
        seen.append(kwargs)
        return "capsule"

    monkeypatch.setattr(dlpack_src._jax, "buffer_to_dlpack_managed_tensor",
                        buffer_to_dlpack_managed_tensor)
    x = jnp.arange(4.0)
    assert x.__dlpack__(max_version=max_version, copy=copy) == "capsule"
    assert seen == [expected]


def test_0003_export_below_0_5_is_refused(versioned_jaxlib):
    with pytest.raises(BufferError, match="does not support any version"):
        jnp.arange(4.0).__dlpack__(max_version=(0, 4))


# 0004: kDLCUDAManaged -----------------------------------------------------


def test_0004_managed_memory_is_imported_as_device_memory(monkeypatch):
    # No CUDA here: the "cuda" backend is the CPU one, which jaxlib's stock
    # DLPack import treats the same way (a view in the default memory space).
    assert DLDeviceType(13).name == "kDLCUDAManaged"
    asked = []
    get_backend = dlpack_src.xla_bridge.get_backend

    def fake_get_backend(platform=None):
        asked.append(platform)
        return get_backend("cpu")

    monkeypatch.setattr(dlpack_src.xla_bridge, "get_backend", fake_get_backend)
    x = _aligned(np.arange(8, dtype=np.float32))
    producer = _LegacyProducer(x, 13)
    y = jax.dlpack.from_dlpack(producer)
    assert "cuda" in asked
    assert y.unsafe_buffer_pointer() == x.ctypes.data  # A view.
    assert y.sharding.memory_kind == "device"
    np.testing.assert_array_equal(y, x)


def test_0004_managed_memory_still_is_not_an_export_target():
    with pytest.raises(BufferError, match="unsupported device type"):
        jnp.arange(4).__dlpack__(dl_device=(13, 0))


# 0005: foreign arrays in jnp.asarray, jnp.array, jax.device_put -----------


CONVERSIONS = {
    "asarray": lambda x: jnp.asarray(x),
    "array": lambda x: jnp.array(x),
    "device_put": lambda x: jax.device_put(x),
    "device_put_pytree": lambda x: jax.device_put({"a": [x]})["a"][0],
}


@pytest.mark.parametrize("convert", CONVERSIONS.values(), ids=CONVERSIONS)
@pytest.mark.parametrize("dl_device_type", [2, 3, 13, 10], ids=[
    "kDLCUDA", "kDLCUDAHost", "kDLCUDAManaged", "kDLROCM"])
def test_0005_gpu_dlpack_producer_goes_through_from_dlpack(
        monkeypatch, convert, dl_device_type):
    x = np.arange(6, dtype=np.float32)
    producer = _Producer(x, dl_device_type)
    imported = []

    def from_dlpack(obj):
        imported.append(obj)
        return jnp.asarray(x)

    monkeypatch.setattr(dlpack_src, "from_dlpack", from_dlpack)
    np.testing.assert_array_equal(convert(producer), x)
    assert imported == [producer]


def test_0005_dlpack_is_preferred_over_the_cuda_array_interface(monkeypatch):
    class Both(_Producer):
        @property
        def __cuda_array_interface__(self):
            raise AssertionError("DLPack should have been used")

    monkeypatch.setattr(dlpack_src, "from_dlpack",
                        lambda obj: jnp.asarray(obj.array))
    x = np.arange(3, dtype=np.float32)
    np.testing.assert_array_equal(
        jax.device_put(Both(x, 2)), x)  # kDLCUDA


def test_0005_host_dlpack_producer_still_takes_the_numpy_path(monkeypatch):
    class HostProducer(_Producer):
        def __array__(self, dtype=None, copy=None):
            return np.asarray(self.array, dtype=dtype)

    monkeypatch.setattr(dlpack_src, "from_dlpack", pytest.fail)
    x = np.arange(3, dtype=np.float32)
    producer = HostProducer(x)
    np.testing.assert_array_equal(jnp.asarray(producer), x)
    assert producer.calls == []


def test_0005_device_put_takes_cuda_array_interface_objects():
    # Routed to the CAI import, whose stock jaxlib binding then asks for a
    # GPU plugin (stock device_put raised TypeError: not a valid JAX type).
    with pytest.raises(jax.errors.JaxRuntimeError, match="requires CUDA"):
        jax.device_put(_CaiOnly(np.zeros(3, np.float32)))


def test_0005_device_put_narrows_64_bit_imports(monkeypatch):
    with jax.enable_x64(True):
        wide = jnp.arange(3, dtype=jnp.int64)
    monkeypatch.setattr(array_constructors, "_cuda_array_interface_to_array",
                        lambda obj: wide)
    y = jax.device_put(_CaiOnly(np.zeros(3, np.int64)))
    assert y.dtype == (np.int64 if jax.config.jax_enable_x64 else np.int32)
    np.testing.assert_array_equal(y, [0, 1, 2])


def test_0005_native_leaves_are_not_probed(monkeypatch):
    monkeypatch.setattr(array_constructors, "import_gpu_array", pytest.fail)
    tree = {"a": np.ones(2), "b": 1.0, "c": jnp.ones(2), "d": np.float32(2)}
    jax.device_put(tree)
