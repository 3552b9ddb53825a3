// DLPack capsules: NewOwnedCapsule copies the description and holds the
// owner, each deleter runs exactly once (from the capsule, a consumer, or
// another thread), and ChainedLegacyCapsule chains to the original, through the GIL
// hand-off when the deleter runs on a thread CPython does not know.
#include "xla_ext/capsule.h"
#include "xla_ext/gil_handoff.h"

#include <Python.h>

#include <cstring>
#include <thread>

#include "tests/cc/check.h"

namespace dl = jxo::dl;

namespace {

struct Counts {
  int64_t live, released;
};
Counts Now() { return {jxo::LiveTensors(), jxo::ReleasedTensors()}; }

// A 2x3 float32 tensor description; the arrays outlive no capsule.
int64_t kShape[] = {2, 3};
int64_t kStrides[] = {1, 2};
float kData[6];

jxo::TensorDesc Desc(bool with_strides) {
  jxo::TensorDesc d;
  d.data = kData;
  d.ndim = 2;
  d.shape = kShape;
  d.strides = with_strides ? kStrides : nullptr;
  d.byte_offset = 8;
  d.flags = dl::kFlagReadOnly;
  return d;
}

// A producer-owned versioned tensor, as another library would hand out.
struct Foreign {
  dl::ManagedTensorVersioned m{};
  int64_t shape[1] = {6};
  int deleted = 0;
};
void ForeignDeleter(dl::ManagedTensorVersioned* t) {
  ++static_cast<Foreign*>(t->manager_ctx)->deleted;
}
PyObject* ForeignCapsule(Foreign* f) {
  f->m.version = {1, 0};
  f->m.manager_ctx = f;
  f->m.deleter = ForeignDeleter;
  f->m.dl_tensor.data = kData;
  f->m.dl_tensor.device = {dl::kCPU, 0};
  f->m.dl_tensor.ndim = 1;
  f->m.dl_tensor.dtype = {dl::kFloat, 32, 1};
  f->m.dl_tensor.shape = f->shape;
  // No destructor of its own: only ForeignDeleter releases it.
  return PyCapsule_New(&f->m, dl::kCapsuleVersioned, nullptr);
}

}  // namespace

TEST(LegacyCapsuleCopiesTheDescriptionAndHoldsTheOwner) {
  PyObject* owner = PyList_New(0);
  Py_ssize_t refs = Py_REFCNT(owner);
  Counts before = Now();
  PyObject* cap = jxo::NewOwnedCapsule(Desc(false), owner, false);
  REQUIRE(cap != nullptr);
  CHECK(PyCapsule_IsValid(cap, dl::kCapsuleLegacy));
  CHECK_EQ(Py_REFCNT(owner), refs + 1);
  CHECK_EQ(jxo::LiveTensors(), before.live + 1);

  auto* t = static_cast<dl::ManagedTensor*>(
      PyCapsule_GetPointer(cap, dl::kCapsuleLegacy));
  REQUIRE(t != nullptr);
  CHECK(t->dl_tensor.data == static_cast<void*>(kData));
  CHECK_EQ(t->dl_tensor.ndim, 2);
  CHECK(t->dl_tensor.shape != kShape);  // a copy, not the caller's array
  CHECK_EQ(t->dl_tensor.shape[0], 2);
  CHECK_EQ(t->dl_tensor.shape[1], 3);
  CHECK(t->dl_tensor.strides == nullptr);
  CHECK_EQ(t->dl_tensor.byte_offset, uint64_t{8});
  CHECK_EQ(t->dl_tensor.device.device_type, int32_t{dl::kCPU});
  CHECK_EQ(int(t->dl_tensor.dtype.code), int(dl::kFloat));
  CHECK_EQ(int(t->dl_tensor.dtype.bits), 32);

  Py_DECREF(cap);  // never consumed: the capsule's destructor deletes
  CHECK_EQ(Py_REFCNT(owner), refs);
  CHECK_EQ(jxo::LiveTensors(), before.live);
  CHECK_EQ(jxo::ReleasedTensors(), before.released + 1);
  Py_DECREF(owner);
}

TEST(VersionedCapsuleCarriesVersionFlagsAndStrides) {
  PyObject* owner = PyList_New(0);
  Py_ssize_t refs = Py_REFCNT(owner);
  PyObject* cap = jxo::NewOwnedCapsule(Desc(true), owner, true);
  REQUIRE(cap != nullptr);
  CHECK_EQ(std::string(PyCapsule_GetName(cap)), std::string("dltensor_versioned"));
  auto* t = static_cast<dl::ManagedTensorVersioned*>(
      PyCapsule_GetPointer(cap, dl::kCapsuleVersioned));
  REQUIRE(t != nullptr);
  CHECK_EQ(t->version.major, dl::kMajorVersion);
  CHECK_EQ(t->version.minor, dl::kMinorVersion);
  CHECK_EQ(t->flags, dl::kFlagReadOnly);
  REQUIRE(t->dl_tensor.strides != nullptr);
  CHECK(t->dl_tensor.strides != kStrides);
  CHECK_EQ(t->dl_tensor.strides[0], 1);
  CHECK_EQ(t->dl_tensor.strides[1], 2);
  Py_DECREF(cap);
  CHECK_EQ(Py_REFCNT(owner), refs);
  Py_DECREF(owner);
}

// A 0-d description without a shape array, as a 0-d import passes it (the
// empty shape vector's data() is nullptr).  Regression: FillTensor copied
// from it with memcpy, undefined for a null pointer even for 0 bytes, which
// UBSan reports (tools/sanitize.sh runs these tests under --config=asan).
TEST(ZeroDimDescriptionWithoutAShapeArray) {
  PyObject* owner = PyList_New(0);
  jxo::TensorDesc d;
  d.data = kData;
  d.ndim = 0;
  d.shape = nullptr;
  for (bool versioned : {false, true}) {
    PyObject* cap = jxo::NewOwnedCapsule(d, owner, versioned);
    REQUIRE(cap != nullptr);
    jxo::CapsuleView view;
    REQUIRE(jxo::InspectCapsule(cap, &view));
    CHECK_EQ(view.tensor->ndim, 0);
    CHECK(view.tensor->shape == nullptr);
    CHECK(view.tensor->strides == nullptr);
    Py_DECREF(cap);
  }
  Py_DECREF(owner);
}

TEST(ConsumedCapsuleLeavesTheDeleterToTheConsumer) {
  PyObject* owner = PyList_New(0);
  Py_ssize_t refs = Py_REFCNT(owner);
  Counts before = Now();
  PyObject* cap = jxo::NewOwnedCapsule(Desc(false), owner, false);
  REQUIRE(cap != nullptr);
  jxo::TakenTensor taken = jxo::TakeTensor(cap);
  REQUIRE(taken.tensor != nullptr);
  CHECK(!taken.versioned);
  CHECK_EQ(std::string(PyCapsule_GetName(cap)), std::string("used_dltensor"));

  // A second consumer is refused.
  CHECK(jxo::TakeTensor(cap).tensor == nullptr);
  CHECK(PyErr_ExceptionMatches(PyExc_BufferError));
  PyErr_Clear();

  Py_DECREF(cap);  // the used capsule must not delete
  CHECK_EQ(jxo::ReleasedTensors(), before.released);
  CHECK_EQ(Py_REFCNT(owner), refs + 1);

  jxo::CallDeleter(taken);
  CHECK_EQ(jxo::ReleasedTensors(), before.released + 1);
  CHECK_EQ(jxo::LiveTensors(), before.live);
  CHECK_EQ(Py_REFCNT(owner), refs);
  Py_DECREF(owner);
}

TEST(DeleterOnAnotherThreadWithoutTheGil) {
  PyObject* owner = PyList_New(0);
  Py_ssize_t refs = Py_REFCNT(owner);
  PyObject* cap = jxo::NewOwnedCapsule(Desc(true), owner, true);
  REQUIRE(cap != nullptr);
  jxo::TakenTensor taken = jxo::TakeTensor(cap);
  Py_DECREF(cap);
  REQUIRE(taken.versioned);
  Py_BEGIN_ALLOW_THREADS
  std::thread([taken] { jxo::CallDeleter(taken); }).join();
  Py_END_ALLOW_THREADS
  jxo::RunHandedOff();  // what the main thread's pending call does
  CHECK_EQ(Py_REFCNT(owner), refs);
  Py_DECREF(owner);
}

TEST(DeleterKeepsAPendingException) {
  PyObject* owner = PyList_New(0);
  PyObject* cap = jxo::NewOwnedCapsule(Desc(false), owner, false);
  REQUIRE(cap != nullptr);
  PyErr_SetString(PyExc_RuntimeError, "in flight");
  Py_DECREF(cap);
  CHECK(PyErr_ExceptionMatches(PyExc_RuntimeError));
  PyErr_Clear();
  CHECK_EQ(Py_REFCNT(owner), Py_ssize_t{1});
  Py_DECREF(owner);
}

TEST(BadDescriptionFailsWithoutTakingTheOwner) {
  PyObject* owner = PyList_New(0);
  jxo::TensorDesc d = Desc(false);
  d.ndim = -1;
  Counts before = Now();
  CHECK(jxo::NewOwnedCapsule(d, owner, false) == nullptr);
  CHECK(PyErr_ExceptionMatches(PyExc_ValueError));
  PyErr_Clear();
  CHECK_EQ(Py_REFCNT(owner), Py_ssize_t{1});
  CHECK_EQ(jxo::LiveTensors(), before.live);
  Py_DECREF(owner);
}

TEST(ChainedLegacyChainsToTheForeignDeleterOnce) {
  Foreign f;
  PyObject* versioned = ForeignCapsule(&f);
  REQUIRE(versioned != nullptr);
  Counts before = Now();
  PyObject* legacy = jxo::ChainedLegacyCapsule(versioned);
  REQUIRE(legacy != nullptr);
  CHECK_EQ(std::string(PyCapsule_GetName(versioned)),
           std::string("used_dltensor_versioned"));
  CHECK(PyCapsule_IsValid(legacy, dl::kCapsuleLegacy));
  auto* t = static_cast<dl::ManagedTensor*>(
      PyCapsule_GetPointer(legacy, dl::kCapsuleLegacy));
  REQUIRE(t != nullptr);
  CHECK(t->dl_tensor.shape == f.shape);  // still the producer's
  CHECK_EQ(t->dl_tensor.shape[0], 6);

  Py_DECREF(versioned);
  CHECK_EQ(f.deleted, 0);
  CHECK_EQ(jxo::LiveTensors(), before.live + 1);
  Py_DECREF(legacy);
  CHECK_EQ(f.deleted, 1);
  CHECK_EQ(jxo::LiveTensors(), before.live);
  CHECK_EQ(jxo::ReleasedTensors(), before.released + 1);
}

TEST(ChainedLegacyOfAnOwnedCapsuleReturnsTheOwner) {
  PyObject* owner = PyList_New(0);
  Py_ssize_t refs = Py_REFCNT(owner);
  Counts before = Now();
  PyObject* versioned = jxo::NewOwnedCapsule(Desc(true), owner, true);
  REQUIRE(versioned != nullptr);
  PyObject* legacy = jxo::ChainedLegacyCapsule(versioned);
  REQUIRE(legacy != nullptr);
  Py_DECREF(versioned);
  CHECK_EQ(Py_REFCNT(owner), refs + 1);
  jxo::TakenTensor taken = jxo::TakeTensor(legacy);  // as a consumer would
  Py_DECREF(legacy);
  CHECK_EQ(Py_REFCNT(owner), refs + 1);
  jxo::CallDeleter(taken);
  CHECK_EQ(Py_REFCNT(owner), refs);
  CHECK_EQ(jxo::LiveTensors(), before.live);
  CHECK_EQ(jxo::ReleasedTensors(), before.released + 2);  // chain + block
  Py_DECREF(owner);
}

TEST(ChainedLegacyOfALegacyCapsuleMarksItUsed) {
  PyObject* owner = PyList_New(0);
  Py_ssize_t refs = Py_REFCNT(owner);
  Counts before = Now();
  PyObject* inner = jxo::NewOwnedCapsule(Desc(false), owner, false);
  REQUIRE(inner != nullptr);
  PyObject* legacy = jxo::ChainedLegacyCapsule(inner);
  REQUIRE(legacy != nullptr);
  CHECK_EQ(std::string(PyCapsule_GetName(inner)), std::string("used_dltensor"));
  CHECK(jxo::ChainedLegacyCapsule(inner) == nullptr);  // consumed once
  CHECK(PyErr_ExceptionMatches(PyExc_ValueError));
  PyErr_Clear();
  Py_DECREF(inner);  // renamed: its destructor must not delete
  CHECK_EQ(Py_REFCNT(owner), refs + 1);
  Py_DECREF(legacy);  // never consumed: the chain's destructor deletes both
  CHECK_EQ(Py_REFCNT(owner), refs);
  CHECK_EQ(jxo::LiveTensors(), before.live);
  CHECK_EQ(jxo::ReleasedTensors(), before.released + 2);
  Py_DECREF(owner);
}

TEST(ChainedLegacyRefusesOtherObjects) {
  PyObject* not_capsule = PyLong_FromLong(1);
  CHECK(jxo::ChainedLegacyCapsule(not_capsule) == nullptr);
  CHECK(PyErr_ExceptionMatches(PyExc_TypeError));
  PyErr_Clear();
  Py_DECREF(not_capsule);
  PyObject* other = PyCapsule_New(kData, "not_a_tensor", nullptr);
  CHECK(jxo::ChainedLegacyCapsule(other) == nullptr);
  CHECK(PyErr_Occurred() != nullptr);
  PyErr_Clear();
  CHECK_EQ(std::string(PyCapsule_GetName(other)), std::string("not_a_tensor"));
  Py_DECREF(other);
}

// A deleter on a thread CPython does not know never takes the GIL, so it
// cannot block on (or, at exit, be killed by) a thread holding it: the
// Py_DECREF waits for the main thread, here RunHandedOff (CPython's pending
// call would run it too, but this test never returns to the eval loop).
// Before the hand-off this test deadlocked: the thread waited for the GIL
// that the joining thread held.
TEST(DeleterOnAForeignThreadHandsTheDecrefOff) {
  PyObject* owner = PyList_New(0);
  Py_ssize_t refs = Py_REFCNT(owner);
  PyObject* cap = jxo::NewOwnedCapsule(Desc(false), owner, false);
  REQUIRE(cap != nullptr);
  jxo::TakenTensor taken = jxo::TakeTensor(cap);
  REQUIRE(taken.tensor != nullptr);
  int64_t handed = jxo::HandedOff();
  int64_t run = jxo::HandedOffRun();
  std::thread([taken] { jxo::CallDeleter(taken); }).join();  // GIL still held here
  CHECK_EQ(jxo::HandedOff(), handed + 1);
  CHECK_EQ(Py_REFCNT(owner), refs + 1);  // not yet: nobody took the GIL
  jxo::RunHandedOff();
  CHECK_EQ(jxo::HandedOffRun(), run + 1);
  CHECK_EQ(Py_REFCNT(owner), refs);
  Py_DECREF(cap);
  Py_DECREF(owner);
}

TEST(DeleterOnTheGilHoldingThreadRunsNow) {
  PyObject* owner = PyList_New(0);
  Py_ssize_t refs = Py_REFCNT(owner);
  PyObject* cap = jxo::NewOwnedCapsule(Desc(false), owner, false);
  REQUIRE(cap != nullptr);
  int64_t handed = jxo::HandedOff();
  Py_DECREF(cap);
  CHECK_EQ(Py_REFCNT(owner), refs);
  CHECK_EQ(jxo::HandedOff(), handed);
  Py_DECREF(owner);
}

// CheckTensor on a 6-element float32 tensor with one field changed.
std::string CheckWith(void (*change)(dl::Tensor*)) {
  static int64_t shape[1] = {6};
  dl::Tensor t{};
  t.data = kData;
  t.device = {dl::kCPU, 0};
  t.ndim = 1;
  t.dtype = {dl::kFloat, 32, 1};
  t.shape = shape;
  change(&t);
  jxo::TensorGeometry g;
  jxo::Error err;
  if (jxo::CheckTensor(t, &g, &err)) return "(ok)";
  CHECK_EQ(err.kind, jxo::ErrorKind::kBuffer);
  return err.message;
}

TEST(CheckTensorAcceptsAPlainTensor) {
  CHECK_EQ(CheckWith([](dl::Tensor*) {}), std::string("(ok)"));
  // No elements: no memory, so no pointer is needed.
  CHECK_EQ(CheckWith([](dl::Tensor* t) {
             static int64_t empty[2] = {0, 3};
             t->ndim = 2;
             t->shape = empty;
             t->data = nullptr;
           }),
           std::string("(ok)"));
  // Nor does a byte_offset that would wrap: nothing is ever read there.
  CHECK_EQ(CheckWith([](dl::Tensor* t) {
             static int64_t empty[1] = {0};
             t->shape = empty;
             t->byte_offset = ~0ull;
           }),
           std::string("(ok)"));
}

TEST(CheckTensorRefusesWhatNoConsumerCanRead) {
  CHECK_CONTAINS(CheckWith([](dl::Tensor* t) { t->ndim = -1; }), "ndim -1");
  CHECK_CONTAINS(CheckWith([](dl::Tensor* t) { t->shape = nullptr; }),
                 "ndim 1 and no shape");
  CHECK_CONTAINS(CheckWith([](dl::Tensor* t) {
                   static int64_t neg[1] = {-6};
                   t->shape = neg;
                 }),
                 "shape (-6,) has a negative dimension");
  // These three were accepted before and imported as garbage or wrapped.
  CHECK_CONTAINS(CheckWith([](dl::Tensor* t) { t->data = nullptr; }),
                 "has a null data pointer");
  CHECK_CONTAINS(CheckWith([](dl::Tensor* t) { t->byte_offset = ~0ull; }),
                 "wraps past the top of the 64-bit address space");
  CHECK_CONTAINS(CheckWith([](dl::Tensor* t) {
                   t->data = reinterpret_cast<void*>(~uintptr_t{0} - 15);
                 }),
                 "reach past the top of the 64-bit address space");
  CHECK_CONTAINS(CheckWith([](dl::Tensor* t) {
                   static int64_t huge[1] = {int64_t{1} << 61};
                   t->shape = huge;
                   t->dtype.bits = 64;
                 }),
                 "in bytes overflows int64");
}

int main(int, char**) {
  Py_InitializeEx(0);
  int rc = ::check::RunAll("capsule_test");
  if (Py_FinalizeEx() != 0) rc = 1;
  return rc;
}
