"""jax_overlay.channel where no GPU is needed: its refusals, its name, and
the jitted pack and unpack a step runs (tests/gpu/test_channel_gpu.py runs
the channel itself between processes)."""

from __future__ import annotations

import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_overlay
from jax_overlay import _channel, _pack


def tree():
    return {"a": jnp.arange(6.0).reshape(2, 3), "b": [jnp.array([True, False]),
                                                     jnp.arange(5, dtype=jnp.int8)],
            "c": jnp.array(1 + 2j, jnp.complex64), "e": jnp.zeros((0, 4))}


def test_host_arrays_are_refused_naming_the_leaf():
    with pytest.raises(BufferError, match=r"\['a'\] is on cpu"):
        jax_overlay.channel(tree())


@pytest.mark.parametrize("slots", [0, -1, 1.5, "2", True])
def test_bad_slots(slots):
    with pytest.raises(ValueError, match="slots="):
        jax_overlay.channel(tree(), slots=slots)


def test_open_takes_a_name():
    with pytest.raises(TypeError, match="ChannelName"):
        jax_overlay.open_channel("jax_overlay/channel/1")


def name(**change):
    fields = dict(version=_channel.CHANNEL_VERSION, address="\0jax_overlay/channel/x",
                  token=bytes(16), pid=1, boot_id=jax_overlay._ipc._BOOT_ID, host="h")
    fields.update(change)
    return _channel.ChannelName(**fields)


@pytest.mark.parametrize("change,match", [
    ({"token": "00" * 16}, "field 'token' is str"),
    ({"pid": "1"}, "field 'pid' is str"),
    ({"version": 99}, "version 99"),
    ({"boot_id": "another"}, "another machine"),
])
def test_damaged_names(change, match):
    with pytest.raises(BufferError, match=match):
        jax_overlay.open_channel(name(**change))


def test_a_name_of_no_live_channel():
    with pytest.raises(BufferError, match="no longer serves this channel"):
        jax_overlay.open_channel(name())


def test_name_pickles():
    n = name(pid=7)
    m = pickle.loads(pickle.dumps(n))
    assert type(m) is _channel.ChannelName
    assert all(getattr(m, k) == getattr(n, k) for k in n.__slots__)


def test_pack_unpack_round_trip():
    t = tree()
    leaves, treedef = jax.tree_util.tree_flatten(t)
    spec, total = _pack.layout(leaves)
    buf = _pack.tree_packer(treedef, spec, total)(t)
    assert buf.dtype == jnp.uint8 and buf.shape == (total,)
    out, read = _pack.tree_unpacker(treedef, spec)(buf)
    assert jax.tree_util.tree_structure(out) == treedef
    assert read.shape == (1,)
    for x, y in zip(leaves, jax.tree_util.tree_leaves(out)):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_pack_refuses_another_tree_naming_the_leaf():
    t = tree()
    leaves, treedef = jax.tree_util.tree_flatten(t)
    spec, total = _pack.layout(leaves)
    pack = _pack.tree_packer(treedef, spec, total)
    pack(t)
    bad = tree()
    bad["b"][1] = jnp.arange(5, dtype=jnp.int16)
    with pytest.raises(ValueError, match=r"\['b'\]\[1\] is int16\[5\], not the channel's int8\[5\]"):
        pack(bad)
    bad = tree()
    bad["a"] = jnp.zeros((3, 2))
    with pytest.raises(ValueError, match=r"\['a'\] is float32\[3, 2\]"):
        pack(bad)
    with pytest.raises(ValueError, match="structure"):
        pack({"a": t["a"]})
    np.testing.assert_array_equal(pack(t), pack(tree()))  # still serves the right tree


def test_a_receiver_in_the_senders_process_is_refused(monkeypatch):
    import os
    with pytest.raises(BufferError, match="made in this process"):
        jax_overlay.open_channel(name(pid=os.getpid()))
