// XLA's FFI (typed custom call) C ABI, declared here from its documented
// layout: only the leading members and entry points this extension uses.
// XLA keeps the ABI stable within a major version (minor versions only
// append members and entry points), so a prefix stays valid; the minor
// version a handler reports is the one of the jaxlib it runs in (see
// ffi_handler.h).
#ifndef JAX_OVERLAY_XLA_EXT_XLA_FFI_ABI_H_
#define JAX_OVERLAY_XLA_EXT_XLA_FFI_ABI_H_

#include <cstddef>
#include <cstdint>

namespace jxo::ffi {

constexpr int kApiMajor = 0;  // the major version these declarations follow

enum ExtensionType : int { kExtensionMetadata = 1 };
enum Stage : int { kStageExecute = 3 };
enum ArgType : int { kArgBuffer = 1 };
enum RetType : int { kRetBuffer = 1 };
enum AttrType : int { kAttrArray = 1 };
enum DataType : int { kS64 = 5 };
enum ErrorCode : int { kInvalidArgument = 3, kInternal = 13 };

struct Error;  // opaque, owned by XLA
struct Api;
struct ExecutionContext;  // opaque

struct ExtensionBase {
  size_t struct_size;
  int type;  // ExtensionType
  ExtensionBase* next;
};

struct ApiVersion {
  size_t struct_size;
  void* extension_start;
  int major_version;
  int minor_version;
};

struct Metadata {
  size_t struct_size;
  ApiVersion api_version;
  uint32_t traits;
  // Later minors append members (XLA zero-fills them): left untouched.
};

struct MetadataExtension {
  ExtensionBase base;
  Metadata* metadata;
};

struct Buffer {
  size_t struct_size;
  void* extension_start;
  int dtype;  // DataType
  void* data;
  int64_t rank;
  int64_t* dims;
};

struct Args {
  size_t struct_size;
  void* extension_start;
  int64_t size;
  int* types;  // ArgType
  void** args;
};

struct Rets {
  size_t struct_size;
  void* extension_start;
  int64_t size;
  int* types;  // RetType
  void** rets;
};

struct ByteSpan {
  const char* ptr;
  size_t len;
};

struct ArrayAttr {
  int dtype;  // DataType
  size_t size;
  void* data;
};

struct Attrs {
  size_t struct_size;
  void* extension_start;
  int64_t size;
  int* types;  // AttrType
  ByteSpan** names;
  void** attrs;
};

struct CallFrame {
  size_t struct_size;
  ExtensionBase* extension_start;
  const Api* api;
  ExecutionContext* ctx;
  int stage;  // Stage
  Args args;
  Rets rets;
  Attrs attrs;
};

struct ErrorCreateArgs {
  size_t struct_size;
  void* extension_start;
  const char* message;
  int errc;  // ErrorCode
};

struct StreamGetArgs {
  size_t struct_size;
  void* extension_start;
  ExecutionContext* ctx;
  void* stream;  // out: the CUstream of the computation
};

using ErrorCreateFn = Error*(ErrorCreateArgs*);
using StreamGetFn = Error*(StreamGetArgs*);

// The API table's first members, in their fixed order.
struct Api {
  size_t struct_size;
  void* extension_start;
  ApiVersion api_version;
  const void* internal_api;
  ErrorCreateFn* error_create;
  void* error_get_message;
  void* error_destroy;
  void* handler_register;
  StreamGetFn* stream_get;
};

using Handler = Error*(CallFrame*);

}  // namespace jxo::ffi

#endif  // JAX_OVERLAY_XLA_EXT_XLA_FFI_ABI_H_
