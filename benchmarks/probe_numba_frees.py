"""Reads of JAX arrays over Numba mapped (pinned) and managed arrays, while
Numba frees its dead arrays in batches (every CUDA_DEALLOCS_COUNT = 10).

Each trial makes a fresh Numba array, imports it with jnp.asarray (the
producer object dropped at once, as user code does), reads it back to the
host, and counts: ok, wrong values, or an error on the read.  Phases, same
process, in this order:
  A  installed, device=GPU: the CAI, a view that holds the producer
  B  stock,     device=GPU: the CAI, a view that does not hold it (reads
                may see pages Numba has freed)
  C  installed after stock
  D  installed, device=None: jnp.array's NumPy fast path, a host copy,
     on stock and installed alike (a mapped array is a NumPy array)
  E  installed, with Numba's batch frees deferred (numba.cuda.defer_cleanup)
  G  stock, a plain NumPy copy of each array imported (no CUDA memory in
     the import at all), Numba's frees as usual: failures here would be
     the frees breaking reads of unrelated buffers
  F  control without JAX: cupy.asarray of the same kind of array (through
     its CUDA Array Interface, a view),
     read with cupy.asnumpy (skipped without CuPy)

    python benchmarks/probe_numba_frees.py [--trials 150]
"""

from __future__ import annotations

import collections
import contextlib
import gc

import harness  # first: XLA's allocator setting, before jax loads

import jax
import jax.numpy as jnp
import numpy as np
from numba import cuda
from numba.core import config as numba_config

import jax_overlay
from _internals import _xla_ext as ext

HOST = (np.arange(128) % 7).astype(np.int16).reshape(8, 16)


def make(alloc):
    m = alloc(HOST.shape, HOST.dtype)
    m[...] = HOST  # written by the host: no producer stream
    return m


def outcome(read, r):
    try:
        return "ok" if np.array_equal(read(r), HOST) else "wrong"
    except Exception as e:  # noqa: BLE001 - counted, with its first words
        return f"error {type(e).__name__}: {str(e).splitlines()[0][:60]}"


class FreeLog:
    """Numba's batch frees, recorded: the handles freed and how many
    batches ran, so a failed read can be set against them."""

    def __init__(self):
        self.freed = set()
        self.batches = 0
        ctx = cuda.current_context()
        # Memory goes to the memory manager's queue (numba-cuda 0.30), streams
        # and events to the context's: both are recorded.
        queues = {id(q): q for q in (getattr(getattr(ctx, "memory_manager", None),
                                             "deallocations", None), ctx.deallocations)
                  if q is not None}
        for q in queues.values():
            self._hook(q)

    def _hook(self, deallocs):
        add, clear = deallocs.add_item, deallocs.clear
        pending = []

        def add_item(dtor, handle, *a, **k):
            pending.append(_as_int(handle))
            return add(dtor, handle, *a, **k)

        def clear_all():
            if not deallocs.is_disabled and pending:
                self.batches += 1
                self.freed.update(pending)
                pending.clear()
            return clear()

        deallocs.add_item, deallocs.clear = add_item, clear_all


def _as_int(handle):
    for get in (lambda h: h.value, int, lambda h: int(h.getPtr())):
        try:
            v = get(handle)
            if v is not None:
                return int(v)
        except Exception:  # noqa: BLE001 - the handle types differ by binding
            pass
    return None


def _info(ptr):
    try:
        return ext.pointer_info(ptr).kind
    except Exception as e:  # noqa: BLE001 - reported as is
        return f"{type(e).__name__}"


def _ptr(r):
    try:
        return r.unsafe_buffer_pointer()
    except Exception:  # noqa: BLE001 - a CuPy array, or no single buffer
        return getattr(getattr(r, "data", None), "ptr", None)


def phase(name, trials, imp, read, log, context=contextlib.nullcontext, detail=4):
    counts = collections.Counter()
    failed = collections.defaultdict(list)  # the trials whose read failed: their cadence
    notes = []
    handed = ext.handed_off()
    with context():
        for alloc in (cuda.mapped_array, cuda.managed_array):
            for i in range(trials):
                m = make(alloc)
                src = m.__cuda_array_interface__["data"][0]
                batches = log.batches
                r = imp(m)
                del m
                gc.collect()
                got = outcome(read, r)
                counts[(alloc.__name__, got)] += 1
                if got != "ok":
                    failed[alloc.__name__].append(i)
                    if len(notes) < detail:
                        # What the failed read was over: the producer's
                        # pointer (freed by Numba yet? a CUDA allocation
                        # still?), the result's, the batch frees during the
                        # trial, and whether a second read fails too.
                        dst = _ptr(r)
                        notes.append(
                            f"    {alloc.__name__} trial {i}: producer {src:#x} "
                            f"freed by Numba {src in log.freed} now {_info(src)}; "
                            f"result {dst if dst is None else hex(dst)} "
                            f"{'same' if dst == src else 'other'} now "
                            f"{None if dst is None else _info(dst)}; batch frees in "
                            f"trial {log.batches - batches}; second read "
                            f"{outcome(read, r)}")
                del r
    print(f"{name}: " + ", ".join(f"{a} {o} {n}" for (a, o), n in sorted(counts.items())),
          flush=True)
    for a, idx in failed.items():
        print(f"    {a} failed at trials {idx[:20]}")
    for n in notes:
        print(n)
    # Producer releases our deleters handed to the main thread (0 when
    # every release ran on a Python thread).
    print(f"    deleters handed to the main thread: {ext.handed_off() - handed}", flush=True)


def main():
    p = harness.arguments(__doc__)
    p.add_argument("--trials", type=int, default=150)
    args = p.parse_args()
    gpu = jax.devices("cuda")[0]
    print(f"# {args.trials} trials per kind; jax {jax.__version__}, numba-cuda "
          f"{getattr(cuda, '__version__', '?')}, CUDA_DEALLOCS_COUNT "
          f"{getattr(numba_config, 'CUDA_DEALLOCS_COUNT', '?')}")
    on_gpu = lambda m: jnp.asarray(m, device=gpu)  # noqa: E731
    log = FreeLog()
    try:
        jax_overlay.install()
        phase("A installed, device=GPU", args.trials, on_gpu, np.asarray, log)
        jax_overlay.uninstall()
        phase("B stock, device=GPU", args.trials, on_gpu, np.asarray, log)
        jax_overlay.install()
        phase("C installed after stock", args.trials, on_gpu, np.asarray, log)
        phase("D installed, device=None", args.trials, jnp.asarray, np.asarray, log)
        phase("E installed, frees deferred", args.trials, on_gpu, np.asarray, log, cuda.defer_cleanup)
    finally:
        jax_overlay.uninstall()
    phase("G stock, a NumPy copy imported", args.trials,
          lambda m: jnp.asarray(np.array(m), device=gpu), np.asarray, log)
    try:
        import cupy as cp
    except ImportError:
        print("F control (CuPy): skipped, no CuPy")
        return
    phase("F control, CuPy cupy.asarray", args.trials, cp.asarray, cp.asnumpy, log)


if __name__ == "__main__":
    main()
