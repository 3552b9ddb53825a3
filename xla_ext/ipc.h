// Interprocess sharing of GPU memory through the driver's virtual memory
// management: XLA allocates its buffers with cuMemCreate, whose memory is
// not legacy-IPC capable but exports as a POSIX file descriptor.  The
// exporter turns the allocation holding a pointer into a descriptor; the
// receiver imports it, reserves an address range, maps it and grants its
// device access.  Interprocess events order the receiver after the
// exporter's pending writes without a host block.
#ifndef JAX_OVERLAY_XLA_EXT_IPC_H_
#define JAX_OVERLAY_XLA_EXT_IPC_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "error.h"

namespace jxo::ipc {

constexpr size_t kEventHandleBytes = 64;  // CUipcEventHandle
constexpr size_t kUuidBytes = 16;         // CUuuid
// The CUmemAllocationHandleType bit of POSIX file descriptors, the one
// handle type shares use (Allocation::handle_types).
constexpr int kHandlePosixFd = 1;

// The allocation (one cuMemMap'ed physical allocation) holding a pointer.
struct Allocation {
  uintptr_t base = 0;      // where the exporter has it mapped
  size_t size = 0;         // bytes a receiver maps
  uint64_t block_id = 0;   // the driver's process-wide id of the allocation
  uint64_t handle_types = 0;  // CUmemAllocationHandleType bits it exports as
  bool legacy_ipc = false;    // cuIpcGetMemHandle would work instead
};

// An interprocess event of this process, and its handle.
struct IpcEvent {
  uintptr_t event = 0;
  std::string handle;
};

// What the driver says of the allocation holding `ptr` (device `ordinal`).
bool AllocationOf(int ordinal, uintptr_t ptr, Allocation* out, Error* err);

// A new POSIX file descriptor of the allocation holding `ptr`; the caller
// owns it (close it once sent).  A BufferError naming the allocator when
// the memory has no shareable handle (cudaMalloc'ed, a cudaMallocAsync pool).
bool ExportFd(int ordinal, uintptr_t ptr, int* fd, Error* err);

// The device's UUID, 16 bytes: ordinals differ between processes
// (CUDA_VISIBLE_DEVICES), UUIDs do not.
bool DeviceUuid(int ordinal, std::string* uuid, Error* err);

// Imports descriptor `fd` (not closed here), maps its first `size` bytes at
// a new address and grants device `ordinal` read-write access.  The mapping
// holds the memory; unmapped with Unmap.
bool MapFd(int ordinal, int fd, size_t size, uintptr_t* va, Error* err);
// `sync`: first wait for all work of the device's primary context, for
// memory a framework may still have in flight when it lets go.
bool Unmap(int ordinal, uintptr_t va, size_t size, bool sync, Error* err);

// A new exportable allocation of at least `bytes` on device `ordinal`,
// mapped read-write in this process: *size is what was allocated (a
// multiple of the allocation granularity).
bool AllocExportable(int ordinal, size_t bytes, uintptr_t* va, size_t* size,
                     Error* err);

// A non-blocking stream of the device's primary context, for the life of
// the process.
bool NewStream(int ordinal, uintptr_t* stream, Error* err);

// An interprocess event recorded on `stream` now, and its handle.
bool RecordIpcEvent(int ordinal, uintptr_t stream, uintptr_t* event,
                    std::string* handle, Error* err);
bool DestroyEvent(int ordinal, uintptr_t event, Error* err);
// True once the work the event covers has finished.
bool EventDone(int ordinal, uintptr_t event, bool* done, Error* err);

// Makes `stream` (1 legacy, 2 per-thread, or a handle) of device `ordinal`
// wait on the GPU for another process's event, given by its handle.
bool WaitIpcEvent(int ordinal, const std::string& handle, uintptr_t stream,
                  Error* err);

// A persistent channel's events (jax_overlay/_channel.py), made once and
// recorded again every step, so a step costs no event creation or handle
// exchange.  `interprocess`: with a handle another process can open.
bool NewEvent(int ordinal, bool interprocess, uintptr_t* event,
              std::string* handle, Error* err);
// Records `event` again on `stream`: later waits on it see this record.
bool RecordEvent(int ordinal, uintptr_t event, uintptr_t stream, Error* err);
// Another process's interprocess event, opened once here (DestroyEvent
// closes it); a wait on it sees the owner's latest record.
bool OpenIpcEvent(int ordinal, const std::string& handle, uintptr_t* event,
                  Error* err);
// Makes `stream` wait on the GPU for `event`'s latest record.
bool WaitEvent(int ordinal, uintptr_t event, uintptr_t stream, Error* err);

// Waits on the host for all work of the device's primary context.
bool Synchronize(int ordinal, Error* err);

// cuMemcpyDtoDAsync on `stream`.
bool CopyAsync(int ordinal, uintptr_t dst, uintptr_t src, size_t bytes,
               uintptr_t stream, Error* err);

}  // namespace jxo::ipc

#endif  // JAX_OVERLAY_XLA_EXT_IPC_H_
