// The XLA FFI handler of the strided copy: XLA allocates the compact output,
// orders the call after the computations that produce its input, and keeps
// the input alive while the kernel reads it; the handler decodes the call
// frame and launches our kernel on XLA's stream.
#ifndef JAX_OVERLAY_XLA_EXT_FFI_HANDLER_H_
#define JAX_OVERLAY_XLA_EXT_FFI_HANDLER_H_

#include "xla_ffi_abi.h"

namespace jxo::ffi {

// XLA accepts a handler only if the FFI version it reports is one it
// supports.  Python sets the version of the jaxlib in use (read from the
// headers jaxlib ships) before registering; major versions other than
// kApiMajor are refused there.
void SetReportedMinor(int minor);

// The handler: one buffer argument (the envelope of the producer's memory),
// one buffer result (the compact copy), and an int64 array attribute "plan"
// (strided::Plan's fields in order, without `envelope`, which is the
// argument's size).
Error* StridedCopy(CallFrame* frame);

}  // namespace jxo::ffi

#endif  // JAX_OVERLAY_XLA_EXT_FFI_HANDLER_H_
