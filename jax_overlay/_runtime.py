"""What the import and export paths need from JAX: devices, their streams,
the one jaxlib entry point that turns a DLPack capsule into an array."""

from __future__ import annotations

import functools

import jax
from jax._src import dtypes as _dtypes
from jax._src import xla_bridge as _xb
from jax._src.lib import _jax

# jaxlib's DLPack import: dlpack_managed_tensor_to_buffer(capsule, device,
# stream, copy, dl_device_type).  Every import path in this package ends here.
capsule_to_array = _jax.dlpack_managed_tensor_to_buffer

ArrayImpl = type(jax.numpy.zeros(()))


@functools.cache
def gpu_backend():
    try:
        return _xb.get_backend("cuda")
    except RuntimeError as e:
        raise BufferError(
            "JAX has no CUDA backend in this process, so it cannot hold GPU "
            "memory; install jax with its CUDA plugin (pip install "
            f"'jax[cuda13]') or keep the array on the host ({e})") from None


_devices: dict[int, object] = {}
_ready_streams: dict[object, int] = {}


def gpu_device(ordinal: int):
    """The JAX device of CUDA device `ordinal` (as libcuda numbers it)."""
    dev = _devices.get(ordinal)
    if dev is None:
        try:
            dev = gpu_backend().device_from_local_hardware_id(ordinal)
        except Exception as e:  # jaxlib raises its own runtime error type
            raise BufferError(
                f"the memory belongs to CUDA device {ordinal}, which JAX does "
                f"not see in this process ({e}); check CUDA_VISIBLE_DEVICES"
            ) from None
        _devices[ordinal] = dev
    return dev


@functools.cache
def host_device():
    return jax.devices("cpu")[0]


def ready_stream(device) -> int:
    """The stream JAX orders DLPack imports on (the definition event of an
    import is recorded there); stable for the life of the device."""
    s = _ready_streams.get(device)
    if s is None:
        s = int(device.get_stream_for_external_ready_events())
        _ready_streams[device] = s
    return s


def canonical(dtype):
    return _dtypes.canonicalize_dtype(dtype)


def memory_sharding(device, kind: str):
    return jax.sharding.SingleDeviceSharding(device, memory_kind=kind)
