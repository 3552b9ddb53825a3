"""The exporter's side of jax_overlay.share without a GPU: its socket
server, descriptors passed with SCM_RIGHTS, and the holds that keep a
share's arrays alive.  Entries carry memfd descriptors and a sentinel in
place of XLA's allocations and PJRT references; the receivers are real
processes speaking the real protocol (tests/cpu/ipc_lease_worker.py).
tests/gpu/test_ipc_gpu.py proves the same on XLA's memory."""

import gc
import multiprocessing
import os
import time
import weakref

import pytest

from jax_overlay import _ipc

import ipc_lease_worker

SPAWN = multiprocessing.get_context("spawn")


class Sentinel:
    """Stands for the PJRT references a share keeps."""


def export(payloads, *, once=False):
    """(Share, weak reference to the entry's sentinel) over memfds."""
    _ipc._EXPORTER.start()
    fds = []
    for p in payloads:
        fd = os.memfd_create("jax_overlay-test")
        os.write(fd, p)
        fds.append(fd)
    sentinel = Sentinel()
    entry = _ipc._Entry(None, [sentinel], 0, fds, 0, None, holds=1)
    entry.once = once
    sid = _ipc._EXPORTER.add(entry)
    h = _ipc.Share(version=_ipc.SHARE_VERSION, address=_ipc._EXPORTER.address, share_id=sid,
                   pid=os.getpid(), boot_id=_ipc._BOOT_ID, host="", uuid=b"", event=b"",
                   treedef=None, leaves=[], allocations=[(0, 0)] * len(fds), nbytes=0,
                   exposed_bytes=0, copied=False)
    h._local = not once
    return h, weakref.ref(sentinel)


class Receiver:
    def __init__(self, h, need):
        self.conn, child = SPAWN.Pipe()
        self.proc = SPAWN.Process(target=ipc_lease_worker.receive, args=(h, need, child))
        self.proc.start()
        child.close()

    def first(self):
        assert self.conn.poll(120), "the receiver did not answer"
        return self.conn.recv()

    def let_go(self):
        self.conn.send("close")
        assert self.conn.recv() == "closed"
        self.proc.join(30)

    def crash(self):
        self.conn.send("crash")
        self.proc.join(30)
        assert self.proc.exitcode == 9


def freed(ref, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        gc.collect()
        if ref() is None:
            return True
        time.sleep(0.02)
    return False


def test_descriptors_reach_the_receiver_and_its_hold_outlives_release():
    h, ref = export([b"alloc-0", b"alloc-1"])
    r = Receiver(h, [1, 0])
    assert r.first() == ("ok", [b"alloc-1", b"alloc-0"], 2)
    h.release()  # the exporter lets go; the receiver still holds
    time.sleep(0.3)
    gc.collect()
    assert ref() is not None
    r.let_go()
    assert freed(ref)


def test_a_crashed_receiver_releases_its_hold():
    h, ref = export([b"x"])
    r = Receiver(h, [0])
    assert r.first()[0] == "ok"
    h.release()
    r.crash()
    assert freed(ref)


def test_released_and_unknown_shares_are_refused():
    h, ref = export([b"x"])
    h.release()
    assert freed(ref)
    r = Receiver(h, [0])
    kind, msg = r.first()
    assert kind == "BufferError" and "was released" in msg
    r.proc.join(30)


def test_a_one_shot_share_ends_with_its_first_receiver():
    h, ref = export([b"once"], once=True)
    r = Receiver(h, [0])
    assert r.first()[1] == [b"once"]
    time.sleep(0.2)
    gc.collect()
    assert ref() is not None  # the receiver's hold
    r.let_go()
    assert freed(ref)



def test_many_descriptors_travel_in_chunks():
    n = 2 * _ipc._FDS_PER_MESSAGE + 50
    h, ref = export([b"%d" % i for i in range(n)])
    r = Receiver(h, list(range(n)))
    kind, heads, count = r.first()
    assert kind == "ok" and count == n and heads == [b"0", b"1", b"2"]
    r.let_go()
    h.release()
    assert freed(ref)


def test_exporter_gone_is_a_clear_error():
    h, _ = export([b"x"])
    h2 = _ipc._rebuild_share({k: getattr(h, k) for k in h.__slots__[:-2]})
    h2.address = "\0jax_overlay/no-such-exporter"
    with pytest.raises(BufferError, match="no longer serves its shares"):
        _ipc._request(h2, [0])
    h.release()


def test_an_exporter_that_never_answers_is_a_clear_error(monkeypatch):
    import socket
    from jax_overlay import config
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    silent.bind("\0jax_overlay-test/silent-" + str(os.getpid()))
    silent.listen(1)  # accepts into its backlog, never answers
    monkeypatch.setattr(config, "share_timeout_s", 0.5)
    h, _ = export([b"x"])
    h2 = _ipc._rebuild_share({k: getattr(h, k) for k in h.__slots__[:-2]})
    h2.address = silent.getsockname()
    t0 = time.monotonic()
    with pytest.raises(BufferError, match="did not answer within 0.5 s"):
        _ipc._request(h2, [0])
    assert time.monotonic() - t0 < 10
    silent.close()
    h.release()


def _child_state(out):
    out.put((_ipc._EXPORTER.server is None, _ipc._EXPORTER.address, len(_ipc._EXPORTER.entries)))


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning", "ignore:This process:DeprecationWarning")
def test_a_forked_child_lets_the_parents_socket_go():
    h, _ = export([b"x"])  # the server runs in this process
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    p = ctx.Process(target=_child_state, args=(out,))
    p.start()
    assert out.get(timeout=60) == (True, None, 0)
    p.join(30)
    h.release()
