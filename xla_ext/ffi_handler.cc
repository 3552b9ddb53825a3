#include "ffi_handler.h"

#include <atomic>
#include <cstring>
#include <string>

#include "error.h"
#include "strided_kernel.h"

namespace jxo::ffi {
namespace {

std::atomic<int> g_minor{-1};

constexpr size_t kErrorCreateArgsSize =
    offsetof(ErrorCreateArgs, errc) + sizeof(int);
constexpr size_t kStreamGetArgsSize =
    offsetof(StreamGetArgs, stream) + sizeof(void*);

Error* Fail(const CallFrame* frame, int code, const std::string& message) {
  ErrorCreateArgs a;
  std::memset(&a, 0, sizeof a);
  a.struct_size = kErrorCreateArgsSize;
  a.message = message.c_str();  // XLA copies it
  a.errc = code;
  return frame->api->error_create(&a);
}

// Bytes per element of the XLA types a compact copy can produce.
int64_t ItemBytes(int dtype) {
  switch (dtype) {
    case 1: case 2: case 6: case 19: case 20: case 23: case 24: case 25:
    case 28: case 29: case 33:
      return 1;  // pred, s8, u8, float8 variants
    case 3: case 7: case 10: case 16:
      return 2;  // s16, u16, f16, bf16
    case 4: case 8: case 11:
      return 4;  // s32, u32, f32
    case 5: case 9: case 12: case 15:
      return 8;  // s64, u64, f64, c64
    case 18:
      return 16;  // c128
    default:
      return 0;
  }
}

int64_t Bytes(const Buffer* b) {
  int64_t n = ItemBytes(b->dtype);
  for (int64_t d = 0; d < b->rank; ++d) n *= b->dims[d];
  return n;
}

const ArrayAttr* FindPlan(const Attrs& attrs) {
  for (int64_t i = 0; i < attrs.size; ++i) {
    const ByteSpan* name = attrs.names[i];
    if (name->len == 4 && std::memcmp(name->ptr, "plan", 4) == 0 &&
        attrs.types[i] == kAttrArray) {
      return static_cast<const ArrayAttr*>(attrs.attrs[i]);
    }
  }
  return nullptr;
}

}  // namespace

void SetReportedMinor(int minor) { g_minor.store(minor); }

Error* StridedCopy(CallFrame* frame) {
  // Registration first calls the handler with a metadata request: answer
  // with the API version and no traits (not command-buffer compatible: the
  // kernel is found at run time, per context).
  for (ExtensionBase* e = frame->extension_start; e; e = e->next) {
    if (e->type == kExtensionMetadata) {
      Metadata* m = reinterpret_cast<MetadataExtension*>(e)->metadata;
      m->api_version.major_version = kApiMajor;
      m->api_version.minor_version = g_minor.load();
      m->traits = 0;
      return nullptr;
    }
  }
  if (frame->stage != kStageExecute) return nullptr;
  if (frame->args.size != 1 || frame->args.types[0] != kArgBuffer ||
      frame->rets.size != 1 || frame->rets.types[0] != kRetBuffer) {
    return Fail(frame, kInvalidArgument,
                "jax_overlay strided copy takes one buffer and returns one");
  }
  const ArrayAttr* attr = FindPlan(frame->attrs);
  if (!attr || attr->dtype != kS64 ||
      attr->size != size_t(strided::kPlanFields)) {
    return Fail(frame, kInvalidArgument,
                "jax_overlay strided copy needs an int64 attribute 'plan' of " +
                    std::to_string(strided::kPlanFields) + " values");
  }
  const int64_t* fields = static_cast<const int64_t*>(attr->data);
  const Buffer* in = static_cast<const Buffer*>(frame->args.args[0]);
  const Buffer* out = static_cast<const Buffer*>(frame->rets.rets[0]);
  int64_t unit = fields[0];
  strided::Plan p =
      strided::FromFields(fields, unit > 0 ? Bytes(in) / unit : 0);
  jxo::Error err;
  if (!strided::Validate(p, &err)) return Fail(frame, kInvalidArgument, err.message);
  if (Bytes(out) != p.count * p.unit) {
    return Fail(frame, kInvalidArgument,
                "jax_overlay strided copy: the result holds " +
                    std::to_string(Bytes(out)) + " bytes, the plan writes " +
                    std::to_string(p.count * p.unit));
  }
  StreamGetArgs s;
  std::memset(&s, 0, sizeof s);
  s.struct_size = kStreamGetArgsSize;
  s.ctx = frame->ctx;
  if (Error* e = frame->api->stream_get(&s)) return e;
  if (!strided::Launch(p, reinterpret_cast<uintptr_t>(out->data),
                       reinterpret_cast<uintptr_t>(in->data),
                       reinterpret_cast<uintptr_t>(s.stream), &err)) {
    return Fail(frame, kInternal, err.message);
  }
  return nullptr;
}

}  // namespace jxo::ffi
