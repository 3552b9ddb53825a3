# The native core builds with a C++17 compiler and pybind11 alone: CUDA is
# loaded at run time, so no toolkit is needed here.
#
# JAX_OVERLAY_SANITIZE=1 builds it with AddressSanitizer and
# UndefinedBehaviorSanitizer (any UB aborts): for tools/sanitize.sh, which
# loads it into a Python started with the ASan runtime preloaded.
import glob
import os

from pybind11.setup_helpers import Pybind11Extension
from setuptools import setup

# `null` stays recoverable so that tools/ubsan.supp can silence one report
# from pybind11's own header (UBSAN_OPTIONS=halt_on_error=1 still stops on
# any other).
SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined",
            "-fsanitize-recover=null", "-fno-omit-frame-pointer", "-g", "-O1"]
sanitize = os.environ.get("JAX_OVERLAY_SANITIZE", "0") not in ("", "0")

setup(
    ext_modules=[
        Pybind11Extension(
            "jax_overlay._xla_ext",
            sorted(glob.glob("xla_ext/*.cc")),
            include_dirs=["xla_ext"],
            cxx_std=17,
            libraries=["dl"],
            extra_compile_args=SANITIZE if sanitize else [],
            extra_link_args=SANITIZE[:1] if sanitize else [],
        )
    ],
)
