// A minimal test harness for the C++ tests: TEST(name) registers a case,
// CHECK* macros record failures and go on, REQUIRE* ones end the case, and
// CHECK_MAIN() runs every case and exits nonzero if any check failed.
#ifndef JAX_OVERLAY_TESTS_CC_CHECK_H_
#define JAX_OVERLAY_TESTS_CC_CHECK_H_

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

namespace check {

struct Case {
  const char* name;
  void (*fn)();
};

inline std::vector<Case>& Cases() {
  static std::vector<Case> cases;
  return cases;
}

inline int& FailedChecks() {
  static int n = 0;
  return n;
}

struct Register {
  Register(const char* name, void (*fn)()) { Cases().push_back({name, fn}); }
};

template <typename T>
std::string Show(const T& v) {
  std::ostringstream s;
  if constexpr (std::is_enum_v<T>) {
    s << static_cast<long long>(v);
  } else if constexpr (std::is_same_v<T, std::string> ||
                       std::is_convertible_v<T, const char*>) {
    s << '"' << v << '"';
  } else if constexpr (std::is_same_v<T, std::vector<int64_t>>) {
    s << '{';
    for (size_t i = 0; i < v.size(); ++i) s << (i ? ", " : "") << v[i];
    s << '}';
  } else {
    s << v;
  }
  return s.str();
}

inline bool Report(bool ok, const char* file, int line, const std::string& what) {
  if (!ok) {
    ++FailedChecks();
    std::fprintf(stderr, "%s:%d: check failed: %s\n", file, line, what.c_str());
  }
  return ok;
}

template <typename A, typename B>
bool ReportEq(const A& a, const B& b, const char* as, const char* bs,
              const char* file, int line) {
  bool ok = a == b;
  return Report(ok, file, line,
                ok ? "" : std::string(as) + " == " + bs + " (" + Show(a) +
                              " vs " + Show(b) + ")");
}

inline bool ReportContains(const std::string& hay, const std::string& needle,
                           const char* hs, const char* file, int line) {
  bool ok = hay.find(needle) != std::string::npos;
  return Report(ok, file, line,
                ok ? "" : std::string(hs) + " contains \"" + needle +
                              "\" (it is \"" + hay + "\")");
}

inline int RunAll(const char* program) {
  int passed = 0, failed = 0;
  for (const Case& c : Cases()) {
    int before = FailedChecks();
    std::printf("[ RUN  ] %s\n", c.name);
    std::fflush(stdout);
    c.fn();
    bool ok = FailedChecks() == before;
    std::printf("[ %s ] %s\n", ok ? " OK " : "FAIL", c.name);
    ++(ok ? passed : failed);
  }
  std::printf("%s: %d passed, %d failed\n", program, passed, failed);
  return failed ? 1 : 0;
}

}  // namespace check

#define TEST(name)                                        \
  static void name();                                     \
  static ::check::Register name##_registered(#name, name); \
  static void name()

#define CHECK(cond) ::check::Report((cond), __FILE__, __LINE__, #cond)
#define CHECK_EQ(a, b) ::check::ReportEq((a), (b), #a, #b, __FILE__, __LINE__)
#define CHECK_CONTAINS(hay, needle) \
  ::check::ReportContains((hay), (needle), #hay, __FILE__, __LINE__)

// As above, but a failure ends the current case (its later checks would
// only follow a null pointer or repeat the failure).
#define REQUIRE(cond) \
  do {                \
    if (!CHECK(cond)) return; \
  } while (0)
#define REQUIRE_EQ(a, b)          \
  do {                            \
    if (!CHECK_EQ(a, b)) return;  \
  } while (0)

#define CHECK_MAIN()                                        \
  int main(int, char** argv) {                              \
    const char* slash = std::strrchr(argv[0], '/');         \
    return ::check::RunAll(slash ? slash + 1 : argv[0]);    \
  }

#endif  // JAX_OVERLAY_TESTS_CC_CHECK_H_
