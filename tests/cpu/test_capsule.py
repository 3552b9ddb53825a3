"""Capsule ownership: the producer lives exactly as long as the last
consumer, every deleter runs once, from any thread, at any time."""

import gc
import subprocess
import sys
import textwrap
import threading
import weakref

import jax
import numpy as np
import pytest

from jax_overlay import _runtime as rt
import forge as T
from jax_overlay import _xla_ext as ext


class Producer(T.HostCAI):
    """A CAI producer whose death can be observed."""


def fresh(shape=(4, 5), dtype=np.float32):
    a = T.aligned_empty(shape, dtype)
    a[...] = np.arange(a.size).reshape(shape).astype(dtype)
    return Producer(a)


pytestmark = pytest.mark.usefixtures("balanced")


def test_unconsumed_capsule_releases_owner_once():
    p = fresh()
    ref = weakref.ref(p)
    before = ext.released_tensors()
    cap = T.host_capsule(p)
    del p
    assert ref() is not None, "the capsule must keep the producer alive"
    del cap
    gc.collect()
    assert ref() is None
    assert ext.released_tensors() == before + 1


@pytest.mark.parametrize("versioned", [False, True])
def test_numpy_consumes_our_capsule(versioned):
    p = fresh()
    ref = weakref.ref(p)
    arr = np.from_dlpack(T.DLPackHolder(T.host_capsule(p, versioned)))
    assert arr.ctypes.data == p.array.ctypes.data
    np.testing.assert_array_equal(arr, p.array)
    del p
    gc.collect()
    assert ref() is not None, "numpy's view must keep the producer alive"
    del arr
    gc.collect()
    assert ref() is None


def test_versioned_flags_read_only():
    p = fresh()
    p.cai["data"] = (p.cai["data"][0], True)
    arr = np.from_dlpack(T.DLPackHolder(T.host_capsule(p, versioned=True)))
    assert not arr.flags.writeable, "READ_ONLY must reach the consumer"
    p2 = fresh()
    arr2 = np.from_dlpack(T.DLPackHolder(T.host_capsule(p2, versioned=True)))
    assert arr2.flags.writeable


def test_jax_consumer_holds_producer_until_buffer_freed():
    p = fresh()
    ref = weakref.ref(p)
    x = rt.capsule_to_array(T.host_capsule(p), jax.devices("cpu")[0], None, None, 1)
    assert x.unsafe_buffer_pointer() == p.array.ctypes.data
    y = x + 1  # a computation reading the view
    del p
    gc.collect()
    assert ref() is not None
    del x
    y.block_until_ready()
    # XLA's thread drops its hold on x just after y is ready.
    T.settle(lambda: ref() is None, "the producer must go when JAX frees the buffer")


def test_deleter_on_native_thread():
    p = fresh()
    ref = weakref.ref(p)
    cap = T.host_capsule(p)
    del p
    before = ext.released_tensors()
    ext._delete_on_native_thread(cap)
    gc.collect()
    assert ref() is None
    assert ext.released_tensors() == before + 1
    del cap  # renamed: its destructor must not call the deleter again
    gc.collect()
    assert ext.released_tensors() == before + 1


def test_deleters_from_many_threads():
    producers = [fresh((3,)) for _ in range(64)]
    refs = [weakref.ref(p) for p in producers]
    caps = [T.host_capsule(p) for p in producers]
    del producers
    threads = [threading.Thread(target=ext._delete_on_native_thread, args=(c,))
               for c in caps]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    gc.collect()
    assert all(r() is None for r in refs)


def test_deleter_preserves_pending_exception():
    p = fresh()
    cap = T.host_capsule(p)
    del p
    assert ext._delete_with_pending_error(cap) is True


def test_consumed_capsule_cannot_be_reused():
    cap = T.host_capsule(fresh())
    rt.capsule_to_array(cap, jax.devices("cpu")[0], None, None, 1)
    with pytest.raises(Exception, match="consumed at most once|used_dltensor"):
        rt.capsule_to_array(cap, jax.devices("cpu")[0], None, None, 1)
    with pytest.raises(BufferError, match="consumed once"):
        ext._delete_on_native_thread(cap)


@pytest.mark.parametrize("versioned", [True, False])
def test_chained_legacy_chains_the_deleter(versioned):
    p = fresh()
    ref = weakref.ref(p)
    vcap = T.host_capsule(p, versioned=versioned)
    del p
    legacy = ext.chained_legacy(vcap)
    with pytest.raises(ValueError):
        ext.chained_legacy(vcap)  # renamed: ownership moved
    x = rt.capsule_to_array(legacy, jax.devices("cpu")[0], None, None, 1)
    del vcap, legacy
    gc.collect()
    assert ref() is not None
    np.testing.assert_array_equal(np.asarray(x), np.arange(20).reshape(4, 5))
    del x
    gc.collect()
    assert ref() is None


def test_interpreter_exit_with_live_capsules_and_arrays():
    code = textwrap.dedent("""
        import threading, numpy as np, jax
        import forge as T
        from jax_overlay import _runtime as rt
        keep = []
        for i in range(20):
            a = T.aligned_empty((8,), np.float32); a[:] = i
            p = T.HostCAI(a)
            keep.append(T.host_capsule(p))
            keep.append(rt.capsule_to_array(T.host_capsule(p), jax.devices("cpu")[0], None, None, 1))
            keep.append(T.import_host(T.HostCAI(a[::2])))
        # Deleters that run while the interpreter is finalizing, on the
        # main thread (module teardown) and on a native thread.
        from jax_overlay import _xla_ext as ext
        import atexit
        late = T.host_capsule(T.HostCAI(T.aligned_empty((4,), np.float32)))
        atexit.register(ext._delete_on_native_thread, late)
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


@pytest.mark.parametrize("versioned", [True, False])
def test_plan_dlpack_import_hands_jaxlib_a_legacy_capsule(versioned):
    p = fresh((3, 4), np.int16)
    a = p.__cuda_array_interface__
    flags = ext.FLAG_IS_COPIED if versioned else 0
    cap = ext.raw_capsule(p, a["data"][0], [3, 4], None, "<i2", 1, 0, versioned, flags)
    plan = ext.plan_dlpack_import(cap)
    legacy, view, dl_type, dl_id, got_flags = (plan.capsule, plan.view, plan.device_type,
                                               plan.device_id, plan.flags)
    assert ext.capsule_info(legacy)["versioned"] is False
    assert legacy is not cap  # ours, chained to the producer's (see gil_handoff.h)
    assert (view.shape, view.data, view.typestr, view.layout) == ((3, 4), a["data"][0], "<i2", "row_major")
    assert (dl_type, dl_id, got_flags) == (1, 0, flags)
    with pytest.raises(BufferError, match="already consumed"):
        ext.capsule_info(cap)  # renamed: the legacy capsule owns the tensor now
    del legacy


def test_plan_dlpack_import_reports_strides_of_a_strided_tensor():
    p = fresh((4, 6), np.float32)
    cap = ext.raw_capsule(p, p.__cuda_array_interface__["data"][0], [2, 3], [12, 2], "<f4", 1, 0)
    view = ext.plan_dlpack_import(cap).view
    assert (view.layout, view.strides, view.numel) == ("strided", (12, 2), 6)


def test_plan_dlpack_import_errors():
    with pytest.raises(TypeError, match="expected a DLPack capsule"):
        ext.plan_dlpack_import(object())
    p = fresh((2,))
    cap = ext.raw_capsule(p, p.__cuda_array_interface__["data"][0], [2], None, "<f4", 1, 0)
    ext.release_capsule(cap)
    with pytest.raises(BufferError, match="already consumed"):
        ext.plan_dlpack_import(cap)


@pytest.mark.parametrize("versioned", [False, True])
@pytest.mark.parametrize("layout", ["compact", "strided", "0d", "offset", "empty"])
def test_capsule_data_is_capsule_infos_address(versioned, layout):
    base = np.arange(48, dtype=np.int16).reshape(6, 8)
    a = np.asarray({"compact": base, "strided": base[::2, 1::3], "0d": base[2, 3],
                    "offset": base.reshape(-1)[5:], "empty": base[:0]}[layout])
    cap = a.__dlpack__(max_version=(1, 0)) if versioned else a.__dlpack__()
    assert ext.capsule_data(cap) == ext.capsule_info(cap)["data"]
    if a.size:
        assert ext.capsule_data(cap) == a.ctypes.data
    np.testing.assert_array_equal(np.from_dlpack(T.DLPackHolder(cap)), a)  # not consumed


def test_capsule_data_refuses_what_capsule_info_refuses():
    with pytest.raises(TypeError, match="expected a DLPack capsule"):
        ext.capsule_data(object())
    p = fresh((2,))
    cap = ext.raw_capsule(p, p.__cuda_array_interface__["data"][0], [2], None, "<f4", 1, 0)
    ext.release_capsule(cap)
    with pytest.raises(BufferError, match="already consumed"):
        ext.capsule_data(cap)
    bad = ext.raw_capsule(p, 0, [2], None, "<f4", 1, 0)  # elements, and no address
    with pytest.raises(BufferError, match="null data pointer") as want:
        ext.capsule_info(bad)
    with pytest.raises(BufferError) as got:
        ext.capsule_data(bad)
    assert str(got.value) == str(want.value)
    ext.release_capsule(bad)


class _Owner:
    """A stand-in for the token a foreign call's view holds."""


@pytest.mark.parametrize("versioned", [False, True])
@pytest.mark.parametrize("layout", ["compact", "strided", "0d", "offset"])
def test_view_capsule_describes_the_same_memory_and_holds_the_owner(versioned, layout):
    base = np.arange(48, dtype=np.int16).reshape(6, 8)
    a = {"compact": base, "strided": base[::2, 1::3], "0d": base[2, 3],
         "offset": base.reshape(-1)[5:]}[layout]
    a = np.asarray(a)
    src = a.__dlpack__(max_version=(1, 0)) if versioned else a.__dlpack__()
    owner = _Owner()
    ref = weakref.ref(owner)
    view = ext.view_capsule(src, owner)
    info, want = ext.capsule_info(view), ext.capsule_info(src)
    assert info["versioned"] is False
    for k in ("data", "shape", "dtype", "device", "low", "span", "layout"):
        assert info[k] == want[k], k
    got = np.from_dlpack(T.DLPackHolder(view))
    np.testing.assert_array_equal(got, a)
    assert got.ctypes.data == a.ctypes.data
    # The input is left unconsumed and still usable.
    np.testing.assert_array_equal(np.from_dlpack(T.DLPackHolder(src)), a)
    del owner
    gc.collect()
    assert ref() is not None, "the consumer's array must hold the owner"
    del got
    gc.collect()
    assert ref() is None, "the owner must be released with the consumer's array"


def test_view_capsule_unconsumed_releases_owner_and_errors():
    owner = _Owner()
    ref = weakref.ref(owner)
    view = ext.view_capsule(np.ones(3).__dlpack__(), owner)
    del owner, view
    gc.collect()
    assert ref() is None, "an unconsumed view releases its owner"
    used = np.ones(3).__dlpack__()
    np.from_dlpack(T.DLPackHolder(used))
    with pytest.raises(BufferError, match="already consumed"):
        ext.view_capsule(used, None)
    with pytest.raises(TypeError, match="expected a DLPack capsule"):
        ext.view_capsule(np.ones(3), None)
