// Classifies an array's strides: what JAX can view as-is, and what needs a
// GPU-side copy.  Pure arithmetic, no Python, no CUDA.
#ifndef JAX_OVERLAY_XLA_EXT_LAYOUT_H_
#define JAX_OVERLAY_XLA_EXT_LAYOUT_H_

#include <cstdint>
#include <vector>

namespace jxo {

enum class LayoutKind {
  kRowMajor,  // compact C order (or no elements): no strides needed
  kPermuted,  // compact transposition (F order, ...): JAX keeps a layout
  kStrided,   // gaps, overlap, negative or zero strides: needs a copy
};

struct Layout {
  LayoutKind kind = LayoutKind::kRowMajor;
  int64_t numel = 0;
  // Element offset of the lowest-addressed element from the data pointer
  // (<= 0), and the number of elements from there to the highest one
  // inclusive: the smallest 1-D envelope that holds every element.
  int64_t low = 0;
  int64_t span = 0;
};

// `strides` are in elements, or empty for compact row-major.  Returns false
// (and sets *error) when the envelope does not fit in int64.
bool AnalyzeLayout(const std::vector<int64_t>& shape,
                   const std::vector<int64_t>& strides, Layout* out,
                   const char** error);

}  // namespace jxo

#endif  // JAX_OVERLAY_XLA_EXT_LAYOUT_H_
