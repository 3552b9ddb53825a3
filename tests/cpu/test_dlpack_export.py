"""DLPack export on the CPU: versions, flags, dtypes, copies, devices,
streams, lifetimes and donation."""

import gc
import weakref

import jax
import jax.numpy as jnp
from jax._src.lib import version as _jaxlib_version
import ml_dtypes
import numpy as np
import pytest

import jax_overlay
from jax_overlay import _dlpack as E
from jax_overlay import _runtime as rt
import forge as T
from jax_overlay import _xla_ext as ext

CPU = jax.devices("cpu")[0]


def on_cpu(x):
    return jax.device_put(x, CPU)


pytestmark = pytest.mark.usefixtures("balanced")


def test_versioned_read_only_view_for_numpy():
    x = on_cpu(jnp.arange(6.0).reshape(2, 3))
    cap = E.to_dlpack(x, max_version=(1, 1))
    info = ext.capsule_info(cap)
    assert info["versioned"] and info["version"] == (1, 1)
    assert info["flags"] == ext.FLAG_READ_ONLY
    a = np.from_dlpack(T.DLPackHolder(cap))
    assert not a.flags.writeable
    assert a.ctypes.data == x.unsafe_buffer_pointer()
    np.testing.assert_array_equal(a, np.asarray(x))


@pytest.mark.parametrize("max_version", [None, (0, 8)])
def test_legacy_capsule_for_old_consumers(max_version):
    cap = E.to_dlpack(on_cpu(jnp.ones(3)), max_version=max_version)
    assert ext.capsule_info(cap)["versioned"] is False


def test_newer_consumer_gets_our_newest():
    cap = E.to_dlpack(on_cpu(jnp.ones(3)), max_version=(2, 0))
    assert ext.capsule_info(cap)["version"] == (1, 1)


def test_copy_sets_is_copied():
    x = on_cpu(jnp.arange(4.0))
    cap = E.to_dlpack(x, max_version=(1, 0), copy=True)
    info = ext.capsule_info(cap)
    assert info["flags"] == ext.FLAG_READ_ONLY | ext.FLAG_IS_COPIED
    assert info["data"] != x.unsafe_buffer_pointer()
    np.testing.assert_array_equal(np.from_dlpack(T.DLPackHolder(cap)), np.arange(4.0))


@pytest.mark.parametrize("dtype,code", [
    (jnp.bool_, (6, 8, 1)), (jnp.int8, (0, 8, 1)), (jnp.uint32, (1, 32, 1)),
    (jnp.float16, (2, 16, 1)), (jnp.float32, (2, 32, 1)), (jnp.complex64, (5, 64, 1)),
    (jnp.bfloat16, (4, 16, 1)), (ml_dtypes.float8_e4m3fn, (10, 8, 1)),
    (ml_dtypes.float8_e5m2, (12, 8, 1))])
def test_dtype_codes(dtype, code):
    cap = E.to_dlpack(on_cpu(jnp.zeros(4, dtype)), max_version=(1, 0))
    assert ext.capsule_info(cap)["dtype"] == code


def test_sub_byte_types_are_refused():
    with pytest.raises(BufferError, match="int4"):
        E.to_dlpack(on_cpu(jnp.zeros(4, jnp.int4)))


def test_round_trip_through_our_import_is_zero_copy():
    x = on_cpu(jnp.arange(12.0).reshape(3, 4))
    y = jax_overlay.from_dlpack(E.to_dlpack(x, max_version=(1, 1)))
    assert y.unsafe_buffer_pointer() == x.unsafe_buffer_pointer()
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))


def test_non_row_major_layout_exports_strides():
    base = T.aligned_empty((6, 4), np.float32).T
    base[...] = np.arange(24).reshape(4, 6)
    x = T.import_host(T.HostCAI(base))
    info = ext.capsule_info(E.to_dlpack(x, max_version=(1, 0)))
    assert info["strides"] == (1, 4) and info["layout"] == "permuted"
    np.testing.assert_array_equal(np.from_dlpack(T.DLPackHolder(E.to_dlpack(x))), base)


def test_the_array_lives_while_the_capsule_does():
    x = on_cpu(jnp.arange(8.0))
    ref = weakref.ref(x)
    cap = E.to_dlpack(x, max_version=(1, 0))
    del x
    gc.collect()
    assert ref() is not None
    del cap
    gc.collect()
    assert ref() is None


# From jaxlib 0.12.1 XLA:CPU deletes an input it was asked to donate even
# where an external reference made it copy instead (its ExecuteLaunch
# deletes the input it only held for use): stock's own __dlpack__ too.
DONATION_DELETES_HELD = _jaxlib_version >= (0, 12, 1)


def test_export_blocks_donation_while_held():
    """What a consumer holds is never XLA's to reuse: the donating call
    copies (4 MiB: XLA:CPU reuses a donated buffer that size) and the view
    keeps its values.  Up to jaxlib 0.12.0 the array lives on as well; from
    0.12.1 it is marked donated, its buffer kept for the consumer."""
    x = on_cpu(jnp.arange(1 << 20, dtype=jnp.float32))
    ptr = x.unsafe_buffer_pointer()
    view = np.from_dlpack(T.DLPackHolder(E.to_dlpack(x, max_version=(1, 0))))
    y = jax.jit(lambda v: v + 1, donate_argnums=0)(x).block_until_ready()
    assert y.unsafe_buffer_pointer() != ptr, "XLA reused a buffer a consumer holds"
    assert x.is_deleted() == DONATION_DELETES_HELD
    churn = [jnp.full(1 << 20, -1.0).block_until_ready() for _ in range(8)]
    assert ptr not in {c.unsafe_buffer_pointer() for c in churn}
    np.testing.assert_array_equal(view, np.arange(1 << 20, dtype=np.float32))
    np.testing.assert_array_equal(y, np.arange(1 << 20, dtype=np.float32) + 1)


_DELETE_WHILE_HELD = """
import gc, sys, jax.numpy as jnp, numpy as np, jax_overlay
class Holder:
    def __init__(self, cap): self.cap = cap
    def __dlpack__(self, **kw): return self.cap
    def __dlpack_device__(self): return (1, 0)
x = jnp.arange(1 << 20, dtype=jnp.float32) + 0
ptr = x.unsafe_buffer_pointer()
view = np.from_dlpack(Holder(jax_overlay.to_dlpack(x, max_version=(1, 0))))
x.delete()  # the user's, while the consumer still holds the view
churn = [jnp.full(1 << 20, -1.0).block_until_ready() for _ in range(16)]
assert ptr not in {c.unsafe_buffer_pointer() for c in churn}, "reused while held"
assert (view == np.arange(1 << 20, dtype=np.float32)).all(), "the view changed"
del view; gc.collect()
print("ok")
"""


def test_delete_while_a_consumer_holds_the_export():
    """x.delete() while a consumer holds our export: no abort (jaxlib's
    CHECK on an external reference taken through x itself, which killed
    the process), the buffer kept for the view until it is let go; stock's
    __dlpack__ behaves so too.  In a subprocess: the failure is an abort."""
    import os
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", _DELETE_WHILE_HELD], capture_output=True,
                       text=True, timeout=120, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.returncode, r.stderr[-2000:])


@pytest.mark.parametrize("stream", [1.5, "1", 2**64])
def test_bad_streams(stream):
    # What jaxlib cannot take as a stream: its TypeError, and the protocol's
    # BufferError.
    with pytest.raises(BufferError, match="stream=") as e:
        E.to_dlpack(on_cpu(jnp.ones(2)), stream=stream)
    assert isinstance(e.value, TypeError)


@pytest.mark.parametrize("stream", [None, -1, 0, 1, 2, -2, True])
def test_cpu_arrays_serve_any_stream(stream):
    """A host reader has no stream to be ordered on: the host waits for the
    array instead.  Stock jaxlib serves a stream for a view of host memory
    and refuses it for a buffer of its own; the overlay serves both."""
    x = on_cpu(jnp.ones(2) + 1)  # a buffer of XLA's own
    cap = E.to_dlpack(x, stream=stream)
    np.testing.assert_array_equal(np.from_dlpack(T.DLPackHolder(cap)), [2.0, 2.0])


def test_dl_device_rules():
    x = on_cpu(jnp.ones(2))
    cap = E.to_dlpack(x, dl_device=(1, 0), copy=False)
    assert ext.capsule_info(cap)["data"] == x.unsafe_buffer_pointer()
    # As stock JAX: the requested device is looked up first, so without a
    # CUDA backend that is the error (a RuntimeError) whatever copy= says.
    with pytest.raises(RuntimeError, match="no cuda device 0"):
        E.to_dlpack(x, dl_device=(2, 0), copy=False)
    with pytest.raises(BufferError, match="device type 4 is not one JAX exports to"):
        E.to_dlpack(x, dl_device=(4, 0))


def test_deleted_and_not_arrays():
    x = on_cpu(jnp.ones(2))
    x.delete()
    with pytest.raises(BufferError, match="deleted or donated"):
        E.to_dlpack(x)
    with pytest.raises(TypeError, match="expected a jax.Array"):
        E.to_dlpack(np.ones(2))


@pytest.mark.parametrize("kwargs,words", [
    (dict(max_version="ab"), "max_version='ab'"),
    (dict(max_version=1), "max_version=1"), (dict(dl_device=(1,)), "dl_device=(1,)"),
    (dict(dl_device=True), "dl_device=True")])
def test_malformed_requests_are_type_errors(kwargs, words):
    """Found by fuzzing: an IndexError or a TypeError/ValueError that named
    nothing."""
    with pytest.raises(TypeError, match=words.replace("(", r"\(").replace(")", r"\)")):
        E.to_dlpack(on_cpu(jnp.ones(3)), **kwargs)


def test_a_device_type_stock_does_not_map_is_its_buffer_error():
    """'1:' unpacks into two characters, as stock unpacks it, and '1' is no
    device type in stock's table: its BufferError, naming the request."""
    with pytest.raises(BufferError, match="dl_device='1:'"):
        E.to_dlpack(on_cpu(jnp.ones(3)), dl_device="1:")


def test_loose_requests_are_read_as_stock_reads_them():
    """What stock JAX accepts: copy= by its truth, max_version compared as a
    tuple ((1,) < (1, 0): a legacy capsule), dl_device of integral floats,
    and a falsy dl_device or a device type 0 naming no device."""
    x = on_cpu(jnp.arange(3.0))
    copied = ext.capsule_info(E.to_dlpack(x, max_version=(1, 0), copy="yes"))
    assert copied["flags"] & ext.FLAG_IS_COPIED and copied["data"] != x.unsafe_buffer_pointer()
    same = ext.capsule_info(E.to_dlpack(x, max_version=(1, 0), copy=0))
    assert same["data"] == x.unsafe_buffer_pointer()
    if rt.NATIVE_DLPACK_1:
        # jaxlib 0.12 takes max_version itself: two ints or its TypeError.
        for odd in [(1,), (1, 0, 0), (1.0, 0)]:
            with pytest.raises(TypeError, match="max_version="):
                E.to_dlpack(x, max_version=odd)
    else:
        assert not ext.capsule_info(E.to_dlpack(x, max_version=(1,)))["versioned"]
        assert ext.capsule_info(E.to_dlpack(x, max_version=(1, 0, 0)))["versioned"]
    for device in [(1.0, 0), (), 0, (0, 5)]:
        info = ext.capsule_info(E.to_dlpack(x, dl_device=device))
        assert info["device"] == (1, 0) and info["data"] == x.unsafe_buffer_pointer()


def test_dl_device_on_a_gpu_jax_does_not_see():
    if any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("this checks the error where no GPU is visible")
    with pytest.raises(BufferError, match=r"dl_device=\(2, 0\)"):
        E.to_dlpack(on_cpu(jnp.ones(3)), dl_device=(2, 0))


def test_ready_array_export_is_remembered_and_forgotten():
    """A ready array's second export comes from the remembered facts: the
    same capsule as the first, its reference to the array held; a deleted
    array is refused, and a dead array's entry is dropped."""
    x = on_cpu(jnp.arange(6.0).reshape(2, 3)).block_until_ready()
    first = ext.capsule_info(E.to_dlpack(x, max_version=(1, 0)))
    assert id(x) in E._dl_ready_facts
    again = ext.capsule_info(E.to_dlpack(x, max_version=(1, 0)))
    assert again == first
    np.testing.assert_array_equal(np.from_dlpack(x), np.arange(6.0).reshape(2, 3))
    legacy = ext.capsule_info(E.to_dlpack(x))
    assert legacy["data"] == first["data"] and legacy != first  # legacy vs versioned
    with pytest.raises(TypeError, match="max_version"):
        E.to_dlpack(x, max_version="1.0")
    key = id(x)
    x.delete()
    with pytest.raises(BufferError, match="deleted or donated"):
        E.to_dlpack(x)
    del x
    gc.collect()
    assert key not in E._dl_ready_facts
