// AnalyzeLayout: classification, envelope and overflow reporting.
#include "xla_ext/layout.h"

#include <cstdint>
#include <string>
#include <vector>

#include "tests/cc/check.h"

using jxo::AnalyzeLayout;
using jxo::Layout;
using jxo::LayoutKind;
using Dims = std::vector<int64_t>;

namespace {

// Analyzes and requires success; the error text is checked separately.
Layout Analyze(const Dims& shape, const Dims& strides) {
  Layout out;
  const char* error = nullptr;
  bool ok = AnalyzeLayout(shape, strides, &out, &error);
  CHECK(ok);
  CHECK(error == nullptr);
  return out;
}

std::string Error(const Dims& shape, const Dims& strides) {
  Layout out;
  const char* error = nullptr;
  if (AnalyzeLayout(shape, strides, &out, &error)) return "(succeeded)";
  return error ? error : "(no message)";
}

}  // namespace

TEST(NoStridesIsRowMajor) {
  Layout l = Analyze({2, 3, 4}, {});
  CHECK_EQ(l.kind, LayoutKind::kRowMajor);
  CHECK_EQ(l.numel, 24);
  CHECK_EQ(l.low, 0);
  CHECK_EQ(l.span, 24);
}

TEST(ScalarIsOneElement) {
  Layout l = Analyze({}, {});
  CHECK_EQ(l.kind, LayoutKind::kRowMajor);
  CHECK_EQ(l.numel, 1);
  CHECK_EQ(l.span, 1);
}

TEST(CompactCOrderIsRowMajor) {
  Layout l = Analyze({2, 3}, {3, 1});
  CHECK_EQ(l.kind, LayoutKind::kRowMajor);
  CHECK_EQ(l.span, 6);
}

TEST(UnitDimensionsMayHaveAnyStride) {
  CHECK_EQ(Analyze({1, 3}, {100, 1}).kind, LayoutKind::kRowMajor);
  CHECK_EQ(Analyze({3, 1}, {1, -7}).kind, LayoutKind::kRowMajor);
}

TEST(ZeroElementsIsRowMajorWhateverTheStrides) {
  Layout l = Analyze({0, 5}, {7, -3});
  CHECK_EQ(l.kind, LayoutKind::kRowMajor);
  CHECK_EQ(l.numel, 0);
  CHECK_EQ(l.span, 0);
}

TEST(FortranOrderIsPermuted) {
  Layout l = Analyze({2, 3}, {1, 2});
  CHECK_EQ(l.kind, LayoutKind::kPermuted);
  CHECK_EQ(l.numel, 6);
  CHECK_EQ(l.span, 6);
}

TEST(ThreeDimensionalTranspositionsArePermuted) {
  CHECK_EQ(Analyze({2, 3, 4}, {1, 2, 6}).kind, LayoutKind::kPermuted);
  CHECK_EQ(Analyze({2, 3, 4}, {12, 1, 3}).kind, LayoutKind::kPermuted);
  // Equal strides on a unit dimension: still a compact transposition.
  CHECK_EQ(Analyze({2, 1, 3}, {1, 1, 2}).kind, LayoutKind::kPermuted);
}

TEST(GapsAreStrided) {
  Layout l = Analyze({2, 3}, {6, 2});  // every other column of a 2x6
  CHECK_EQ(l.kind, LayoutKind::kStrided);
  CHECK_EQ(l.low, 0);
  CHECK_EQ(l.span, 6 + 2 * 2 + 1);
}

TEST(NegativeStridesReachBelowThePointer) {
  Layout l = Analyze({4}, {-1});
  CHECK_EQ(l.kind, LayoutKind::kStrided);
  CHECK_EQ(l.low, -3);
  CHECK_EQ(l.span, 4);

  l = Analyze({2, 3}, {-3, 1});  // rows reversed
  CHECK_EQ(l.kind, LayoutKind::kStrided);
  CHECK_EQ(l.low, -3);
  CHECK_EQ(l.span, 6);
}

TEST(BroadcastAndOverlapAreStrided) {
  Layout l = Analyze({5}, {0});
  CHECK_EQ(l.kind, LayoutKind::kStrided);
  CHECK_EQ(l.numel, 5);
  CHECK_EQ(l.span, 1);
  CHECK_EQ(Analyze({2, 2}, {1, 1}).kind, LayoutKind::kStrided);
}

TEST(OverflowIsAnErrorNotAWrap) {
  CHECK_EQ(Error({int64_t{1} << 62, 4}, {}),
           std::string("the element count overflows int64"));
  CHECK_EQ(Error({int64_t{1} << 40}, {int64_t{1} << 40}),
           std::string("the strides reach beyond int64"));
  CHECK_EQ(Error({3, 3}, {INT64_MAX / 2, -(INT64_MAX / 2)}),
           std::string("the strides reach beyond int64"));
}

CHECK_MAIN()
