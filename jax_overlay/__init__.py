"""Room: the public names.  jax_overlay: safe, zero-copy, stream-ordered GPU array interchange for JAX.

    import jax_overlay
    x = jax_overlay.from_cuda_array_interface(cupy_array)
    y = jax_overlay.from_dlpack(torch_tensor)
    jax_overlay.install()        # JAX's own entry points use the same paths
    shards = jax_overlay.to_shards(sharded_x)     # per-device export
    x = jax_overlay.from_shards([t0, t1], sharding)  # per-device import
    h = jax_overlay.share(params)   # picklable; in another process:
    params = jax_overlay.open_shared(h)          # zero-copy, same GPU
    ch = jax_overlay.channel(params); ch.send(params)  # a re-sync every step;
    rx = jax_overlay.open_channel(ch.name); params = rx.recv()   # there
    f = jax_overlay.foreign(torch_fn, framework="torch", result_shape_dtypes=...)
"""

from ._version import __version__
from . import _native  # noqa: F401  (first: ImportError saying how to build a missing or stale native module)
from ._config import config
from . import errors
from .errors import CopyRequiredError, ForeignError
from ._cai import cuda_array_interface
from ._dlpack import to_dlpack
from ._foreign import foreign, foreign_stream
from ._route import from_cuda_array_interface, from_dlpack
from ._install import install, installed, uninstall
from ._shards import Shard, from_shards, to_shards
from ._ipc import Share, open_shared, share
from ._channel import Channel, ChannelName, Receiver, channel, open_channel

__all__ = ["Channel", "ChannelName", "CopyRequiredError", "ForeignError", "Receiver", "Shard",
           "channel", "config", "cuda_array_interface", "errors",
           "foreign", "foreign_stream", "from_cuda_array_interface", "from_dlpack", "from_shards", "install",
           "installed", "open_channel", "open_shared", "share", "Share", "to_dlpack", "to_shards", "uninstall"]
