// Ownership of the DLPack tensors this project creates, and the capsules
// that carry them.  Pure CPython: no pybind11 types cross this header, so the
// deleters can run on any thread, at any time, including interpreter exit.
#ifndef JAX_OVERLAY_XLA_EXT_CAPSULE_H_
#define JAX_OVERLAY_XLA_EXT_CAPSULE_H_

#include <Python.h>

#include <cstdint>
#include <vector>

#include "dlpack_abi.h"
#include "error.h"
#include "layout.h"

namespace jxo {

// What a new tensor describes.  `shape` and `strides` are copied; `strides`
// is in elements, or nullptr for compact row-major.
struct TensorDesc {
  void* data = nullptr;
  dl::Device device{dl::kCPU, 0};
  dl::DataType dtype{dl::kFloat, 32, 1};
  int32_t ndim = 0;
  const int64_t* shape = nullptr;
  const int64_t* strides = nullptr;
  uint64_t byte_offset = 0;
  uint64_t flags = 0;  // versioned tensors only
};

// Returns a new capsule ("dltensor" or "dltensor_versioned") that owns a
// tensor described by `desc`.  The tensor holds a strong reference to
// `owner` until its deleter runs, so the memory stays valid for as long as any
// consumer holds the tensor.  Returns nullptr with a Python error set on
// failure.  Requires the GIL.
PyObject* NewOwnedCapsule(const TensorDesc& desc, PyObject* owner,
                          bool versioned);

// Takes the tensor out of an unconsumed capsule produced by anyone
// (versioned or legacy) and returns a legacy "dltensor" capsule whose deleter
// chains to the original one through WithGil (gil_handoff.h).  The input
// capsule is renamed "used_dltensor[_versioned]" (it no longer owns
// anything).  Returns nullptr with a Python error set on failure.
PyObject* ChainedLegacyCapsule(PyObject* capsule);

// A legacy "dltensor" capsule over the tensor of an unconsumed capsule from
// any producer (the same data, byte_offset, shape, strides, dtype and
// device), whose deleter releases `owner` instead of the producer's tensor.
// The input capsule is left unconsumed: the caller must keep the memory valid
// for as long as `owner` lives (the caller's own lifetime rule, e.g. a token
// that a buffer callback checks).  nullptr with `err` set for a tensor
// CheckTensor refuses, or with a Python error set (not a DLPack capsule).
PyObject* ViewCapsule(PyObject* capsule, PyObject* owner, Error* err);

// Calls `deleter` of the tensor in an unconsumed DLPack capsule and marks the
// capsule used, as a consumer would; used by tests to drive deleters from
// other threads.  Returns the raw tensor pointer and its kind.
struct TakenTensor {
  void* tensor = nullptr;
  bool versioned = false;
};
TakenTensor TakeTensor(PyObject* capsule);  // nullptr + error on failure
void CallDeleter(const TakenTensor& t);      // safe without the GIL

// A look inside an unconsumed DLPack capsule from any producer, without
// taking it.  False with a Python error set (BufferError) when the capsule is
// not an unconsumed DLPack capsule.
struct CapsuleView {
  bool versioned = false;
  uint32_t major = 0, minor = 0;  // versioned capsules only
  uint64_t flags = 0;             // versioned capsules only
  const dl::Tensor* tensor = nullptr;
};
bool InspectCapsule(PyObject* capsule, CapsuleView* out);

// What a tensor from any producer describes, checked as far as anything can
// be without touching its memory: ndim 0 to 64 with a shape, sizes >= 0, an
// element count and strides that fit in int64, a data pointer when there are
// elements, and bytes (from data + byte_offset) that lie inside the address
// space.  False with a BufferError-kind `err` otherwise.
struct TensorGeometry {
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;  // empty when the tensor has none
  Layout layout;
  uintptr_t data = 0;  // data + byte_offset: element 0
  int itemsize = 0;    // bytes per element, rounded up for sub-byte types
};
bool CheckTensor(const dl::Tensor& t, TensorGeometry* out, Error* err);

// Counters for lifetime tests.
int64_t LiveTensors();
int64_t ReleasedTensors();

}  // namespace jxo

#endif  // JAX_OVERLAY_XLA_EXT_CAPSULE_H_
