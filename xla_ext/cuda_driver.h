// The CUDA driver, loaded at run time with dlopen on first GPU use: building
// and importing the extension needs no CUDA toolkit and no libcuda.
// Every call runs in the primary context of the device it concerns, the
// context JAX, CuPy, PyTorch and Numba all use.
#ifndef JAX_OVERLAY_XLA_EXT_CUDA_DRIVER_H_
#define JAX_OVERLAY_XLA_EXT_CUDA_DRIVER_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "error.h"

namespace jxo::cuda {

// The driver API's types and results that the files calling the driver
// share (cuda_driver.cc, ipc.cc), declared once from its documented ABI:
// handles are pointers, results are ints.
using CUresult = int;
using CUdevice = int;
using CUdeviceptr = unsigned long long;
using CUstream = void*;
using CUevent = void*;
constexpr CUresult kSuccess = 0;
constexpr CUresult kNotReady = 600;

// CU_STREAM_LEGACY and CU_STREAM_PER_THREAD as stream handles.
constexpr uintptr_t kLegacyStream = 1;
constexpr uintptr_t kPerThreadStream = 2;

enum class MemoryKind { kNotCuda, kDevice, kPinnedHost, kManaged };

struct PointerInfo {
  MemoryKind kind = MemoryKind::kNotCuda;
  int ordinal = -1;        // the device whose context owns the memory
  uintptr_t device_ptr = 0;  // the address GPU code uses
  uintptr_t host_ptr = 0;    // pinned/managed memory: the host's address
  uintptr_t range_start = 0;  // the allocation holding the pointer
  size_t range_size = 0;
};

// Loads libcuda.so.1 and calls cuInit once.  False with a BufferError
// message when there is no usable driver.
bool Load(Error* err);

// True once Load succeeded; never loads by itself.
bool Loaded();

// The driver's entry point `name`, or nullptr (before a successful Load
// too): for the files that declare the entry points of their own concern
// (ipc.cc) beside the ones this file needs.
void* Symbol(const char* name);

// The driver's words for a result, "NAME (code: text)", for messages.
std::string Describe(int result);

// A pointer as 0x..., for messages.
std::string Hex(uintptr_t v);

bool QueryPointer(uintptr_t ptr, PointerInfo* out, Error* err);

// Makes `consumer` wait on the GPU for everything already enqueued on
// `producer` (1 = legacy, 2 = per-thread, or a handle), without blocking the
// host.  A handle must be a live stream of that device: the driver cannot
// validate handles and may crash on a dangling one, as every consumer of the
// protocol would.  When `producer` is already idle nothing is enqueued and *waited is
// false, so callers can skip their own event bookkeeping.
bool OrderAfter(int ordinal, uintptr_t producer, uintptr_t consumer,
                bool* waited, Error* err);

// True when every piece of work enqueued on `stream` has finished.
bool StreamIdle(int ordinal, uintptr_t stream, bool* idle, Error* err);

// CUstreamCaptureStatus of `stream`: kCaptureNone, kCaptureActive (work
// enqueued now is recorded into a graph, not run) or kCaptureInvalidated.
constexpr int kCaptureNone = 0;
constexpr int kCaptureActive = 1;
constexpr int kCaptureInvalidated = 2;
bool CaptureStatus(int ordinal, uintptr_t stream, int* status, Error* err);

// This thread's CUstreamCaptureMode set to *mode, and the previous one
// returned in *mode (cuThreadExchangeStreamCaptureMode).  kCaptureRelaxed
// lets this thread allocate (cuMemAlloc) while a stream it launches on is
// captured; the modes that refuse it are global (0) and thread-local (1).
constexpr int kCaptureRelaxed = 2;
bool ExchangeCaptureMode(int* mode, Error* err);

// Makes the primary context of device `ordinal` current for the life of the
// object, unless it already is, and restores the previous one after.  The
// CUDA runtime reads "the current device" from the current context, so a
// producer called inside (PyTorch's and CuPy's __dlpack__, which order the
// consumer's stream after the current device's current stream) picks the
// device that owns its memory, whatever device the caller had current.
// Without a usable driver there is no context to switch: Enter does nothing
// and succeeds.
class DeviceScope {
 public:
  DeviceScope() = default;
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;
  ~DeviceScope();
  bool Enter(int ordinal, Error* err);

 private:
  bool pushed_ = false;
};

// A function of a PTX module and the context it was loaded in.
struct Function {
  void* fn = nullptr;
  void* ctx = nullptr;
};

// A function of a PTX module, JIT-compiled by the driver the first time a
// context asks for it and cached for the life of the process (the module is
// never unloaded: XLA may hold launches of it in flight at exit).  The
// context is the one `stream` belongs to, or, for stream 0, the primary
// context of device `ordinal`.
bool PtxFunction(uintptr_t stream, int ordinal, const std::string& ptx,
                 const char* name, Function* fn, Error* err);

// cuLaunchKernel of a PtxFunction on `stream` (of the function's context),
// 1-D grid and block.
bool Launch(const Function& fn, unsigned grid, unsigned block,
            uintptr_t stream, void** params, Error* err);

int DriverVersion();  // 0 when unknown
int DeviceCount();    // 0 when unknown

}  // namespace jxo::cuda

#endif  // JAX_OVERLAY_XLA_EXT_CUDA_DRIVER_H_
