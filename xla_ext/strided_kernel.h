// The GPU copy of a strided array into a compact one: our own kernel, written
// as PTX text and JIT-compiled by the driver (no CUDA toolkit at build time),
// launched on the stream the caller gives (XLA's, inside a custom call).
#ifndef JAX_OVERLAY_XLA_EXT_STRIDED_KERNEL_H_
#define JAX_OVERLAY_XLA_EXT_STRIDED_KERNEL_H_

#include <cstdint>
#include <string>

#include "error.h"

namespace jxo::strided {

// What the kernel copies: `count` items of `unit` bytes (1, 2, 4, 8 or 16),
// item i of the output being, with i = (a * o2 + b) * inner + j,
//   src + unit * (offset + a * s1 + b * s2 + j * s_inner).
// Strides and offset are in items; o1 = count / (o2 * inner).
struct Plan {
  int64_t unit = 0;
  int64_t offset = 0;
  int64_t count = 0;
  int64_t inner = 1, s_inner = 0;
  int64_t o2 = 1, s2 = 0;
  int64_t s1 = 0;
  int64_t envelope = 0;  // items readable from src
};

// A plan serialized as the custom call's int64 attribute: Plan's members in
// order, without `envelope` (the size of the input buffer).
constexpr int kPlanFields = 8;
Plan FromFields(const int64_t* fields, int64_t envelope);

// True when `p` is consistent and every item it reads lies inside the
// envelope; ValueError naming the field otherwise.  The kernel's index
// arithmetic is 32-bit: counts, sizes and strides must stay below 2**31.
bool Validate(const Plan& p, Error* err);

// floor(n / d) == (n * magic) >> shift for every 0 <= n < 2**31, with
// 1 <= d < 2**31: the kernel divides with one wide multiply.
struct FastDivisor {
  uint32_t magic = 0;
  uint32_t shift = 0;
};
FastDivisor MakeFastDivisor(uint32_t d);

// The PTX text of the kernels (one entry per unit size).
const std::string& Ptx();

// Enqueues the copy of `p` from `src` to `dst` on `stream` (a CUstream of
// the current or any context: the kernel is loaded, once, into the stream's
// own context).  `p` must have passed Validate.
bool Launch(const Plan& p, uintptr_t dst, uintptr_t src, uintptr_t stream,
            Error* err);

// Loads the kernels into the primary context of device `ordinal` now, so
// that a driver which cannot JIT them fails here, with a BufferError, and not
// inside a running computation.
bool Prepare(int ordinal, Error* err);

}  // namespace jxo::strided

#endif  // JAX_OVERLAY_XLA_EXT_STRIDED_KERNEL_H_
