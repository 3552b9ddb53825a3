"""Threads: eight threads importing and exporting at once, deleters fired
from native threads and XLA's own threads while that goes on, and
interpreter exit with all of it still alive.  (test_capsule.py has the
single-deleter cases: one native thread, a pending exception, a plain exit.)

Rounds per thread: JAX_OVERLAY_THREAD_ROUNDS (CI: 300).
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading
import weakref

import jax
import numpy as np
import pytest

import jax_overlay
from jax_overlay import _dlpack as E
import forge as T
from jax_overlay import _xla_ext as ext

ROUNDS = int(os.environ.get("JAX_OVERLAY_THREAD_ROUNDS") or 300)
THREADS = 8
CPU = jax.devices("cpu")[0]


def filled(shape, seed):
    a = T.aligned_empty(shape, np.float32)
    a[...] = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return a


def worker_ops(k):
    """The operations thread `k` cycles through, each returning (result,
    expected): every import and export path the CPU can run."""
    a = filled((32, 48), k)
    producer = T.HostCAI(a)
    strided = T.HostCAI(a[::2, ::3], strides=a[::2, ::3].strides)
    x = jax.device_put(a, CPU)
    x.block_until_ready()

    class Holder:  # a CAI export of x, holding x as the protocol asks
        def __init__(self):
            self.__cuda_array_interface__ = T.host_cai(x)
            self.x = x

    return [
        lambda: (T.import_host(producer), a),
        lambda: (T.import_host(strided), a[::2, ::3]),
        lambda: (jax_overlay.from_dlpack(a), a),
        lambda: (jax_overlay.from_dlpack(T.host_capsule(producer, versioned=True)), a),
        lambda: (np.from_dlpack(T.DLPackHolder(E.to_dlpack(x, max_version=(1, 1)))), a),
        lambda: (np.from_dlpack(T.DLPackHolder(E.to_dlpack(x))), a),
        lambda: (T.import_host(Holder()), a),
        lambda: (T.import_host(producer) * 2, a * 2),  # a computation reading a view
    ], (producer, strided, x)


@pytest.mark.usefixtures("balanced")
def test_eight_threads_import_and_export_at_once():
    start = threading.Barrier(THREADS)
    errors, done = [], [0] * THREADS
    keep = []

    def run(k):
        try:
            ops, owners = worker_ops(k)
            keep.append(weakref.ref(owners[0]))
            start.wait()
            for i in range(ROUNDS):
                out, want = ops[i % len(ops)]()
                np.testing.assert_array_equal(np.asarray(out), want)
                done[k] += 1
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(f"thread {k}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=run, args=(k,)) for k in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert done == [ROUNDS] * THREADS
    T.settle(lambda: all(r() is None for r in keep), "a producer outlived every import")


@pytest.mark.usefixtures("balanced")
def test_native_thread_deleters_while_threads_import():
    """Deleters taking the GIL from native threads, while eight Python
    threads import: every producer is released exactly once."""
    n = THREADS * ROUNDS // 4
    producers = [T.HostCAI(filled((8,), i)) for i in range(n)]
    refs = [weakref.ref(p) for p in producers]
    capsules = [T.host_capsule(p, versioned=bool(i % 2)) for i, p in enumerate(producers)]
    del producers
    before = ext.released_tensors()
    stop = threading.Event()
    errors = []

    def importer(k):
        a = filled((16,), k)
        p = T.HostCAI(a)
        while not stop.is_set():
            try:
                np.testing.assert_array_equal(np.asarray(T.import_host(p)), a)
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
                return

    def deleter(chunk):
        for cap in chunk:
            ext._delete_on_native_thread(cap)  # a new native thread per deleter

    importers = [threading.Thread(target=importer, args=(k,)) for k in range(THREADS // 2)]
    deleters = [threading.Thread(target=deleter, args=(capsules[k::THREADS // 2],))
                for k in range(THREADS // 2)]
    for t in importers + deleters:
        t.start()
    for t in deleters:
        t.join()
    stop.set()
    for t in importers:
        t.join()
    assert not errors, errors[:3]
    del capsules  # renamed by their consumers: their destructors must do nothing
    gc.collect()
    assert ext.released_tensors() - before >= n
    assert all(r() is None for r in refs)


@pytest.mark.usefixtures("balanced")
def test_deleters_from_xla_threads():
    """Views freed by XLA when the computations reading them finish, on its
    own threads, while Python threads keep importing: the forged producers'
    deleters (ctypes callbacks, which take the GIL) each run exactly once, and
    only on Python's threads: a thread XLA owns hands them to the main thread
    (taking the GIL there could kill it at exit and abort the process)."""
    n = THREADS * ROUNDS // 4
    keys, results, errors = [], [], []
    python_threads = {threading.get_ident()}
    lock = threading.Lock()

    def work(k):
        python_threads.add(threading.get_ident())
        try:
            for i in range(n // THREADS):
                a = filled((64, 64), k * n + i)
                cap, key = T.forge_capsule(data=a.ctypes.data, shape=a.shape, keep=a,
                                           versioned=bool(i % 2))
                x = jax_overlay.from_dlpack(cap)
                del cap, a
                y = (x @ x.T).sum()  # reads x on XLA's threads: x's last user
                del x
                with lock:
                    keys.append(key)
                    results.append(y)
        except BaseException as e:  # noqa: BLE001
            errors.append(f"thread {k}: {type(e).__name__}: {e}")

    T.forged_delete_threads.clear()
    handed = ext.handed_off()
    ts = [threading.Thread(target=work, args=(k,)) for k in range(THREADS)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    for y in results:
        y.block_until_ready()
    del results
    assert not errors, errors[:3]

    def all_ran():
        # XLA's thread drops its hold on each x just after its result is ready.
        ext.run_handed_off()
        return all(T.forged_deletes.get(k, 0) >= 1 for k in keys)

    T.settle(all_ran, "a deleter never ran")
    ext.run_handed_off()
    assert all(T.forged_deletes.get(k) == 1 for k in keys), "a deleter ran twice"
    assert T.forged_deletes.get(-1, 0) == 0
    assert T.forged_delete_threads <= python_threads, "a producer's deleter ran on XLA's thread"
    print(f"{len(keys)} deleters ran on {len(T.forged_delete_threads)} Python threads; "
          f"{ext.handed_off() - handed} handed over from threads XLA owns")


EXIT_SCRIPT = textwrap.dedent("""
    import threading, numpy as np, jax
    import forge as T
    import jax_overlay as D
    from jax_overlay import _dlpack as E, _xla_ext as ext
    cpu = jax.devices("cpu")[0]
    keep = []
    for i in range(50):
        a = T.aligned_empty((64, 64), np.float32); a[...] = i
        p = T.HostCAI(a)
        keep.append(T.host_capsule(p, versioned=bool(i % 2)))          # unconsumed capsules
        keep.append(D.from_dlpack(T.host_capsule(p, versioned=True)))  # live imported views
        keep.append(T.import_host(T.HostCAI(a[::2], strides=a[::2].strides)))
        keep.append(T.forge_capsule(data=a.ctypes.data, shape=a.shape, keep=a)[0])
        keep.append(D.from_dlpack(T.forge_capsule(data=a.ctypes.data, shape=a.shape,
                                                  keep=a)[0]))  # a foreign producer's view
        x = jax.device_put(a, cpu)
        keep.append(E.to_dlpack(x, max_version=(1, 1)))    # exported, never consumed
        keep.append(T.import_host(p) @ T.import_host(p))   # computations maybe pending

    def work(k):
        # Non-daemon: still importing and exporting when the main thread
        # ends; the interpreter waits for them, then exits with their
        # results alive.
        a = T.aligned_empty((32,), np.float32); a[...] = k
        p = T.HostCAI(a)
        for i in range(200):
            x = T.import_host(p)
            keep.append(np.from_dlpack(T.DLPackHolder(E.to_dlpack(x))))
            keep.append(D.from_dlpack(T.host_capsule(p, versioned=True)) + 1)

    def native(k):
        # Daemon: stopped wherever it is at exit, inside jax_overlay's own
        # calls, firing deleters from new native threads.  (A daemon thread
        # inside a JAX computation at exit aborts the process on stock jax
        # too, so JAX calls stay in the threads above.)
        a = T.aligned_empty((32,), np.float32); a[...] = k
        p = T.HostCAI(a)
        while True:
            ext._delete_on_native_thread(T.host_capsule(p, versioned=bool(k % 2)))
            keep.append(T.host_capsule(p))
            ext.parse_cai(p.cai)

    for k in range(8):
        threading.Thread(target=work, args=(k,)).start()
        threading.Thread(target=native, args=(k,), daemon=True).start()
    import atexit
    late = T.host_capsule(T.HostCAI(T.aligned_empty((4,), np.float32)))
    atexit.register(ext._delete_on_native_thread, late)  # a deleter during shutdown
    print("ok", flush=True)
""")


def test_interpreter_exit_with_everything_alive():
    """Exit with unconsumed capsules (ours, versioned, legacy and a foreign
    producer's), live imported views and copies, unconsumed exports,
    pending computations, eight threads still importing and exporting, and
    eight daemon threads stopped inside jax_overlay's calls while firing
    native-thread deleters: no crash, no hang."""
    r = subprocess.run([sys.executable, "-c", EXIT_SCRIPT], capture_output=True, text=True,
                       timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "ok"
