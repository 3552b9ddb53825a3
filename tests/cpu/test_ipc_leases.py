"""The exporter's side of jax_overlay.share without a GPU: its socket
server, descriptors passed with SCM_RIGHTS, and the holds that keep a
share's arrays alive.  Entries carry memfd descriptors and a sentinel in
place of XLA's allocations and PJRT references; the receivers are real
processes speaking the real protocol (tests/cpu/ipc_lease_worker.py).
tests/gpu/test_ipc_gpu.py proves the same on XLA's memory."""

import gc
import multiprocessing
import os
import pickle
import time
import weakref

import pytest

from jax_overlay import _ipc

import ipc_lease_worker

SPAWN = multiprocessing.get_context("spawn")


class Sentinel:
    """Stands for the PJRT references a share keeps."""


LAYOUT = ("uuid", "event", "treedef", "leaves")


def export(payloads, *, once=False):
    """(Share, weak reference to the entry's sentinel) over memfds; its
    layout names each payload as an allocation."""
    _ipc._EXPORTER.start()
    fds = []
    for p in payloads:
        fd = os.memfd_create("jax_overlay-test")
        os.write(fd, p)
        fds.append(fd)
    sentinel = Sentinel()
    layout = pickle.dumps(LAYOUT + ([(0, len(p)) for p in payloads],))
    entry = _ipc._Entry(None, [sentinel], 0, fds, 0, None, 1, os.urandom(16), layout)
    h = _ipc._publish(entry, once, arrays=0, nbytes=0, allocations=len(fds),
                      exposed_bytes=0, copied=False)
    return h, weakref.ref(sentinel)


class Receiver:
    def __init__(self, h, need=None):
        self.conn, child = SPAWN.Pipe()
        # daemon: a receiver a failed test left waiting dies with pytest
        self.proc = SPAWN.Process(target=ipc_lease_worker.receive, args=(h, child), daemon=True)
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
    r = Receiver(h)
    assert r.first() == ("ok", [b"alloc-0", b"alloc-1"], 2, LAYOUT + ([(0, 7), (0, 7)],))
    h.release()  # the exporter lets go; the receiver still holds
    time.sleep(0.3)
    gc.collect()
    assert ref() is not None
    r.let_go()
    assert freed(ref)


def test_a_crashed_receiver_releases_its_hold():
    h, ref = export([b"x"])
    r = Receiver(h)
    assert r.first()[0] == "ok"
    h.release()
    r.crash()
    assert freed(ref)


def test_released_and_unknown_shares_are_refused():
    h, ref = export([b"x"])
    h.release()
    assert freed(ref)
    r = Receiver(h)
    kind, msg = r.first()
    assert kind == "BufferError" and "was released" in msg
    r.proc.join(30)


def test_a_one_shot_share_ends_with_its_first_receiver():
    h, ref = export([b"once"], once=True)
    r = Receiver(h)
    assert r.first()[1] == [b"once"]
    time.sleep(0.2)
    gc.collect()
    assert ref() is not None  # the receiver's hold
    r.let_go()
    assert freed(ref)



def test_many_descriptors_travel_in_chunks():
    n = 2 * _ipc._FDS_PER_MESSAGE + 50
    h, ref = export([b"%d" % i for i in range(n)])
    r = Receiver(h)
    kind, heads, count, _ = r.first()
    assert kind == "ok" and count == n and heads == [b"0", b"1", b"2"]
    r.let_go()
    h.release()
    assert freed(ref)


def test_exporter_gone_is_a_clear_error():
    h, _ = export([b"x"])
    h2 = pickle.loads(pickle.dumps(h))
    h2.address = "\0jax_overlay/no-such-exporter"
    with pytest.raises(BufferError, match="no longer serves its shares"):
        _ipc._request(h2)
    h.release()


def test_an_exporter_that_never_answers_is_a_clear_error(monkeypatch):
    import socket
    from jax_overlay import config
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    silent.bind("\0jax_overlay-test/silent-" + str(os.getpid()))
    silent.listen(1)  # accepts into its backlog, never answers
    monkeypatch.setattr(config, "share_timeout_s", 0.5)
    h, _ = export([b"x"])
    h2 = pickle.loads(pickle.dumps(h))
    h2.address = silent.getsockname()
    t0 = time.monotonic()
    with pytest.raises(BufferError, match="did not answer within 0.5 s"):
        _ipc._request(h2)
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


def _ask_as(uid, h):
    """What the exporter answers a process of user `uid` that presents
    share `h` (a forked child, which drops to `uid` first): (reply,
    descriptors received)."""
    import json
    import socket
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # only os, socket and json from here: nothing of the parent's threads
        try:
            os.setgid(uid)
            os.setuid(uid)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.settimeout(20)
            s.connect(h.address)
            s.send(json.dumps({"open": h.share_id, "token": h.token.hex()}).encode())
            msg, fds, _, _ = socket.recv_fds(s, 1 << 16, 8)
            os.write(w, json.dumps([msg.decode(errors="replace"), len(fds)]).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        out = f.read()
    os.waitpid(pid, 0)
    return json.loads(out)


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning", "ignore:This process:DeprecationWarning")
def test_a_receiver_of_another_user_is_refused():
    """The same-user check (SO_PEERCRED) is what keeps other users out: a
    process of another user that holds the share's name and token gets no
    layout and no descriptor."""
    if os.getuid() != 0:
        pytest.skip("needs root, to run the receiver as another user (CI runs as root)")
    h, ref = export([b"secret"])
    msg, fds = _ask_as(65534, h)
    assert "runs as user 65534" in msg and fds == 0, msg
    assert _ask_as(0, h)[0].startswith('{"ok": true'), "the same request as this user is served"
    h.release()
    assert freed(ref)


def test_a_released_share_is_refused_while_another_receiver_holds_it():
    """After release, no new receiver, even while an earlier one keeps the
    arrays alive: the entry lives on, released."""
    h, ref = export([b"x"])
    first = Receiver(h)
    assert first.first()[0] == "ok"
    h.release()
    second = Receiver(h)
    kind, msg = second.first()
    assert kind == "BufferError" and "was released" in msg
    second.proc.join(30)
    assert ref() is not None  # the first receiver's hold
    first.let_go()
    assert freed(ref)


def test_a_released_share_opened_in_the_exporter_is_an_error():
    h, ref = export([b"x"])
    keeper = Receiver(h)
    assert keeper.first()[0] == "ok"
    twin = pickle.loads(pickle.dumps(h))
    h.release()
    for share in (h, twin, pickle.dumps(h)):  # held by the receiver, but released
        with pytest.raises(BufferError, match="was released"):
            _ipc.open_shared(share)
    keeper.let_go()
    assert freed(ref)
    with pytest.raises(BufferError, match="was released"):  # and once gone
        _ipc.open_shared(twin)


def test_a_share_is_a_name_the_exporter_checks():
    """What a receiver maps comes from the exporter, which serves only the
    share's id with its token: a forged token or id gets nothing, and the
    fields a Share carries for display change nothing."""
    h, ref = export([b"alloc-0"])
    forged = pickle.loads(pickle.dumps(h))
    forged.token = bytes(16)
    r = Receiver(forged)
    kind, msg = r.first()
    assert kind == "BufferError" and "token does not match" in msg
    r.proc.join(30)
    other, _ = export([b"other"])
    forged = pickle.loads(pickle.dumps(h))
    forged.share_id = other.share_id  # a live share's id, with this share's token
    r = Receiver(forged)
    kind, msg = r.first()
    assert kind == "BufferError" and "token does not match" in msg
    r.proc.join(30)
    told = pickle.loads(pickle.dumps(h))
    told.nbytes, told.allocations = 1 << 40, 9
    r = Receiver(told)
    assert r.first() == ("ok", [b"alloc-0"], 1, LAYOUT + ([(0, 7)],))
    r.let_go()
    for s in (h, other):
        s.release()
    assert freed(ref)


def test_a_large_layout_travels_in_chunks():
    h, ref = export([b"x"])
    entry = _ipc._EXPORTER.entries[h.share_id]
    entry.layout = pickle.dumps(LAYOUT[:3] + (list(range(100_000)), [(0, 1)], None))
    assert len(entry.layout) > 4 * _ipc._CHUNK
    r = Receiver(h)
    kind, _, count, layout = r.first()
    assert kind == "ok" and count == 1 and layout[3] == list(range(100_000))
    r.let_go()
    h.release()
    assert freed(ref)


@pytest.mark.parametrize("bad", [b"", b"\x80\x05junk", pickle.dumps({"version": 2}),
                                 pickle.dumps(os.getcwd), pickle.dumps([1, 2])])
def test_bytes_that_are_no_share_are_a_buffer_error(bad):
    with pytest.raises(BufferError, match="share"):
        _ipc.open_shared(bad)


def test_damaged_share_bytes_never_crash_the_receiver():
    """A slice of tools/fuzz_share.py (its long runs: benchmarks/results/
    cpu-*-share-fuzz.json): every damaged share, opened in a process of its
    own, is a Python exception."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, os.path.join(root, "tools", "fuzz_share.py"),
                          "--cases", "300", "--seed", "2"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    import json
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["cases"] == 300 and sum(result["outcomes"].values()) == 300, result
