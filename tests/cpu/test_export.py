"""The CAI export's dict builder, switches and errors, on real JAX buffers
(host memory stands in for the GPU where a test allows it)."""

import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_overlay
from jax_overlay import _config
from jax_overlay import _cai
from jax_overlay import _runtime as rt
import forge as T


CPU = jax.devices("cpu")[0]


def on_cpu(x):
    return jax.device_put(x, CPU)


@pytest.fixture
def orders(monkeypatch):
    calls = []
    monkeypatch.setattr(rt, "order_stream_after", lambda x, s: calls.append(s))
    return calls


@pytest.mark.parametrize("dtype,typestr", [
    (np.bool_, "|b1"), (np.int8, "|i1"), (np.uint8, "|u1"), (np.int16, "<i2"),
    (np.int32, "<i4"), (np.uint32, "<u4"), (np.float16, "<f2"),
    (np.float32, "<f4"), (np.complex64, "<c8")])
def test_dict_fields(dtype, typestr):
    x = on_cpu(jnp.zeros((2, 3), dtype))
    x.block_until_ready()  # a ready array needs no stream
    d = T.host_cai(x)
    assert d == {"shape": (2, 3), "typestr": typestr,
                 "data": (x.unsafe_buffer_pointer(), False), "version": 3,
                 "strides": None, "stream": None, "descr": [("", typestr)]}


def test_x64_dtypes():
    jax.config.update("jax_enable_x64", True)
    try:
        for dt, ts in [(np.int64, "<i8"), (np.float64, "<f8"), (np.complex128, "<c16")]:
            assert T.host_cai(jnp.zeros(2, dt))["typestr"] == ts
    finally:
        jax.config.update("jax_enable_x64", False)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, ml_dtypes.float8_e4m3fn,
                                   ml_dtypes.float8_e5m2, jnp.int4])
def test_inexpressible_dtypes(dtype):
    x = jnp.zeros(4, dtype)
    with pytest.raises(AttributeError, match="DLPack") as e:
        T.host_cai(x)
    assert str(np.dtype(dtype)) in str(e.value)


def test_non_row_major_layouts_give_strides():
    base = T.aligned_empty((6, 4), np.float32).T  # an F-order (4, 6) view
    base[...] = np.arange(24).reshape(4, 6)
    x = T.import_host(T.HostCAI(base))  # keeps the column-major layout
    assert x.unsafe_buffer_pointer() == base.ctypes.data
    d = T.host_cai(x)
    assert d["strides"] == base.strides == (4, 16)
    back = T.import_host(T.HostCAI(base))
    np.testing.assert_array_equal(np.asarray(back), base)
    three = T.aligned_empty((2, 3, 4), np.int16).transpose(2, 0, 1)
    three[...] = np.arange(24).reshape(4, 2, 3)
    y = T.import_host(T.HostCAI(three))
    assert T.host_cai(y)["strides"] == three.strides


def test_round_trip_through_our_own_import():
    x = on_cpu(jnp.arange(12.0).reshape(3, 4))

    class Holder:
        __cuda_array_interface__ = T.host_cai(x)

    y = T.import_host(Holder())
    assert y.unsafe_buffer_pointer() == x.unsafe_buffer_pointer()
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))


def test_read_only_policy(monkeypatch):
    x = jnp.zeros(3)
    assert T.host_cai(x)["data"][1] is False
    assert T.host_cai(x, read_only=True)["data"][1] is True
    monkeypatch.setattr(_config.config, "cai_read_only", True)
    assert T.host_cai(x)["data"][1] is True
    assert T.host_cai(x, read_only=False)["data"][1] is False


def test_environment_switches(monkeypatch):
    monkeypatch.setenv("JAX_OVERLAY_CAI_READ_ONLY", "1")
    monkeypatch.setenv("JAX_OVERLAY_CAI_SYNC", "0")
    c = _config.Config()
    assert c.cai_read_only is True and c.cai_sync is False
    monkeypatch.setenv("JAX_OVERLAY_CAI_SYNC", "maybe")
    with pytest.raises(ValueError, match="JAX_OVERLAY_CAI_SYNC='maybe'"):
        _config.Config()


def test_explicit_stream_is_ordered_and_exported(orders):
    x = on_cpu(jnp.zeros(3))  # host memory takes jaxlib's ordering path
    d = T.host_cai(x, stream=7)
    assert d["stream"] == 7 and orders == [7]


def test_ready_array_needs_no_stream(orders):
    x = on_cpu(jnp.zeros(3))
    x.block_until_ready()
    assert T.host_cai(x)["stream"] is None
    assert orders == []


def test_sync_switch_off_exports_no_stream(orders, monkeypatch):
    monkeypatch.setattr(_config.config, "cai_sync", False)
    d = T.host_cai(on_cpu(jnp.zeros(3)), stream=7)
    assert d["stream"] is None and orders == []


@pytest.mark.parametrize("stream", [0, -1, 1.0, True, "1"])
def test_bad_stream_argument(stream):
    with pytest.raises(ValueError, match="stream="):
        T.host_cai(jnp.zeros(3), stream=stream)


def test_deleted_array():
    x = jnp.zeros(3)
    x.delete()
    with pytest.raises(BufferError, match="deleted or donated"):
        T.host_cai(x)


def test_donated_array():
    x = jnp.zeros(3)
    jax.jit(lambda v: v + 1, donate_argnums=0)(x)
    if not x.is_deleted():
        pytest.skip("this backend ignores donation")
    with pytest.raises(BufferError, match="deleted or donated"):
        T.host_cai(x)


def test_cpu_arrays_have_no_cai_even_installed():
    x = on_cpu(jnp.zeros(3))
    assert not hasattr(x, "__cuda_array_interface__")
    jax_overlay.install()
    try:
        assert not hasattr(x, "__cuda_array_interface__")
        with pytest.raises(AttributeError, match="only defined for NVidia GPU buffers"):
            x.__cuda_array_interface__
    finally:
        jax_overlay.uninstall()


def test_not_a_jax_array():
    with pytest.raises(TypeError, match="expected a jax.Array"):
        jax_overlay.cuda_array_interface(np.zeros(3))


def test_install_replaces_and_uninstall_restores_the_property():
    orig = rt.ArrayImpl.__dict__["__cuda_array_interface__"]
    jax_overlay.install()
    assert rt.ArrayImpl.__dict__["__cuda_array_interface__"] is _cai.cai_property
    jax_overlay.uninstall()
    assert rt.ArrayImpl.__dict__["__cuda_array_interface__"] is orig


def test_sharded_arrays_point_to_shards():
    code = textwrap.dedent("""
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import NamedSharding, PartitionSpec as P
        import jax_overlay
        import forge as T
        mesh = jax.make_mesh((2,), ("x",))
        x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("x")))
        try:
            jax_overlay.cuda_array_interface(x)
        except AttributeError as e:
            assert "addressable_shards" in str(e) and "2 devices" in str(e), e
            shard = x.addressable_shards[1].data
            shard.block_until_ready()  # host memory has no stream to order a pending shard on
            d = T.host_cai(shard)
            assert d["shape"] == (4,)
            print("ok")
    """)
    env = {**__import__("os").environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
           "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_kept_facts_go_with_the_array():
    """The per-array entry of a ready GPU array's CAI facts is dropped by the
    weak reference when the array dies (so a reused id finds nothing), and
    an entry whose reference points elsewhere is never used."""
    x = jnp.arange(3.0) + 0
    key = id(x)
    rt.remember(x, ("facts",), _cai._ready_facts)
    assert _cai._ready_facts[key][1] == ("facts",)
    del x
    assert key not in _cai._ready_facts
    y = jnp.arange(3.0) + 0
    z = jnp.arange(3.0) + 0
    rt.remember(z, (12345, "<f4", (3,), None), _cai._ready_facts)
    # y under z's key: the reference check turns the forged entry away.
    _cai._ready_facts[id(y)] = _cai._ready_facts.pop(id(z))
    with pytest.raises(AttributeError, match="only defined for NVidia GPU buffers"):
        _cai.cuda_array_interface(y)
    _cai._ready_facts.pop(id(y), None)
    del z


_DELETE_WHILE_VIEWED = """
import ctypes, gc, sys, jax, jax.numpy as jnp, numpy as np, jax_overlay
from jax_overlay import _cai
import forge as T
if sys.argv[1] == "installed":
    jax_overlay.install()
n = 1 << 20
y = (jnp.arange(n, dtype=jnp.float32) + 0).block_until_ready()
T.host_cai(y)  # exported, then donated: the export takes no reference
jax.jit(lambda v: v + 1, donate_argnums=0)(y).block_until_ready()
print("donated" if y.is_deleted() else "not donated", flush=True)
x = (jnp.arange(n, dtype=jnp.float32) + 0).block_until_ready()
ptr = T.host_cai(x)["data"][0]
# A CAI consumer's view: the pointer, and the object x as its owner.
view = np.ctypeslib.as_array((ctypes.c_float * n).from_address(ptr))
x.delete()  # the user's, while the consumer still views x
churn = [jnp.full(n, -1.0).block_until_ready() for _ in range(16)]
reused = ptr in {c.unsafe_buffer_pointer() for c in churn}
same = bool((view == np.arange(n, dtype=np.float32)).all())
print("kept" if not reused and same else "lost", len(_cai._kept_for_consumers), flush=True)
del x; gc.collect()  # the consumer lets go of its owner: the buffer goes
print(len(_cai._kept_for_consumers))
"""


def _delete_while_viewed(arm):
    import os
    return subprocess.run([sys.executable, "-c", _DELETE_WHILE_VIEWED, arm],
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))


def test_delete_while_a_cai_consumer_views_the_array():
    """x.delete() (install()ed) while a CAI consumer views x: the buffer is
    kept until the object x dies (CAI consumers hold x, nothing else), and
    a donation after an export is stock's.  The stock arm gives the
    donation's outcome; its delete() frees the memory under the view (with
    jax 0.12 XLA:CPU unmaps it and the read crashes; jax 0.10.1's allocator
    may keep the block, so only the held reference, counted, says the
    buffer was kept on purpose)."""
    stock, ours = _delete_while_viewed("stock"), _delete_while_viewed("installed")
    assert ours.returncode == 0, ours.stderr[-2000:]
    lines = ours.stdout.split("\n")
    assert lines[1:3] == ["kept 1", "0"], ours.stdout
    assert lines[0] == stock.stdout.split("\n")[0], (ours.stdout, stock.stdout)
