"""Room: the configuration.  Switches, read from the environment at import and settable at run time:

    jax_overlay.config.cai_sync = False       # or JAX_OVERLAY_CAI_SYNC=0
    jax_overlay.config.cai_read_only = True   # or JAX_OVERLAY_CAI_READ_ONLY=1
    jax_overlay.config.strided_kernel = False # or JAX_OVERLAY_STRIDED_KERNEL=0
    jax_overlay.config.strict_copy = True     # or JAX_OVERLAY_STRICT_COPY=1
    jax_overlay.config.agree_timeout_s = 60.0 # or JAX_OVERLAY_AGREE_TIMEOUT_S=60
    jax_overlay.config.share_timeout_s = 60.0 # or JAX_OVERLAY_SHARE_TIMEOUT_S=60
    jax_overlay.config.saved_graphs = 16      # or JAX_OVERLAY_SAVED_GRAPHS=16
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any


def _flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={value!r}: use 1 or 0")


def _number(name: str, default: Any, kind: type, ok: Callable[[Any], bool], use: str) -> Any:
    """The environment's `name` as a `kind`, `default` where unset; a value
    `ok` refuses (or none of `kind`) is a ValueError saying what to `use`."""
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        number = kind(value)
    except ValueError:
        number = None
    if number is None or not ok(number):
        raise ValueError(f"{name}={value!r}: use {use}")
    return number


def _count(name: str, default: int) -> int:
    return _number(name, default, int, lambda n: n >= 0, "a whole number, 0 or more")


def _seconds(name: str, default: float) -> float:
    return _number(name, default, float, lambda s: s > 0, "a positive number of seconds")


class Config:
    """cai_sync: the CAI export orders its ``stream`` after the array's
    pending computation (default).  Off, it exports ``stream: None`` and the
    consumer must synchronise itself (e.g. ``x.block_until_ready()``), as
    with ``CUPY_CUDA_ARRAY_INTERFACE_SYNC`` / ``NUMBA_CUDA_ARRAY_INTERFACE_SYNC``.

    cai_read_only: the ``read_only`` flag of the CAI export.  Off by default,
    as CuPy, Numba and PyTorch export: PyTorch refuses read-only CAI, and
    CuPy and Numba ignore the flag anyway.  JAX arrays are immutable all the
    same: writing through an exported pointer is undefined behaviour in JAX.
    Turn it on for consumers that honour the flag.

    strided_kernel: on CUDA, the one copy of a strided or misaligned import
    runs jax_overlay's own kernel as an XLA custom call (default).  Off, an
    XLA gather writes it, as it does on other platforms.

    strict_copy: ``copy=False`` also refuses the conversion of 64-bit data
    to 32 bits (JAX's default mode), as the Array API reads ``copy=False``.
    Off by default: stock JAX converts whatever ``copy`` says, and code
    that passes ``copy=False`` for every tensor relies on it.

    agree_timeout_s: how long ``from_shards`` under ``jax.distributed`` waits
    for every other process's account of its shards before it raises (a
    process that never calls it, or died): a clear error, never a hang.

    share_timeout_s: how long ``open_shared`` waits for the exporting
    process to answer (an exporter stopped in a debugger, or whose socket a
    forked child still holds after the exporter died): a clear error, never
    a hang.

    saved_graphs: how many forward graphs one ``foreign(...,
    vjp="autograd")`` function keeps for backward calls that have not run
    yet (each holds the activations its backward needs).  A backward runs
    its own graph and releases it; past this many waiting (forwards whose
    backward never comes), the oldest is released, and its backward, if it
    comes after all, runs ``fn`` again.  0 keeps none."""

    cai_sync: bool
    cai_read_only: bool
    strided_kernel: bool
    strict_copy: bool
    agree_timeout_s: float
    share_timeout_s: float
    saved_graphs: int

    def __init__(self) -> None:
        self.cai_sync = _flag("JAX_OVERLAY_CAI_SYNC", True)
        self.cai_read_only = _flag("JAX_OVERLAY_CAI_READ_ONLY", False)
        self.strided_kernel = _flag("JAX_OVERLAY_STRIDED_KERNEL", True)
        self.strict_copy = _flag("JAX_OVERLAY_STRICT_COPY", False)
        self.agree_timeout_s = _seconds("JAX_OVERLAY_AGREE_TIMEOUT_S", 60.0)
        self.share_timeout_s = _seconds("JAX_OVERLAY_SHARE_TIMEOUT_S", 60.0)
        self.saved_graphs = _count("JAX_OVERLAY_SAVED_GRAPHS", 16)


config = Config()
