#include "cai.h"

#include <cstdio>

namespace jxo {
namespace {

constexpr int kMaxNdim = 64;
constexpr const char* kAcceptedTypes =
    "|b1, |i1, <i2, <i4, <i8, |u1, <u2, <u4, <u8, <f2, <f4, <f8, <c8, <c16";

std::string Repr(PyObject* o) {
  PyObject* r = PyObject_Repr(o);
  if (!r) {
    PyErr_Clear();
    return "<unprintable>";
  }
  const char* s = PyUnicode_AsUTF8(r);
  std::string out = s ? s : "<unprintable>";
  if (!s) PyErr_Clear();
  Py_DECREF(r);
  if (out.size() > 80) out = out.substr(0, 77) + "...";
  return out;
}

std::string TypeName(PyObject* o) { return Py_TYPE(o)->tp_name; }

// A Python int that is not a bool (bool is an int subclass, but True as a
// shape or a pointer is a bug in the producer, not a value).
bool IsInt(PyObject* o) { return PyLong_Check(o) && !PyBool_Check(o); }

bool GetInt64(PyObject* o, const char* field, int64_t* out, Error* err) {
  if (!IsInt(o)) {
    return Fail(err, ErrorKind::kType,
                std::string("__cuda_array_interface__['") + field +
                    "'] must hold Python ints, got " + TypeName(o) + " " +
                    Repr(o));
  }
  int overflow = 0;
  long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
  if (overflow) {
    return Fail(err, ErrorKind::kValue,
                std::string("__cuda_array_interface__['") + field + "'] value " +
                    Repr(o) + " does not fit in int64");
  }
  *out = v;
  return true;
}

// A pointer-sized unsigned value: data pointers and stream handles.
bool GetHandle(PyObject* o, const char* what, uintptr_t* out, Error* err) {
  if (!IsInt(o)) {
    return Fail(err, ErrorKind::kType,
                std::string(what) + " must be a Python int, got " +
                    TypeName(o) + " " + Repr(o));
  }
  int overflow = 0;
  long long as_signed = PyLong_AsLongLongAndOverflow(o, &overflow);
  if (overflow < 0 || (overflow == 0 && as_signed < 0)) {
    return Fail(err, ErrorKind::kValue,
                std::string(what) + " must be non-negative, got " + Repr(o));
  }
  unsigned long long v = PyLong_AsUnsignedLongLong(o);
  if (v == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
    PyErr_Clear();
    return Fail(err, ErrorKind::kValue,
                std::string(what) + " " + Repr(o) + " does not fit in 64 bits");
  }
  *out = static_cast<uintptr_t>(v);
  return true;
}

bool IsSequence2(PyObject* o) {
  return PyTuple_Check(o) || PyList_Check(o);
}

PyObject* Item(PyObject* seq, Py_ssize_t i) {
  return PyTuple_Check(seq) ? PyTuple_GET_ITEM(seq, i)
                            : PyList_GET_ITEM(seq, i);
}

}  // namespace

bool TypestrToDtype(const std::string& ts, dl::DataType* dtype, int* itemsize,
                    Error* err) {
  auto bad = [&](const std::string& why) {
    return Fail(err, ErrorKind::kType,
                "__cuda_array_interface__['typestr'] " + std::string("'") + ts +
                    "' " + why + "; JAX holds " + kAcceptedTypes);
  };
  if (ts.size() < 3) return bad("is not a NumPy type string");
  char order = ts[0], kind = ts[1];
  if (order != '<' && order != '>' && order != '|' && order != '=') {
    return bad("has no byte-order character (<, >, | or =)");
  }
  int size = 0;
  for (size_t i = 2; i < ts.size(); ++i) {
    if (ts[i] < '0' || ts[i] > '9' || size > 1000) {
      return bad("is not a NumPy type string");
    }
    size = size * 10 + (ts[i] - '0');
  }
  if (order == '>' && size > 1) {
    return bad("is big-endian; convert it to little-endian first");
  }
  uint8_t code;
  switch (kind) {
    case 'b':
      if (size != 1) return bad("is not a dtype JAX can hold");
      code = dl::kBool;
      break;
    case 'i':
    case 'u':
      if (size != 1 && size != 2 && size != 4 && size != 8) {
        return bad("is not a dtype JAX can hold");
      }
      code = kind == 'i' ? dl::kInt : dl::kUInt;
      break;
    case 'f':
      if (size != 2 && size != 4 && size != 8) {
        return bad("is not a dtype JAX can hold");
      }
      code = dl::kFloat;
      break;
    case 'c':
      if (size != 8 && size != 16) return bad("is not a dtype JAX can hold");
      code = dl::kComplex;
      break;
    default:
      return bad("is not a dtype JAX can hold");
  }
  *dtype = dl::DataType{code, static_cast<uint8_t>(size * 8), 1};
  *itemsize = size;
  return true;
}

std::string DtypeToTypestr(const dl::DataType& dt) {
  if (dt.lanes != 1 || dt.bits % 8 != 0) return "";
  int size = dt.bits / 8;
  char kind;
  switch (dt.code) {
    case dl::kBool: kind = 'b'; break;
    case dl::kInt: kind = 'i'; break;
    case dl::kUInt: kind = 'u'; break;
    case dl::kFloat: kind = 'f'; break;
    case dl::kComplex: kind = 'c'; break;
    default: return "";
  }
  std::string ts = std::string(size == 1 ? "|" : "<") + kind + std::to_string(size);
  dl::DataType check;
  int itemsize;
  Error ignored;
  // Only what the parser accepts back: both directions agree on every code.
  return TypestrToDtype(ts, &check, &itemsize, &ignored) ? ts : "";
}

namespace {

// One function per field of the dict, in the protocol's order; each names
// the field, the value and what would be accepted.

bool Missing(Error* err, const char* key, const char* want) {
  return Fail(err, ErrorKind::kType,
              std::string("__cuda_array_interface__ has no '") + key +
                  "' key; the protocol requires " + want);
}

bool ParseVersion(PyObject* v, ArrayView* out, Error* err) {
  if (!v) return Missing(err, "version", "an int (3 is current)");
  int64_t version;
  if (!IsInt(v)) {
    return Fail(err, ErrorKind::kType,
                "__cuda_array_interface__['version'] must be an int, got " +
                    TypeName(v) + " " + Repr(v));
  }
  if (!GetInt64(v, "version", &version, err)) return false;
  if (version < 0 || version > 3) {
    return Fail(err, ErrorKind::kBuffer,
                "__cuda_array_interface__['version'] is " +
                    std::to_string(version) +
                    "; jax_overlay reads versions 0 to 3");
  }
  out->version = static_cast<int>(version);
  return true;
}

bool ParseShape(PyObject* shape, ArrayView* out, Error* err) {
  if (!shape) return Missing(err, "shape", "a tuple of ints");
  if (!IsSequence2(shape)) {
    return Fail(err, ErrorKind::kType,
                "__cuda_array_interface__['shape'] must be a tuple of ints, "
                "got " + TypeName(shape) + " " + Repr(shape));
  }
  Py_ssize_t nd = PySequence_Fast_GET_SIZE(shape);
  if (nd > kMaxNdim) {
    return Fail(err, ErrorKind::kValue,
                "__cuda_array_interface__['shape'] has " + std::to_string(nd) +
                    " dimensions; at most " + std::to_string(kMaxNdim) +
                    " are accepted");
  }
  out->shape.resize(nd);
  for (Py_ssize_t i = 0; i < nd; ++i) {
    if (!GetInt64(Item(shape, i), "shape", &out->shape[i], err)) return false;
    if (out->shape[i] < 0) {
      return Fail(err, ErrorKind::kValue,
                  "__cuda_array_interface__['shape'] " + Repr(shape) +
                      " has a negative dimension; sizes must be >= 0");
    }
  }
  return true;
}

bool ParseTypestr(PyObject* ts, ArrayView* out, Error* err) {
  if (!ts) return Missing(err, "typestr", "a NumPy type string such as '<f4'");
  if (!PyUnicode_Check(ts)) {
    return Fail(err, ErrorKind::kType,
                "__cuda_array_interface__['typestr'] must be a str, got " +
                    TypeName(ts) + " " + Repr(ts));
  }
  Py_ssize_t ts_len = 0;
  const char* tsc = PyUnicode_AsUTF8AndSize(ts, &ts_len);
  if (!tsc) {
    PyErr_Clear();
    return Fail(err, ErrorKind::kType,
                "__cuda_array_interface__['typestr'] is not valid UTF-8");
  }
  // The whole string, embedded NULs included: '<f4\0junk' is not '<f4'.
  out->typestr.assign(tsc, static_cast<size_t>(ts_len));
  if (out->typestr.find('\0') != std::string::npos) {
    return Fail(err, ErrorKind::kType,
                "__cuda_array_interface__['typestr'] " + Repr(ts) +
                    " has a NUL character; JAX holds " + kAcceptedTypes);
  }
  return TypestrToDtype(out->typestr, &out->dtype, &out->itemsize, err);
}

bool ParseData(PyObject* data, ArrayView* out, Error* err) {
  if (!data) return Missing(err, "data", "a tuple (pointer: int, read_only: bool)");
  if (!IsSequence2(data) || PySequence_Fast_GET_SIZE(data) != 2) {
    return Fail(err, ErrorKind::kType,
                "__cuda_array_interface__['data'] must be a tuple (pointer: "
                "int, read_only: bool), got " + TypeName(data) + " " +
                    Repr(data));
  }
  if (!GetHandle(Item(data, 0), "__cuda_array_interface__['data'][0]",
                 &out->data, err)) {
    return false;
  }
  PyObject* ro = Item(data, 1);
  if (!PyBool_Check(ro)) {
    return Fail(err, ErrorKind::kType,
                "__cuda_array_interface__['data'][1] (read_only) must be a "
                "bool, got " + TypeName(ro) + " " + Repr(ro));
  }
  out->read_only = ro == Py_True;
  return true;
}

// Bytes in the protocol, elements from here on.  `st`: None or absent for
// C order.
bool ParseStrides(PyObject* st, PyObject* shape, ArrayView* out, Error* err) {
  out->strides.clear();
  if (!st || st == Py_None) return true;
  Py_ssize_t nd = static_cast<Py_ssize_t>(out->shape.size());
  if (!IsSequence2(st)) {
    return Fail(err, ErrorKind::kType,
                "__cuda_array_interface__['strides'] must be None or a "
                "tuple of ints (bytes), got " + TypeName(st) + " " +
                    Repr(st));
  }
  if (PySequence_Fast_GET_SIZE(st) != nd) {
    return Fail(err, ErrorKind::kValue,
                "__cuda_array_interface__['strides'] " + Repr(st) + " has " +
                    std::to_string(PySequence_Fast_GET_SIZE(st)) +
                    " entries but shape " + Repr(shape) + " has " +
                    std::to_string(nd));
  }
  out->strides.resize(nd);
  for (Py_ssize_t i = 0; i < nd; ++i) {
    int64_t b;
    if (!GetInt64(Item(st, i), "strides", &b, err)) return false;
    if (b % out->itemsize != 0) {
      return Fail(err, ErrorKind::kValue,
                  "__cuda_array_interface__['strides'] " + Repr(st) +
                      " are not multiples of the item size " +
                      std::to_string(out->itemsize) + " of '" +
                      out->typestr + "'; JAX needs element-aligned strides");
    }
    out->strides[i] = b / out->itemsize;
  }
  return true;
}

// JAX arrays have no masked form, and ignoring a mask would hand back data
// the producer marked invalid.
bool RefuseMask(PyObject* mask, Error* err) {
  if (!mask || mask == Py_None) return true;
  return Fail(err, ErrorKind::kBuffer,
              "__cuda_array_interface__['mask'] is set (" + Repr(mask) +
                  "); JAX has no masked arrays: fill or compress the "
                  "masked elements first and pass mask=None");
}

// Defined from version 3 on; absent or None means no ordering.
bool ParseStream(PyObject* stream, ArrayView* out, Error* err) {
  out->has_stream = false;
  if (!stream || stream == Py_None) return true;
  if (!GetHandle(stream, "__cuda_array_interface__['stream']", &out->stream,
                 err)) {
    return false;
  }
  if (out->stream == 0) {
    return Fail(err, ErrorKind::kValue,
                "__cuda_array_interface__['stream'] is 0, which the "
                "protocol forbids as ambiguous; use 1 (legacy default "
                "stream), 2 (per-thread default stream), a stream handle, "
                "or None (no ordering needed)");
  }
  out->has_stream = true;
  return true;
}

// The layout the shape and strides make, and the memory it spans from the
// pointer: what the fields say together.
bool CheckGeometry(PyObject* shape, PyObject* st, ArrayView* out, Error* err) {
  const char* why = nullptr;
  bool strided = st && st != Py_None;
  if (!AnalyzeLayout(out->shape, out->strides, &out->layout, &why)) {
    return Fail(err, ErrorKind::kValue,
                "__cuda_array_interface__ shape " + Repr(shape) +
                    (strided ? " with strides " + Repr(st) : "") + ": " + why);
  }
  if (out->data == 0 && out->layout.numel != 0) {
    return Fail(err, ErrorKind::kValue,
                "__cuda_array_interface__['data'][0] is a null pointer for "
                "shape " + Repr(shape) +
                    "; only zero-size arrays may have pointer 0");
  }
  if (!CheckEnvelope(out->data, out->layout, out->itemsize, &why)) {
    return Fail(err, ErrorKind::kValue,
                "__cuda_array_interface__['data'][0] = " +
                    std::to_string(out->data) + " with shape " + Repr(shape) +
                    (strided ? " and strides " + Repr(st) : "") +
                    " of '" + out->typestr + "': " + why +
                    "; the producer's pointer or strides are wrong");
  }
  return true;
}

}  // namespace

bool ParseCai(PyObject* cai, ArrayView* out, Error* err) {
  if (!PyDict_Check(cai)) {
    return Fail(err, ErrorKind::kType,
                "__cuda_array_interface__ must be a dict, got " +
                    TypeName(cai));
  }
  auto get = [&](const char* key) { return PyDict_GetItemString(cai, key); };
  PyObject* shape = get("shape");
  PyObject* st = get("strides");
  return ParseVersion(get("version"), out, err) &&
         ParseShape(shape, out, err) &&
         ParseTypestr(get("typestr"), out, err) &&
         ParseData(get("data"), out, err) &&
         ParseStrides(st, shape, out, err) && RefuseMask(get("mask"), err) &&
         ParseStream(out->version >= 3 ? get("stream") : nullptr, out, err) &&
         CheckGeometry(shape, st, out, err);
}

}  // namespace jxo
