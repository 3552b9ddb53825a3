// DLPack ABI as this project uses it, declared from the public DLPack
// specification (v1.1).  Field order and widths are the ABI: the
// static_asserts at the bottom pin them so a careless edit cannot break
// interchange with other libraries.
#ifndef JAX_OVERLAY_XLA_EXT_DLPACK_ABI_H_
#define JAX_OVERLAY_XLA_EXT_DLPACK_ABI_H_

#include <cstddef>
#include <cstdint>

namespace jxo::dl {

// Device types (DLDeviceType).
enum DeviceType : int32_t {
  kCPU = 1,
  kCUDA = 2,
  kCUDAHost = 3,  // pinned host memory, visible to the GPU
  kOpenCL = 4,
  kVulkan = 7,
  kMetal = 8,
  kVPI = 9,
  kROCM = 10,
  kROCMHost = 11,
  kExtDev = 12,
  kCUDAManaged = 13,
  kOneAPI = 14,
  kWebGPU = 15,
  kHexagon = 16,
  kMAIA = 17,
};

// Type codes (DLDataTypeCode).
enum TypeCode : uint8_t {
  kInt = 0,
  kUInt = 1,
  kFloat = 2,
  kOpaqueHandle = 3,
  kBfloat = 4,
  kComplex = 5,
  kBool = 6,
  kFloat8_e3m4 = 7,
  kFloat8_e4m3 = 8,
  kFloat8_e4m3b11fnuz = 9,
  kFloat8_e4m3fn = 10,
  kFloat8_e4m3fnuz = 11,
  kFloat8_e5m2 = 12,
  kFloat8_e5m2fnuz = 13,
  kFloat8_e8m0fnu = 14,
  kFloat6_e2m3fn = 15,
  kFloat6_e3m2fn = 16,
  kFloat4_e2m1fn = 17,
};

// Flags of a versioned managed tensor.
constexpr uint64_t kFlagReadOnly = 1ull << 0;
constexpr uint64_t kFlagIsCopied = 1ull << 1;
constexpr uint64_t kFlagIsSubbytePadded = 1ull << 2;

// The newest version this project writes and understands.
constexpr uint32_t kMajorVersion = 1;
constexpr uint32_t kMinorVersion = 1;

struct Device {
  int32_t device_type;
  int32_t device_id;
};

struct DataType {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
};

struct Tensor {
  void* data;
  Device device;
  int32_t ndim;
  DataType dtype;
  int64_t* shape;
  int64_t* strides;  // in elements; nullptr means compact row-major
  uint64_t byte_offset;
};

// Legacy (pre-1.0) managed tensor, capsule name "dltensor".
struct ManagedTensor {
  Tensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(ManagedTensor* self);
};

struct PackVersion {
  uint32_t major;
  uint32_t minor;
};

// Versioned (1.x) managed tensor, capsule name "dltensor_versioned".
// Note the order differs from the legacy struct: version first, tensor last.
struct ManagedTensorVersioned {
  PackVersion version;
  void* manager_ctx;
  void (*deleter)(ManagedTensorVersioned* self);
  uint64_t flags;
  Tensor dl_tensor;
};

inline constexpr const char* kCapsuleLegacy = "dltensor";
inline constexpr const char* kCapsuleLegacyUsed = "used_dltensor";
inline constexpr const char* kCapsuleVersioned = "dltensor_versioned";
inline constexpr const char* kCapsuleVersionedUsed = "used_dltensor_versioned";

static_assert(sizeof(Device) == 8 && sizeof(DataType) == 4);
static_assert(offsetof(Tensor, device) == 8 && offsetof(Tensor, ndim) == 16 &&
              offsetof(Tensor, dtype) == 20 && offsetof(Tensor, shape) == 24 &&
              offsetof(Tensor, strides) == 32 &&
              offsetof(Tensor, byte_offset) == 40 && sizeof(Tensor) == 48);
static_assert(offsetof(ManagedTensor, manager_ctx) == 48 &&
              offsetof(ManagedTensor, deleter) == 56);
static_assert(offsetof(ManagedTensorVersioned, manager_ctx) == 8 &&
              offsetof(ManagedTensorVersioned, deleter) == 16 &&
              offsetof(ManagedTensorVersioned, flags) == 24 &&
              offsetof(ManagedTensorVersioned, dl_tensor) == 32);

}  // namespace jxo::dl

#endif  // JAX_OVERLAY_XLA_EXT_DLPACK_ABI_H_
