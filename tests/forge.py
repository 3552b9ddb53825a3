"""Test helpers (never in the wheel): run the real import path on host memory, so CI without a
GPU exercises the parser, the capsules, the strided copy and the lifetimes;
and forge DLPack capsules field by field, as a buggy producer would."""

from __future__ import annotations

import ctypes
import gc
import itertools
import re
import threading
import time
from typing import Any


from jax_overlay import _cai, _view
from jax_overlay import _xla_ext as ext
from jax_overlay.doctor import aligned_empty  # noqa: F401  (the tests' too)

from jax_overlay._vocab import KDLCPU as _KDLCPU  # noqa: E402


class HostCAI:
    """Exports a NumPy array's memory through __cuda_array_interface__, the
    way a GPU producer would (the pointer is just host memory here)."""

    def __init__(self, array, *, version=3, stream=None, strides="auto",
                 read_only=False, **extra):
        self.array = array
        self.cai = {
            "shape": tuple(array.shape),
            "typestr": array.dtype.str,
            "data": (array.__array_interface__["data"][0], read_only),
            "version": version,
            "strides": None if array.flags.c_contiguous and strides == "auto"
            else tuple(array.strides) if strides == "auto" else strides,
        }
        if version >= 3:
            self.cai["stream"] = stream
        self.cai.update(extra)

    @property
    def __cuda_array_interface__(self):
        return self.cai


def import_host(obj, *, copy=None, device=None):
    """jax_overlay.from_cuda_array_interface, reading the pointer as host
    memory: the same native plan and Python path, with kDLCPU capsules."""
    arr, copied = _cai.import_cai(obj, copy=copy, host=True)
    return _view.finish(arr, copied, device=device, copy=copy)


def host_cai(x, *, stream=None, read_only=None):
    """jax_overlay.cuda_array_interface of an array in host memory too (a CPU
    array), so CI checks the dict builder on real JAX buffers."""
    return _cai._describe(x, stream, read_only, True)


def settle(condition, what, timeout=30.0):
    """Asserts `condition()` once what a test started has finished.  A
    reference cycle may hold the last reference (one full collection is
    allowed: one per case would cost more than the case), and a copy made by
    JAX (copy=True, device=...) releases its source when XLA's thread drops
    its hold, just after the copy is ready: so poll, bounded by a timeout no
    healthy run comes near."""
    if condition():
        return
    gc.collect()
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.001)


class DLPackHolder:
    """Hands out one capsule through __dlpack__ so NumPy can consume it."""

    def __init__(self, capsule):
        self.capsule = capsule

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        cap, self.capsule = self.capsule, None
        return cap

    def __dlpack_device__(self):
        return (_KDLCPU, 0)


def host_capsule(obj, versioned=False):
    """A kDLCPU capsule straight from an object's CAI dict."""
    view = ext.parse_cai(obj.__cuda_array_interface__)
    return ext.capsule_from_cai(view, obj, _KDLCPU, 0, versioned)


# The native module's test hooks (xla_ext/module.cc's BindTestHooks): only in
# a build made with JAX_OVERLAY_TESTING=1 (tools/test.sh, Bazel), never in a
# wheel.  Tests that call one are skipped, saying so, where the module has none.
HOOKS = frozenset({
    "chained_legacy", "live_tensors", "released_tensors", "handed_off", "handed_off_run",
    "run_handed_off", "memory_kind", "stream_idle", "check_strided_plan", "fast_divisor",
    "launch_strided_copy", "strided_copy_ptx", "_delete_on_native_thread",
    "_delete_with_pending_error"})
NO_HOOKS = ("the native module was built without its test hooks (a wheel has none; "
            "JAX_OVERLAY_TESTING=1 builds them, as tools/test.sh does)")
HOOK_CALL = re.compile(r"\bext\.(" + "|".join(sorted(HOOKS)) + r")\b")


def has_hooks():
    return bool(getattr(ext, "TESTING", False))



class CopyRoutes:
    """Counts the strided copies per route ("kernel", "gather") while it is
    installed over _strided._copy: `with CopyRoutes() as routes: ...`."""

    def __init__(self):
        self.counts = {"kernel": 0, "gather": 0}

    def __enter__(self):
        from jax_overlay import _strided
        self._strided, self._real = _strided, _strided._copy

        def counted(route, fn, envelope, itemsize):
            self.counts[route] += 1
            return self._real(route, fn, envelope, itemsize)
        _strided._copy = counted
        return self.counts

    def __exit__(self, *exc):
        self._strided._copy = self._real


# Forged DLPack capsules ---------------------------------------------------
#
# A foreign producer written with ctypes: every field of the managed tensor,
# the capsule's name and the version are the caller's, malformed or not, so
# the fuzz tests can hand the import path anything a buggy producer could.
# The producer's side keeps its promises: its deleter frees exactly its own
# tensor, and its capsule destructor calls the deleter only while the
# capsule is unconsumed (its name unchanged).  Every deleter call is counted
# per tensor, so a test can check that each forged tensor was released
# exactly once.


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8),
                ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice),
                ("ndim", ctypes.c_int32), ("dtype", _DLDataType),
                ("shape", ctypes.c_void_p), ("strides", ctypes.c_void_p),
                ("byte_offset", ctypes.c_uint64)]


_DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", _DELETER)]


class _DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32),
                ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER),
                ("flags", ctypes.c_uint64), ("dl_tensor", _DLTensor)]


# Private prototypes: the capsule destructor gets the dying capsule as a raw
# pointer, which must not become a py_object (that would resurrect it), and
# the name is passed as a pointer the forged entry keeps alive (a capsule
# keeps the name pointer, not a copy).
_capsule_new = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_void_p,
                                 ctypes.c_void_p)(("PyCapsule_New", ctypes.pythonapi))
_capsule_name = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)(
    ("PyCapsule_GetName", ctypes.pythonapi))
_capsule_context = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)(
    ("PyCapsule_GetContext", ctypes.pythonapi))
_capsule_set_context = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_void_p)(
    ("PyCapsule_SetContext", ctypes.pythonapi))

_forged: dict[int, tuple] = {}   # struct address -> (id, struct, keep-alives, name pointer)
_forged_ids: dict[int, int] = {}  # id -> struct address
forged_deletes: dict[int, int] = {}  # id -> deleter calls; -1 counts calls for no live tensor
forged_delete_threads: set[int] = set()  # threading.get_ident() of every deleter call
_ids = itertools.count(1)


def _release(address):
    forged_delete_threads.add(threading.get_ident())
    entry = _forged.pop(address, None)
    key = -1 if entry is None else entry[0]
    forged_deletes[key] = forged_deletes.get(key, 0) + 1
    if entry is not None:
        del _forged_ids[key]


# The deleter a consumer calls (on any thread: ctypes takes the GIL).
_forged_deleter = _DELETER(_release)


@ctypes.CFUNCTYPE(None, ctypes.c_void_p)
def _forged_destructor(capsule):
    # A null context is None, which no entry has.
    address: Any = _forged_ids.get(_capsule_context(capsule))
    entry = _forged.get(address)
    if entry is None or _capsule_name(capsule) != entry[3]:
        return  # consumed (renamed) or already released: not ours to free
    _release(address)


def forge_capsule(*, data, device=(1, 0), ndim=None, dtype=(2, 32, 1), shape=(),
                  strides=None, byte_offset=0, versioned=True, version=(1, 1),
                  flags=0, name=None, keep=None):
    """(capsule, id): a DLPack capsule with exactly these fields.  `shape` or
    `strides` None is a null pointer; `ndim` defaults to len(shape) (a larger
    one makes the consumer read past the arrays: only smaller, or with a null
    shape, is safe); `name` defaults to the right one for `versioned`, False
    is a null name; `keep` stays alive until the tensor's deleter runs (the
    memory `data` points into)."""
    key = next(_ids)
    arrays = []

    def int64s(values):
        if values is None:
            return None
        arr = (ctypes.c_int64 * max(len(values), 1))(*values)
        arrays.append(arr)
        return ctypes.addressof(arr)

    if ndim is None:
        ndim = 0 if shape is None else len(shape)
    tensor = _DLTensor(data, _DLDevice(*device), ndim, _DLDataType(*dtype),
                       int64s(shape), int64s(strides), byte_offset)
    managed: ctypes.Structure
    if versioned:
        managed = _DLManagedTensorVersioned(version[0], version[1], None,
                                            _forged_deleter, flags, tensor)
    else:
        managed = _DLManagedTensor(tensor, None, _forged_deleter)
    if name is None:
        name = "dltensor_versioned" if versioned else "dltensor"
    raw_name = None if name is False else ctypes.create_string_buffer(
        name.encode() if isinstance(name, str) else name)
    name_ptr = None if raw_name is None else ctypes.addressof(raw_name)
    address = ctypes.addressof(managed)
    _forged[address] = (key, managed, (arrays, keep, raw_name), name_ptr)
    _forged_ids[key] = address
    cap = _capsule_new(address, name_ptr, ctypes.cast(_forged_destructor, ctypes.c_void_p))
    _capsule_set_context(cap, key)
    return cap, key


def forged_alive():
    """Forged tensors whose deleter has not run."""
    return len(_forged)
