"""jax_overlay.share / open_shared / jax_overlay.multiprocessing where there
is no GPU to share: the refusals, each naming what works instead, and the
handle's own rules (pickling, version, machine).  tests/gpu/test_ipc_gpu.py
proves the sharing itself."""

import multiprocessing
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_overlay
from jax_overlay import _ipc

from multidevice import check, on, params


def a_share(**over):
    fields = dict(version=_ipc.SHARE_VERSION, address="\0jax_overlay/none", share_id=1,
                  token=b"\7" * 16, pid=1, boot_id=_ipc._BOOT_ID, host="here", arrays=1,
                  nbytes=16, allocations=1, exposed_bytes=1 << 21, copied=False)
    fields.update(over)
    return _ipc.Share(**fields)


def test_cpu_array_is_refused_naming_the_alternatives():
    with pytest.raises(BufferError, match=r"\['w'\] is on .*host memory.*pickling.*device_put"):
        jax_overlay.share({"w": jax.device_put(jnp.ones(3), jax.devices("cpu")[0])})


def test_non_array_leaf_is_a_type_error_naming_the_leaf():
    with pytest.raises(TypeError, match=r"\['b'\]\[1\] is a numpy.ndarray"):
        jax_overlay.share({"b": [jnp.ones(2), np.ones(2)]})


def test_deleted_array_is_refused():
    x = jnp.ones(3)
    x.delete()
    with pytest.raises(BufferError, match="deleted or donated"):
        jax_overlay.share([x])


@on(2)
def case_sharded_array_is_refused_naming_the_shards(n):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]), ("x",))
    x = jax.device_put(jnp.arange(4.0), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x")))
    with pytest.raises(BufferError, match="sharded over 2 devices.*addressable_shards"):
        jax_overlay.share(x)
    with pytest.raises(BufferError, match="sharded over 2 devices"):
        jax_overlay.share({"ok": jax.device_put(jnp.ones(2), jax.devices()[0]), "bad": x})


@pytest.mark.parametrize("n,case", params(globals()))
def test_multidevice(n, case):
    """Cases that need several devices, each run in a subprocess that has
    them (multidevice.py)."""
    check(__file__, n, case)


def test_open_shared_argument_checks():
    with pytest.raises(TypeError, match="jax_overlay.Share"):
        jax_overlay.open_shared(object())
    with pytest.raises(ValueError, match="framework='tf'"):
        jax_overlay.open_shared(a_share(), framework="tf")


def test_share_pickles_and_carries_no_ownership():
    s = a_share()
    s2 = pickle.loads(pickle.dumps(s))
    assert _ipc._state(s2) == _ipc._state(s)
    assert set(_ipc._state(s)) == set(s.__slots__) - {"_local", "__weakref__"}
    assert _ipc._state(_ipc.loads(pickle.dumps(s))) == _ipc._state(s)
    assert not s2._local
    s2.release()  # a no-op outside the exporter
    assert "1 arrays, 16 bytes in 1 allocations" in repr(s2)


def test_another_format_version_is_refused_by_name():
    with pytest.raises(BufferError, match="format version 99"):
        pickle.loads(pickle.dumps(a_share(version=99)))


@pytest.mark.parametrize("field, value", [("share_id", "1"), ("token", b"short"),
                                          ("address", None), ("copied", 1)])
def test_a_damaged_field_is_refused_by_name(field, value):
    with pytest.raises(BufferError, match="damaged"):
        pickle.loads(pickle.dumps(a_share(**{field: value})))


def test_another_machine_is_refused():
    with pytest.raises(BufferError, match="another machine .*device_get"):
        jax_overlay.open_shared(a_share(boot_id="another-boot", host="elsewhere"))


def test_open_without_a_gpu_is_a_clear_buffer_error():
    # The machine check passes; the GPU lookup cannot (no driver, or no such UUID).
    with pytest.raises(BufferError):
        jax_overlay.open_shared(a_share())


def _get(q, out):
    import jax_overlay.multiprocessing  # noqa: F401
    out.put(np.asarray(q.get(timeout=60)).tolist())


def test_multiprocessing_sends_host_arrays_as_copies():
    import jax_overlay.multiprocessing as jmp
    ctx = jmp.get_context("spawn")
    q, out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_get, args=(q, out))
    p.start()
    q.put(jnp.arange(5.0))
    assert out.get(timeout=120) == [0.0, 1.0, 2.0, 3.0, 4.0]
    p.join(60)
    assert p.exitcode == 0
    assert _ipc.live_shares() == 0


def test_multiprocessing_module_is_the_standard_one():
    import jax_overlay.multiprocessing as jmp
    assert jmp.Queue is multiprocessing.Queue and jmp.get_context is multiprocessing.get_context


def test_torch_tensors_from_a_share_pickle_as_the_share():
    """PyTorch's reducers are wrapped once a share is opened as tensors:
    the tensors open_shared made are sent as (share, leaf index); any other
    tensor goes through PyTorch's own reducer, unchanged."""
    from torch_or_skip import torch as torch_or_skip
    torch = torch_or_skip()
    from multiprocessing.reduction import ForkingPickler

    from jax_overlay import peers
    peer = peers.REGISTRY["torch"]
    mine, other = torch.arange(4.0), torch.arange(3.0)
    h = a_share()
    peer.came_from_share([mine], h, [], _ipc.open_leaf)
    fn, args = ForkingPickler._extra_reducers[torch.Tensor](mine)
    assert fn is _ipc.open_leaf and args[1:] == (0, "torch") and args[0] is h
    assert ForkingPickler._extra_reducers[torch.Tensor](other)[0] is not _ipc.open_leaf
    assert torch.equal(pickle.loads(ForkingPickler.dumps(other)), other)
    peer.came_from_share([torch.arange(2.0)], h, [], _ipc.open_leaf)  # wrapped once, not twice
    wrapped = ForkingPickler._extra_reducers[torch.Tensor]
    assert getattr(wrapped, "_jax_overlay", False)
