// ParseCai and TypestrToDtype, driven by dicts built with the C API in an
// embedded interpreter: every field validated, with the right error kind
// and a message that names the field.
#include "xla_ext/cai.h"

#include <Python.h>

#include <string>

#include "tests/cc/check.h"

using jxo::ArrayView;
using jxo::Error;
using jxo::ErrorKind;
using jxo::LayoutKind;

namespace {

// Sets d[key] = value and drops our reference to value.
void Set(PyObject* d, const char* key, PyObject* value) {
  PyDict_SetItemString(d, key, value);
  Py_DECREF(value);
}

// A valid version-3 dict: a 2x3 float32 array at 0x1000, no strides.
PyObject* Valid() {
  PyObject* d = PyDict_New();
  Set(d, "version", PyLong_FromLong(3));
  Set(d, "shape", Py_BuildValue("(ii)", 2, 3));
  Set(d, "typestr", PyUnicode_FromString("<f4"));
  Set(d, "data", Py_BuildValue("(KO)", 4096ULL, Py_False));
  Set(d, "strides", Py_NewRef(Py_None));
  Set(d, "stream", Py_NewRef(Py_None));
  return d;
}

struct Result {
  bool ok;
  ArrayView spec;
  Error err;
};

// Parses and drops `cai`; a failure must leave no Python exception behind.
Result Parse(PyObject* cai) {
  Result r;
  r.ok = jxo::ParseCai(cai, &r.spec, &r.err);
  Py_DECREF(cai);
  CHECK(PyErr_Occurred() == nullptr);
  PyErr_Clear();
  return r;
}

// Valid() with one key replaced (value stolen), or removed (nullptr).
Result ParseWith(const char* key, PyObject* value) {
  PyObject* d = Valid();
  if (value) {
    Set(d, key, value);
  } else {
    PyDict_DelItemString(d, key);
  }
  return Parse(d);
}

void ExpectError(const Result& r, ErrorKind kind, const std::string& text) {
  CHECK(!r.ok);
  CHECK_EQ(r.err.kind, kind);
  CHECK_CONTAINS(r.err.message, text);
}

}  // namespace

TEST(ValidDictWithStridesAndStream) {
  PyObject* d = Valid();
  Set(d, "strides", Py_BuildValue("(ii)", 4, 8));
  Set(d, "stream", PyLong_FromLong(7));
  Set(d, "data", Py_BuildValue("(KO)", 8192ULL, Py_True));
  Result r = Parse(d);
  REQUIRE(r.ok);
  CHECK(r.err.ok());
  CHECK_EQ(r.spec.version, 3);
  CHECK_EQ(r.spec.data, uintptr_t{8192});
  CHECK(r.spec.read_only);
  CHECK_EQ(r.spec.typestr, std::string("<f4"));
  CHECK_EQ(r.spec.itemsize, 4);
  CHECK_EQ(int(r.spec.dtype.code), int(jxo::dl::kFloat));
  CHECK_EQ(int(r.spec.dtype.bits), 32);
  CHECK_EQ(int(r.spec.dtype.lanes), 1);
  CHECK_EQ(r.spec.shape, (std::vector<int64_t>{2, 3}));
  CHECK_EQ(r.spec.strides, (std::vector<int64_t>{1, 2}));  // elements
  CHECK_EQ(r.spec.layout.kind, LayoutKind::kPermuted);
  CHECK_EQ(r.spec.layout.numel, 6);
  CHECK(r.spec.has_stream);
  CHECK_EQ(r.spec.stream, uintptr_t{7});
}

TEST(NoneStridesAndStreamMeanRowMajorUnordered) {
  Result r = Parse(Valid());
  REQUIRE(r.ok);
  CHECK(r.spec.strides.empty());
  CHECK_EQ(r.spec.layout.kind, LayoutKind::kRowMajor);
  CHECK(!r.spec.read_only);
  CHECK(!r.spec.has_stream);
}

TEST(ListsAreAcceptedAsSequences) {
  Result r = ParseWith("shape", Py_BuildValue("[iii]", 4, 1, 2));
  REQUIRE(r.ok);
  CHECK_EQ(r.spec.shape, (std::vector<int64_t>{4, 1, 2}));
}

TEST(NotADict) {
  ExpectError(Parse(Py_BuildValue("[i]", 1)), ErrorKind::kType,
              "__cuda_array_interface__ must be a dict, got list");
}

TEST(MissingKeysNameTheKey) {
  for (const char* key : {"version", "shape", "typestr", "data"}) {
    Result r = ParseWith(key, nullptr);
    ExpectError(r, ErrorKind::kType,
                std::string("has no '") + key + "' key");
  }
}

TEST(Version) {
  ExpectError(ParseWith("version", PyLong_FromLong(4)), ErrorKind::kBuffer,
              "reads versions 0 to 3");
  ExpectError(ParseWith("version", PyLong_FromLong(-1)), ErrorKind::kBuffer,
              "['version'] is -1");
  ExpectError(ParseWith("version", Py_NewRef(Py_True)), ErrorKind::kType,
              "['version'] must be an int, got bool");
  ExpectError(ParseWith("version", PyUnicode_FromString("3")),
              ErrorKind::kType, "got str '3'");
}

TEST(Shape) {
  ExpectError(ParseWith("shape", Py_BuildValue("(ii)", 2, -1)),
              ErrorKind::kValue, "has a negative dimension");
  ExpectError(ParseWith("shape", Py_BuildValue("(O)", Py_True)),
              ErrorKind::kType, "['shape'] must hold Python ints, got bool");
  ExpectError(ParseWith("shape", PyLong_FromLong(6)), ErrorKind::kType,
              "['shape'] must be a tuple of ints, got int 6");
  PyObject* huge = PyLong_FromString("1180591620717411303424", nullptr, 10);
  ExpectError(ParseWith("shape", Py_BuildValue("(N)", huge)), ErrorKind::kValue,
              "does not fit in int64");
  PyObject* many = PyTuple_New(65);
  for (int i = 0; i < 65; ++i) PyTuple_SET_ITEM(many, i, PyLong_FromLong(1));
  ExpectError(ParseWith("shape", many), ErrorKind::kValue,
              "has 65 dimensions; at most 64");
}

TEST(Typestr) {
  ExpectError(ParseWith("typestr", PyUnicode_FromString(">f4")),
              ErrorKind::kType, "is big-endian");
  ExpectError(ParseWith("typestr", PyUnicode_FromString("<f3")),
              ErrorKind::kType, "'<f3' is not a dtype JAX can hold");
  ExpectError(ParseWith("typestr", PyUnicode_FromString("f4")),
              ErrorKind::kType, "is not a NumPy type string");
  ExpectError(ParseWith("typestr", PyBytes_FromString("<f4")),
              ErrorKind::kType, "['typestr'] must be a str, got bytes");
  // The whole string counts: it used to be read up to the NUL, as '<f4'.
  ExpectError(ParseWith("typestr", PyUnicode_FromStringAndSize("<f4\0junk", 8)),
              ErrorKind::kType, "['typestr'] '<f4\\x00junk' has a NUL character");
}

TEST(TypestrToDtypeCodes) {
  struct Row {
    const char* ts;
    uint8_t code;
    int itemsize;
  } rows[] = {{"|b1", jxo::dl::kBool, 1},    {"<i8", jxo::dl::kInt, 8},
              {"<u2", jxo::dl::kUInt, 2},    {"<f2", jxo::dl::kFloat, 2},
              {"<c16", jxo::dl::kComplex, 16}, {">i1", jxo::dl::kInt, 1}};
  for (const Row& row : rows) {
    jxo::dl::DataType dt{};
    int itemsize = 0;
    Error err;
    CHECK(jxo::TypestrToDtype(row.ts, &dt, &itemsize, &err));
    CHECK_EQ(int(dt.code), int(row.code));
    CHECK_EQ(int(dt.bits), row.itemsize * 8);
    CHECK_EQ(itemsize, row.itemsize);
  }
}

TEST(Data) {
  ExpectError(ParseWith("data", Py_BuildValue("(iO)", -8, Py_False)),
              ErrorKind::kValue, "['data'][0] must be non-negative");
  ExpectError(ParseWith("data", Py_BuildValue("(ii)", 4096, 0)),
              ErrorKind::kType, "['data'][1] (read_only) must be a bool");
  ExpectError(ParseWith("data", Py_BuildValue("(i)", 4096)), ErrorKind::kType,
              "['data'] must be a tuple (pointer: int, read_only: bool)");
  ExpectError(ParseWith("data", Py_BuildValue("(iO)", 0, Py_False)),
              ErrorKind::kValue, "is a null pointer");
  // 2x3 float32 is 24 bytes: from 2**64 - 16 they would wrap to address 8.
  ExpectError(ParseWith("data", Py_BuildValue("(KO)", ~0ULL - 15, Py_False)),
              ErrorKind::kValue, "reach past the top of the 64-bit address space");
  CHECK(ParseWith("data", Py_BuildValue("(KO)", ~0ULL - 23, Py_False)).ok);
}

TEST(NullPointerIsFineForZeroSize) {
  PyObject* d = Valid();
  Set(d, "shape", Py_BuildValue("(ii)", 0, 3));
  Set(d, "data", Py_BuildValue("(iO)", 0, Py_False));
  Result r = Parse(d);
  REQUIRE(r.ok);
  CHECK_EQ(r.spec.layout.numel, 0);
}

TEST(Strides) {
  ExpectError(ParseWith("strides", Py_BuildValue("(ii)", 12, 6)),
              ErrorKind::kValue, "not multiples of the item size 4");
  ExpectError(ParseWith("strides", Py_BuildValue("(i)", 4)), ErrorKind::kValue,
              "has 1 entries but shape (2, 3) has 2");
  ExpectError(ParseWith("strides", PyUnicode_FromString("C")),
              ErrorKind::kType, "['strides'] must be None or a tuple");

  PyObject* d = Valid();
  Set(d, "shape", Py_BuildValue("(i)", 4));
  Set(d, "strides", Py_BuildValue("(i)", -4));
  Set(d, "data", Py_BuildValue("(iO)", 4, Py_False));  // reaches -8
  ExpectError(Parse(d), ErrorKind::kValue, "reach below address 0");
}

TEST(MaskIsRefused) {
  ExpectError(ParseWith("mask", PyLong_FromLong(1)), ErrorKind::kBuffer,
              "JAX has no masked arrays");
  CHECK(ParseWith("mask", Py_NewRef(Py_None)).ok);
}

TEST(Stream) {
  ExpectError(ParseWith("stream", PyLong_FromLong(0)), ErrorKind::kValue,
              "['stream'] is 0");
  ExpectError(ParseWith("stream", PyFloat_FromDouble(1.0)), ErrorKind::kType,
              "['stream'] must be a Python int, got float");
  // Before version 3 there is no stream field: whatever is there is ignored.
  PyObject* d = Valid();
  Set(d, "version", PyLong_FromLong(2));
  Set(d, "stream", PyLong_FromLong(0));
  Result r = Parse(d);
  REQUIRE(r.ok);
  CHECK(!r.spec.has_stream);
  CHECK_EQ(r.spec.version, 2);
}

int main(int, char**) {
  Py_InitializeEx(0);  // no signal handlers: this is a test, not an app
  int rc = ::check::RunAll("cai_test");
  if (Py_FinalizeEx() != 0) rc = 1;
  return rc;
}
