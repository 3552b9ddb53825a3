// libFuzzer harness for AnalyzeLayout and CheckEnvelope: any shape, any
// strides, any pointer.  Every accepted layout is checked against a 128-bit
// reference computed here, so a silent wrap is a crash, not a pass.
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "layout.h"

namespace {

using i128 = __int128;

[[noreturn]] void Mismatch() { std::abort(); }

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* input, size_t size) {
  FuzzedDataProvider in(input, size);
  const size_t nd = in.ConsumeIntegralInRange<size_t>(0, 8);
  const bool with_strides = in.ConsumeBool();
  std::vector<int64_t> shape, strides;
  for (size_t i = 0; i < nd; ++i) {
    // Mostly small sizes (so envelopes are checked for real), some huge.
    shape.push_back(in.ConsumeBool() ? in.ConsumeIntegralInRange<int64_t>(0, 9)
                                     : in.ConsumeIntegralInRange<int64_t>(0, INT64_MAX));
    if (with_strides) {
      strides.push_back(in.ConsumeBool() ? in.ConsumeIntegralInRange<int64_t>(-9, 9)
                                         : in.ConsumeIntegral<int64_t>());
    }
  }
  const int64_t itemsize = in.ConsumeIntegralInRange<int64_t>(1, 16);
  const uintptr_t data = in.ConsumeIntegral<uintptr_t>();

  jxo::Layout layout;
  const char* why = nullptr;
  const bool ok = jxo::AnalyzeLayout(shape, strides, &layout, &why);

  // The reference: exact products and sums in 128 bits.
  i128 numel = 1;
  bool count_overflow = false;
  for (int64_t n : shape) {
    // As consumers multiply: in order.  Stop at the first overflow, so the
    // reference itself cannot overflow 128 bits.
    if (count_overflow) break;
    numel *= n;
    if (numel > INT64_MAX) count_overflow = true;
  }
  if (!ok) {
    if (why == nullptr) Mismatch();
    return 0;  // a refusal is always safe; acceptances are what must be exact
  }
  if (count_overflow || layout.numel != numel) Mismatch();
  i128 low = 0, high = 0;
  if (numel != 0 && !strides.empty()) {
    for (size_t d = 0; d < nd; ++d) {
      i128 reach = i128(shape[d] - 1) * strides[d];
      (reach < 0 ? low : high) += reach;
    }
  } else {
    high = numel - 1;
  }
  const i128 span = numel == 0 ? 0 : high - low + 1;
  if (layout.low != low || layout.span != span) Mismatch();
  // Compact layouts touch exactly numel distinct elements.
  if (layout.kind != jxo::LayoutKind::kStrided && numel != 0 && span != numel) Mismatch();

  const bool fits = jxo::CheckEnvelope(data, layout, itemsize, &why);
  const i128 bytes = span * itemsize;
  const i128 start = i128(data) + low * itemsize;
  const bool want = bytes <= INT64_MAX &&
                    (numel == 0 || (start >= 0 && start + bytes <= (i128(1) << 64)));
  if (fits != want) Mismatch();
  return 0;
}
