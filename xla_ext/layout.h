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

// Checks the bytes an array of `layout` touches when its element 0 is at
// address `data` (elements of `itemsize` bytes): their count must fit in
// int64 and they must lie inside the 64-bit address space, below or above.
// A wrapped envelope is not a pointer any consumer can read, and the
// envelope copy would compute addresses from it.  Returns false (and sets
// *error) otherwise; arrays without elements touch nothing and pass.
bool CheckEnvelope(uintptr_t data, const Layout& layout, int64_t itemsize,
                   const char** error);

}  // namespace jxo

#endif  // JAX_OVERLAY_XLA_EXT_LAYOUT_H_
