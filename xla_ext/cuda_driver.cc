#include "cuda_driver.h"

#include <dlfcn.h>

#include <atomic>
#include <cstdio>
#include <map>
#include <mutex>
#include <utility>

namespace jxo::cuda {
namespace {

// The driver types only this file needs (the shared ones: cuda_driver.h).
using CUcontext = void*;
using CUmodule = void*;
using CUfunction = void*;

constexpr unsigned kEventDisableTiming = 0x2;

enum PointerAttribute : int {
  kAttrContext = 1,
  kAttrMemoryType = 2,
  kAttrDevicePointer = 3,
  kAttrHostPointer = 4,
  kAttrIsManaged = 8,
  kAttrDeviceOrdinal = 9,
  kAttrRangeStart = 11,
  kAttrRangeSize = 12,
};
constexpr int kJitErrorLogBuffer = 5;  // CUjit_option
constexpr int kJitErrorLogBufferBytes = 6;

enum MemoryType : unsigned { kMemHost = 1, kMemDevice = 2, kMemUnified = 4 };

struct Table {
  CUresult (*Init)(unsigned);
  CUresult (*DriverGetVersion)(int*);
  CUresult (*DeviceGetCount)(int*);
  CUresult (*DeviceGet)(CUdevice*, int);
  CUresult (*DevicePrimaryCtxRetain)(CUcontext*, CUdevice);
  CUresult (*CtxGetCurrent)(CUcontext*);
  CUresult (*CtxPushCurrent)(CUcontext);
  CUresult (*CtxPopCurrent)(CUcontext*);
  CUresult (*CtxGetDevice)(CUdevice*);
  CUresult (*PointerGetAttributes)(unsigned, int*, void**, CUdeviceptr);
  CUresult (*StreamQuery)(CUstream);
  CUresult (*StreamIsCapturing)(CUstream, int*);
  CUresult (*ThreadExchangeStreamCaptureMode)(int*);
  CUresult (*EventCreate)(CUevent*, unsigned);
  CUresult (*EventRecord)(CUevent, CUstream);
  CUresult (*EventDestroy)(CUevent);
  CUresult (*StreamWaitEvent)(CUstream, CUevent, unsigned);
  CUresult (*StreamGetCtx)(CUstream, CUcontext*);
  CUresult (*ModuleLoadDataEx)(CUmodule*, const void*, unsigned, int*, void**);
  CUresult (*ModuleGetFunction)(CUfunction*, CUmodule, const char*);
  CUresult (*LaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned,
                           unsigned, unsigned, unsigned, CUstream, void**,
                           void**);
  CUresult (*GetErrorName)(CUresult, const char**);
  CUresult (*GetErrorString)(CUresult, const char**);
};

Table g_cu;
void* g_lib = nullptr;
std::once_flag g_load_once;
std::atomic<bool> g_loaded{false};
std::string g_load_error;

constexpr int kMaxDevices = 64;
std::atomic<CUcontext> g_primary[kMaxDevices];
std::mutex g_primary_mu;

template <typename F>
bool Sym(void* lib, const char* name, F* out) {
  *out = reinterpret_cast<F>(dlsym(lib, name));
  return *out != nullptr;
}

void LoadOnce() {
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    const char* e = dlerror();
    g_load_error = std::string("libcuda.so.1 could not be loaded (") +
                   (e ? e : "unknown reason") +
                   "); GPU interchange needs an NVIDIA driver";
    return;
  }
  // Versioned entry points are named explicitly: the unversioned symbols of
  // these functions are the pre-CUDA-4 ABI.
  bool ok = Sym(lib, "cuInit", &g_cu.Init) &&
            Sym(lib, "cuDriverGetVersion", &g_cu.DriverGetVersion) &&
            Sym(lib, "cuDeviceGetCount", &g_cu.DeviceGetCount) &&
            Sym(lib, "cuDeviceGet", &g_cu.DeviceGet) &&
            Sym(lib, "cuDevicePrimaryCtxRetain", &g_cu.DevicePrimaryCtxRetain) &&
            Sym(lib, "cuCtxGetCurrent", &g_cu.CtxGetCurrent) &&
            Sym(lib, "cuCtxPushCurrent_v2", &g_cu.CtxPushCurrent) &&
            Sym(lib, "cuCtxPopCurrent_v2", &g_cu.CtxPopCurrent) &&
            Sym(lib, "cuCtxGetDevice", &g_cu.CtxGetDevice) &&
            Sym(lib, "cuPointerGetAttributes", &g_cu.PointerGetAttributes) &&
            Sym(lib, "cuStreamQuery", &g_cu.StreamQuery) &&
            Sym(lib, "cuStreamIsCapturing", &g_cu.StreamIsCapturing) &&
            Sym(lib, "cuThreadExchangeStreamCaptureMode",
                &g_cu.ThreadExchangeStreamCaptureMode) &&
            Sym(lib, "cuEventCreate", &g_cu.EventCreate) &&
            Sym(lib, "cuEventRecord", &g_cu.EventRecord) &&
            Sym(lib, "cuEventDestroy_v2", &g_cu.EventDestroy) &&
            Sym(lib, "cuStreamWaitEvent", &g_cu.StreamWaitEvent) &&
            Sym(lib, "cuStreamGetCtx", &g_cu.StreamGetCtx) &&
            Sym(lib, "cuModuleLoadDataEx", &g_cu.ModuleLoadDataEx) &&
            Sym(lib, "cuModuleGetFunction", &g_cu.ModuleGetFunction) &&
            Sym(lib, "cuLaunchKernel", &g_cu.LaunchKernel) &&
            Sym(lib, "cuGetErrorName", &g_cu.GetErrorName) &&
            Sym(lib, "cuGetErrorString", &g_cu.GetErrorString);
  if (!ok) {
    g_load_error =
        "libcuda.so.1 lacks a driver entry point jax_overlay needs; the "
        "NVIDIA driver is too old";
    return;
  }
  CUresult r = g_cu.Init(0);
  if (r != kSuccess) {
    g_load_error = "cuInit failed with CUDA error " + std::to_string(r) +
                   "; no usable GPU is visible to this process";
    return;
  }
  g_lib = lib;
  g_loaded.store(true, std::memory_order_release);
}

bool DriverFail(Error* err, const std::string& what, CUresult r) {
  return Fail(err, ErrorKind::kBuffer, what + " failed: " + Describe(r));
}

bool Primary(int ordinal, CUcontext* out, Error* err) {
  if (ordinal < 0 || ordinal >= kMaxDevices) {
    return Fail(err, ErrorKind::kBuffer,
                "CUDA device ordinal " + std::to_string(ordinal) +
                    " is out of range");
  }
  CUcontext c = g_primary[ordinal].load(std::memory_order_acquire);
  if (c) {
    *out = c;
    return true;
  }
  std::lock_guard<std::mutex> lock(g_primary_mu);
  c = g_primary[ordinal].load(std::memory_order_relaxed);
  if (!c) {
    CUdevice dev;
    CUresult r = g_cu.DeviceGet(&dev, ordinal);
    if (r != kSuccess) {
      return DriverFail(err, "cuDeviceGet(" + std::to_string(ordinal) + ")", r);
    }
    // Retained for the life of the process, as JAX does: releasing it could
    // tear down the context under live buffers.
    r = g_cu.DevicePrimaryCtxRetain(&c, dev);
    if (r != kSuccess) return DriverFail(err, "cuDevicePrimaryCtxRetain", r);
    g_primary[ordinal].store(c, std::memory_order_release);
  }
  *out = c;
  return true;
}

// Pushes `want` unless it is already current; *pushed says whether a pop is
// owed.
bool PushUnlessCurrent(CUcontext want, bool* pushed, Error* err) {
  CUcontext cur = nullptr;
  g_cu.CtxGetCurrent(&cur);
  if (cur == want) return true;
  CUresult r = g_cu.CtxPushCurrent(want);
  if (r != kSuccess) return DriverFail(err, "cuCtxPushCurrent", r);
  *pushed = true;
  return true;
}

void PopIfPushed(bool pushed) {
  if (pushed) {
    CUcontext ignored;
    g_cu.CtxPopCurrent(&ignored);
  }
}

// Makes `want` current for the scope unless it already is.
class ScopedContext {
 public:
  bool Enter(CUcontext want, Error* err) {
    return PushUnlessCurrent(want, &pushed_, err);
  }
  ~ScopedContext() { PopIfPushed(pushed_); }

 private:
  bool pushed_ = false;
};

std::string StreamName(uintptr_t s) {
  if (s == kLegacyStream) return "1 (legacy default stream)";
  if (s == kPerThreadStream) return "2 (per-thread default stream)";
  return Hex(s);
}

}  // namespace

bool Load(Error* err) {
  std::call_once(g_load_once, LoadOnce);
  if (g_loaded.load(std::memory_order_acquire)) return true;
  return Fail(err, ErrorKind::kBuffer, g_load_error);
}

bool Loaded() { return g_loaded.load(std::memory_order_acquire); }

void* Symbol(const char* name) {
  return Loaded() ? dlsym(g_lib, name) : nullptr;
}

std::string Describe(int r) {
  const char* name = nullptr;
  const char* text = nullptr;
  if (g_cu.GetErrorName) g_cu.GetErrorName(r, &name);
  if (g_cu.GetErrorString) g_cu.GetErrorString(r, &text);
  return std::string(name ? name : "CUDA error") + " (" + std::to_string(r) +
         (text ? std::string(": ") + text : std::string()) + ")";
}

std::string Hex(uintptr_t v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(v));
  return buf;
}

bool QueryPointer(uintptr_t ptr, PointerInfo* out, Error* err) {
  if (!Load(err)) return false;
  // The query needs some current context; any primary context will do, since
  // unified addressing makes pointers global to the process.
  CUcontext cur = nullptr;
  g_cu.CtxGetCurrent(&cur);
  ScopedContext scope;
  if (!cur) {
    CUcontext c0;
    if (!Primary(0, &c0, err) || !scope.Enter(c0, err)) return false;
  }
  CUcontext ctx = nullptr;
  unsigned mem_type = 0, is_managed = 0;
  int ordinal = -1;
  CUdeviceptr dptr = 0, range_start = 0;
  void* hptr = nullptr;
  size_t range_size = 0;
  int attrs[] = {kAttrContext,       kAttrMemoryType, kAttrIsManaged,
                 kAttrDeviceOrdinal, kAttrDevicePointer, kAttrHostPointer,
                 kAttrRangeStart,    kAttrRangeSize};
  void* data[] = {&ctx, &mem_type, &is_managed, &ordinal,
                  &dptr, &hptr,    &range_start, &range_size};
  // Unlike cuPointerGetAttribute, this succeeds for pointers the driver does
  // not know and leaves the outputs zero: that is how host memory shows up.
  CUresult r = g_cu.PointerGetAttributes(sizeof(attrs) / sizeof(attrs[0]),
                                         attrs, data, ptr);
  if (r != kSuccess) {
    return DriverFail(err, "cuPointerGetAttributes(" + Hex(ptr) + ")", r);
  }
  if (mem_type == 0) {
    out->kind = MemoryKind::kNotCuda;
    return true;
  }
  if (is_managed) {
    out->kind = MemoryKind::kManaged;
  } else if (mem_type == kMemHost) {
    out->kind = MemoryKind::kPinnedHost;
  } else if (mem_type == kMemDevice || mem_type == kMemUnified) {
    out->kind = MemoryKind::kDevice;
  } else {
    out->kind = MemoryKind::kNotCuda;
    return true;
  }
  if (ordinal < 0 && ctx) {
    // Host allocations report no ordinal: use the device of their context.
    ScopedContext owner;
    CUdevice dev = 0;
    if (owner.Enter(ctx, err) && g_cu.CtxGetDevice(&dev) == kSuccess) {
      ordinal = dev;
    }
  }
  out->ordinal = ordinal < 0 ? 0 : ordinal;
  out->device_ptr = dptr ? uintptr_t(dptr) : ptr;
  out->host_ptr = reinterpret_cast<uintptr_t>(hptr);
  out->range_start = uintptr_t(range_start);
  out->range_size = range_size;
  return true;
}

bool CaptureStatus(int ordinal, uintptr_t stream, int* status, Error* err) {
  if (!Load(err)) return false;
  CUcontext ctx;
  ScopedContext scope;
  if (!Primary(ordinal, &ctx, err) || !scope.Enter(ctx, err)) return false;
  // cuStreamIsCapturing is itself legal during a capture (cuStreamQuery is
  // not: it would invalidate the capture it asks about).
  CUresult r = g_cu.StreamIsCapturing(reinterpret_cast<CUstream>(stream), status);
  if (r == kSuccess) return true;
  return DriverFail(err,
                    "cuStreamIsCapturing on stream " + StreamName(stream) +
                        " of device " + std::to_string(ordinal),
                    r);
}

bool ExchangeCaptureMode(int* mode, Error* err) {
  if (!Load(err)) return false;
  CUresult r = g_cu.ThreadExchangeStreamCaptureMode(mode);
  if (r == kSuccess) return true;
  return DriverFail(err, "cuThreadExchangeStreamCaptureMode", r);
}

bool StreamIdle(int ordinal, uintptr_t stream, bool* idle, Error* err) {
  if (!Load(err)) return false;
  CUcontext ctx;
  ScopedContext scope;
  if (!Primary(ordinal, &ctx, err) || !scope.Enter(ctx, err)) return false;
  CUresult r = g_cu.StreamQuery(reinterpret_cast<CUstream>(stream));
  if (r == kSuccess || r == kNotReady) {
    *idle = r == kSuccess;
    return true;
  }
  return DriverFail(err,
                    "cuStreamQuery on stream " + StreamName(stream) +
                        " of device " + std::to_string(ordinal) +
                        " (is it a live stream of that device?)",
                    r);
}

bool OrderAfter(int ordinal, uintptr_t producer, uintptr_t consumer,
                bool* waited, Error* err) {
  *waited = false;
  if (!Load(err)) return false;
  CUcontext ctx;
  ScopedContext scope;
  if (!Primary(ordinal, &ctx, err) || !scope.Enter(ctx, err)) return false;
  CUresult r = g_cu.StreamQuery(reinterpret_cast<CUstream>(producer));
  if (r == kSuccess) return true;  // idle: nothing to order after
  if (r != kNotReady) {
    return DriverFail(err,
                      "cuStreamQuery on the producer's stream " +
                          StreamName(producer) + " of device " +
                          std::to_string(ordinal) +
                          " (is it a live stream of that device?)",
                      r);
  }
  CUevent ev = nullptr;
  r = g_cu.EventCreate(&ev, kEventDisableTiming);
  if (r != kSuccess) return DriverFail(err, "cuEventCreate", r);
  r = g_cu.EventRecord(ev, reinterpret_cast<CUstream>(producer));
  if (r == kSuccess) {
    r = g_cu.StreamWaitEvent(reinterpret_cast<CUstream>(consumer), ev, 0);
    if (r != kSuccess) {
      g_cu.EventDestroy(ev);
      return DriverFail(err, "cuStreamWaitEvent", r);
    }
  } else {
    g_cu.EventDestroy(ev);
    return DriverFail(err,
                      "cuEventRecord on the producer's stream " +
                          StreamName(producer),
                      r);
  }
  // Destroying an event whose wait is already enqueued is safe: the driver
  // keeps what the pending wait needs.
  g_cu.EventDestroy(ev);
  *waited = true;
  return true;
}

bool DeviceScope::Enter(int ordinal, Error* err) {
  Error no_driver;
  if (!Load(&no_driver)) return true;  // no driver, no contexts, no producers
  CUcontext want;
  return Primary(ordinal, &want, err) && PushUnlessCurrent(want, &pushed_, err);
}

DeviceScope::~DeviceScope() { PopIfPushed(pushed_); }

namespace {

struct ModuleEntry {
  CUmodule module = nullptr;
  std::map<std::string, CUfunction> fns;
};
// Keyed by context and module text; entries live for the process.
std::map<std::pair<CUcontext, const std::string*>, ModuleEntry> g_modules;
std::mutex g_modules_mu;

}  // namespace

bool PtxFunction(uintptr_t stream, int ordinal, const std::string& ptx,
                 const char* name, Function* fn, Error* err) {
  if (!Load(err)) return false;
  CUcontext ctx = nullptr;
  if (stream) {
    CUresult r = g_cu.StreamGetCtx(reinterpret_cast<CUstream>(stream), &ctx);
    if (r != kSuccess) return DriverFail(err, "cuStreamGetCtx", r);
  } else if (!Primary(ordinal, &ctx, err)) {
    return false;
  }
  std::lock_guard<std::mutex> lock(g_modules_mu);
  ModuleEntry& m = g_modules[{ctx, &ptx}];
  if (!m.module) {
    ScopedContext scope;
    if (!scope.Enter(ctx, err)) return false;
    char log[2048] = {0};
    int opts[] = {kJitErrorLogBuffer, kJitErrorLogBufferBytes};
    void* vals[] = {log, reinterpret_cast<void*>(uintptr_t(sizeof log))};
    CUresult r = g_cu.ModuleLoadDataEx(&m.module, ptx.c_str(), 2, opts, vals);
    if (r != kSuccess) {
      m.module = nullptr;
      return DriverFail(err,
                        std::string("JIT compiling jax_overlay's PTX (") +
                            log + ")",
                        r);
    }
  }
  auto it = m.fns.find(name);
  if (it == m.fns.end()) {
    CUfunction f = nullptr;
    CUresult r = g_cu.ModuleGetFunction(&f, m.module, name);
    if (r != kSuccess) {
      return DriverFail(err, std::string("cuModuleGetFunction(") + name + ")",
                        r);
    }
    it = m.fns.emplace(name, f).first;
  }
  fn->fn = it->second;
  fn->ctx = ctx;
  return true;
}

bool Launch(const Function& fn, unsigned grid, unsigned block,
            uintptr_t stream, void** params, Error* err) {
  // A module's function launches only with its own context current.
  ScopedContext scope;
  if (!scope.Enter(static_cast<CUcontext>(fn.ctx), err)) return false;
  CUresult r =
      g_cu.LaunchKernel(fn.fn, grid, 1, 1, block, 1, 1, 0,
                        reinterpret_cast<CUstream>(stream), params, nullptr);
  if (r != kSuccess) return DriverFail(err, "cuLaunchKernel", r);
  return true;
}

int DriverVersion() {
  Error ignored;
  int v = 0;
  if (Load(&ignored)) g_cu.DriverGetVersion(&v);
  return v;
}

int DeviceCount() {
  Error ignored;
  int n = 0;
  if (Load(&ignored)) g_cu.DeviceGetCount(&n);
  return n;
}

}  // namespace jxo::cuda
