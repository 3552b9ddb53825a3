"""jax_overlay.channel between processes on one GPU: a tree sent every step
(issue 40's re-sync), ordered and never overwritten while read, under the
suite's load.  The receiver is a spawned ipc_worker process; every value it
reports was read straight to the host (np.asarray)."""

from __future__ import annotations

import functools
import os
import pickle

import jax
import jax.numpy as jnp
import pytest

import jax_overlay
import test_ipc_gpu


class Peer(test_ipc_gpu.Peer):
    def ask(self, *msg, timeout=30):  # a hang fails one test, not the run
        return super().ask(*msg, timeout=timeout)

pytestmark = pytest.mark.gpu
ROUNDS = int(os.environ.get("JAX_OVERLAY_CHANNEL_ROUNDS", "30"))
ARRAYS = 200


def _chain(ms):
    """A jitted tree of ARRAYS leaves, all k, written at the end of about
    `ms` of matmuls (every leaf depends on the whole chain)."""
    m = jnp.full((2048, 2048), 1e-4, jnp.float32)

    @functools.partial(jax.jit, static_argnums=1)
    def chain(k, steps):
        y = m
        for _ in range(steps):
            y = jnp.tanh(y @ m)
        zero = jnp.minimum(jnp.abs(y[0, 0]), 0.0)
        return {"w": [jnp.full((1024 + i,), k, jnp.float32) + zero for i in range(ARRAYS)],
                "step": jnp.full((), k, jnp.float32) + zero}

    import time
    jax.block_until_ready(chain(0.0, 16))
    t0 = time.perf_counter()
    jax.block_until_ready(chain(0.0, 16))
    steps = max(1, round(ms / 1e3 / ((time.perf_counter() - t0) / 16)))
    jax.block_until_ready(chain(0.0, steps))
    return lambda k: chain(float(k), steps)


@pytest.fixture
def peer():
    p = Peer()
    p.ok("init")
    yield p
    p.close()


def test_inflight_steps_read_to_the_host(peer):
    """Each step is sent while ~50 ms of work that writes it still runs; the
    receiver reads every leaf to the host: all k, every step, in order."""
    make = _chain(50)
    ch = jax_overlay.channel(make(0))
    assert peer.ok("channel_open", ch.name)
    in_flight = 0
    for k in range(1, ROUNDS + 1):
        tree = make(k)
        in_flight += not tree["step"].is_ready()
        ch.send(tree)
        assert peer.ok("channel_recv", 1, 0, False) == [[float(k)]], f"step {k}"
    assert in_flight == ROUNDS, f"only {in_flight} of {ROUNDS} steps sent in flight"
    ch.close()


def test_sender_ahead_never_overwrites_a_slot_being_read(peer):
    """The sender sends ROUNDS steps back to back while the receiver's GPU
    is kept busy before each recv (its unpack queues ~30 ms late): without
    the receiver's events the sender's copies would overwrite slots not yet
    read.  Every step arrives, in order, with its own values."""
    make = _chain(5)
    ch = jax_overlay.channel(make(0), slots=2)
    assert peer.ok("channel_open", ch.name)
    peer.conn.send(("channel_recv", ROUNDS, 30, False))
    for k in range(1, ROUNDS + 1):
        ch.send(make(k), timeout=30)
    assert peer.conn.poll(60), "the receiver did not answer"
    status, got = peer.conn.recv()
    assert status == "ok", got
    assert got == [[float(k)] for k in range(1, ROUNDS + 1)]
    ch.close()


def test_latest_skips_to_the_newest_step(peer):
    make = _chain(5)
    ch = jax_overlay.channel(make(0), slots=4)
    assert peer.ok("channel_open", ch.name)
    for k in range(1, 5):  # four steps: the slots are full, no ack read yet
        ch.send(make(k))
    assert peer.ok("channel_recv", 1, 0, True) == [[4.0]]
    for k in range(5, 12):  # the skipped slots are free again
        ch.send(make(k), timeout=60)
        assert peer.ok("channel_recv", 1, 0, True) == [[float(k)]]
    ch.close()


def test_leaves_may_be_donated_after_send(peer):
    make = _chain(20)
    ch = jax_overlay.channel(make(0))
    assert peer.ok("channel_open", ch.name)
    bump = jax.jit(lambda t: jax.tree_util.tree_map(lambda x: x + 100, t), donate_argnums=0)
    for k in range(1, 6):
        tree = make(k)
        ch.send(tree)
        bump(tree)  # donated at once: the pack has read them on XLA's stream
        assert all(x.is_deleted() for x in jax.tree_util.tree_leaves(tree))
        assert peer.ok("channel_recv", 1, 0, False) == [[float(k)]]
    ch.close()


def test_receiver_exit_is_a_clear_error():
    make = _chain(1)
    ch = jax_overlay.channel(make(0))
    p = Peer()
    assert p.ok("channel_open", ch.name)
    p.close()  # the receiver process exits
    with pytest.raises(BufferError, match="receiver closed the channel"):
        for k in range(4):  # slots=2: the third send needs the receiver's answer
            ch.send(make(k), timeout=30)
    ch.close()


def test_errors(peer):
    make = _chain(1)
    ch = jax_overlay.channel(make(0))
    assert peer.ok("channel_open", ch.name)
    r = peer.ask("channel_open", ch.name)  # a second receiver
    assert r[0] == "error" and "has its receiver already" in r[2], r
    with pytest.raises(ValueError, match=r"\['w'\]\[3\] is float32\[7\]"):
        t = make(1)
        t["w"][3] = jnp.zeros(7)
        ch.send(t)
    with pytest.raises(ValueError, match="structure"):
        ch.send({"w": make(1)["w"]})
    forged = pickle.loads(pickle.dumps(ch.name))
    forged.token = bytes(16)
    other = Peer()
    try:
        r = other.ask("channel_open", forged)
        assert r[0] == "error" and r[1] == "BufferError" and "token" in r[2], r
    finally:
        other.close()
    ch.send(make(1))  # the channel still works
    assert peer.ok("channel_recv", 1, 0, False) == [[1.0]]
    ch.close()
    with pytest.raises(BufferError, match="closed"):
        ch.send(make(2))


def test_close_frees_the_slots(peer):
    """The sender's slots and events go once both sides let go, and not
    before: the receiver's pending reads keep the memory mapped."""
    from jax_overlay import _xla_ext as ext
    tree = {"w": [jnp.ones((16 << 20,), jnp.uint8)]}
    ch = jax_overlay.channel(tree, slots=2)
    base = ch._alloc.base
    assert peer.ok("channel_open", ch.name)
    ch.send(tree)
    assert peer.ok("channel_recv", 1, 0, False) == [[1.0]]
    ch.close()
    assert ext.pointer_info(base).kind == "device", "freed while the receiver holds it"
    peer.ok("channel_close")
    import time
    deadline = time.monotonic() + 20
    # The freeing thread unmaps the slots, then lets go of the events: wait
    # for both (under load on the H200 the lists were read between them).
    while ((ext.pointer_info(base).kind == "device" or ch._ready or ch._done)
           and time.monotonic() < deadline):
        time.sleep(0.05)
    assert ext.pointer_info(base).kind != "device"
    assert ch._ready == [] and ch._done == []


def test_unconnected_close_frees_at_once():
    from jax_overlay import _xla_ext as ext
    tree = {"w": [jnp.ones((1 << 20,), jnp.uint8)]}
    ch = jax_overlay.channel(tree)
    base = ch._alloc.base
    ch.send(tree)  # queued for a receiver that never comes
    ch.close()
    assert ext.pointer_info(base).kind != "device"
