"""jax_overlay: safe, zero-copy, stream-ordered GPU array interchange for JAX.

    import jax_overlay
    x = jax_overlay.from_cuda_array_interface(cupy_array)
    jax_overlay.install()        # jnp.asarray / jnp.array use the same path
"""

from ._config import config
from ._dlpack import from_dlpack
from ._exports import cuda_array_interface
from ._imports import from_cuda_array_interface
from ._install import install, installed, uninstall

__version__ = "0.1.0"
__all__ = ["config", "cuda_array_interface", "from_cuda_array_interface", "from_dlpack",
           "install", "installed", "uninstall"]
