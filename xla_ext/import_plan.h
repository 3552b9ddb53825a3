// The native half of an import: validate the CAI dict, find the memory,
// build the zero-copy capsule when a view is possible, and report whether
// the producer's stream still has work: all in one call, so the Python glue
// on the hot path is a dictionary lookup and jaxlib's import.
#ifndef JAX_OVERLAY_XLA_EXT_IMPORT_PLAN_H_
#define JAX_OVERLAY_XLA_EXT_IMPORT_PLAN_H_

#include <Python.h>

#include "cai.h"
#include "dlpack_abi.h"
#include "cuda_driver.h"
#include "error.h"

namespace jxo {

// XLA's GPU code assumes 16-byte aligned entry parameters (vector loads).
constexpr uintptr_t kGpuAlignment = 16;
// XLA's CPU client views host memory only at 64-byte aligned addresses
// (jaxlib 0.12 refuses 16- and 32-byte aligned ones: "Can't create a view of
// buffer with unaligned data"; tests/cpu/test_native_table.py checks it).
constexpr uintptr_t kHostAlignment = 64;

// What a zero-copy view of memory of DLPack device type `dl_device_type`
// needs of its pointer: the one rule both imports apply (bound as
// view_alignment).  Pinned host memory is moved by DMA: no rule.
inline uintptr_t ViewAlignment(int dl_device_type) {
  switch (dl_device_type) {
    case dl::kCPU:
      return kHostAlignment;
    case dl::kCUDAHost:
      return 1;
    default:  // kDLCUDA, kDLCUDAManaged: device memory to XLA
      return kGpuAlignment;
  }
}

struct ImportPlan {
  ArrayView view;
  int dl_device_type = 0;      // kDLCUDA, kDLCUDAHost or kDLCPU
  int ordinal = 0;
  uintptr_t range_start = 0;   // allocation start, when the driver knows it
  uintptr_t alignment = 1;     // what a zero-copy view needs of the pointer
  PyObject* capsule = nullptr;  // new reference, or nullptr: a copy is needed
  bool producer_busy = false;  // `order_after` still has work enqueued
  uintptr_t order_after = 0;   // the stream the import must follow when busy
};

// CUDA's legacy default stream, as the CAI and the driver name it.
constexpr uintptr_t kLegacyStream = 1;

// A capsule viewing the array `v` describes, holding `owner` alive: the one
// place a CAI view becomes a DLPack tensor.  nullptr + Python error on failure.
PyObject* ViewCapsule(const ArrayView& v, PyObject* owner, int device_type,
                      int device_id, bool versioned = false,
                      uint64_t flags = 0);

// `host` treats the pointer as host memory without asking the driver (the
// test entry that lets CI run this same path on NumPy buffers).
bool PlanCaiImport(PyObject* cai, PyObject* owner, bool host, ImportPlan* out,
                   Error* err);

// A DLPack tensor described the way the CAI path describes arrays (pointer
// with byte_offset applied, shape, strides, dtype, layout), so both imports
// share the view and copy code.  BufferError for what no consumer can read.
bool DescribeTensor(const dl::Tensor& t, ArrayView* out, Error* err);

struct DlpackPlan {
  ArrayView view;
  bool versioned = false;
  uint32_t major = 0, minor = 0;
  uint64_t flags = 0;              // versioned capsules only
  int device_type = 0, device_id = 0;  // as the capsule says
  PyObject* capsule = nullptr;     // new reference: a legacy capsule for jaxlib
};

// The native half of a DLPack import: inspects an unconsumed capsule from any
// producer and hands back a legacy capsule jaxlib can read (a versioned one
// is converted: renamed, deleter chained).  A tensor of a newer major
// version, or one that cannot be described, is released (its deleter runs,
// as the protocol asks of a consumer that refuses it) and refused.
bool PlanDlpackImport(PyObject* capsule, DlpackPlan* out, Error* err);

}  // namespace jxo

#endif  // JAX_OVERLAY_XLA_EXT_IMPORT_PLAN_H_
