"""Test helpers: run the real import path on host memory, so CI without a
GPU exercises the parser, the capsules, the strided copy and the lifetimes."""

from __future__ import annotations

import jax
import numpy as np

from . import _imports
from . import _xla_ext as ext

_KDLCPU = 1


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
    arr, copied = _imports.import_cai(obj, copy=copy, host=True)
    return _imports.finish(arr, copied, device=device, copy=copy)


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


def aligned_empty(shape, dtype, alignment=256):
    dtype = np.dtype(dtype)
    n = int(np.prod(shape)) * dtype.itemsize
    buf = np.empty(n + alignment, np.uint8)
    off = (-buf.ctypes.data) % alignment
    return buf[off:off + n].view(dtype).reshape(shape)
