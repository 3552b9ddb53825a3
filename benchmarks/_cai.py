"""CUDA Array Interface wrappers the benchmarks hand to imports: another
array's CAI with a chosen stream, and host memory exported as a GPU producer
would; nothing here reaches into tests/."""

from __future__ import annotations

from jax_overlay.doctor import WithStream  # noqa: F401  (the suite's too)


class HostCAI:
    """Exports a NumPy array's memory through __cuda_array_interface__, the
    way a GPU producer would (the pointer is host memory: pinned, for the
    pinned -> device copy)."""

    def __init__(self, array, *, version=3, stream=None):
        self.array = array
        self.cai = {"shape": tuple(array.shape), "typestr": array.dtype.str,
                    "data": (array.__array_interface__["data"][0], False), "version": version,
                    "strides": None if array.flags.c_contiguous else tuple(array.strides)}
        if version >= 3:
            self.cai["stream"] = stream

    @property
    def __cuda_array_interface__(self):
        return self.cai
