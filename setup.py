# The native core builds with a C++17 compiler and pybind11 alone: CUDA is
# loaded at run time, so no toolkit is needed here.
#
# JAX_OVERLAY_SANITIZE=1 builds it with AddressSanitizer and
# UndefinedBehaviorSanitizer (any UB aborts): for tools/sanitize.sh, which
# loads it into a Python started with the ASan runtime preloaded.
import glob
import os
import runpy

from pybind11.setup_helpers import Pybind11Extension
from setuptools import setup

# `null` stays recoverable so that tools/ubsan.supp can silence one report
# from pybind11's own header (UBSAN_OPTIONS=halt_on_error=1 still stops on
# any other).
SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined",
            "-fsanitize-recover=null", "-fno-omit-frame-pointer", "-g", "-O1"]
sanitize = os.environ.get("JAX_OVERLAY_SANITIZE", "0") not in ("", "0")

# The version, native ABI number and supported jaxlib range of
# jax_overlay/_version.py, and the jaxlib installed here, compiled into the
# extension (import jax_overlay checks them): the generated header lives in
# build/, and it and _version.py are dependencies, so a version bump
# rebuilds the extension.
build_info = runpy.run_path(os.path.join("xla_ext", "build_info.py"))
gen_dir = os.path.join("build", "gen")
# JAX_OVERLAY_TESTING=1 (tools/test.sh's in-place build) compiles in the
# test hooks; a wheel (pip's build) has none.
testing = os.environ.get("JAX_OVERLAY_TESTING", "0") not in ("", "0")
build_info["write"](os.path.join("jax_overlay", "_version.py"),
                    os.path.join(gen_dir, build_info["HEADER"]), testing)

setup(
    ext_modules=[
        Pybind11Extension(
            "jax_overlay._xla_ext",
            sorted(glob.glob("xla_ext/*.cc")),
            include_dirs=["xla_ext", gen_dir],
            depends=sorted(glob.glob("xla_ext/*.h")) + [
                os.path.join(gen_dir, build_info["HEADER"]),
                os.path.join("jax_overlay", "_version.py")],
            cxx_std=17,
            libraries=["dl"],
            extra_compile_args=SANITIZE if sanitize else [],
            extra_link_args=SANITIZE[:1] if sanitize else [],
        )
    ],
)
