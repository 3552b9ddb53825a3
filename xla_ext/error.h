// An error the native core reports to Python: which exception class, and a
// message that names the field, the value and what would be accepted.
#ifndef JAX_OVERLAY_XLA_EXT_ERROR_H_
#define JAX_OVERLAY_XLA_EXT_ERROR_H_

#include <string>

namespace jxo {

enum class ErrorKind { kNone, kType, kValue, kBuffer };

struct Error {
  ErrorKind kind = ErrorKind::kNone;
  std::string message;
  bool ok() const { return kind == ErrorKind::kNone; }
};

inline bool Fail(Error* e, ErrorKind kind, std::string message) {
  e->kind = kind;
  e->message = std::move(message);
  return false;
}

}  // namespace jxo

#endif  // JAX_OVERLAY_XLA_EXT_ERROR_H_
