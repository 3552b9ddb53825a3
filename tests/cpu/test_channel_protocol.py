"""jax_overlay.channel's protocol on the CPU: the handshake, steps and
answers over the socket, back-pressure, latest=True, a second receiver, a
receiver that leaves and close(), with the driver replaced by host stand-ins
(slots in shared memory mapped twice, copies done at once, events that are
always done).  What the stand-ins cannot show (GPU ordering under load) is
tests/gpu/test_channel_gpu.py's."""

from __future__ import annotations

import ctypes
import itertools
import mmap
import os
import threading
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_overlay
from jax_overlay import _channel


_IDS = itertools.count(1)


class FakeDriver:
    """The calls _channel makes of the native module, on the host."""

    def __init__(self):
        self.maps = {}       # address -> mmap (kept alive while mapped)
        self.events = set()  # live event ids
        self.opened = {}     # our handle -> the owner's event
        self.next = next(_IDS) * 1000  # ids of no earlier test's fake (their threads may
        # still free resources through whichever fake is installed)
        self.copies = 0

    def _map(self, fd, size):
        mm = mmap.mmap(fd, size)
        va = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        self.maps[va] = mm
        return va

    def alloc_exportable(self, o, n):
        fd = os.memfd_create("slots")
        os.ftruncate(fd, n)
        va = self._map(fd, n)
        self.fds = getattr(self, "fds", {})
        self.fds[va] = fd
        return types.SimpleNamespace(base=va, size=n, block_id=1)

    def export_fd(self, o, base):
        return os.dup(self.fds[base])

    def map_fd(self, o, fd, size):
        return self._map(fd, size)

    def unmap(self, o, va, size, sync):
        self.maps.pop(va, None)  # (a thread of an earlier test may call here)
        fd = getattr(self, "fds", {}).pop(va, None)
        if fd is not None:
            os.close(fd)

    def new_event(self, o, interprocess):
        self.next += 1
        self.events.add(self.next)
        return types.SimpleNamespace(event=self.next,
                                     handle=self.next.to_bytes(64, "little") if interprocess else b"")

    def open_ipc_event(self, o, handle):
        """Another process's event: our own handle of it (closing it leaves
        the owner's event alive)."""
        ev = int.from_bytes(handle, "little")
        assert ev in self.events, "a handle of no live event"
        self.next += 1
        self.opened[self.next] = ev
        return self.next

    def destroy_event(self, o, ev):
        if self.opened.pop(ev, None) is None:
            self.events.discard(ev)

    def record_event(self, o, ev, stream):
        assert ev in self.events, "recording a destroyed or another process's event"

    def wait_event(self, o, ev, stream):
        assert self.opened.get(ev, ev) in self.events, "waiting on a destroyed event"

    def event_done(self, o, ev):
        return True

    def copy_async(self, o, dst, src, n, stream):
        ctypes.memmove(dst, src, n)
        self.copies += 1

    def new_stream(self, o):
        return 7

    def device_uuid(self, o):
        return b"u" * 16

    def pointer_info(self, ptr):
        return types.SimpleNamespace(kind="device", ordinal=0)

    def raw_capsule(self, owner, ptr, shape, strides, code, dl_type, o):
        return (owner, ptr, shape)


@pytest.fixture
def fake(monkeypatch):
    d = FakeDriver()
    monkeypatch.setattr(_channel, "ext", d)
    monkeypatch.setattr(jax_overlay._ipc, "ext", d)  # _Mapping's unmap
    monkeypatch.setattr(_channel._ipc, "_checked_leaves",
                        lambda wp: ([x.unsafe_buffer_pointer() for _, x in wp], 0))
    monkeypatch.setattr(_channel._ipc, "_ordinal_of", lambda uuid: 0)
    monkeypatch.setattr(_channel.rt, "gpu_device", lambda o: jax.devices()[0])
    monkeypatch.setattr(_channel.rt, "ready_stream", lambda dev: 3)
    monkeypatch.setattr(_channel.rt, "order_stream_after", lambda x, s: None)

    def import_view(cap, device, copy, dl_type, stream):
        _, ptr, (n,) = cap
        return jnp.asarray(np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(ptr)).copy())
    monkeypatch.setattr(_channel._view, "import_view", import_view)
    monkeypatch.setattr(_channel._ipc._EXPORTER, "streams", {})
    # Both ends in this process (the real channel refuses that: CUDA opens
    # another process's events only).
    monkeypatch.setattr(_channel, "_this_process", lambda: -1)
    yield d
    # A channel closed before its receiver frees its slots from a thread:
    # done before the next test's stand-ins (the same addresses may recur).
    for t in threading.enumerate():
        if t.name == "jax_overlay-channel-free":
            t.join(10)


def tree(k):
    return {"w": [jnp.full((5 + i,), k, jnp.float32) for i in range(3)],
            "b": jnp.full((2, 2), k, jnp.int8), "flag": jnp.array(k % 2 == 1)}


def values(t):
    return sorted({float(v) for x in jax.tree_util.tree_leaves(t) if x.dtype != jnp.bool_
                   for v in np.unique(np.asarray(x))})


def test_steps_arrive_in_order_with_their_values(fake):
    ch = jax_overlay.channel(tree(0))
    rx = jax_overlay.open_channel(ch.name)
    for k in range(1, 8):
        ch.send(tree(k))
        got = rx.recv(timeout=10)
        assert values(got) == [float(k)]
        assert bool(got["flag"]) == (k % 2 == 1)
        assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(tree(0))
    assert fake.copies == 7
    ch.close()
    with pytest.raises(BufferError, match="sender closed the channel"):
        rx.recv(timeout=10)
    rx.close()


def test_steps_sent_before_the_receiver_connects_are_queued(fake):
    ch = jax_overlay.channel(tree(0), slots=3)
    for k in range(1, 4):  # three slots: no answer needed yet
        ch.send(tree(k))
    rx = jax_overlay.open_channel(ch.name)
    assert [values(rx.recv(timeout=10)) for _ in range(3)] == [[1.0], [2.0], [3.0]]
    ch.send(tree(4), timeout=10)  # needs step 1's answer: there
    assert values(rx.recv(timeout=10)) == [4.0]
    ch.close()
    rx.close()


def test_back_pressure_waits_for_the_receiver(fake):
    ch = jax_overlay.channel(tree(0), slots=2)
    rx = jax_overlay.open_channel(ch.name)
    ch.send(tree(1))
    ch.send(tree(2))
    with pytest.raises(TimeoutError, match="has not read step 0"):
        ch.send(tree(3), timeout=0.2)  # two steps unread
    got = []
    t = threading.Thread(target=lambda: got.extend(values(rx.recv(timeout=10)) for _ in range(3)))
    t.start()
    ch.send(tree(3), timeout=10)
    t.join(10)
    assert got == [[1.0], [2.0], [3.0]]
    ch.close()
    rx.close()


def test_latest_skips_and_frees_the_skipped_slots(fake):
    ch = jax_overlay.channel(tree(0), slots=3)
    rx = jax_overlay.open_channel(ch.name)
    for k in range(1, 4):
        ch.send(tree(k))
    assert values(rx.recv(timeout=10, latest=True)) == [3.0]
    for k in range(4, 7):  # all three slots free again: no wait
        ch.send(tree(k), timeout=0.5)
    assert values(rx.recv(timeout=10, latest=True)) == [6.0]
    ch.close()
    rx.close()


def test_one_receiver_per_channel(fake):
    ch = jax_overlay.channel(tree(0))
    rx = jax_overlay.open_channel(ch.name)
    with pytest.raises(BufferError, match="has its receiver already"):
        jax_overlay.open_channel(ch.name)
    ch.send(tree(1))
    assert values(rx.recv(timeout=10)) == [1.0]
    ch.close()
    rx.close()


def test_a_forged_token_is_refused(fake):
    ch = jax_overlay.channel(tree(0))
    forged = _channel.ChannelName(*(getattr(ch.name, k) for k in ch.name.__slots__))
    forged.token = bytes(16)
    with pytest.raises(BufferError, match="token does not match"):
        jax_overlay.open_channel(forged)
    rx = jax_overlay.open_channel(ch.name)  # the real one still opens
    ch.send(tree(1))
    assert values(rx.recv(timeout=10)) == [1.0]
    ch.close()
    rx.close()


def test_receiver_gone_is_a_clear_error(fake):
    ch = jax_overlay.channel(tree(0))
    rx = jax_overlay.open_channel(ch.name)
    rx.close()
    with pytest.raises(BufferError, match="receiver closed the channel"):
        for k in range(3):
            ch.send(tree(k), timeout=10)
    ch.close()


def test_resources_freed_once_both_sides_let_go(fake):
    ch = jax_overlay.channel(tree(0))
    rx = jax_overlay.open_channel(ch.name)
    ch.send(tree(1))
    rx.recv(timeout=10)
    base = ch._alloc.base
    ch.close()
    assert base in fake.maps, "freed while the receiver holds the channel"
    rx.close()
    for _ in range(200):
        if base not in fake.maps:
            break
        threading.Event().wait(0.01)
    assert base not in fake.maps
    assert ch._ready == [] and ch._done == []


def test_timeout_without_a_receiver(fake):
    ch = jax_overlay.channel(tree(0), slots=1)
    ch.send(tree(1))
    with pytest.raises(TimeoutError, match="no receiver opened this channel"):
        ch.send(tree(2), timeout=0.2)
    ch.close()


def test_recv_timeout(fake):
    ch = jax_overlay.channel(tree(0))
    rx = jax_overlay.open_channel(ch.name)
    with pytest.raises(TimeoutError, match="no step arrived within 0.1 s"):
        rx.recv(timeout=0.1)
    ch.close()
    rx.close()
