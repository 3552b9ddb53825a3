// Compile-time check that xla_ext/xla_ffi_abi.h, our own declarations of
// XLA's FFI ABI, agree with the headers of the installed jaxlib
// (jax.ffi.include_dir()): sizes, member offsets and enum values.  Compiled
// by tests/cpu/test_strided_plan.py with -fsyntax-only; never linked.
#include <cstddef>

#include "xla/ffi/api/c_api.h"
#include "xla_ffi_abi.h"

namespace f = jxo::ffi;

#define SAME_SIZE(theirs, ours) \
  static_assert(sizeof(theirs) == sizeof(ours), #ours);
#define SAME_AT(theirs, their_member, ours, our_member)                    \
  static_assert(offsetof(theirs, their_member) == offsetof(ours, our_member), \
                #ours "::" #our_member);

// The extension base type was renamed across jaxlib releases: name it by use.
SAME_SIZE(decltype(XLA_FFI_Metadata_Extension::extension_base), f::ExtensionBase)
SAME_SIZE(XLA_FFI_Metadata_Extension, f::MetadataExtension)
SAME_AT(XLA_FFI_Metadata, api_version, f::Metadata, api_version)
SAME_AT(XLA_FFI_Metadata, traits, f::Metadata, traits)
SAME_SIZE(XLA_FFI_Api_Version, f::ApiVersion)
SAME_SIZE(XLA_FFI_Buffer, f::Buffer)
SAME_AT(XLA_FFI_Buffer, dtype, f::Buffer, dtype)
SAME_AT(XLA_FFI_Buffer, data, f::Buffer, data)
SAME_AT(XLA_FFI_Buffer, rank, f::Buffer, rank)
SAME_AT(XLA_FFI_Buffer, dims, f::Buffer, dims)
SAME_SIZE(XLA_FFI_Args, f::Args)
SAME_SIZE(XLA_FFI_Rets, f::Rets)
SAME_SIZE(XLA_FFI_Attrs, f::Attrs)
SAME_AT(XLA_FFI_Attrs, names, f::Attrs, names)
SAME_SIZE(XLA_FFI_ByteSpan, f::ByteSpan)
SAME_SIZE(XLA_FFI_Array, f::ArrayAttr)
SAME_AT(XLA_FFI_Array, size, f::ArrayAttr, size)
SAME_AT(XLA_FFI_Array, data, f::ArrayAttr, data)
SAME_AT(XLA_FFI_CallFrame, api, f::CallFrame, api)
SAME_AT(XLA_FFI_CallFrame, ctx, f::CallFrame, ctx)
SAME_AT(XLA_FFI_CallFrame, stage, f::CallFrame, stage)
SAME_AT(XLA_FFI_CallFrame, args, f::CallFrame, args)
SAME_AT(XLA_FFI_CallFrame, rets, f::CallFrame, rets)
SAME_AT(XLA_FFI_CallFrame, attrs, f::CallFrame, attrs)
SAME_SIZE(XLA_FFI_Error_Create_Args, f::ErrorCreateArgs)
SAME_AT(XLA_FFI_Error_Create_Args, errc, f::ErrorCreateArgs, errc)
SAME_SIZE(XLA_FFI_Stream_Get_Args, f::StreamGetArgs)
SAME_AT(XLA_FFI_Stream_Get_Args, stream, f::StreamGetArgs, stream)
SAME_AT(XLA_FFI_Api, api_version, f::Api, api_version)
SAME_AT(XLA_FFI_Api, XLA_FFI_Error_Create, f::Api, error_create)
SAME_AT(XLA_FFI_Api, XLA_FFI_Stream_Get, f::Api, stream_get)

static_assert(XLA_FFI_API_MAJOR == f::kApiMajor, "major version");
static_assert(int(XLA_FFI_Extension_Metadata) == int(f::kExtensionMetadata), "f::kExtensionMetadata");
static_assert(int(XLA_FFI_ExecutionStage_EXECUTE) == int(f::kStageExecute), "f::kStageExecute");
static_assert(int(XLA_FFI_ArgType_BUFFER) == int(f::kArgBuffer), "f::kArgBuffer");
static_assert(int(XLA_FFI_RetType_BUFFER) == int(f::kRetBuffer), "f::kRetBuffer");
static_assert(int(XLA_FFI_AttrType_ARRAY) == int(f::kAttrArray), "f::kAttrArray");
static_assert(int(XLA_FFI_DataType_S64) == int(f::kS64), "f::kS64");
static_assert(int(XLA_FFI_Error_Code_INVALID_ARGUMENT) == int(f::kInvalidArgument), "f::kInvalidArgument");
static_assert(int(XLA_FFI_Error_Code_INTERNAL) == int(f::kInternal), "f::kInternal");
// The handler sizes buffers from these type codes (ffi_handler.cc).
static_assert(XLA_FFI_DataType_PRED == 1 && XLA_FFI_DataType_S8 == 2 &&
                  XLA_FFI_DataType_U8 == 6 && XLA_FFI_DataType_F8E5M2 == 19 &&
                  XLA_FFI_DataType_F8E4M3FN == 20 &&
                  XLA_FFI_DataType_F8E4M3B11FNUZ == 23 &&
                  XLA_FFI_DataType_F8E5M2FNUZ == 24 &&
                  XLA_FFI_DataType_F8E4M3FNUZ == 25 &&
                  XLA_FFI_DataType_F8E4M3 == 28 &&
                  XLA_FFI_DataType_F8E3M4 == 29 &&
                  XLA_FFI_DataType_F8E8M0FNU == 33,
              "1-byte types");
static_assert(XLA_FFI_DataType_S16 == 3 && XLA_FFI_DataType_U16 == 7 &&
                  XLA_FFI_DataType_F16 == 10 && XLA_FFI_DataType_BF16 == 16,
              "2-byte types");
static_assert(XLA_FFI_DataType_S32 == 4 && XLA_FFI_DataType_U32 == 8 &&
                  XLA_FFI_DataType_F32 == 11,
              "4-byte types");
static_assert(XLA_FFI_DataType_S64 == 5 && XLA_FFI_DataType_U64 == 9 &&
                  XLA_FFI_DataType_F64 == 12 && XLA_FFI_DataType_C64 == 15,
              "8-byte types");
static_assert(XLA_FFI_DataType_C128 == 18, "16-byte types");
