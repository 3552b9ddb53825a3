#include "layout.h"

#include <algorithm>
#include <numeric>

namespace jxo {
namespace {

bool MulOverflow(int64_t a, int64_t b, int64_t* out) {
  return __builtin_mul_overflow(a, b, out);
}
bool AddOverflow(int64_t a, int64_t b, int64_t* out) {
  return __builtin_add_overflow(a, b, out);
}

}  // namespace

bool AnalyzeLayout(const std::vector<int64_t>& shape,
                   const std::vector<int64_t>& strides, Layout* out,
                   const char** error) {
  const size_t nd = shape.size();
  int64_t numel = 1;
  for (int64_t n : shape) {
    if (MulOverflow(numel, n, &numel)) {
      *error = "the element count overflows int64";
      return false;
    }
  }
  out->numel = numel;
  out->low = 0;
  out->span = numel;
  if (numel == 0 || strides.empty()) {
    out->kind = LayoutKind::kRowMajor;
    return true;
  }
  // Envelope: the offsets of the lowest and highest elements.
  int64_t low = 0, high = 0;
  for (size_t d = 0; d < nd; ++d) {
    int64_t reach;
    if (MulOverflow(shape[d] - 1, strides[d], &reach)) {
      *error = "the strides reach beyond int64";
      return false;
    }
    if (reach < 0) {
      if (AddOverflow(low, reach, &low)) {
        *error = "the strides reach beyond int64";
        return false;
      }
    } else if (AddOverflow(high, reach, &high)) {
      *error = "the strides reach beyond int64";
      return false;
    }
  }
  int64_t span;
  if (__builtin_sub_overflow(high, low, &span) || AddOverflow(span, 1, &span)) {
    *error = "the strides reach beyond int64";
    return false;
  }
  out->low = low;
  out->span = span;

  // Row-major check: dimensions of size 1 may carry any stride.
  bool row_major = true;
  int64_t expect = 1;
  for (size_t i = nd; i-- > 0;) {
    if (shape[i] != 1 && strides[i] != expect) {
      row_major = false;
      break;
    }
    expect *= shape[i];
  }
  if (row_major) {
    out->kind = LayoutKind::kRowMajor;
    return true;
  }
  // Compact transposition: sorted by stride, each non-unit dimension's
  // stride is the product of the sizes inside it.  Ties go to the
  // major-to-minor reading, as XLA's layouts do.
  std::vector<size_t> order(nd);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    if (strides[a] != strides[b]) return strides[a] < strides[b];
    return b < a;
  });
  expect = 1;
  for (size_t d : order) {
    if (shape[d] > 1 && strides[d] != expect) {
      out->kind = LayoutKind::kStrided;
      return true;
    }
    expect *= shape[d];
  }
  out->kind = LayoutKind::kPermuted;
  return true;
}

bool CheckEnvelope(uintptr_t data, const Layout& layout, int64_t itemsize,
                   const char** error) {
  int64_t bytes;
  if (MulOverflow(layout.span, itemsize, &bytes)) {
    *error = "the memory it spans in bytes overflows int64";
    return false;
  }
  if (layout.numel == 0 || bytes == 0) return true;
  // low <= 0 and |low| < span, so this product fits as well.
  uint64_t below = static_cast<uint64_t>(-layout.low) * uint64_t(itemsize);
  if (data < below) {
    *error = "its elements reach below address 0";
    return false;
  }
  uint64_t start = data - below;
  if (uint64_t(bytes) - 1 > UINT64_MAX - start) {
    *error = "its elements reach past the top of the 64-bit address space";
    return false;
  }
  return true;
}

}  // namespace jxo
