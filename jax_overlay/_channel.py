"""Room: one tree sent again every step.  ``channel(tree)`` is a persistent
share for a weight re-sync between two processes on one GPU: what
``share`` makes per call (an exportable allocation, interprocess events,
a connection, the receiver's mapping) is made once, and a step is

  sender:   one jitted pack of the tree into a buffer of XLA's, one device
            copy of it into the channel's slot, one event record, and a
            12-byte message;
  receiver: one event wait, one view of the slot, one jitted unpack into
            arrays of its own, one event record, and an 8-byte answer.

Ordering, on the GPU only: the copy waits for the pack (a definition event),
the receiver's view is defined behind the sender's event (every reader of
the unpacked arrays waits: computations, host reads, exports), and the
sender's next copy into a slot waits for the receiver's event recorded
after its unpack read that slot.  The host waits only when the receiver is
``slots`` steps behind (back-pressure; ``recv(latest=True)`` skips ahead).

Lifetime: the leaves are read by the pack, an execution of XLA's, so they
may be donated or deleted right after ``send``.  The packed buffer is held
until the copy out of it is done.  The slots live while either side has
them mapped; events live until both sides are done with them.
"""

from __future__ import annotations

import collections
import json
import os
import pickle
import secrets
import socket
import struct
import threading
import weakref
from typing import Any

import jax
import numpy as np

from . import _ipc, _pack, _view
from . import _runtime as rt
from . import _xla_ext as ext
from ._config import config
from ._dlpack import dtype_code
from ._vocab import KDLCUDA

CHANNEL_VERSION = 1
_SLOT_ALIGN = 256
_STEP = struct.Struct("<QI")   # sender -> receiver: (step, slot)
_ACK = struct.Struct("<Q")     # receiver -> sender: step, read (its slot may be reused)


def _this_process() -> int:
    return os.getpid()


class ChannelName:
    """What a receiver needs to open a channel: the sender's socket, a random
    token and where it runs.  Picklable; a capability (any process of the
    same user on this machine that holds it can open the channel, once)."""

    __slots__ = ("version", "address", "token", "pid", "boot_id", "host")
    _TYPES = {"version": int, "address": str, "token": bytes, "pid": int, "boot_id": str,
              "host": str}

    def __init__(self, version, address, token, pid, boot_id, host):
        self.version, self.address, self.token = version, address, token
        self.pid, self.boot_id, self.host = pid, boot_id, host

    def __reduce__(self):
        return (ChannelName, tuple(getattr(self, k) for k in self.__slots__))

    def __repr__(self):
        return f"jax_overlay.ChannelName(process {self.pid})"

    def check(self):
        for k, kind in self._TYPES.items():
            v = getattr(self, k)
            if type(v) is not kind:
                raise BufferError(f"this channel name is damaged: its field {k!r} is "
                                  f"{type(v).__name__} {v!r:.60}, not {kind.__name__}; send "
                                  "channel.name as jax_overlay pickles it")
        if self.version != CHANNEL_VERSION:
            raise BufferError(f"this channel has version {self.version}, this jax_overlay reads "
                              f"{CHANNEL_VERSION}: use the same jax_overlay in both processes")
        if self.boot_id != _ipc._BOOT_ID:
            raise BufferError(f"this channel was made on another machine ({self.host}): GPU "
                              "memory is shared between processes of one machine only")


class Channel:
    """The sending side of :func:`channel`."""

    def __init__(self, tree: Any, *, slots: int = 2):
        if type(slots) is not int or slots < 1:
            raise ValueError(f"slots={slots!r}: pass a positive int (2 lets the sender pack "
                             "the next step while the receiver reads this one)")
        with_path, self.treedef = jax.tree_util.tree_flatten_with_path(tree)
        leaves = [x for _, x in with_path]
        _, self.ordinal = _ipc._checked_leaves(with_path)  # every refusal, naming the leaf
        self.spec, self.total = _pack.layout(leaves)
        self._pack = _pack.tree_packer(self.treedef, self.spec, self.total)
        self.slots = slots
        self.slot_bytes = max(-(-self.total // _SLOT_ALIGN) * _SLOT_ALIGN, _SLOT_ALIGN)
        o = self.ordinal
        self._alloc = ext.alloc_exportable(o, slots * self.slot_bytes)
        self._fd = ext.export_fd(o, self._alloc.base)
        self._ready = [ext.new_event(o, True) for _ in range(slots)]
        self._done: list[int] = []          # the receiver's events, opened at its connection
        self._marks: list[int] = []         # free plain events
        self._held: collections.deque = collections.deque()  # (mark, packed, reference)
        self._queue: list[bytes] = []       # steps sent before the receiver connected
        self._lock = threading.Lock()
        self._connected = threading.Event()
        self._conn: socket.socket | None = None
        self._closed = False
        self.sent = 0
        self._acked = -1
        self._token = secrets.token_bytes(16)
        address = f"\0jax_overlay/channel/{os.getpid()}/{secrets.token_hex(16)}"
        self._srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._srv.bind(address)
        self._srv.listen(4)
        self.name = ChannelName(CHANNEL_VERSION, address, self._token, os.getpid(),
                                _ipc._BOOT_ID, socket.gethostname())
        # The thread holds the channel weakly: an unreferenced channel is
        # collected, and its close() ends the thread.
        threading.Thread(target=_serve, args=(self._srv, weakref.ref(self)),
                         name="jax_overlay-channel", daemon=True).start()

    # --- a step ---------------------------------------------------------------

    def send(self, tree: Any, *, timeout: float | None = None) -> None:
        """Sends `tree` (the channel's structure, shapes and dtypes) as the
        next step.  No host wait unless the receiver is `slots` steps behind
        (then up to `timeout` seconds, None: as long as it takes)."""
        if self._closed:
            raise BufferError("this channel is closed: make a new one")
        packed = self._pack(tree)  # reads the leaves on XLA's stream: they are free after
        o, k = self.ordinal, self.sent
        j = k % self.slots
        stream = _ipc._EXPORTER.stream(o)
        ptr = packed.unsafe_buffer_pointer() if self.total else 0
        if ptr:
            info = ext.pointer_info(ptr)
            if info.kind != "device" or info.ordinal != o:
                raise BufferError(f"this tree is on CUDA device {info.ordinal} ({info.kind} "
                                  f"memory), the channel on device {o}: send trees of its GPU")
        if k >= self.slots:
            self._await_ack(k - self.slots, timeout)
            # The receiver's unpack of step k - slots has read slot j.
            ext.wait_event(o, self._done[j], stream)
        hold = None
        if ptr:
            hold = rt.order_stream_after(packed, stream)  # the copy after the pack
            ext.copy_async(o, self._alloc.base + j * self.slot_bytes, ptr, self.total, stream)
        ext.record_event(o, self._ready[j].event, stream)
        self._keep(packed, hold, stream)
        self._post(_STEP.pack(k, j))
        self.sent = k + 1

    def _keep(self, packed, hold, stream):
        """Holds the packed buffer until the copy out of it is done (PJRT
        knows nothing of our stream's read), then lets it go."""
        o = self.ordinal
        mark = self._marks.pop() if self._marks else ext.new_event(o, False).event
        ext.record_event(o, mark, stream)
        self._held.append((mark, packed, hold))
        while self._held and ext.event_done(o, self._held[0][0]):
            self._marks.append(self._held.popleft()[0])

    def _post(self, msg):
        with self._lock:
            if self._conn is None:
                self._queue.append(msg)
                return
            conn = self._conn
        try:
            conn.send(msg)
        except OSError as e:
            raise BufferError(f"the receiver closed the channel (close() or exit; {e}): make "
                              "a new channel for a new receiver") from None

    def _await_ack(self, step, timeout):
        if self._acked >= step:
            return
        if not self._connected.wait(timeout):
            raise TimeoutError(f"no receiver opened this channel within {timeout} s, and "
                               f"{self.slots} steps wait unread: open_channel(channel.name) "
                               "in the receiving process")
        conn = self._conn
        assert conn is not None
        conn.settimeout(timeout)
        try:
            while self._acked < step:
                msg = conn.recv(64)
                if not msg:
                    raise BufferError("the receiver closed the channel (close() or exit): "
                                      "make a new channel for a new receiver")
                self._acked = _ACK.unpack(msg)[0]
        except TimeoutError:
            raise TimeoutError(f"the receiver has not read step {step} within {timeout} s "
                               f"(it is {self.sent - step} steps behind): call recv() there, "
                               "or recv(latest=True) to skip ahead") from None
        finally:
            if not self._closed:
                conn.settimeout(None)

    # --- the receiver's connection (a thread) -----------------------------------

    def _handshake(self, conn):
        conn.settimeout(config.share_timeout_s)
        uid = _ipc._peer_uid(conn)
        req = json.loads(conn.recv(4096))
        why = None
        if uid != os.getuid():
            why = (f"the receiving process runs as user {uid}, the sender as user "
                   f"{os.getuid()}: channels open only between processes of one user")
        elif not secrets.compare_digest(bytes.fromhex(req["token"]), self._token):
            why = "this channel name's token does not match: it was damaged or forged"
        elif self._conn is not None or self._closed:
            why = ("this channel has its receiver already (or is closed): make one channel "
                   "per receiver")
        if why is not None:
            conn.send(json.dumps({"error": why}).encode())
            conn.close()
            return
        layout = pickle.dumps((ext.device_uuid(self.ordinal), self.treedef, self.spec,
                               self.total, self.slot_bytes, self.slots, self._alloc.size,
                               [e.handle for e in self._ready]))
        conn.send(json.dumps({"ok": True, "size": len(layout)}).encode())
        _ipc._send_chunks(conn, layout)
        socket.send_fds(conn, [b"fd"], [self._fd])
        reply = json.loads(conn.recv(4096))
        done = [ext.open_ipc_event(self.ordinal, bytes.fromhex(h)) for h in reply["done"]]
        if len(done) != self.slots:
            raise ValueError("the receiver sent another number of events")
        conn.settimeout(None)
        with self._lock:
            self._done, self._conn = done, conn
            queued, self._queue = self._queue, []
            for msg in queued:  # in order, before any later step (the lock)
                conn.send(msg)
        self._connected.set()

    # --- the end ----------------------------------------------------------------

    def close(self) -> None:
        """No more steps.  The receiver still gets those already sent; the
        slots and events are freed once it has let go (or at once if no
        receiver connected)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._srv.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
        except OSError:
            pass
        self._srv.close()
        with self._lock:
            conn = self._conn
        if conn is None:
            self._free()
            return
        try:
            conn.shutdown(socket.SHUT_WR)  # the receiver reads what was sent, then EOF
        except OSError:
            pass
        # The receiver may still wait on our events and read our slots:
        # they are freed only once it has let go (its end of the socket).
        threading.Thread(target=self._free_after, args=(conn,), name="jax_overlay-channel-free",
                         daemon=True).start()

    def _free_after(self, conn):
        try:
            conn.settimeout(None)
            while conn.recv(64):
                pass
        except OSError:
            pass
        conn.close()
        self._free()

    def _free(self):
        o = self.ordinal
        try:
            while self._held:  # the copies out of the packed buffers are done
                if ext.event_done(o, self._held[0][0]):
                    self._marks.append(self._held.popleft()[0])
                else:
                    threading.Event().wait(0.0005)
            for ev in self._marks + [e.event for e in self._ready] + self._done:
                ext.destroy_event(o, ev)
            ext.unmap(o, self._alloc.base, self._alloc.size, True)
            os.close(self._fd)
        except (BufferError, OSError):
            pass  # the driver is shutting down with the process
        self._marks, self._ready, self._done = [], [], []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def _serve(srv, ref):
    """The sender's thread: answers the receiver's connection (and refuses
    any later one)."""
    while True:
        try:
            conn, _ = srv.accept()
        except OSError:  # closed
            return
        ch = ref()
        if ch is None:
            conn.close()
            return
        try:
            ch._handshake(conn)
        except (OSError, ValueError, KeyError, TypeError, BufferError):
            conn.close()
        del ch


class Receiver:
    """The receiving side of a channel: :func:`open_channel`'s result."""

    def __init__(self, name: ChannelName):
        if not isinstance(name, ChannelName):
            raise TypeError(f"open_channel takes a jax_overlay.ChannelName (channel.name), not "
                            f"{type(name).__module__}.{type(name).__qualname__}")
        name.check()
        if name.pid == _this_process():
            # CUDA's interprocess events open in other processes only.
            raise BufferError("this channel was made in this process: its receiver is another "
                              "process (in this one, use the arrays themselves)")
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        conn.settimeout(config.share_timeout_s)
        fds: list[int] = []
        try:
            try:
                conn.connect(name.address)
            except (OSError, ValueError) as e:
                raise BufferError(f"the sending process (pid {name.pid}) no longer serves this "
                                  f"channel ({e}): it has exited or closed it") from None
            uid = _ipc._peer_uid(conn)
            if uid != os.getuid():
                raise BufferError(f"the process serving this channel runs as user {uid}, this "
                                  f"one as user {os.getuid()}: channels open only between "
                                  "processes of one user")
            conn.send(json.dumps({"token": name.token.hex()}).encode())
            head = conn.recv(4096)
            reply = json.loads(head) if head else {"error": "the sender closed the connection"}
            if "error" in reply:
                raise BufferError(reply["error"])
            data = _ipc._recv_chunks(conn, int(reply["size"]), "the sender")
            _, fds, _, _ = socket.recv_fds(conn, 16, 1)
            if len(fds) != 1:
                raise BufferError("the sender sent no descriptor for its slots")
            # From a process of this user that knew the channel's token.
            (uuid, treedef, spec, self.total, self.slot_bytes, self.slots, size,
             ready) = pickle.loads(data)
            self.ordinal = o = _ipc._ordinal_of(uuid)
            self.device = rt.gpu_device(o)
            # The views of the slots hold the mapping: a pending unpack reads
            # mapped memory even after this receiver is closed.
            self._mapping = _ipc._Mapping(o, ext.map_fd(o, fds[0], size), size)
            self._ready = [ext.open_ipc_event(o, h) for h in ready]
            self._done = [ext.new_event(o, True) for _ in range(self.slots)]
            conn.send(json.dumps({"done": [e.handle.hex() for e in self._done]}).encode())
        except TimeoutError:
            conn.close()
            raise BufferError(f"the sending process (pid {name.pid}) did not answer within "
                              f"{config.share_timeout_s} s (jax_overlay.config.share_timeout_s)"
                              ) from None
        except BaseException:
            conn.close()
            raise
        finally:
            for fd in fds:
                os.close(fd)
        conn.settimeout(None)
        self._conn: socket.socket | None = conn
        self._unpack = _pack.tree_unpacker(treedef, spec)
        self._uint8 = dtype_code(np.dtype(np.uint8))
        self._sender_done = False
        self.received = 0

    def recv(self, *, timeout: float | None = None, latest: bool = False) -> Any:
        """The next step's tree, as new JAX arrays of this process, ordered
        after the sender's writes on the GPU (no host wait for them).  Waits
        up to `timeout` seconds for a step (None: as long as it takes).
        `latest=True`: skip to the newest step already sent, letting the
        sender reuse the skipped steps' slots."""
        if self._conn is None:
            raise BufferError("this receiver is closed: open the channel's name again? (a "
                              "channel has one receiver: make a new channel)")
        conn = self._conn
        msg = self._next(conn, timeout)
        if latest:
            while True:
                try:
                    more = conn.recv(64, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    break
                if not more:
                    self._sender_done = True
                    break
                # Never read: the sender may reuse its slot at once.
                conn.send(_ACK.pack(_STEP.unpack(msg)[0]))
                msg = more
        k, j = _STEP.unpack(msg)
        o = self.ordinal
        stream = rt.ready_stream(self.device)
        # The view of slot j is defined behind the sender's copy of step k.
        ext.wait_event(o, self._ready[j], stream)
        if self.total:
            cap = ext.raw_capsule(self._mapping, self._mapping.va + j * self.slot_bytes,
                                  (self.total,), None, self._uint8, KDLCUDA, o)
            buf = _view.import_view(cap, self.device, False, KDLCUDA, stream)
        else:
            buf = _view.empty((0,), np.uint8, self.device)
        out, read = self._unpack(buf)
        if self.total:
            # Slot j may be written again once the unpack has read it: our
            # event, recorded behind the unpack's outputs' definition.
            done_stream = _ipc._EXPORTER.stream(o)
            rt.order_stream_after(read, done_stream)
            ext.record_event(o, self._done[j].event, done_stream)
        conn.send(_ACK.pack(k))
        self.received += 1
        return out

    def _next(self, conn, timeout):
        conn.settimeout(timeout)
        try:
            msg = conn.recv(64)
        except TimeoutError:
            raise TimeoutError(f"no step arrived within {timeout} s") from None
        finally:
            conn.settimeout(None)
        if not msg:
            self._sender_done = True
            raise BufferError("the sender closed the channel (close() or exit), and every "
                              "step it sent has been received")
        return msg

    def close(self) -> None:
        """Lets the channel go: the sender may free its slots."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        conn.close()
        o = self.ordinal
        try:
            for ev in self._ready:  # our handles of the sender's events (waits are enqueued)
                ext.destroy_event(o, ev)
            if self._sender_done:
                # The sender waits on our events no more.  Otherwise they are
                # left alive: a wait it enqueued on them may still be pending.
                for e in self._done:
                    ext.destroy_event(o, e.event)
        except BufferError:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def channel(tree: Any, *, slots: int = 2) -> Channel:
    """A persistent channel for sending trees of `tree`'s structure, shapes
    and dtypes again and again to one receiver process on the same GPU
    (a weight re-sync).  Pass ``ch.name`` (picklable) to the receiver, which
    calls :func:`open_channel`; then ``ch.send(tree)`` each step and
    ``rx.recv()`` there.  `slots`: steps that can be in flight before the
    sender waits for the receiver."""
    return Channel(tree, slots=slots)


def open_channel(name: ChannelName) -> Receiver:
    """The receiving end of the channel named `name` (``channel.name``,
    from another process of this user on this machine); its ``recv()``
    gives each step's tree as JAX arrays of this process."""
    return Receiver(name)
