#include "ipc.h"

#include <cstring>
#include <mutex>

#include "cuda_driver.h"

namespace jxo::ipc {
namespace {

using cuda::CUdevice;
using cuda::CUdeviceptr;
using cuda::CUevent;
using cuda::CUresult;
using cuda::CUstream;
using cuda::kNotReady;
using cuda::kSuccess;

// The driver's memory-sharing types, declared from its documented ABI (the
// common ones: cuda_driver.h).
using Handle = unsigned long long;  // CUmemGenericAllocationHandle

struct Location {  // CUmemLocation
  int type;
  int id;
};
struct AllocationProp {  // CUmemAllocationProp
  int type;
  int requested_handle_types;
  Location location;
  void* win32_metadata;
  unsigned char alloc_flags[8];
};
struct AccessDesc {  // CUmemAccessDesc
  Location location;
  int flags;
};
struct EventHandle {  // CUipcEventHandle
  char reserved[kEventHandleBytes];
};
struct Uuid {  // CUuuid
  char bytes[kUuidBytes];
};

constexpr int kLocationDevice = 1;
constexpr int kAllocationPinned = 1;
constexpr int kAccessReadWrite = 3;
constexpr int kGranularityMinimum = 0;
constexpr unsigned kStreamNonBlocking = 1;
constexpr unsigned kEventDisableTiming = 2, kEventInterprocess = 4;
enum : int {
  kAttrLegacyIpc = 10,
  kAttrRangeStart = 11,
  kAttrRangeSize = 12,
  kAttrHandleTypes = 14,
  kAttrMappingSize = 18,
  kAttrMappingBase = 19,
  kAttrBlockId = 20,
};

struct Table {
  CUresult (*PointerGetAttribute)(void*, int, CUdeviceptr);
  CUresult (*RetainAllocationHandle)(Handle*, void*);
  CUresult (*ExportToShareableHandle)(void*, Handle, int, unsigned long long);
  CUresult (*ImportFromShareableHandle)(Handle*, void*, int);
  CUresult (*Release)(Handle);
  CUresult (*Create)(Handle*, size_t, const AllocationProp*,
                     unsigned long long);
  CUresult (*GetGranularity)(size_t*, const AllocationProp*, int);
  CUresult (*GetPropertiesFromHandle)(AllocationProp*, Handle);
  CUresult (*AddressReserve)(CUdeviceptr*, size_t, size_t, CUdeviceptr,
                             unsigned long long);
  CUresult (*AddressFree)(CUdeviceptr, size_t);
  CUresult (*Map)(CUdeviceptr, size_t, size_t, Handle, unsigned long long);
  CUresult (*Unmap)(CUdeviceptr, size_t);
  CUresult (*SetAccess)(CUdeviceptr, size_t, const AccessDesc*, size_t);
  CUresult (*DeviceGet)(CUdevice*, int);
  CUresult (*DeviceGetUuid)(Uuid*, CUdevice);
  CUresult (*StreamCreate)(CUstream*, unsigned);
  CUresult (*EventCreate)(CUevent*, unsigned);
  CUresult (*EventRecord)(CUevent, CUstream);
  CUresult (*EventQuery)(CUevent);
  CUresult (*EventDestroy)(CUevent);
  CUresult (*IpcGetEventHandle)(EventHandle*, CUevent);
  CUresult (*IpcOpenEventHandle)(CUevent*, EventHandle);
  CUresult (*StreamWaitEvent)(CUstream, CUevent, unsigned);
  CUresult (*MemcpyDtoDAsync)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
  CUresult (*CtxSynchronize)();
};

Table g_cu;
std::once_flag g_once;
bool g_ok = false;
std::string g_why;

template <typename F>
bool Sym(const char* name, F* out) {
  *out = reinterpret_cast<F>(cuda::Symbol(name));
  return *out != nullptr;
}

void LoadOnce() {
  g_ok = Sym("cuPointerGetAttribute", &g_cu.PointerGetAttribute) &&
         Sym("cuMemRetainAllocationHandle", &g_cu.RetainAllocationHandle) &&
         Sym("cuMemExportToShareableHandle", &g_cu.ExportToShareableHandle) &&
         Sym("cuMemImportFromShareableHandle", &g_cu.ImportFromShareableHandle) &&
         Sym("cuMemRelease", &g_cu.Release) &&
         Sym("cuMemCreate", &g_cu.Create) &&
         Sym("cuMemGetAllocationGranularity", &g_cu.GetGranularity) &&
         Sym("cuMemGetAllocationPropertiesFromHandle", &g_cu.GetPropertiesFromHandle) &&
         Sym("cuMemAddressReserve", &g_cu.AddressReserve) &&
         Sym("cuMemAddressFree", &g_cu.AddressFree) &&
         Sym("cuMemMap", &g_cu.Map) &&
         Sym("cuMemUnmap", &g_cu.Unmap) &&
         Sym("cuMemSetAccess", &g_cu.SetAccess) &&
         Sym("cuDeviceGet", &g_cu.DeviceGet) &&
         Sym("cuDeviceGetUuid", &g_cu.DeviceGetUuid) &&
         Sym("cuStreamCreate", &g_cu.StreamCreate) &&
         Sym("cuEventCreate", &g_cu.EventCreate) &&
         Sym("cuEventRecord", &g_cu.EventRecord) &&
         Sym("cuEventQuery", &g_cu.EventQuery) &&
         Sym("cuEventDestroy_v2", &g_cu.EventDestroy) &&
         Sym("cuIpcGetEventHandle", &g_cu.IpcGetEventHandle) &&
         Sym("cuIpcOpenEventHandle", &g_cu.IpcOpenEventHandle) &&
         Sym("cuStreamWaitEvent", &g_cu.StreamWaitEvent) &&
         Sym("cuMemcpyDtoDAsync_v2", &g_cu.MemcpyDtoDAsync) &&
         Sym("cuCtxSynchronize", &g_cu.CtxSynchronize);
  if (!g_ok) {
    g_why = "the NVIDIA driver lacks the virtual memory management or IPC "
            "entry points that sharing GPU memory between processes needs "
            "(CUDA 11.7 or newer)";
  }
}

// The driver, its IPC entry points, and the device's primary context
// current for the scope.
bool Enter(int ordinal, cuda::DeviceScope* scope, Error* err) {
  if (!cuda::Load(err)) return false;
  std::call_once(g_once, LoadOnce);
  if (!g_ok) return Fail(err, ErrorKind::kBuffer, g_why);
  return scope->Enter(ordinal, err);
}

bool DriverFail(Error* err, const std::string& what, CUresult r) {
  return Fail(err, ErrorKind::kBuffer, what + " failed: " + cuda::Describe(r));
}

using cuda::Hex;

template <typename T>
bool Attr(uintptr_t ptr, int attr, T* out) {
  return g_cu.PointerGetAttribute(out, attr, CUdeviceptr(ptr)) == kSuccess;
}

AllocationProp DeviceProp(int ordinal) {
  AllocationProp p{};
  p.type = kAllocationPinned;
  p.requested_handle_types = kHandlePosixFd;
  p.location = {kLocationDevice, ordinal};
  return p;
}

}  // namespace

bool AllocationOf(int ordinal, uintptr_t ptr, Allocation* out, Error* err) {
  cuda::DeviceScope scope;
  if (!Enter(ordinal, &scope, err)) return false;
  int legacy = 0;
  unsigned long long types = 0, block = 0;
  CUdeviceptr base = 0;
  size_t size = 0;
  Attr(ptr, kAttrLegacyIpc, &legacy);
  Attr(ptr, kAttrHandleTypes, &types);
  Attr(ptr, kAttrBlockId, &block);
  // A virtual-memory mapping is one physical allocation mapped at offset 0;
  // for other memory the driver's allocation range says the same.
  if (!Attr(ptr, kAttrMappingBase, &base) || !Attr(ptr, kAttrMappingSize, &size)) {
    CUresult r = g_cu.PointerGetAttribute(&base, kAttrRangeStart, ptr);
    if (r != kSuccess) {
      return DriverFail(err, "cuPointerGetAttribute(" + Hex(ptr) + ")", r);
    }
    Attr(ptr, kAttrRangeSize, &size);
  }
  out->base = uintptr_t(base);
  out->size = size;
  out->block_id = block;
  out->handle_types = types;
  out->legacy_ipc = legacy != 0;
  return true;
}

bool ExportFd(int ordinal, uintptr_t ptr, int* fd, Error* err) {
  cuda::DeviceScope scope;
  if (!Enter(ordinal, &scope, err)) return false;
  Handle h = 0;
  CUresult r = g_cu.RetainAllocationHandle(&h, reinterpret_cast<void*>(ptr));
  if (r != kSuccess) {
    return Fail(err, ErrorKind::kBuffer,
                "the GPU memory at " + Hex(ptr) +
                    " has no shareable allocation handle "
                    "(cuMemRetainAllocationHandle: " +
                    std::to_string(r) +
                    "): it was not allocated with cuMemCreate, as XLA's "
                    "cuda_async allocator's pool and cudaMalloc'ed memory "
                    "are not");
  }
  int out = -1;
  r = g_cu.ExportToShareableHandle(&out, h, kHandlePosixFd, 0);
  // The retained reference is ours either way; the descriptor, once made,
  // holds the allocation by itself.
  g_cu.Release(h);
  if (r != kSuccess) {
    return Fail(err, ErrorKind::kBuffer,
                "the GPU memory at " + Hex(ptr) +
                    " cannot be exported as a POSIX file descriptor "
                    "(cuMemExportToShareableHandle: " +
                    std::to_string(r) +
                    "): its allocator did not ask for a shareable handle");
  }
  *fd = out;
  return true;
}

bool DeviceUuid(int ordinal, std::string* uuid, Error* err) {
  cuda::DeviceScope scope;
  if (!Enter(ordinal, &scope, err)) return false;
  CUdevice dev = 0;
  CUresult r = g_cu.DeviceGet(&dev, ordinal);
  if (r != kSuccess) return DriverFail(err, "cuDeviceGet", r);
  Uuid u{};
  r = g_cu.DeviceGetUuid(&u, dev);
  if (r != kSuccess) return DriverFail(err, "cuDeviceGetUuid", r);
  uuid->assign(u.bytes, kUuidBytes);
  return true;
}

namespace {

// Reserves, maps and grants access; on failure undoes what it did.  The
// handle stays the caller's to release: the mapping holds the memory.
bool MapHandle(int ordinal, Handle h, size_t size, uintptr_t* va, Error* err) {
  // The range must be aligned as the allocation's granularity asks.
  AllocationProp prop{};
  size_t align = 0;
  if (g_cu.GetPropertiesFromHandle(&prop, h) != kSuccess ||
      g_cu.GetGranularity(&align, &prop, kGranularityMinimum) != kSuccess) {
    align = 0;  // the driver's default
  }
  CUdeviceptr p = 0;
  CUresult r = g_cu.AddressReserve(&p, size, align, 0, 0);
  if (r != kSuccess) return DriverFail(err, "cuMemAddressReserve", r);
  r = g_cu.Map(p, size, 0, h, 0);
  if (r != kSuccess) {
    g_cu.AddressFree(p, size);
    return DriverFail(err, "cuMemMap", r);
  }
  AccessDesc access{{kLocationDevice, ordinal}, kAccessReadWrite};
  r = g_cu.SetAccess(p, size, &access, 1);
  if (r != kSuccess) {
    g_cu.Unmap(p, size);
    g_cu.AddressFree(p, size);
    return DriverFail(err, "cuMemSetAccess", r);
  }
  *va = uintptr_t(p);
  return true;
}

}  // namespace

bool MapFd(int ordinal, int fd, size_t size, uintptr_t* va, Error* err) {
  cuda::DeviceScope scope;
  if (!Enter(ordinal, &scope, err)) return false;
  Handle h = 0;
  CUresult r = g_cu.ImportFromShareableHandle(
      &h, reinterpret_cast<void*>(static_cast<intptr_t>(fd)), kHandlePosixFd);
  if (r != kSuccess) {
    return DriverFail(err, "cuMemImportFromShareableHandle (the descriptor "
                           "of another process's GPU allocation)", r);
  }
  bool ok = MapHandle(ordinal, h, size, va, err);
  // Released either way: a live mapping keeps the physical memory, even
  // after the exporting process has exited.
  g_cu.Release(h);
  return ok;
}

bool Unmap(int ordinal, uintptr_t va, size_t size, bool sync, Error* err) {
  cuda::DeviceScope scope;
  if (!Enter(ordinal, &scope, err)) return false;
  if (sync) {
    CUresult s = g_cu.CtxSynchronize();
    if (s != kSuccess) return DriverFail(err, "cuCtxSynchronize", s);
  }
  CUresult r = g_cu.Unmap(CUdeviceptr(va), size);
  if (r != kSuccess) return DriverFail(err, "cuMemUnmap", r);
  r = g_cu.AddressFree(CUdeviceptr(va), size);
  if (r != kSuccess) return DriverFail(err, "cuMemAddressFree", r);
  return true;
}

bool AllocExportable(int ordinal, size_t bytes, uintptr_t* va, size_t* size,
                     Error* err) {
  cuda::DeviceScope scope;
  if (!Enter(ordinal, &scope, err)) return false;
  AllocationProp prop = DeviceProp(ordinal);
  size_t gran = 0;
  CUresult r = g_cu.GetGranularity(&gran, &prop, kGranularityMinimum);
  if (r != kSuccess || gran == 0) {
    return DriverFail(err, "cuMemGetAllocationGranularity", r);
  }
  size_t n = (bytes + gran - 1) / gran * gran;
  if (n == 0) n = gran;
  Handle h = 0;
  r = g_cu.Create(&h, n, &prop, 0);
  if (r != kSuccess) {
    return DriverFail(err, "cuMemCreate(" + std::to_string(n) + " bytes)", r);
  }
  bool ok = MapHandle(ordinal, h, n, va, err);
  g_cu.Release(h);  // the mapping holds it; unmapping frees it
  if (ok) *size = n;
  return ok;
}

bool NewStream(int ordinal, uintptr_t* stream, Error* err) {
  cuda::DeviceScope scope;
  if (!Enter(ordinal, &scope, err)) return false;
  CUstream s = nullptr;
  CUresult r = g_cu.StreamCreate(&s, kStreamNonBlocking);
  if (r != kSuccess) return DriverFail(err, "cuStreamCreate", r);
  *stream = reinterpret_cast<uintptr_t>(s);
  return true;
}

bool RecordIpcEvent(int ordinal, uintptr_t stream, uintptr_t* event,
                    std::string* handle, Error* err) {
  if (!NewEvent(ordinal, true, event, handle, err)) return false;
  if (RecordEvent(ordinal, *event, stream, err)) return true;
  Error ignored;
  DestroyEvent(ordinal, *event, &ignored);
  return false;
}

bool DestroyEvent(int ordinal, uintptr_t event, Error* err) {
  cuda::DeviceScope scope;
  if (!Enter(ordinal, &scope, err)) return false;
  CUresult r = g_cu.EventDestroy(reinterpret_cast<CUevent>(event));
  if (r != kSuccess) return DriverFail(err, "cuEventDestroy", r);
  return true;
}

bool EventDone(int ordinal, uintptr_t event, bool* done, Error* err) {
  cuda::DeviceScope scope;
  if (!Enter(ordinal, &scope, err)) return false;
  CUresult r = g_cu.EventQuery(reinterpret_cast<CUevent>(event));
  if (r != kSuccess && r != kNotReady) return DriverFail(err, "cuEventQuery", r);
  *done = r == kSuccess;
  return true;
}

bool WaitIpcEvent(int ordinal, const std::string& handle, uintptr_t stream,
                  Error* err) {
  uintptr_t ev = 0;
  if (!OpenIpcEvent(ordinal, handle, &ev, err)) return false;
  bool ok = WaitEvent(ordinal, ev, stream, err);
  // Closing the opened event is safe once the wait is enqueued.
  Error ignored;
  DestroyEvent(ordinal, ev, &ignored);
  return ok;
}

bool NewEvent(int ordinal, bool interprocess, uintptr_t* event,
              std::string* handle, Error* err) {
  cuda::DeviceScope scope;
  if (!Enter(ordinal, &scope, err)) return false;
  CUevent ev = nullptr;
  CUresult r = g_cu.EventCreate(
      &ev, kEventDisableTiming | (interprocess ? kEventInterprocess : 0u));
  if (r != kSuccess) return DriverFail(err, "cuEventCreate", r);
  handle->clear();
  if (interprocess) {
    EventHandle eh{};
    r = g_cu.IpcGetEventHandle(&eh, ev);
    if (r != kSuccess) {
      g_cu.EventDestroy(ev);
      return DriverFail(err, "cuIpcGetEventHandle", r);
    }
    handle->assign(eh.reserved, kEventHandleBytes);
  }
  *event = reinterpret_cast<uintptr_t>(ev);
  return true;
}

bool RecordEvent(int ordinal, uintptr_t event, uintptr_t stream, Error* err) {
  cuda::DeviceScope scope;
  if (!Enter(ordinal, &scope, err)) return false;
  CUresult r = g_cu.EventRecord(reinterpret_cast<CUevent>(event),
                                reinterpret_cast<CUstream>(stream));
  if (r != kSuccess) return DriverFail(err, "cuEventRecord", r);
  return true;
}

bool OpenIpcEvent(int ordinal, const std::string& handle, uintptr_t* event,
                  Error* err) {
  if (handle.size() != kEventHandleBytes) {
    return Fail(err, ErrorKind::kValue,
                "an interprocess event handle is " +
                    std::to_string(kEventHandleBytes) + " bytes, not " +
                    std::to_string(handle.size()));
  }
  cuda::DeviceScope scope;
  if (!Enter(ordinal, &scope, err)) return false;
  EventHandle eh;
  std::memcpy(eh.reserved, handle.data(), kEventHandleBytes);
  CUevent ev = nullptr;
  CUresult r = g_cu.IpcOpenEventHandle(&ev, eh);
  if (r != kSuccess) {
    return DriverFail(err, "cuIpcOpenEventHandle (the other process's event; "
                           "has it exited?)", r);
  }
  *event = reinterpret_cast<uintptr_t>(ev);
  return true;
}

bool WaitEvent(int ordinal, uintptr_t event, uintptr_t stream, Error* err) {
  cuda::DeviceScope scope;
  if (!Enter(ordinal, &scope, err)) return false;
  CUresult r = g_cu.StreamWaitEvent(reinterpret_cast<CUstream>(stream),
                                    reinterpret_cast<CUevent>(event), 0);
  if (r != kSuccess) return DriverFail(err, "cuStreamWaitEvent", r);
  return true;
}

bool Synchronize(int ordinal, Error* err) {
  cuda::DeviceScope scope;
  if (!Enter(ordinal, &scope, err)) return false;
  CUresult r = g_cu.CtxSynchronize();
  if (r != kSuccess) return DriverFail(err, "cuCtxSynchronize", r);
  return true;
}

bool CopyAsync(int ordinal, uintptr_t dst, uintptr_t src, size_t bytes,
               uintptr_t stream, Error* err) {
  cuda::DeviceScope scope;
  if (!Enter(ordinal, &scope, err)) return false;
  CUresult r = g_cu.MemcpyDtoDAsync(CUdeviceptr(dst), CUdeviceptr(src), bytes,
                                    reinterpret_cast<CUstream>(stream));
  if (r != kSuccess) return DriverFail(err, "cuMemcpyDtoDAsync", r);
  return true;
}

}  // namespace jxo::ipc
