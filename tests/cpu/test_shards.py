"""to_shards / from_shards on 2 and 4 CPU devices (multidevice.py runs the
cases in one subprocess per device count): per-shard export through DLPack,
zero-copy assembly from host producers and from host memory playing GPU
producers on their devices, and every error path."""

import gc

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_overlay
import forge as T
from jax_overlay import _runtime as rt
from multidevice import (KDLCUDA, HostCAIOn, HostDLPack, aligned, check, cpus_as_gpus,
                         installed, on, params)


def ptr(x):
    return x.unsafe_buffer_pointer()


def layouts(n):
    """name -> (sharding, global shape): 1-D meshes (also in reversed device
    order, and cutting the second dimension), replicated, and on 4 devices
    2-D meshes (both axes, one axis with replication, both axes on one
    dimension)."""
    devs = jax.devices("cpu")
    line = Mesh(np.array(devs), ("x",))
    backwards = Mesh(np.array(devs[::-1]), ("x",))
    out = {"rows": (NamedSharding(line, P("x")), (2 * n, 3)),
           "rows_reversed_mesh": (NamedSharding(backwards, P("x")), (2 * n, 3)),
           "columns": (NamedSharding(line, P(None, "x")), (3, 2 * n)),
           "replicated": (NamedSharding(line, P()), (4, 3))}
    if n == 4:
        grid = Mesh(np.array(devs).reshape(2, 2), ("x", "y"))
        out["grid"] = (NamedSharding(grid, P("x", "y")), (4, 6))
        out["grid_rows_replicated_on_y"] = (NamedSharding(grid, P("x")), (4, 6))
        out["grid_both_axes_on_rows"] = (NamedSharding(grid, P(("x", "y"))), (8, 3))
    return out


def host_blocks(sharding, shape):
    """The global array, its blocks in the sharding's device order (each in
    its own aligned host buffer) and that order."""
    g = aligned(shape)
    index = sharding.addressable_devices_indices_map(shape)
    bs = []
    for i in index.values():
        b = aligned(g[i].shape)
        b[...] = g[i]
        bs.append(b)
    return g, bs, list(index)


@on(2, 4)
def case_to_shards_exports_every_shard_zero_copy_through_dlpack(n):
    with installed():
        for name, (s, shape) in layouts(n).items():
            g = aligned(shape)
            x = jax.device_put(g, s)
            shards = jax_overlay.to_shards(x)
            assert len(shards) == n, name
            for shard, ref in zip(shards, x.addressable_shards):
                assert isinstance(shard, jax_overlay.Shard)
                assert (shard.device, shard.index) == (ref.device, ref.index), name
                assert shard.data.devices() == {shard.device}
                assert ptr(shard.data) == ptr(ref.data), name
                v = np.from_dlpack(shard.data)
                assert v.ctypes.data == ptr(shard.data), name  # a view, not a copy
                np.testing.assert_array_equal(v, g[shard.index])


@on(2, 4)
def case_to_shards_single_device_array_is_one_shard(n):
    x = jax.device_put(aligned((2, 3)), jax.devices("cpu")[n - 1])
    (shard,) = jax_overlay.to_shards(x)
    assert shard.device == jax.devices("cpu")[n - 1]
    assert shard.index == (slice(None), slice(None)) and ptr(shard.data) == ptr(x)


@on(2, 4)
def case_from_shards_views_host_arrays_on_their_cpu_devices(n):
    for name, (s, shape) in layouts(n).items():
        g, bs, order = host_blocks(s, shape)
        for form in ("numpy", "dlpack", "dict", "global_shape"):
            producers = [HostDLPack(b) for b in bs] if form == "dlpack" else bs
            if form == "dict":
                producers = dict(zip(order, bs))
            x = jax_overlay.from_shards(
                producers, s, global_shape=shape if form == "global_shape" else None)
            assert x.sharding == s and x.shape == shape, (name, form)
            np.testing.assert_array_equal(np.asarray(x), g)
            for shard, b, d in zip(jax_overlay.to_shards(x), bs, order):
                assert shard.device == d and ptr(shard.data) == b.ctypes.data, (name, form)


@on(2, 4)
def case_from_shards_keeps_its_producers_alive(n):
    s, shape = layouts(n)["rows"]
    g, bs, _ = host_blocks(s, shape)
    x = jax_overlay.from_shards([HostDLPack(b) for b in bs], s)
    pointers = [b.ctypes.data for b in bs]
    del bs
    gc.collect()
    assert [ptr(a.data) for a in x.addressable_shards] == pointers
    np.testing.assert_array_equal(np.asarray(x), g)


@on(2, 4)
def case_from_shards_takes_gpu_producers_on_their_own_devices(n):
    for name, (s, shape) in layouts(n).items():
        g, bs, order = host_blocks(s, shape)
        with cpus_as_gpus() as gpus:
            # DLPack and CAI producers alternate: each goes through its own path.
            producers = [HostDLPack(b, (KDLCUDA, d.id)) if i % 2 == 0 else HostCAIOn(b, d.id)
                         for i, (b, d) in enumerate(zip(bs, order))]
            x = jax_overlay.from_shards(producers, s)
            np.testing.assert_array_equal(np.asarray(x), g)
            for a, b in zip(x.addressable_shards, bs):
                assert ptr(a.data) == b.ctypes.data, name
            dl = [(p, d) for p, d in zip(producers, order) if isinstance(p, HostDLPack)]
            # Each DLPack producer ordered its own device's compute stream,
            # with its own device current.
            assert gpus.switches == [d.id for _, d in dl], name
            assert [p.streams for p, _ in dl] == [[1000 + d.id] for _, d in dl], name


@on(2, 4)
def case_from_shards_refuses_gpu_producers_in_the_wrong_places(n):
    s, shape = layouts(n)["rows"]
    _, bs, order = host_blocks(s, shape)
    with cpus_as_gpus():
        on_gpu = [HostDLPack(b, (KDLCUDA, d.id)) for b, d in zip(bs, order)]
        with pytest.raises(BufferError, match=(
                rf"arrays\[0\] is on {order[-1]}, but the sharding places it on "
                rf"{order[0]}; pass the arrays in the sharding's device order "
                rf"\[{', '.join(map(str, order))}\].*or as a dict.*jax.device_put")):
            jax_overlay.from_shards(on_gpu[::-1], s)
        wrong_keys = dict(zip(order, on_gpu[::-1]))
        with pytest.raises(BufferError, match=(
                rf"arrays\[{order[0]}\] is on {order[-1]}, .*key it by the device it is on")):
            jax_overlay.from_shards(wrong_keys, s)
        # Keyed by where they are, in any order, they are accepted.
        x = jax_overlay.from_shards(dict(zip(order[::-1], on_gpu[::-1])), s)
        assert [ptr(a.data) for a in x.addressable_shards] == [b.ctypes.data for b in bs]


@on(2, 4)
def case_from_shards_round_trips_to_shards(n):
    for name, (s, shape) in layouts(n).items():
        g = aligned(shape)
        x = jax.device_put(g, s)
        shards = jax_overlay.to_shards(x)
        for arrays in ([sh.data for sh in shards], {sh.device: sh.data for sh in shards}):
            y = jax_overlay.from_shards(arrays, x.sharding, copy=False)
            assert [ptr(a.data) for a in y.addressable_shards] == [ptr(sh.data) for sh in shards]
        z = jax_overlay.from_shards([sh.data for sh in shards], s, copy=True)
        for a, sh in zip(z.addressable_shards, shards):
            assert a.device == sh.device and ptr(a.data) != ptr(sh.data), name
        np.testing.assert_array_equal(np.asarray(z), g)


@on(2)
def case_from_shards_copies_strided_blocks_on_their_device_or_refuses(n):
    s, shape = layouts(n)["rows"]
    g, _, order = host_blocks(s, shape)
    index = s.addressable_devices_indices_map(shape)
    wide = [aligned((shape[0] // n, 2 * shape[1])) for _ in order]
    strided = [w[:, ::2] for w in wide]
    for st, i in zip(strided, index.values()):
        st[...] = g[i]
    x = jax_overlay.from_shards([HostDLPack(st) for st in strided], s)
    np.testing.assert_array_equal(np.asarray(x), g)
    for a, d, w in zip(x.addressable_shards, order, wide):
        assert a.device == d and ptr(a.data) != w.ctypes.data
    with pytest.raises(BufferError, match="without a copy"):
        jax_overlay.from_shards([HostDLPack(st) for st in strided], s, copy=False)


@on(2, 4)
def case_from_shards_infers_or_checks_the_global_shape(n):
    devs = jax.devices("cpu")
    line = Mesh(np.array(devs), ("x",))
    rows = NamedSharding(line, P("x"))
    bs = [aligned((2, 3)) for _ in devs]
    assert jax_overlay.from_shards(bs, rows).shape == (2 * n, 3)
    assert jax_overlay.from_shards(bs, NamedSharding(line, P(None, "x")),
                                   global_shape=(2, 3 * n)).shape == (2, 3 * n)
    with pytest.raises(ValueError, match=r"cannot infer global_shape from arrays\[0\]'s shape \(5,\)"):
        jax_overlay.from_shards([aligned((5,)) for _ in devs], NamedSharding(line, P(None, "x")))
    with pytest.raises(ValueError, match=rf"global_shape=\({2 * n + 1}, 3\) does not fit the sharding"):
        jax_overlay.from_shards(bs, rows, global_shape=(2 * n + 1, 3))
    with pytest.raises(ValueError, match=(
            rf"arrays\[0\] has shape \(2, 3\), but the sharding gives {devs[0]} the block "
            rf".* of the global shape \({4 * n}, 3\), of shape \(4, 3\)")):
        jax_overlay.from_shards(bs, rows, global_shape=(4 * n, 3))
    with pytest.raises(TypeError, match=r"global_shape=\(2\.0, 3\): pass a tuple of ints"):
        jax_overlay.from_shards(bs, rows, global_shape=(2.0, 3))


@on(2)
def case_from_shards_errors_name_the_array_the_value_and_the_fix(n):
    cpu0, cpu1 = jax.devices("cpu")
    s, shape = layouts(n)["rows"]
    _, bs, order = host_blocks(s, shape)
    with pytest.raises(TypeError, match="sharding must be a jax.sharding.Sharding, got builtins.str"):
        jax_overlay.from_shards(bs, "x")
    with pytest.raises(TypeError, match=r"arrays must be a list .* or a dict \{device: array\}, got numpy.ndarray"):
        jax_overlay.from_shards(np.zeros(shape, np.float32), s)
    with pytest.raises(TypeError, match=r"arrays\[1\] is a builtins.object, which has neither __dlpack__ nor"):
        jax_overlay.from_shards([bs[0], object()], s)
    with pytest.raises(ValueError, match=r"got 1 arrays, but the sharding has 2 addressable devices \[cpu:0, cpu:1\]"):
        jax_overlay.from_shards(bs[:1], s)
    with pytest.raises(ValueError, match=r"missing \['cpu:1'\], not in the sharding \['x'\]"):
        jax_overlay.from_shards({cpu0: bs[0], "x": bs[1]}, s)
    with pytest.raises(ValueError, match=r"arrays\[1\] is int32 but arrays\[0\] is float32"):
        jax_overlay.from_shards([bs[0], bs[1].astype(np.int32)], s)
    with pytest.raises(ValueError, match=r"arrays\[1\] has shape \(3, 3\), .*of shape \(2, 3\)"):
        jax_overlay.from_shards([bs[0], aligned((3, 3))], s)
    sharded = jax.device_put(aligned(shape), s)
    with pytest.raises(BufferError, match=r"arrays\[0\] is sharded over 2 devices.*to_shards"):
        jax_overlay.from_shards([sharded, bs[1]], s)
    gone = jax.device_put(bs[0], cpu0)
    gone.delete()
    with pytest.raises(BufferError, match=r"arrays\[0\] was deleted or donated"):
        jax_overlay.from_shards([gone, bs[1]], s)
    with pytest.raises(BufferError, match=r"arrays\[0\] is on cpu:1, but the sharding places it on cpu:0"):
        jax_overlay.from_shards([jax.device_put(bs[0], cpu1), bs[1]], s)
    pinned = NamedSharding(s.mesh, P("x"), memory_kind="pinned_host")
    with pytest.raises(BufferError, match=(
            r"arrays\[0\] is in cpu:0's 'device' memory, but the sharding wants "
            r"'pinned_host' memory; jax.device_put it there")):
        jax_overlay.from_shards(bs, pinned)
    in_pinned = [jax.device_put(b, jax.sharding.SingleDeviceSharding(d, memory_kind="pinned_host"))
                 for b, d in zip(bs, order)]
    with pytest.raises(BufferError, match=(
            r"arrays\[0\] is in cpu:0's 'pinned_host' memory, but the sharding wants "
            r"'device' memory.*or use a sharding with memory_kind='pinned_host'")):
        jax_overlay.from_shards(in_pinned, s)
    x = jax_overlay.from_shards(in_pinned, pinned)  # the memory kind it asks for
    assert [ptr(a.data) for a in x.addressable_shards] == [ptr(a) for a in in_pinned]
    with pytest.raises(TypeError, match="expected a jax.Array, got numpy.ndarray"):
        jax_overlay.to_shards(bs[0])
    sharded.delete()
    with pytest.raises(BufferError, match="deleted or donated"):
        jax_overlay.to_shards(sharded)


@on(2)
def case_whole_array_protocols_send_sharded_arrays_to_to_shards(n):
    s, shape = layouts(n)["rows"]
    x = jax.device_put(aligned(shape), s)
    # Described as a CPU array would be where allowed (as test_export does):
    # the sharding is refused first.
    with pytest.raises(AttributeError, match=r"sharded over 2 devices.*jax_overlay.to_shards\(x\)"):
        T.host_cai(x)
    with pytest.raises(AttributeError, match=r"sharded over 2 devices.*jax_overlay.to_shards\(x\)"):
        jax_overlay.cuda_array_interface(x)
    with pytest.raises(BufferError, match=r"sharded over 2 devices.*jax_overlay.to_shards\(x\)"):
        jax_overlay.to_dlpack(x)
    with installed():
        for method in (x.__dlpack__, x.__dlpack_device__):
            # A jaxlib with DLPack 1.x of its own keeps its CPU export, and
            # its words (_dlpack.ours); the overlay's name to_shards.
            words = "" if rt.NATIVE_DLPACK_1 else r"jax_overlay.to_shards\(x\).*shard.data.__dlpack__"
            with pytest.raises(BufferError, match=words):
                method()
        with pytest.raises(BufferError):
            np.from_dlpack(x)


@pytest.mark.parametrize("n,case", params(globals()))
def test_multidevice(n, case):
    check(__file__, n, case)
