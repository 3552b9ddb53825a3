#include "gil_handoff.h"

#include <atomic>
#include <mutex>
#include <utility>
#include <vector>

namespace jxo {
namespace {

struct Work {
  void (*fn)(void*);
  void* arg;
};

std::mutex g_mu;
std::vector<Work>* g_queue = nullptr;  // never freed: deleters may run at exit
bool g_scheduled = false;              // a pending call is queued with CPython
std::atomic<bool> g_nonempty{false};
std::atomic<int64_t> g_handed{0};
std::atomic<int64_t> g_run{0};

bool Finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

void RunOne(const Work& w) {
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);
  w.fn(w.arg);
  PyErr_Restore(type, value, tb);
}

int PendingCall(void*) {
  {
    std::lock_guard<std::mutex> lock(g_mu);
    g_scheduled = false;
  }
  RunHandedOff();
  return 0;
}

}  // namespace

void WithGil(void (*fn)(void*), void* arg) {
  if (Finalizing()) return;
  if (PyGILState_Check()) {
    RunOne({fn, arg});
    return;
  }
  if (PyGILState_GetThisThreadState() != nullptr) {
    // A Python thread that let the GIL go (inside a JAX call, say): CPython
    // owns its fate at exit, as for any of its threads.
    PyGILState_STATE gil = PyGILState_Ensure();
    RunOne({fn, arg});
    PyGILState_Release(gil);
    return;
  }
  bool schedule;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (!g_queue) g_queue = new std::vector<Work>();
    g_queue->push_back({fn, arg});
    g_nonempty.store(true, std::memory_order_release);
    schedule = !g_scheduled;
    g_scheduled = true;
  }
  g_handed.fetch_add(1, std::memory_order_relaxed);
  // Needs neither the GIL nor a thread state.  A full CPython queue (-1) is
  // harmless: the work stays queued for the next hand-off or entry point.
  if (schedule && Py_AddPendingCall(PendingCall, nullptr) != 0) {
    std::lock_guard<std::mutex> lock(g_mu);
    g_scheduled = false;
  }
}

void RunHandedOff() {
  if (!g_nonempty.load(std::memory_order_acquire)) return;
  std::vector<Work> work;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    work.swap(*g_queue);
    g_nonempty.store(false, std::memory_order_release);
  }
  // Outside the lock: a deleter may free an array whose own deleter hands
  // off more work.
  for (const Work& w : work) {
    RunOne(w);
    g_run.fetch_add(1, std::memory_order_relaxed);
  }
}

int64_t HandedOff() { return g_handed.load(); }
int64_t HandedOffRun() { return g_run.load(); }

}  // namespace jxo
