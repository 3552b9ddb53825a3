// Parsing and validation of a __cuda_array_interface__ dict (versions 0-3).
// Every field is checked before anything touches the driver, so a malformed
// dict gets its real error on any machine.
#ifndef JAX_OVERLAY_XLA_EXT_CAI_H_
#define JAX_OVERLAY_XLA_EXT_CAI_H_

#include <Python.h>

#include <cstdint>
#include <string>
#include <vector>

#include "dlpack_abi.h"
#include "error.h"
#include "layout.h"

namespace jxo {

struct ArrayView {
  int version = 0;
  uintptr_t data = 0;
  bool read_only = false;
  std::string typestr;
  dl::DataType dtype{};
  int itemsize = 0;
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;  // elements; empty when the dict has none
  Layout layout;
  bool has_stream = false;  // v3 with a non-None stream
  uintptr_t stream = 0;
};

// Parses `cai` into `out`.  On failure returns false and fills `err`.
// Requires the GIL.
bool ParseCai(PyObject* cai, ArrayView* out, Error* err);

// Maps a NumPy type string to a DLPack dtype; shared with the exporter so
// both directions agree on every code.
bool TypestrToDtype(const std::string& typestr, dl::DataType* dtype,
                    int* itemsize, Error* err);

// The inverse: the NumPy type string of a DLPack dtype, or "" when the CAI
// has none (bfloat16, float8, sub-byte, lanes > 1).
std::string DtypeToTypestr(const dl::DataType& dtype);

}  // namespace jxo

#endif  // JAX_OVERLAY_XLA_EXT_CAI_H_
