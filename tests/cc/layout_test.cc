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

std::string Envelope(uintptr_t data, const Dims& shape, const Dims& strides,
                     int64_t itemsize) {
  Layout l = Analyze(shape, strides);
  const char* error = nullptr;
  if (jxo::CheckEnvelope(data, l, itemsize, &error)) return "(fits)";
  return error ? error : "(no message)";
}

TEST(EnvelopeMustFitTheAddressSpace) {
  const uintptr_t top = UINTPTR_MAX;  // the last byte of the address space
  CHECK_EQ(Envelope(top - 23, {6}, {}, 4), std::string("(fits)"));
  CHECK_EQ(Envelope(top - 22, {6}, {}, 4),
           std::string("its elements reach past the top of the 64-bit address space"));
  CHECK_EQ(Envelope(top, {1}, {}, 1), std::string("(fits)"));
  // Negative strides: element 0 is the highest, the envelope ends after it.
  CHECK_EQ(Envelope(top - 3, {4}, {-1}, 4), std::string("(fits)"));
  CHECK_EQ(Envelope(12, {4}, {-1}, 4), std::string("(fits)"));
  CHECK_EQ(Envelope(11, {4}, {-1}, 4),
           std::string("its elements reach below address 0"));
  CHECK_EQ(Envelope(16, {int64_t{1} << 61}, {}, 8),
           std::string("the memory it spans in bytes overflows int64"));
  // No elements, no memory: any pointer will do.
  CHECK_EQ(Envelope(top, {0, 5}, {}, 16), std::string("(fits)"));
}

CHECK_MAIN()
