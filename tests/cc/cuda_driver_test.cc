// The driver table on a machine without libcuda: Load fails once, with a
// message that names libcuda.so.1, and every entry point reports that
// failure instead of calling through a null table.  Where a driver library
// exists the no-driver assertions are skipped.
#include "xla_ext/cuda_driver.h"

#include <dlfcn.h>

#include <cstdio>
#include <string>

#include "tests/cc/check.h"

namespace cuda = jxo::cuda;

namespace {

bool DriverLibraryPresent() {
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib) dlclose(lib);
  return lib != nullptr;
}

}  // namespace

TEST(LoadWithoutADriver) {
  jxo::Error err;
  bool loaded = cuda::Load(&err);
  if (DriverLibraryPresent()) {
    std::printf("libcuda.so.1 is present: skipping the no-driver checks\n");
    // Either way the result and the error must agree.
    CHECK_EQ(loaded, err.ok());
    CHECK_EQ(loaded, cuda::Loaded());
    return;
  }
  CHECK(!loaded);
  CHECK(!cuda::Loaded());
  CHECK_EQ(err.kind, jxo::ErrorKind::kBuffer);
  CHECK_CONTAINS(err.message, "libcuda.so.1");
  CHECK_CONTAINS(err.message, "needs an NVIDIA driver");

  // Loaded once: a second call gives the same answer without retrying.
  jxo::Error again;
  CHECK(!cuda::Load(&again));
  CHECK_EQ(again.message, err.message);
}

TEST(EntryPointsReportTheLoadFailure) {
  if (DriverLibraryPresent()) return;
  jxo::Error err;
  cuda::PointerInfo info;
  CHECK(!cuda::QueryPointer(0x1000, &info, &err));
  CHECK_CONTAINS(err.message, "libcuda.so.1");
  CHECK(info.kind == cuda::MemoryKind::kNotCuda);

  jxo::Error order_err;
  bool waited = true;
  CHECK(!cuda::OrderAfter(0, cuda::kLegacyStream, cuda::kPerThreadStream,
                          &waited, &order_err));
  CHECK(!waited);
  CHECK_CONTAINS(order_err.message, "libcuda.so.1");

  jxo::Error idle_err;
  bool idle = false;
  CHECK(!cuda::StreamIdle(0, cuda::kLegacyStream, &idle, &idle_err));
  CHECK_CONTAINS(idle_err.message, "libcuda.so.1");

  CHECK_EQ(cuda::DriverVersion(), 0);
  CHECK_EQ(cuda::DeviceCount(), 0);
}

TEST(DeviceScopeIsANoOpWithoutADriver) {
  if (DriverLibraryPresent()) return;
  // No driver means no contexts and no CUDA producers: the producer's export
  // runs as it is, instead of failing every host-memory test double.
  jxo::Error err;
  {
    cuda::DeviceScope scope;
    CHECK(scope.Enter(1, &err));
  }
  CHECK(err.ok());
}

CHECK_MAIN()
