"""Every private jax_overlay module the benchmarks use, imported here and
nowhere else in benchmarks/: when the package moves one, re-point its line
(the comment says who uses what).  The public API (jax_overlay.install,
from_dlpack, foreign, config, doctor, ...) is imported from the package
directly."""

# ruff: noqa: F401 - re-exported for the plug-ins
from jax_overlay import _cai  # probe_dlpack: cuda_array_interface
from jax_overlay import _dlpack  # probe_dlpack: _request, import_dlpack, to_dlpack
from jax_overlay import _foreign  # probe_foreign: _make_callback (wrapped to time each callback)
from jax_overlay import _runtime  # compute_stream, gpu_device, capsule_to_array, byte_strides, ...
from jax_overlay import _strided  # probe_call_cost, probe_strided: plan, kernel_plan, _kernel_fn, gather
from jax_overlay import _view  # probe_strided: _row_major
from jax_overlay import _vocab  # device codes, alignment rules (probe_call_cost, probe_strided)
from jax_overlay import _xla_ext  # the native core: parse_cai, plan_*_import, order_after, capsules, ...
from jax_overlay.doctor import JAX_N, cycles, jax_fill, spin_fill, torch_sleep  # busy producers
from jax_overlay.peers import cupy as _cupy_peer
from jax_overlay.peers._base import Adapter  # probe_foreign: Adapter.write, the output through a view


def cupy_stream(cupy, handle, device_id=-1):
    """A CuPy stream over a raw handle it never destroys (the CuPy peer's)."""
    return _cupy_peer.PEER.stream(handle, device_id)
