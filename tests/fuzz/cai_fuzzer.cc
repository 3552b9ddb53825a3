// libFuzzer harness for ParseCai in an embedded interpreter: dicts built from
// the input with the protocol's keys (and others) holding ints of any size,
// bools, floats, None, str (any bytes, NUL included), bytes, tuples, lists
// and nested dicts.  ParseCai must never crash, never leave a Python error
// set, and what it accepts must be self-consistent.
#include <Python.h>
#include <fuzzer/FuzzedDataProvider.h>

#include <cstdlib>
#include <string>

#include "cai.h"

namespace {

const char* const kKeys[] = {"version", "shape", "typestr", "data", "strides",
                             "mask", "stream", "descr", "Shape", ""};
const std::string kTypestrs[] = {"<f4", "|b1", "<c16", "|u1", "<i8", ">i1", "=f2",
                                  "<f04", ">f4", "<V8", std::string("<f4\0x", 5), ""};

PyObject* Value(FuzzedDataProvider& in, int depth);

PyObject* Sequence(FuzzedDataProvider& in, int depth, bool tuple) {
  const size_t n = in.ConsumeIntegralInRange<size_t>(0, in.ConsumeBool() ? 4 : 70);
  PyObject* seq = tuple ? PyTuple_New(n) : PyList_New(n);
  for (size_t i = 0; i < n; ++i) {
    PyObject* v = Value(in, depth + 1);
    if (tuple) {
      PyTuple_SET_ITEM(seq, i, v);
    } else {
      PyList_SET_ITEM(seq, i, v);
    }
  }
  return seq;
}

PyObject* Int(FuzzedDataProvider& in) {
  switch (in.ConsumeIntegralInRange<int>(0, 3)) {
    case 0:
      return PyLong_FromLongLong(in.ConsumeIntegralInRange<long long>(-3, 9));
    case 1:
      return PyLong_FromLongLong(in.ConsumeIntegral<long long>());
    case 2:
      return PyLong_FromUnsignedLongLong(in.ConsumeIntegral<unsigned long long>());
    default: {  // beyond 64 bits, either sign
      std::string digits = std::to_string(in.ConsumeIntegral<unsigned long long>()) + "123456789";
      if (in.ConsumeBool()) digits = "-" + digits;
      return PyLong_FromString(digits.c_str(), nullptr, 10);
    }
  }
}

PyObject* Value(FuzzedDataProvider& in, int depth) {
  const int kind = in.ConsumeIntegralInRange<int>(0, depth > 2 ? 6 : 10);
  switch (kind) {
    case 0:
    case 1:
    case 2:
      return Int(in);
    case 3:
      return Py_NewRef(in.ConsumeBool() ? Py_True : Py_False);
    case 4:
      return Py_NewRef(Py_None);
    case 5: {
      // A known typestr, perhaps cut short, or any bytes.
      std::string s = in.ConsumeBool()
                          ? kTypestrs[in.ConsumeIntegralInRange<int>(0, 11)].substr(
                                0, in.ConsumeIntegralInRange<size_t>(0, 5))
                          : in.ConsumeRandomLengthString(8);
      PyObject* u = PyUnicode_DecodeUTF8(s.data(), Py_ssize_t(s.size()), "surrogatepass");
      if (!u) {
        PyErr_Clear();
        u = PyUnicode_FromString("<f4");
      }
      return u;
    }
    case 6:
      return PyFloat_FromDouble(in.ConsumeFloatingPoint<double>());
    case 7:
    case 8:
      return Sequence(in, depth, true);
    case 9:
      return Sequence(in, depth, false);
    default: {
      std::string s = in.ConsumeRandomLengthString(4);
      return PyBytes_FromStringAndSize(s.data(), Py_ssize_t(s.size()));
    }
  }
}

// A well-formed dict to start from (random keys alone rarely get past the
// first checks): version, shape, typestr, data, and sometimes strides and a
// stream, all drawn from the input; the keys drawn after it may spoil it.
void WellFormed(FuzzedDataProvider& in, PyObject* d) {
  static const char* const kGood[] = {"<f4", "|b1", "<c16", "|u1", "<i8", "<f2"};
  static const int kSize[] = {4, 1, 16, 1, 8, 2};
  const int t = in.ConsumeIntegralInRange<int>(0, 5);
  const Py_ssize_t nd = in.ConsumeIntegralInRange<Py_ssize_t>(0, 5);
  PyObject* shape = PyTuple_New(nd);
  for (Py_ssize_t i = 0; i < nd; ++i) {
    PyTuple_SET_ITEM(shape, i, PyLong_FromLongLong(in.ConsumeBool()
        ? in.ConsumeIntegralInRange<long long>(0, 9) : in.ConsumeIntegral<long long>()));
  }
  PyObject* data = Py_BuildValue("(KO)", in.ConsumeIntegral<unsigned long long>(),
                                 in.ConsumeBool() ? Py_True : Py_False);
  PyObject* version = PyLong_FromLong(in.ConsumeIntegralInRange<long>(0, 3));
  PyObject* typestr = PyUnicode_FromString(kGood[t]);
  PyDict_SetItemString(d, "version", version);
  PyDict_SetItemString(d, "shape", shape);
  PyDict_SetItemString(d, "typestr", typestr);
  PyDict_SetItemString(d, "data", data);
  Py_DECREF(version);
  Py_DECREF(shape);
  Py_DECREF(typestr);
  Py_DECREF(data);
  if (in.ConsumeBool()) {  // strides in bytes, mostly multiples of the item size
    PyObject* strides = PyTuple_New(nd);
    for (Py_ssize_t i = 0; i < nd; ++i) {
      const long long s = in.ConsumeBool()
          ? in.ConsumeIntegralInRange<long long>(-9, 9) * kSize[t]
          : in.ConsumeIntegral<long long>();
      PyTuple_SET_ITEM(strides, i, PyLong_FromLongLong(s));
    }
    PyDict_SetItemString(d, "strides", strides);
    Py_DECREF(strides);
  }
  if (in.ConsumeBool()) {
    PyObject* stream = PyLong_FromUnsignedLongLong(in.ConsumeIntegralInRange<unsigned long long>(0, 3));
    PyDict_SetItemString(d, "stream", stream);
    Py_DECREF(stream);
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  Py_InitializeEx(0);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* bytes, size_t size) {
  FuzzedDataProvider in(bytes, size);
  PyObject* d = PyDict_New();
  if (in.ConsumeBool()) WellFormed(in, d);
  const size_t keys = in.ConsumeIntegralInRange<size_t>(0, in.ConsumeBool() ? 2 : 9);
  for (size_t i = 0; i < keys; ++i) {
    PyObject* v = Value(in, 0);
    PyDict_SetItemString(d, kKeys[in.ConsumeIntegralInRange<int>(0, 9)], v);
    Py_DECREF(v);
  }
  jxo::ArrayView spec;
  jxo::Error err;
  const bool ok = jxo::ParseCai(d, &spec, &err);
  if (PyErr_Occurred()) std::abort();  // errors travel in `err`, never as Python's
  if (ok != err.ok()) std::abort();
  if (!ok && err.message.empty()) std::abort();
  if (ok) {
    // What the parser hands on must describe a readable array.
    if (spec.shape.size() > 64 || spec.itemsize <= 0) std::abort();
    if (!spec.strides.empty() && spec.strides.size() != spec.shape.size()) std::abort();
    if (spec.layout.numel != 0 && spec.data == 0) std::abort();
    const char* why = nullptr;
    if (!jxo::CheckEnvelope(spec.data, spec.layout, spec.itemsize, &why)) std::abort();
    if (spec.typestr.find('\0') != std::string::npos) std::abort();
    if (spec.has_stream && spec.stream == 0) std::abort();
  }
  Py_DECREF(d);
  return 0;
}
