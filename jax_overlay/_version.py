"""Room: the version of jax_overlay, in this one place.

pyproject.toml reads ``__version__`` from here (setuptools' dynamic
version), ``jax_overlay.__version__`` is this, and the build compiles all
of these into the native module (xla_ext/build_info.py writes them into a
header for setup.py and for Bazel), so that ``import jax_overlay`` can tell
a native module built from other sources, or for another jaxlib, from the
right one (jax_overlay/_native.py).

Plain literals only: setup.py and setuptools read this file without
importing the package (which needs the native module and jax).
"""

__version__ = "0.1.0"

# The interface between the Python package and its native module
# (xla_ext/module.cc).  Bump it whenever a binding changes in a way the
# Python side relies on (a name, an argument, a return value): a native
# module built with another number is refused at import, whatever the
# version says.
ABI = 4

# The jaxlib releases this version is validated against: at least
# JAXLIB_MIN and below JAXLIB_BELOW (release numbers, compared
# component by component).  The native module does not link jaxlib, but
# the Python side drives jaxlib's private DLPack and FFI entry points,
# so a jaxlib outside this range is refused at import.  Keep it in step
# with the jax requirement in pyproject.toml (tests/cpu/test_packaging.py
# checks that).
# 0.12.1 is validated: its XLA:CPU marks a donated input deleted even where
# a DLPack consumer's external reference makes it copy instead of reusing
# the buffer; the consumer's view stays valid (tests/cpu/test_dlpack_export.py).
JAXLIB_MIN = "0.10"
JAXLIB_BELOW = "0.12.2"
