// Python bindings of the native core: the only file that knows pybind11.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <thread>

#include "cai.h"
#include "capsule.h"
#include "cuda_driver.h"
#include "dlpack_abi.h"
#include "error.h"
#include "ffi_handler.h"
#include "gil_handoff.h"
#include "import_plan.h"
#include "ipc.h"
#include "jax_overlay_build_info.h"  // generated: see build_info.py
#include "layout.h"
#include "strided_kernel.h"

namespace py = pybind11;

namespace jxo {
namespace {

[[noreturn]] void Raise(const Error& e) {
  switch (e.kind) {
    case ErrorKind::kType:
      throw py::type_error(e.message);
    case ErrorKind::kValue:
      throw py::value_error(e.message);
    default:
      throw py::buffer_error(e.message);
  }
}

const char* LayoutName(LayoutKind k) {
  switch (k) {
    case LayoutKind::kRowMajor:
      return "row_major";
    case LayoutKind::kPermuted:
      return "permuted";
    default:
      return "strided";
  }
}

const char* KindName(cuda::MemoryKind k) {
  switch (k) {
    case cuda::MemoryKind::kDevice:
      return "device";
    case cuda::MemoryKind::kPinnedHost:
      return "pinned_host";
    case cuda::MemoryKind::kManaged:
      return "managed";
    default:
      return "not_cuda";
  }
}

py::tuple Tuple(const std::vector<int64_t>& v) {
  py::tuple t(v.size());
  for (size_t i = 0; i < v.size(); ++i) t[i] = py::int_(v[i]);
  return t;
}

ArrayView Parse(py::handle cai) {
  ArrayView spec;
  Error err;
  if (!ParseCai(cai.ptr(), &spec, &err)) Raise(err);
  return spec;
}

strided::Plan PlanOf(const std::vector<int64_t>& fields, int64_t envelope) {
  if (fields.size() != strided::kPlanFields) {
    throw py::value_error("a strided copy plan has " +
                          std::to_string(strided::kPlanFields) +
                          " fields, not " + std::to_string(fields.size()));
  }
  return strided::FromFields(fields.data(), envelope);
}

py::object Steal(PyObject* o) {
  if (!o) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(o);
}

py::object RawCapsule(py::handle owner, uintptr_t data,
                      const std::vector<int64_t>& shape,
                      std::optional<std::vector<int64_t>> strides,
                      py::handle dtype, int device_type,
                      int device_id, bool versioned, uint64_t flags) {
  TensorDesc d;
  Error err;
  int itemsize = 0;
  // A NumPy type string, or a DLPack (code, bits, lanes) for the types the
  // CAI cannot name (bfloat16, float8).
  if (py::isinstance<py::str>(dtype)) {
    if (!TypestrToDtype(dtype.cast<std::string>(), &d.dtype, &itemsize, &err)) {
      Raise(err);
    }
  } else {
    auto t = dtype.cast<std::tuple<int, int, int>>();
    if (std::get<0>(t) < 0 || std::get<0>(t) > 255 || std::get<1>(t) <= 0 ||
        std::get<1>(t) > 255 || std::get<2>(t) <= 0 || std::get<2>(t) > 65535) {
      throw py::value_error("dtype must be (code 0-255, bits 1-255, lanes 1-65535)");
    }
    d.dtype = dl::DataType{static_cast<uint8_t>(std::get<0>(t)),
                           static_cast<uint8_t>(std::get<1>(t)),
                           static_cast<uint16_t>(std::get<2>(t))};
  }
  if (strides && strides->size() != shape.size()) {
    throw py::value_error("strides must have one entry per dimension");
  }
  d.data = reinterpret_cast<void*>(data);
  d.device = {device_type, device_id};
  d.ndim = static_cast<int32_t>(shape.size());
  d.shape = shape.data();
  d.strides = strides ? strides->data() : nullptr;
  d.flags = flags;
  return Steal(NewOwnedCapsule(d, owner.ptr(), versioned));
}

// The import plans as Python sees them: named fields, the capsule an object.
struct CaiPlan {
  py::object capsule = py::none();
  ArrayView view;
  int device_type = 0;
  int ordinal = 0;
  uintptr_t range_start = 0;
  uintptr_t alignment = 1;
  bool busy = false;
  uintptr_t order_after = 0;
};

struct DlpackImport {
  py::object capsule = py::none();
  ArrayView view;
  int device_type = 0, device_id = 0;
  uint64_t flags = 0;
};

#if JAX_OVERLAY_TESTING
// Bindings only the tests and the benchmarks call (lifetime counters, the
// deleter hand-off, deleters driven the way consumers drive them, the
// strided kernel on its own): compiled in by tools/test.sh's build
// (JAX_OVERLAY_TESTING=1) and by Bazel's, never into a wheel.
void BindTestHooks(py::module_& m) {
  m.def(
      "chained_legacy",
      [](py::handle capsule) {
        return Steal(ChainedLegacyCapsule(capsule.ptr()));
      },
      py::arg("capsule"),
      "A legacy capsule of ours whose deleter chains to the producer's "
      "tensor (versioned or legacy); the input is marked used.");
  m.def("live_tensors", &LiveTensors,
        "Tensors created here whose deleter has not run.");
  m.def("released_tensors", &ReleasedTensors,
        "Tensors created here whose deleter has run.");
  m.def("handed_off", &HandedOff,
        "Deleter work handed from threads CPython does not know to the main "
        "thread (gil_handoff.h).");
  m.def("handed_off_run", &HandedOffRun,
        "Handed-off deleter work that has run.");
  m.def("run_handed_off", &RunHandedOff,
        "Runs the deleter work handed off so far, now.");
  m.def(
      "memory_kind",
      [](uintptr_t ptr) {
        cuda::PointerInfo info;
        Error err;
        if (!cuda::QueryPointer(ptr, &info, &err)) Raise(err);
        return static_cast<int>(info.kind);
      },
      py::arg("ptr"),
      "0 not CUDA memory, 1 device, 2 pinned host, 3 managed (the export's "
      "cheap platform check).");
  m.def(
      "stream_idle",
      [](int ordinal, uintptr_t stream) {
        bool idle = false;
        Error err;
        if (!cuda::StreamIdle(ordinal, stream, &idle, &err)) Raise(err);
        return idle;
      },
      py::arg("ordinal"), py::arg("stream"));
  m.def(
      "check_strided_plan",
      [](const std::vector<int64_t>& plan, int64_t envelope) {
        strided::Plan p = PlanOf(plan, envelope);
        Error err;
        if (!strided::Validate(p, &err)) Raise(err);
      },
      py::arg("plan"), py::arg("envelope"),
      "The handler's own check of a plan (ValueError naming the field).");
  m.def(
      "fast_divisor",
      [](uint32_t d) {
        strided::FastDivisor f = strided::MakeFastDivisor(d);
        return py::make_tuple(f.magic, f.shift);
      },
      py::arg("d"), "(magic, shift) with n // d == (n * magic) >> shift.");
  m.def(
      "launch_strided_copy",
      [](const std::vector<int64_t>& plan, int64_t envelope, uintptr_t dst,
         uintptr_t src, uintptr_t stream) {
        if (stream == 0) {
          throw py::value_error(
              "stream = 0: pass a stream handle (the kernel is loaded into "
              "that stream's context)");
        }
        strided::Plan p = PlanOf(plan, envelope);
        Error err;
        if (!strided::Validate(p, &err) ||
            !strided::Launch(p, dst, src, stream, &err)) {
          Raise(err);
        }
      },
      py::arg("plan"), py::arg("envelope"), py::arg("dst"), py::arg("src"),
      py::arg("stream"),
      "Enqueues the strided copy kernel on `stream` outside XLA, exactly as "
      "the custom call does (benchmarks and tests: the kernel alone).");
  m.def("strided_copy_ptx", &strided::Ptx,
        "The PTX text of the strided copy kernels.");
  m.def(
      "_delete_on_native_thread",
      [](py::handle capsule) {
        TakenTensor t = TakeTensor(capsule.ptr());
        if (!t.tensor) throw py::error_already_set();
        // The GIL must be free while the thread runs: the deleter takes it.
        // Plain macros, not an RAII guard: a daemon thread woken during
        // interpreter exit is unwound by CPython, and a noexcept destructor
        // in that path would abort the process.
        Py_BEGIN_ALLOW_THREADS
        std::thread([t] { CallDeleter(t); }).join();
        Py_END_ALLOW_THREADS
      },
      py::arg("capsule"),
      "Consumes a DLPack capsule and calls its deleter from a new native "
      "thread (tests).");
  m.def(
      "_delete_with_pending_error",
      [](py::handle capsule) {
        TakenTensor t = TakeTensor(capsule.ptr());
        if (!t.tensor) throw py::error_already_set();
        PyErr_SetString(PyExc_KeyError, "pending");
        CallDeleter(t);
        // The deleter must leave the caller's exception exactly as it was.
        bool kept = PyErr_ExceptionMatches(PyExc_KeyError);
        PyErr_Clear();
        return kept;
      },
      py::arg("capsule"),
      "Consumes a capsule and calls its deleter with a KeyError pending; "
      "True when the error survived (tests).");
}
#endif  // JAX_OVERLAY_TESTING

}  // namespace
}  // namespace jxo

PYBIND11_MODULE(_xla_ext, m) {
  using namespace jxo;
  m.doc() = "jax_overlay native core: DLPack ownership, CAI parsing, CUDA "
            "driver access.";

  py::class_<ArrayView>(m, "ArrayView",
                        "An array as either protocol describes it (a validated "
                        "__cuda_array_interface__ dict, or a DLPack tensor).")
      .def_readonly("version", &ArrayView::version)
      .def_readonly("data", &ArrayView::data)
      .def_readonly("read_only", &ArrayView::read_only)
      .def_readonly("typestr", &ArrayView::typestr)
      .def_readonly("itemsize", &ArrayView::itemsize)
      .def_property_readonly("shape",
                             [](const ArrayView& s) { return Tuple(s.shape); })
      .def_property_readonly(
          "dtype",
          [](const ArrayView& s) {
            return py::make_tuple(s.dtype.code, s.dtype.bits, s.dtype.lanes);
          },
          "The DLPack (code, bits, lanes).")
      .def_property_readonly(
          "strides",
          [](const ArrayView& s) -> py::object {
            if (s.strides.empty() && !s.shape.empty()) return py::none();
            return Tuple(s.strides);
          },
          "Strides in elements, or None for row-major.")
      .def_property_readonly(
          "layout", [](const ArrayView& s) { return LayoutName(s.layout.kind); })
      .def_property_readonly("numel",
                             [](const ArrayView& s) { return s.layout.numel; })
      .def_property_readonly("low",
                             [](const ArrayView& s) { return s.layout.low; })
      .def_property_readonly("span",
                             [](const ArrayView& s) { return s.layout.span; })
      .def_property_readonly("stream", [](const ArrayView& s) -> py::object {
        if (!s.has_stream) return py::none();
        return py::int_(s.stream);
      });

  m.def("parse_cai", &Parse, py::arg("cai"),
        "Validates a __cuda_array_interface__ dict; raises TypeError, "
        "ValueError or BufferError naming the bad field.");

  py::class_<CaiPlan>(m, "CaiPlan", "What plan_cai_import found.")
      .def_readonly("capsule", &CaiPlan::capsule,
                    "A zero-copy capsule, or None: a copy is needed.")
      .def_readonly("view", &CaiPlan::view)
      .def_readonly("device_type", &CaiPlan::device_type,
                    "kDLCUDA, kDLCUDAHost or kDLCPU.")
      .def_readonly("ordinal", &CaiPlan::ordinal)
      .def_readonly("range_start", &CaiPlan::range_start,
                    "The allocation's start, when the driver knows it (else 0).")
      .def_readonly("alignment", &CaiPlan::alignment,
                    "What a zero-copy view needs of the pointer.")
      .def_readonly("busy", &CaiPlan::busy,
                    "order_after still has work enqueued.")
      .def_readonly("order_after", &CaiPlan::order_after,
                    "The stream the import follows: the v3 stream, or the "
                    "legacy default stream (1) for a CAI without one.");

  m.def(
      "plan_cai_import",
      [](py::handle cai, py::handle owner, bool host) {
        RunHandedOff();  // see gil_handoff.h: the import paths drain it
        ImportPlan plan;
        Error err;
        if (!PlanCaiImport(cai.ptr(), owner.ptr(), host, &plan, &err)) {
          Raise(err);
        }
        CaiPlan out;
        // The plan's capsule is a new reference: the object takes it over.
        if (plan.capsule) out.capsule = py::reinterpret_steal<py::object>(plan.capsule);
        out.view = std::move(plan.view);
        out.device_type = plan.dl_device_type;
        out.ordinal = plan.ordinal;
        out.range_start = plan.range_start;
        out.alignment = plan.alignment;
        out.busy = plan.producer_busy;
        out.order_after = plan.order_after;
        return out;
      },
      py::arg("cai"), py::arg("owner"), py::arg("host") = false,
      "Validate, locate, and build the zero-copy capsule when a view is "
      "possible (a CaiPlan).  host=True treats the pointer as host memory "
      "(tests).");

  py::class_<DlpackImport>(m, "DlpackPlan", "What plan_dlpack_import found.")
      .def_readonly("capsule", &DlpackImport::capsule,
                    "A legacy capsule jaxlib reads.")
      .def_readonly("view", &DlpackImport::view)
      .def_readonly("device_type", &DlpackImport::device_type,
                    "As the capsule says.")
      .def_readonly("device_id", &DlpackImport::device_id)
      .def_readonly("flags", &DlpackImport::flags,
                    "0 for legacy capsules.");

  m.def(
      "plan_dlpack_import",
      [](py::handle capsule) {
        RunHandedOff();
        DlpackPlan plan;
        Error err;
        if (!PlanDlpackImport(capsule.ptr(), &plan, &err)) Raise(err);
        DlpackImport out;
        out.capsule = py::reinterpret_steal<py::object>(plan.capsule);
        out.view = std::move(plan.view);
        out.device_type = plan.device_type;
        out.device_id = plan.device_id;
        out.flags = plan.flags;
        return out;
      },
      py::arg("capsule"),
      "Inspect a producer's capsule and make it one jaxlib reads (a "
      "DlpackPlan).  BufferError for a consumed capsule, a newer major "
      "version (released first) or a tensor no consumer can read.");

  m.def(
      "capsule_from_cai",
      [](const ArrayView& s, py::handle owner, int device_type, int device_id,
         bool versioned, uint64_t flags) {
        return Steal(ViewCapsule(s, owner.ptr(), device_type, device_id,
                                 versioned, flags));
      },
      py::arg("view"), py::arg("owner"), py::arg("device_type"),
      py::arg("device_id"), py::arg("versioned") = false,
      py::arg("flags") = 0,
      "A DLPack capsule viewing the array of `view`, holding `owner` alive "
      "until its deleter runs.");

  m.def("raw_capsule", &RawCapsule, py::arg("owner"), py::arg("data"),
        py::arg("shape"), py::arg("strides"), py::arg("dtype"),
        py::arg("device_type"), py::arg("device_id"),
        py::arg("versioned") = false, py::arg("flags") = 0,
        "A DLPack capsule over `data` with the given shape, strides "
        "(elements) and dtype (type string or (code, bits, lanes)), holding "
        "`owner` alive.");

  m.def(
      "view_capsule",
      [](py::handle capsule, py::handle owner) {
        Error err;
        PyObject* out = ViewCapsule(capsule.ptr(), owner.ptr(), &err);
        if (!out) {
          if (!err.ok()) Raise(err);
          throw py::error_already_set();
        }
        return Steal(out);
      },
      py::arg("capsule"), py::arg("owner"),
      "A legacy capsule over the same memory as an unconsumed DLPack capsule "
      "(same data, shape, strides, dtype, device) that holds `owner` until "
      "its consumer frees it; the input is left unconsumed.");


  m.def(
      "capsule_data",
      [](py::handle capsule) {
        // capsule_info's "data" alone, with the same checks: the address a
        // foreign call copies to, per output, without building a dict.
        CapsuleView v;
        if (!InspectCapsule(capsule.ptr(), &v)) throw py::error_already_set();
        ArrayView d;
        Error err;
        if (!DescribeTensor(*v.tensor, &d, &err)) Raise(err);
        return d.data;
      },
      py::arg("capsule"),
      "The address of the first element (data + byte_offset) of an unconsumed "
      "DLPack capsule, checked as capsule_info checks it, without taking it.");

  m.def(
      "capsule_info",
      [](py::handle capsule) {
        CapsuleView v;
        if (!InspectCapsule(capsule.ptr(), &v)) throw py::error_already_set();
        const dl::Tensor& t = *v.tensor;
        ArrayView d;
        Error err;
        if (!DescribeTensor(t, &d, &err)) Raise(err);
        py::object version = py::none();
        if (v.versioned) version = py::make_tuple(v.major, v.minor);
        py::dict out;
        out["versioned"] = v.versioned;
        out["version"] = version;
        out["flags"] = v.flags;
        out["device"] = py::make_tuple(t.device.device_type, t.device.device_id);
        out["data"] = d.data;
        out["shape"] = Tuple(d.shape);
        out["strides"] = t.strides ? py::object(Tuple(d.strides)) : py::none();
        out["dtype"] = py::make_tuple(t.dtype.code, t.dtype.bits, t.dtype.lanes);
        out["typestr"] = d.typestr.empty() ? py::object(py::none()) : py::str(d.typestr);
        out["itemsize"] = d.itemsize;
        out["layout"] = LayoutName(d.layout.kind);
        out["numel"] = d.layout.numel;
        out["low"] = d.layout.low;
        out["span"] = d.layout.span;
        return out;
      },
      py::arg("capsule"),
      "What an unconsumed DLPack capsule holds, without taking it: "
      "BufferError for a consumed or foreign capsule.");

  m.def(
      "release_capsule",
      [](py::handle capsule) {
        TakenTensor t = TakeTensor(capsule.ptr());
        if (!t.tensor) throw py::error_already_set();
        CallDeleter(t);
      },
      py::arg("capsule"),
      "Consumes a capsule and calls its deleter now (for tensors the consumer "
      "must refuse, as the protocol asks).");


  m.def(
      "load_driver",
      []() {
        Error err;
        if (!cuda::Load(&err)) Raise(err);
      },
      "Loads libcuda.so.1; BufferError when there is no usable driver.");
  m.def("driver_loaded", &cuda::Loaded);
  m.def("driver_version", &cuda::DriverVersion);
  m.def("device_count", &cuda::DeviceCount);

  py::class_<cuda::PointerInfo>(m, "PointerInfo",
                                "What the driver says of a pointer.")
      .def_property_readonly(
          "kind", [](const cuda::PointerInfo& i) { return KindName(i.kind); },
          "device, pinned_host, managed or not_cuda.")
      .def_readonly("ordinal", &cuda::PointerInfo::ordinal)
      .def_readonly("device_ptr", &cuda::PointerInfo::device_ptr)
      .def_readonly("host_ptr", &cuda::PointerInfo::host_ptr)
      .def_readonly("range_start", &cuda::PointerInfo::range_start)
      .def_readonly("range_size", &cuda::PointerInfo::range_size);

  m.def(
      "pointer_info",
      [](uintptr_t ptr) {
        cuda::PointerInfo info;
        Error err;
        if (!cuda::QueryPointer(ptr, &info, &err)) Raise(err);
        return info;
      },
      py::arg("ptr"), "A PointerInfo of `ptr`.");


  m.def(
      "order_after",
      [](int ordinal, uintptr_t producer, uintptr_t consumer) {
        bool waited = false;
        Error err;
        if (!cuda::OrderAfter(ordinal, producer, consumer, &waited, &err)) {
          Raise(err);
        }
        return waited;
      },
      py::arg("ordinal"), py::arg("producer"), py::arg("consumer"),
      "Orders `consumer` after the work on `producer` with an event, without "
      "blocking the host; False when the producer was idle (nothing "
      "enqueued).");

  m.def(
      "capture_status",
      [](int ordinal, uintptr_t stream) {
        int status = cuda::kCaptureNone;
        Error err;
        if (!cuda::CaptureStatus(ordinal, stream, &status, &err)) Raise(err);
        return status;
      },
      py::arg("ordinal"), py::arg("stream"),
      "0 when `stream` is not capturing, 1 while a CUDA graph capture records "
      "it (what is enqueued is recorded, not run), 2 for a capture that an "
      "illegal call invalidated.");

  m.def(
      "exchange_capture_mode",
      [](int mode) {
        Error err;
        if (!cuda::ExchangeCaptureMode(&mode, &err)) Raise(err);
        return mode;
      },
      py::arg("mode"),
      "Sets this thread's stream capture mode (0 global, 1 thread-local, 2 "
      "relaxed: allocations allowed during a capture) and returns the one it "
      "had.");

  m.def(
      "call_on_device",
      [](int ordinal, py::function fn, py::args args) {
        cuda::DeviceScope scope;  // popped on return and on exceptions alike
        Error err;
        if (!scope.Enter(ordinal, &err)) Raise(err);
        return fn(*args);
      },
      py::arg("ordinal"), py::arg("fn"),
      "fn(*args) with the primary context of CUDA device `ordinal` current "
      "(the CUDA runtime's current device), restoring the caller's after; "
      "without a driver, just fn(*args).");


  // Interprocess sharing (jax_overlay/_ipc.py).
  auto check = [](bool ok, const Error& err) {
    if (!ok) Raise(err);
  };
  py::class_<ipc::Allocation>(m, "Allocation",
                              "The allocation holding a pointer.")
      .def_readonly("base", &ipc::Allocation::base)
      .def_readonly("size", &ipc::Allocation::size)
      .def_readonly("block_id", &ipc::Allocation::block_id)
      .def_readonly("handle_types", &ipc::Allocation::handle_types)
      .def_readonly("legacy_ipc", &ipc::Allocation::legacy_ipc);
  m.def(
      "allocation_of",
      [check](int ordinal, uintptr_t ptr) {
        ipc::Allocation a;
        Error err;
        check(ipc::AllocationOf(ordinal, ptr, &a, &err), err);
        return a;
      },
      py::arg("ordinal"), py::arg("ptr"),
      "The Allocation holding `ptr` on CUDA device `ordinal`.");
  m.def(
      "export_fd",
      [check](int ordinal, uintptr_t ptr) {
        int fd = -1;
        Error err;
        check(ipc::ExportFd(ordinal, ptr, &fd, &err), err);
        return fd;
      },
      py::arg("ordinal"), py::arg("ptr"),
      "A new POSIX file descriptor of the allocation holding `ptr` (the "
      "caller closes it).");
  m.def(
      "device_uuid",
      [check](int ordinal) {
        std::string u;
        Error err;
        check(ipc::DeviceUuid(ordinal, &u, &err), err);
        return py::bytes(u);
      },
      py::arg("ordinal"), "The device's 16-byte UUID.");
  m.def(
      "map_fd",
      [check](int ordinal, int fd, size_t size) {
        uintptr_t va = 0;
        Error err;
        check(ipc::MapFd(ordinal, fd, size, &va, &err), err);
        return va;
      },
      py::arg("ordinal"), py::arg("fd"), py::arg("size"),
      "Maps `size` bytes of another process's allocation (its descriptor, "
      "not closed) for device `ordinal`; the address.");
  m.def(
      "unmap",
      [check](int ordinal, uintptr_t va, size_t size, bool sync) {
        Error err;
        check(ipc::Unmap(ordinal, va, size, sync, &err), err);
      },
      py::arg("ordinal"), py::arg("va"), py::arg("size"), py::arg("sync"),
      "Unmaps and frees the address range of map_fd or alloc_exportable; "
      "`sync`: after all of the device's work.");
  m.def(
      "alloc_exportable",
      [check](int ordinal, size_t nbytes) {
        uintptr_t va = 0;
        size_t size = 0;
        Error err;
        check(ipc::AllocExportable(ordinal, nbytes, &va, &size, &err), err);
        ipc::Allocation a;
        check(ipc::AllocationOf(ordinal, va, &a, &err), err);
        a.base = va;  // the mapping made here, whatever the driver reports
        a.size = size;
        return a;
      },
      py::arg("ordinal"), py::arg("nbytes"),
      "The Allocation of a new exportable allocation of at least `nbytes`, "
      "mapped here (unmap frees it).");
  m.def(
      "new_stream",
      [check](int ordinal) {
        uintptr_t s = 0;
        Error err;
        check(ipc::NewStream(ordinal, &s, &err), err);
        return s;
      },
      py::arg("ordinal"), "A new non-blocking stream (never destroyed).");
  py::class_<ipc::IpcEvent>(m, "IpcEvent", "An interprocess event.")
      .def_readonly("event", &ipc::IpcEvent::event)
      .def_property_readonly(
          "handle", [](const ipc::IpcEvent& e) { return py::bytes(e.handle); },
          "Its 64-byte handle, for wait_ipc_event in another process.");
  m.def(
      "record_ipc_event",
      [check](int ordinal, uintptr_t stream) {
        ipc::IpcEvent e;
        Error err;
        check(ipc::RecordIpcEvent(ordinal, stream, &e.event, &e.handle, &err),
              err);
        return e;
      },
      py::arg("ordinal"), py::arg("stream"),
      "An IpcEvent recorded on `stream` now.");
  m.def(
      "destroy_event",
      [check](int ordinal, uintptr_t event) {
        Error err;
        check(ipc::DestroyEvent(ordinal, event, &err), err);
      },
      py::arg("ordinal"), py::arg("event"));
  m.def(
      "event_done",
      [check](int ordinal, uintptr_t event) {
        bool done = false;
        Error err;
        check(ipc::EventDone(ordinal, event, &done, &err), err);
        return done;
      },
      py::arg("ordinal"), py::arg("event"));
  m.def(
      "wait_ipc_event",
      [check](int ordinal, py::bytes handle, uintptr_t stream) {
        Error err;
        check(ipc::WaitIpcEvent(ordinal, std::string(handle), stream, &err),
              err);
      },
      py::arg("ordinal"), py::arg("handle"), py::arg("stream"),
      "Makes `stream` wait on the GPU for another process's interprocess "
      "event.");
  m.def(
      "new_event",
      [check](int ordinal, bool interprocess) {
        ipc::IpcEvent e;
        Error err;
        check(ipc::NewEvent(ordinal, interprocess, &e.event, &e.handle, &err),
              err);
        return e;
      },
      py::arg("ordinal"), py::arg("interprocess"),
      "A new event, never recorded (its handle empty unless interprocess); "
      "destroy_event frees it.");
  m.def(
      "record_event",
      [check](int ordinal, uintptr_t event, uintptr_t stream) {
        Error err;
        check(ipc::RecordEvent(ordinal, event, stream, &err), err);
      },
      py::arg("ordinal"), py::arg("event"), py::arg("stream"),
      "Records `event` again on `stream`.");
  m.def(
      "open_ipc_event",
      [check](int ordinal, py::bytes handle) {
        uintptr_t ev = 0;
        Error err;
        check(ipc::OpenIpcEvent(ordinal, std::string(handle), &ev, &err), err);
        return ev;
      },
      py::arg("ordinal"), py::arg("handle"),
      "Another process's interprocess event, opened (destroy_event closes "
      "it).");
  m.def(
      "wait_event",
      [check](int ordinal, uintptr_t event, uintptr_t stream) {
        Error err;
        check(ipc::WaitEvent(ordinal, event, stream, &err), err);
      },
      py::arg("ordinal"), py::arg("event"), py::arg("stream"),
      "Makes `stream` wait on the GPU for `event`'s latest record.");
  m.def(
      "synchronize",
      [check](int ordinal) {
        Error err;
        // The GIL is let go: other threads' deleters may need it meanwhile.
        bool ok;
        {
          py::gil_scoped_release release;
          ok = ipc::Synchronize(ordinal, &err);
        }
        check(ok, err);
      },
      py::arg("ordinal"),
      "Waits on the host for all work of the device's primary context.");
  m.def(
      "copy_async",
      [check](int ordinal, uintptr_t dst, uintptr_t src, size_t nbytes,
              uintptr_t stream) {
        Error err;
        check(ipc::CopyAsync(ordinal, dst, src, nbytes, stream, &err), err);
      },
      py::arg("ordinal"), py::arg("dst"), py::arg("src"), py::arg("nbytes"),
      py::arg("stream"));

  m.def(
      "strided_copy_handler",
      [](int ffi_major, int ffi_minor) {
        if (ffi_major != ffi::kApiMajor) {
          throw py::buffer_error(
              "this jaxlib speaks XLA FFI " + std::to_string(ffi_major) + "." +
              std::to_string(ffi_minor) + "; jax_overlay's strided copy "
              "kernel needs major version " + std::to_string(ffi::kApiMajor));
        }
        ffi::SetReportedMinor(ffi_minor);
        // A plain function pointer, valid for the life of the process.
        return py::capsule(reinterpret_cast<void*>(&ffi::StridedCopy),
                           "xla._CUSTOM_CALL_TARGET");
      },
      py::arg("ffi_major"), py::arg("ffi_minor"),
      "The XLA FFI handler of the strided copy, as a capsule for "
      "jax.ffi.register_ffi_target, reporting FFI version "
      "ffi_major.ffi_minor (those of the running jaxlib).");
  m.def(
      "prepare_strided_copy",
      [](int ordinal) {
        Error err;
        if (!strided::Prepare(ordinal, &err)) Raise(err);
      },
      py::arg("ordinal"),
      "JIT-compiles the strided copy kernels for CUDA device `ordinal` "
      "(BufferError when the driver cannot).");


#if JAX_OVERLAY_TESTING
  BindTestHooks(m);
#endif
  m.attr("TESTING") = static_cast<bool>(JAX_OVERLAY_TESTING);

  m.attr("DLPACK_VERSION") = py::make_tuple(dl::kMajorVersion, dl::kMinorVersion);
  m.attr("FLAG_READ_ONLY") = dl::kFlagReadOnly;
  m.attr("FLAG_IS_COPIED") = dl::kFlagIsCopied;
  // The DLPack device types both protocols' plans name memory with, and the
  // view alignment rules: stated once here, read by jax_overlay._vocab.
  m.attr("DL_CPU") = static_cast<int>(dl::kCPU);
  m.attr("DL_CUDA") = static_cast<int>(dl::kCUDA);
  m.attr("DL_CUDA_HOST") = static_cast<int>(dl::kCUDAHost);
  m.attr("DL_CUDA_MANAGED") = static_cast<int>(dl::kCUDAManaged);
  m.attr("GPU_ALIGNMENT") = kGpuAlignment;
  m.attr("HOST_ALIGNMENT") = kHostAlignment;
  m.def("view_alignment", &ViewAlignment, py::arg("dl_device_type"),
        "What a zero-copy view of memory of this DLPack device type needs of "
        "its pointer (both imports' one rule).");
  m.attr("HANDLE_POSIX_FD") = ipc::kHandlePosixFd;
  // capture_status's "not capturing", and exchange_capture_mode's relaxed
  // mode: the driver's values, named once (cuda_driver.h).
  m.attr("CAPTURE_NONE") = cuda::kCaptureNone;
  m.attr("CAPTURE_RELAXED") = cuda::kCaptureRelaxed;

  // What this module was built from, compared at import with the Python
  // package and the running jaxlib (jax_overlay/_native.py).
  m.attr("VERSION") = JAX_OVERLAY_VERSION;
  m.attr("ABI") = JAX_OVERLAY_ABI;
  m.attr("JAXLIB_RANGE") =
      py::make_tuple(JAX_OVERLAY_JAXLIB_MIN, JAX_OVERLAY_JAXLIB_BELOW);
  m.attr("JAXLIB_AT_BUILD") = JAX_OVERLAY_JAXLIB_AT_BUILD;
}
