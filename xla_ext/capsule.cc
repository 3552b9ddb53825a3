#include "capsule.h"

#include "gil_handoff.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>

namespace jxo {
namespace {

std::atomic<int64_t> g_live{0};
std::atomic<int64_t> g_released{0};

// One allocation holds the header, the managed tensor and its shape and
// strides, so a deleter frees exactly one block and nothing can dangle.
struct Block {
  PyObject* owner;  // strong reference: the memory's guarantor
  bool versioned;
  union {
    dl::ManagedTensor legacy;
    dl::ManagedTensorVersioned versioned_tensor;
  };
  int64_t* dims() { return reinterpret_cast<int64_t*>(this + 1); }
};
static_assert(alignof(Block) >= alignof(int64_t));

void DecRef(void* owner) { Py_DECREF(static_cast<PyObject*>(owner)); }

// Drops the owner reference.  Deleters are called by whoever consumed the
// tensor, on whatever thread frees its buffer (an XLA worker, a CUDA
// callback, a foreign runtime): WithGil decides whether this thread may take
// the GIL or must hand the Py_DECREF to the main thread.
void ReleaseOwner(PyObject* owner) {
  if (owner != nullptr) WithGil(DecRef, owner);
}

void ReleaseBlock(Block* b) {
  PyObject* owner = b->owner;
  b->owner = nullptr;
  std::free(b);
  g_live.fetch_sub(1, std::memory_order_relaxed);
  g_released.fetch_add(1, std::memory_order_relaxed);
  ReleaseOwner(owner);
}

void LegacyDeleter(dl::ManagedTensor* t) {
  if (t) ReleaseBlock(static_cast<Block*>(t->manager_ctx));
}

void VersionedDeleter(dl::ManagedTensorVersioned* t) {
  if (t) ReleaseBlock(static_cast<Block*>(t->manager_ctx));
}

// Capsule destructors: they run when the capsule object dies.  A consumer
// that took the tensor renamed the capsule, so a still-valid name means
// nobody took it and the deleter is ours to call, exactly once.
void DestroyLegacyCapsule(PyObject* capsule) {
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);
  if (PyCapsule_IsValid(capsule, dl::kCapsuleLegacy)) {
    auto* t = static_cast<dl::ManagedTensor*>(
        PyCapsule_GetPointer(capsule, dl::kCapsuleLegacy));
    if (t && t->deleter) t->deleter(t);
  }
  PyErr_Restore(type, value, tb);
}

void DestroyVersionedCapsule(PyObject* capsule) {
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);
  if (PyCapsule_IsValid(capsule, dl::kCapsuleVersioned)) {
    auto* t = static_cast<dl::ManagedTensorVersioned*>(
        PyCapsule_GetPointer(capsule, dl::kCapsuleVersioned));
    if (t && t->deleter) t->deleter(t);
  }
  PyErr_Restore(type, value, tb);
}

void FillTensor(dl::Tensor& t, const TensorDesc& d, int64_t* dims) {
  t.data = d.data;
  t.device = d.device;
  t.ndim = d.ndim;
  t.dtype = d.dtype;
  t.byte_offset = d.byte_offset;
  // A 0-d description may have no shape array (an empty vector's data() is
  // nullptr), and memcpy from a null pointer is undefined even for 0 bytes:
  // UBSan caught this on every 0-d import.
  if (d.ndim > 0) std::memcpy(dims, d.shape, sizeof(int64_t) * d.ndim);
  t.shape = d.ndim ? dims : nullptr;
  if (d.strides) {
    std::memcpy(dims + d.ndim, d.strides, sizeof(int64_t) * d.ndim);
    t.strides = dims + d.ndim;
  } else {
    t.strides = nullptr;
  }
}

// A legacy tensor of our own in front of someone else's tensor (versioned
// or legacy): jaxlib reads legacy capsules only, and the producer's deleter
// must not run on a thread that may not take the GIL (NumPy's, CuPy's and
// ctypes deleters all take it), so the chained deleter goes through WithGil.
struct Chain {
  dl::ManagedTensor legacy;
  void* inner;
  bool inner_versioned;
};

void CallVersioned(void* t) {
  auto* m = static_cast<dl::ManagedTensorVersioned*>(t);
  if (m->deleter) m->deleter(m);
}

void CallLegacy(void* t) {
  auto* m = static_cast<dl::ManagedTensor*>(t);
  if (m->deleter) m->deleter(m);
}

void ChainDeleter(dl::ManagedTensor* t) {
  if (!t) return;
  Chain* c = static_cast<Chain*>(t->manager_ctx);
  void* inner = c->inner;
  bool versioned = c->inner_versioned;
  delete c;
  g_live.fetch_sub(1, std::memory_order_relaxed);
  g_released.fetch_add(1, std::memory_order_relaxed);
  if (inner) WithGil(versioned ? CallVersioned : CallLegacy, inner);
}

}  // namespace

PyObject* NewOwnedCapsule(const TensorDesc& desc, PyObject* owner,
                          bool versioned) {
  if (desc.ndim < 0 || (desc.ndim > 0 && desc.shape == nullptr)) {
    PyErr_SetString(PyExc_ValueError, "tensor description has a bad ndim");
    return nullptr;
  }
  size_t bytes = sizeof(Block) + 2 * sizeof(int64_t) * size_t(desc.ndim);
  auto* b = static_cast<Block*>(std::calloc(1, bytes));
  if (!b) return PyErr_NoMemory();
  b->versioned = versioned;
  if (versioned) {
    dl::ManagedTensorVersioned& m = b->versioned_tensor;
    m.version = {dl::kMajorVersion, dl::kMinorVersion};
    m.manager_ctx = b;
    m.deleter = VersionedDeleter;
    m.flags = desc.flags;
    FillTensor(m.dl_tensor, desc, b->dims());
  } else {
    dl::ManagedTensor& m = b->legacy;
    m.manager_ctx = b;
    m.deleter = LegacyDeleter;
    FillTensor(m.dl_tensor, desc, b->dims());
  }
  // The reference is taken before the capsule exists, so the owner outlives
  // every path out of here, including a failed PyCapsule_New.
  Py_XINCREF(owner);
  b->owner = owner;
  g_live.fetch_add(1, std::memory_order_relaxed);
  void* ptr = versioned ? static_cast<void*>(&b->versioned_tensor)
                        : static_cast<void*>(&b->legacy);
  PyObject* cap = PyCapsule_New(
      ptr, versioned ? dl::kCapsuleVersioned : dl::kCapsuleLegacy,
      versioned ? DestroyVersionedCapsule : DestroyLegacyCapsule);
  if (!cap) {
    // Nobody else saw the tensor: release it here, exactly once.
    ReleaseBlock(b);
    return nullptr;
  }
  return cap;
}

PyObject* ChainedLegacyCapsule(PyObject* capsule) {
  if (!PyCapsule_CheckExact(capsule)) {
    PyErr_SetString(PyExc_TypeError, "expected a DLPack capsule");
    return nullptr;
  }
  Chain* c = new (std::nothrow) Chain{};
  if (!c) return PyErr_NoMemory();
  const char* used;
  if (PyCapsule_IsValid(capsule, dl::kCapsuleVersioned)) {
    auto* inner = static_cast<dl::ManagedTensorVersioned*>(
        PyCapsule_GetPointer(capsule, dl::kCapsuleVersioned));
    c->inner = inner;
    c->inner_versioned = true;
    c->legacy.dl_tensor = inner->dl_tensor;  // shape/strides stay owned by inner
    used = dl::kCapsuleVersionedUsed;
  } else if (PyCapsule_IsValid(capsule, dl::kCapsuleLegacy)) {
    auto* inner = static_cast<dl::ManagedTensor*>(
        PyCapsule_GetPointer(capsule, dl::kCapsuleLegacy));
    c->inner = inner;
    c->legacy.dl_tensor = inner->dl_tensor;
    used = dl::kCapsuleLegacyUsed;
  } else {
    delete c;
    PyErr_SetString(PyExc_ValueError,
                    "not an unconsumed 'dltensor' or 'dltensor_versioned' "
                    "capsule");
    return nullptr;
  }
  c->legacy.manager_ctx = c;
  c->legacy.deleter = ChainDeleter;
  g_live.fetch_add(1, std::memory_order_relaxed);
  PyObject* out =
      PyCapsule_New(&c->legacy, dl::kCapsuleLegacy, DestroyLegacyCapsule);
  if (!out) {
    // The input capsule still owns `inner`; only drop the chain link.
    delete c;
    g_live.fetch_sub(1, std::memory_order_relaxed);
    return nullptr;
  }
  // Ownership moved to the chain: the consumed capsule must never call the
  // deleter again, so rename it as the protocol says and drop its destructor.
  PyCapsule_SetName(capsule, used);
  PyCapsule_SetDestructor(capsule, nullptr);
  return out;
}

PyObject* ViewCapsule(PyObject* capsule, PyObject* owner, Error* err) {
  CapsuleView v;
  if (!InspectCapsule(capsule, &v)) return nullptr;
  const dl::Tensor& t = *v.tensor;
  TensorGeometry g;
  if (!CheckTensor(t, &g, err)) return nullptr;
  TensorDesc d;
  d.data = t.data;
  d.byte_offset = t.byte_offset;
  d.device = t.device;
  d.dtype = t.dtype;
  d.ndim = t.ndim;
  d.shape = t.shape;  // copied by NewOwnedCapsule: the input may die first
  d.strides = t.strides;
  return NewOwnedCapsule(d, owner, /*versioned=*/false);
}

TakenTensor TakeTensor(PyObject* capsule) {
  TakenTensor t;
  if (PyCapsule_IsValid(capsule, dl::kCapsuleLegacy)) {
    t.tensor = PyCapsule_GetPointer(capsule, dl::kCapsuleLegacy);
    PyCapsule_SetName(capsule, dl::kCapsuleLegacyUsed);
  } else if (PyCapsule_IsValid(capsule, dl::kCapsuleVersioned)) {
    t.tensor = PyCapsule_GetPointer(capsule, dl::kCapsuleVersioned);
    t.versioned = true;
    PyCapsule_SetName(capsule, dl::kCapsuleVersionedUsed);
  } else {
    PyErr_SetString(PyExc_BufferError,
                    "not an unconsumed DLPack capsule (a capsule can be "
                    "consumed once; ask the producer for a new one)");
    return t;
  }
  PyCapsule_SetDestructor(capsule, nullptr);
  return t;
}

void CallDeleter(const TakenTensor& t) {
  if (!t.tensor) return;
  if (t.versioned) {
    auto* m = static_cast<dl::ManagedTensorVersioned*>(t.tensor);
    if (m->deleter) m->deleter(m);
  } else {
    auto* m = static_cast<dl::ManagedTensor*>(t.tensor);
    if (m->deleter) m->deleter(m);
  }
}

bool InspectCapsule(PyObject* capsule, CapsuleView* out) {
  if (!PyCapsule_CheckExact(capsule)) {
    PyErr_Format(PyExc_TypeError, "expected a DLPack capsule, got %s",
                 Py_TYPE(capsule)->tp_name);
    return false;
  }
  if (PyCapsule_IsValid(capsule, dl::kCapsuleVersioned)) {
    auto* m = static_cast<dl::ManagedTensorVersioned*>(
        PyCapsule_GetPointer(capsule, dl::kCapsuleVersioned));
    out->versioned = true;
    out->major = m->version.major;
    out->minor = m->version.minor;
    out->flags = m->flags;
    out->tensor = &m->dl_tensor;
    return true;
  }
  if (PyCapsule_IsValid(capsule, dl::kCapsuleLegacy)) {
    auto* m = static_cast<dl::ManagedTensor*>(
        PyCapsule_GetPointer(capsule, dl::kCapsuleLegacy));
    out->tensor = &m->dl_tensor;
    return true;
  }
  const char* name = PyCapsule_GetName(capsule);
  if (!name) PyErr_Clear();
  PyErr_Format(PyExc_BufferError,
               "the capsule is named '%s', not 'dltensor' or "
               "'dltensor_versioned': %s",
               name ? name : "",
               name && std::strncmp(name, "used_", 5) == 0
                   ? "it was already consumed (a DLPack capsule can be "
                     "consumed once); ask the producer for a new one"
                   : "it is not a DLPack capsule");
  return false;
}

namespace {

std::string Dims(const int64_t* v, int n) {
  std::string s = "(";
  for (int i = 0; i < n; ++i) {
    s += (i ? ", " : "") + std::to_string(v[i]);
  }
  return s + (n == 1 ? ",)" : ")");
}

}  // namespace

bool CheckTensor(const dl::Tensor& t, TensorGeometry* out, Error* err) {
  if (t.ndim < 0 || t.ndim > 64 || (t.ndim > 0 && !t.shape)) {
    return Fail(err, ErrorKind::kBuffer,
                "the DLPack tensor has ndim " + std::to_string(t.ndim) +
                    (t.ndim > 0 && !t.shape ? " and no shape" : "") +
                    "; 0 to 64 with a shape are accepted");
  }
  out->shape.assign(t.shape, t.shape + t.ndim);
  out->strides.clear();
  if (t.strides) out->strides.assign(t.strides, t.strides + t.ndim);
  // Only built on failure: this runs on every DLPack import.
  auto where = [&] {
    return "the DLPack tensor of shape " + Dims(t.shape, t.ndim) +
           (t.strides ? " and strides " + Dims(t.strides, t.ndim) : "");
  };
  for (int64_t n : out->shape) {
    if (n < 0) {
      return Fail(err, ErrorKind::kBuffer,
                  where() + " has a negative dimension; sizes must be >= 0");
    }
  }
  const char* why = nullptr;
  if (!AnalyzeLayout(out->shape, out->strides, &out->layout, &why)) {
    return Fail(err, ErrorKind::kBuffer, where() + ": " + why);
  }
  out->itemsize = (int(t.dtype.bits) * int(t.dtype.lanes) + 7) / 8;
  uintptr_t base = reinterpret_cast<uintptr_t>(t.data);
  if (out->layout.numel != 0 && base == 0) {
    // A view of address 0 is no array; jaxlib would hand back garbage.
    return Fail(err, ErrorKind::kBuffer,
                where() + " has a null data pointer; only tensors without "
                        "elements may have one");
  }
  if (out->layout.numel != 0 && t.byte_offset > UINTPTR_MAX - base) {
    return Fail(err, ErrorKind::kBuffer,
                where() + ": data " + std::to_string(base) + " + byte_offset " +
                    std::to_string(t.byte_offset) +
                    " wraps past the top of the 64-bit address space");
  }
  out->data = base + t.byte_offset;  // unused (may wrap) when there are no elements
  if (!CheckEnvelope(out->data, out->layout, out->itemsize, &why)) {
    return Fail(err, ErrorKind::kBuffer,
                where() + " at address " + std::to_string(out->data) + ": " +
                    why + "; the producer's pointer or strides are wrong");
  }
  return true;
}

int64_t LiveTensors() { return g_live.load(); }
int64_t ReleasedTensors() { return g_released.load(); }

}  // namespace jxo
