# The native core builds with a C++17 compiler and pybind11 alone: CUDA is
# loaded at run time, so no toolkit is needed here.
import glob

from pybind11.setup_helpers import Pybind11Extension
from setuptools import setup

setup(
    ext_modules=[
        Pybind11Extension(
            "jax_overlay._xla_ext",
            sorted(glob.glob("xla_ext/*.cc")),
            include_dirs=["xla_ext"],
            cxx_std=17,
            libraries=["dl"],
        )
    ],
)
