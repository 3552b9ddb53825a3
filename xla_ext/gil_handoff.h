// Python work that a deleter must do (a Py_DECREF, a foreign producer's own
// deleter) when the deleter may run on any thread.
//
// A thread that CPython does not know (an XLA worker, a CUDA callback
// thread) must never take the GIL itself: while the interpreter is
// finalizing, PyGILState_Ensure ends such a thread with pthread_exit, and the
// forced unwind through the caller's noexcept frames (XLA's buffer
// destructors) aborts the process with "terminate called without an active
// exception".  Checking Py_IsFinalizing() first leaves a race, so such
// threads hand the work to the main thread (Py_AddPendingCall) instead.
#ifndef JAX_OVERLAY_XLA_EXT_GIL_HANDOFF_H_
#define JAX_OVERLAY_XLA_EXT_GIL_HANDOFF_H_

#include <Python.h>

#include <cstdint>

namespace jxo {

// Runs fn(arg) with the GIL held and the caller's Python error preserved:
// now, on a thread that holds the GIL or has a Python thread state (taking
// the GIL if needed); later, on the main thread, from a thread CPython does
// not know.  Once the interpreter is finalizing nothing runs: the process is
// going away, and leaking is the only safe outcome.
void WithGil(void (*fn)(void*), void* arg);

// Runs the work handed off so far.  Requires the GIL.  The main thread runs
// it by itself as soon as it executes Python code; jax_overlay's entry points
// call this too, so a main thread blocked in C does not hold producers alive
// while other threads keep working.
void RunHandedOff();

// Counters for tests: work items handed to the main thread, and run there.
int64_t HandedOff();
int64_t HandedOffRun();

}  // namespace jxo

#endif  // JAX_OVERLAY_XLA_EXT_GIL_HANDOFF_H_
