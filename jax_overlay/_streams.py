"""Framework stream objects over CUDA stream handles that the framework does
not own (XLA's compute stream, a producer's stream): made once per handle
and never destroyed by the framework.  CuPy and PyTorch are imported by the
caller, which passes its module."""

from __future__ import annotations

import warnings
from typing import Any


def cupy_stream(cupy: Any, handle: int, device_id: int = -1) -> Any:
    """A ``cupy.cuda.ExternalStream`` over `handle`.

    CuPy 14 deprecates ``ExternalStream`` in favour of
    ``Stream.from_external``, but the ``Stream`` that returns destroys its
    handle when the object is collected, which would destroy a stream XLA
    still uses.  ExternalStream never destroys it; only its deprecation
    warning is silenced, once per handle the caller caches.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return cupy.cuda.ExternalStream(handle, device_id)


def torch_stream(torch: Any, handle: int, ordinal: int) -> Any:
    """A ``torch.cuda.ExternalStream`` over `handle` on GPU `ordinal`."""
    return torch.cuda.ExternalStream(handle, device=torch.device("cuda", ordinal))
