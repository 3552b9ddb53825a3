#include "import_plan.h"

#include <cstdio>
#include <string>

#include "capsule.h"
#include "dlpack_abi.h"
#include "layout.h"

namespace jxo {

PyObject* ViewCapsule(const ArrayView& v, PyObject* owner, int device_type,
                      int device_id, bool versioned, uint64_t flags) {
  TensorDesc d;
  d.data = reinterpret_cast<void*>(v.data);
  d.device = {device_type, device_id};
  d.dtype = v.dtype;
  d.ndim = static_cast<int32_t>(v.shape.size());
  d.shape = v.shape.data();
  // Row-major goes without strides: JAX then uses its default layout.
  d.strides = v.layout.kind == LayoutKind::kRowMajor || v.strides.empty()
                  ? nullptr
                  : v.strides.data();
  d.flags = flags | (v.read_only ? dl::kFlagReadOnly : 0);
  return NewOwnedCapsule(d, owner, versioned);
}

bool PlanCaiImport(PyObject* cai, PyObject* owner, bool host, ImportPlan* out,
                   Error* err) {
  ArrayView& v = out->view;
  // Validation first: a malformed dict gets its real error on any machine.
  if (!ParseCai(cai, &v, err)) return false;
  if (v.layout.numel == 0) return true;  // nothing to view or order

  if (host) {
    out->dl_device_type = dl::kCPU;
    out->ordinal = 0;
    out->alignment = ViewAlignment(dl::kCPU);
  } else {
    cuda::PointerInfo info;
    if (!cuda::QueryPointer(v.data, &info, err)) return false;
    if (info.kind == cuda::MemoryKind::kNotCuda) {
      char buf[160];
      std::snprintf(buf, sizeof buf,
                    "__cuda_array_interface__['data'][0] = 0x%llx is not CUDA "
                    "memory (pageable host memory?); ",
                    static_cast<unsigned long long>(v.data));
      return Fail(err, ErrorKind::kBuffer,
                  std::string(buf) +
                      "for host data use jax.device_put(numpy_array) or pin "
                      "it first");
    }
    bool pinned = info.kind == cuda::MemoryKind::kPinnedHost;
    // Managed memory is device-accessible: JAX holds it as device memory.
    out->dl_device_type = pinned ? dl::kCUDAHost : dl::kCUDA;
    out->ordinal = info.ordinal;
    out->range_start = info.range_start;
    out->alignment = ViewAlignment(out->dl_device_type);
    // A CAI with no stream (v2, or None) promises written data, but a
    // synchronous copy keeps that promise only on the legacy default stream:
    // cuMemcpyHtoD from pageable memory returns before its DMA lands, and
    // Numba's cuda.to_device arrays say stream None.  So such an import
    // follows the legacy stream (which also follows every blocking stream);
    // when it is idle this costs one query and orders nothing.
    out->order_after = v.has_stream ? v.stream : kLegacyStream;
    bool idle = true;
    if (!cuda::StreamIdle(info.ordinal, out->order_after, &idle, err)) {
      return false;
    }
    out->producer_busy = !idle;
  }

  if (v.layout.kind != LayoutKind::kStrided && v.data % out->alignment == 0) {
    out->capsule = ViewCapsule(v, owner, out->dl_device_type, out->ordinal);
    if (!out->capsule) {
      PyErr_Clear();
      return Fail(err, ErrorKind::kBuffer, "could not allocate a capsule");
    }
  }
  return true;
}

bool DescribeTensor(const dl::Tensor& t, ArrayView* out, Error* err) {
  TensorGeometry g;
  if (!CheckTensor(t, &g, err)) return false;
  out->version = 0;
  out->shape = std::move(g.shape);
  out->strides = std::move(g.strides);
  out->layout = g.layout;
  out->data = g.data;
  out->dtype = t.dtype;
  out->typestr = DtypeToTypestr(t.dtype);
  out->itemsize = g.itemsize;
  return true;
}

namespace {

// The consumer's duty for a tensor it refuses: take it and run its deleter.
bool Refuse(PyObject* capsule, Error* err, std::string message) {
  TakenTensor taken = TakeTensor(capsule);
  if (!taken.tensor) {
    PyErr_Clear();
  } else {
    CallDeleter(taken);
  }
  return Fail(err, ErrorKind::kBuffer, std::move(message));
}

std::string PythonErrorText() {
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);
  std::string text = "not a DLPack capsule";
  if (value) {
    PyObject* s = PyObject_Str(value);
    if (s) {
      const char* c = PyUnicode_AsUTF8(s);
      if (c) text = c;
      Py_DECREF(s);
    }
  }
  PyErr_Clear();
  Py_XDECREF(type);
  Py_XDECREF(value);
  Py_XDECREF(tb);
  return text;
}

}  // namespace

bool PlanDlpackImport(PyObject* capsule, DlpackPlan* out, Error* err) {
  CapsuleView cv;
  if (!InspectCapsule(capsule, &cv)) {
    bool type = PyErr_ExceptionMatches(PyExc_TypeError);
    return Fail(err, type ? ErrorKind::kType : ErrorKind::kBuffer,
                PythonErrorText());
  }
  out->versioned = cv.versioned;
  out->major = cv.major;
  out->minor = cv.minor;
  out->flags = cv.flags;
  if (cv.versioned && cv.major > dl::kMajorVersion) {
    // The fields past the version may be laid out differently: read nothing.
    return Refuse(capsule, err,
                  "the producer returned a DLPack " + std::to_string(cv.major) +
                      "." + std::to_string(cv.minor) +
                      " tensor; jax_overlay reads up to " +
                      std::to_string(dl::kMajorVersion) + ".x");
  }
  const dl::Tensor& t = *cv.tensor;
  out->device_type = t.device.device_type;
  out->device_id = t.device.device_id;
  // A tensor that cannot be described stays unconsumed: its capsule's own
  // destructor releases it.
  if (!DescribeTensor(t, &out->view, err)) return false;
  out->view.read_only = cv.flags & dl::kFlagReadOnly;
  // jaxlib reads legacy capsules only, and calls the deleter on whatever
  // thread frees the buffer: the producer's tensor moves into a legacy one of
  // ours whose deleter chains to it from a thread that may take the GIL (the
  // input is renamed used_*).
  out->capsule = ChainedLegacyCapsule(capsule);
  if (!out->capsule) {
    return Fail(err, ErrorKind::kBuffer, PythonErrorText());
  }
  return true;
}

}  // namespace jxo
