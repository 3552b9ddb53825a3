// libFuzzer harness for the DLPack side of the core: CheckTensor on tensors
// with every field from the input (shape and strides arrays as long as ndim
// says, as a producer must provide), the dtype <-> typestr tables, and
// capsules with any name going through InspectCapsule, ChainedLegacy
// and TakeTensor + CallDeleter: every tensor must be freed exactly once.
#include <Python.h>
#include <fuzzer/FuzzedDataProvider.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "capsule.h"
#include "cai.h"

namespace dl = jxo::dl;

namespace {

int g_deleted = 0;

struct Foreign {
  dl::ManagedTensorVersioned versioned{};
  dl::ManagedTensor legacy{};
  std::vector<int64_t> shape, strides;
};

void VersionedDeleter(dl::ManagedTensorVersioned* t) {
  ++g_deleted;
  (void)t;
}
void LegacyDeleter(dl::ManagedTensor* t) {
  ++g_deleted;
  (void)t;
}

dl::Tensor DrawTensor(FuzzedDataProvider& in, Foreign& f) {
  dl::Tensor t{};
  const int nd = in.ConsumeIntegralInRange<int>(0, 6);
  for (int i = 0; i < nd; ++i) {
    f.shape.push_back(in.ConsumeBool() ? in.ConsumeIntegralInRange<int64_t>(-2, 9)
                                       : in.ConsumeIntegral<int64_t>());
    f.strides.push_back(in.ConsumeBool() ? in.ConsumeIntegralInRange<int64_t>(-9, 9)
                                         : in.ConsumeIntegral<int64_t>());
  }
  // ndim may claim less than the arrays hold (safe to read), or be out of
  // range with no arrays at all; never more than what is there.
  switch (in.ConsumeIntegralInRange<int>(0, 3)) {
    case 0: t.ndim = in.ConsumeIntegralInRange<int32_t>(0, nd); break;
    case 1: t.ndim = in.ConsumeIntegral<int32_t>(); f.shape.clear(); f.strides.clear(); break;
    default: t.ndim = nd;
  }
  t.shape = f.shape.empty() ? nullptr : f.shape.data();
  t.strides = f.strides.empty() || in.ConsumeBool() ? nullptr : f.strides.data();
  if (t.shape == nullptr && t.ndim > 0 && in.ConsumeBool()) t.ndim = 0;
  t.data = reinterpret_cast<void*>(in.ConsumeIntegral<uintptr_t>());
  t.byte_offset = in.ConsumeBool() ? in.ConsumeIntegralInRange<uint64_t>(0, 64)
                                   : in.ConsumeIntegral<uint64_t>();
  t.device = {in.ConsumeIntegral<int32_t>(), in.ConsumeIntegral<int32_t>()};
  t.dtype = {in.ConsumeIntegral<uint8_t>(), in.ConsumeIntegral<uint8_t>(),
             in.ConsumeIntegral<uint16_t>()};
  return t;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  Py_InitializeEx(0);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* bytes, size_t size) {
  FuzzedDataProvider in(bytes, size);
  Foreign f;
  dl::Tensor t = DrawTensor(in, f);

  // CheckTensor: refusals name themselves; acceptances are readable.
  jxo::TensorGeometry g;
  jxo::Error err;
  if (jxo::CheckTensor(t, &g, &err)) {
    if (g.layout.numel != 0 && t.data == nullptr) std::abort();
    const char* why = nullptr;
    if (!jxo::CheckEnvelope(g.data, g.layout, g.itemsize, &why)) std::abort();
  } else if (err.message.empty() || err.kind != jxo::ErrorKind::kBuffer) {
    std::abort();
  }

  // Our own producer on the same description: the capsule owns a copy of
  // shape and strides and a reference to `owner`; dropped untaken, taken and
  // deleted, or chained to a legacy capsule, it releases both exactly once.
  {
    jxo::TensorDesc desc;
    desc.data = t.data;
    desc.device = t.device;
    desc.dtype = t.dtype;
    desc.ndim = t.ndim;
    desc.shape = t.shape;
    desc.strides = t.strides;
    desc.byte_offset = t.byte_offset;
    const bool versioned = in.ConsumeBool();
    PyObject* owner = PyList_New(0);
    const Py_ssize_t refs = Py_REFCNT(owner);
    const int64_t live = jxo::LiveTensors();
    PyObject* own = jxo::NewOwnedCapsule(desc, owner, versioned);
    const bool valid = t.ndim >= 0 && (t.ndim == 0 || t.shape != nullptr);
    if ((own != nullptr) != valid) std::abort();
    if (own) {
      jxo::CapsuleView view;
      if (!jxo::InspectCapsule(own, &view) || view.versioned != versioned) std::abort();
      const dl::Tensor& c = *view.tensor;
      if (c.ndim != t.ndim || c.data != t.data || c.byte_offset != t.byte_offset) std::abort();
      if ((c.strides == nullptr) != (t.strides == nullptr)) std::abort();
      for (int i = 0; i < t.ndim; ++i) {
        if (c.shape[i] != t.shape[i] || (t.strides && c.strides[i] != t.strides[i])) {
          std::abort();
        }
      }
      PyObject* chained = nullptr;
      if (in.ConsumeBool()) {
        chained = jxo::ChainedLegacyCapsule(own);
        if (!chained) std::abort();
      }
      if (in.ConsumeBool()) jxo::CallDeleter(jxo::TakeTensor(chained ? chained : own));
      Py_XDECREF(chained);
      Py_DECREF(own);
    } else {
      PyErr_Clear();
    }
    if (jxo::LiveTensors() != live || Py_REFCNT(owner) != refs) std::abort();
    Py_DECREF(owner);
  }

  // The dtype tables agree both ways.
  const std::string ts = jxo::DtypeToTypestr(t.dtype);
  if (!ts.empty()) {
    dl::DataType back{};
    int itemsize = 0;
    if (!jxo::TypestrToDtype(ts, &back, &itemsize, &err)) std::abort();
    if (back.code != t.dtype.code || back.bits != t.dtype.bits || back.lanes != 1) std::abort();
  }

  // A capsule of either kind, under any name, consumed the ways a consumer can.
  const bool versioned = in.ConsumeBool();
  f.versioned.version = {in.ConsumeIntegral<uint32_t>(), in.ConsumeIntegral<uint32_t>()};
  f.versioned.deleter = VersionedDeleter;
  f.versioned.dl_tensor = t;
  f.legacy.deleter = LegacyDeleter;
  f.legacy.dl_tensor = t;
  static const char* const kNames[] = {"dltensor", "dltensor_versioned", "used_dltensor",
                                       "used_dltensor_versioned", "DLTensor", ""};
  const char* name = in.ConsumeBool() ? (versioned ? dl::kCapsuleVersioned : dl::kCapsuleLegacy)
                                      : kNames[in.ConsumeIntegralInRange<int>(0, 5)];
  // The other kind's name on this struct would make any consumer misread it.
  if (std::string(name) == (versioned ? dl::kCapsuleLegacy : dl::kCapsuleVersioned)) {
    name = "DLTensor";
  }
  void* ptr = versioned ? static_cast<void*>(&f.versioned) : static_cast<void*>(&f.legacy);
  PyObject* cap = PyCapsule_New(ptr, name, nullptr);
  const int before = g_deleted;
  const bool ours = std::string(name) == (versioned ? dl::kCapsuleVersioned : dl::kCapsuleLegacy);

  jxo::CapsuleView view;
  if (jxo::InspectCapsule(cap, &view) != ours) std::abort();
  PyErr_Clear();
  PyObject* legacy = nullptr;
  if (ours && in.ConsumeBool()) {
    legacy = jxo::ChainedLegacyCapsule(cap);
    if (!legacy) std::abort();
  }
  jxo::TakenTensor taken = jxo::TakeTensor(legacy ? legacy : cap);
  if ((taken.tensor != nullptr) != ours) std::abort();
  PyErr_Clear();
  jxo::CallDeleter(taken);
  Py_XDECREF(legacy);
  Py_DECREF(cap);
  if (g_deleted - before != (ours ? 1 : 0)) std::abort();  // exactly once, or not ours
  if (PyErr_Occurred()) std::abort();
  return 0;
}
