"""Room: the vocabulary, at the bottom.  The DLPack device types both
protocols' plans name memory with, the alignment a zero-copy view needs,
and the dtypes NumPy names by a type string: each stated once, the codes
and rules by the native core (xla_ext/module.cc), which its C++ uses too.
Imports nothing of jax_overlay's but the native module."""

from __future__ import annotations

import numpy as np

from . import _xla_ext as ext

# DLPack device types (dlpack.h's kDLCPU, kDLCUDA, kDLCUDAHost, kDLCUDAManaged).
KDLCPU: int = ext.DL_CPU
KDLCUDA: int = ext.DL_CUDA
KDLCUDAHOST: int = ext.DL_CUDA_HOST
KDLCUDAMANAGED: int = ext.DL_CUDA_MANAGED

# What a zero-copy view needs of its pointer: device memory (XLA's kernels
# load 16 bytes at a time) and host memory (XLA's CPU client views only
# 64-byte aligned data).  Pinned host memory is moved by DMA: no rule.
GPU_ALIGNMENT: int = ext.GPU_ALIGNMENT
HOST_ALIGNMENT: int = ext.HOST_ALIGNMENT
# The rule by DLPack device type, as the CAI import applies it natively.
view_alignment = ext.view_alignment

# NumPy's own dtypes: the ones both protocols name by a type string
# (ml_dtypes' float8 types also call themselves 'f').
NUMPY_DTYPES = frozenset(np.dtype(t) for t in (
    np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16,
    np.uint32, np.uint64, np.float16, np.float32, np.float64, np.complex64,
    np.complex128))
