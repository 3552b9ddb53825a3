"""Room: beyond one process.  ``share`` turns a pytree of GPU ``jax.Array``s
into a small picklable :class:`Share`; ``open_shared`` in another process of
the same machine and user gives the same pytree back, zero-copy, as JAX
arrays or as PyTorch/CuPy tensors.

Mechanism (xla_ext/ipc.cc): XLA allocates its buffers with the driver's
virtual memory management (cuMemCreate), which legacy CUDA IPC cannot share
but which exports as a POSIX file descriptor.  A share names each underlying
allocation once, with every array's offset in it; the exporting process
runs one server thread on an abstract Unix socket whose name holds a
128-bit random token, and hands the descriptors over it (SCM_RIGHTS) to
processes of the same user.  A receiver maps each allocation once per
process while any of its opened arrays lives.

Ordering: the share waits on its own stream for every array's pending
computation and records an interprocess event there; a JAX receiver's
ready stream waits on that event on the GPU and defines the opened arrays
behind it (a framework receiver's current stream waits on it instead).
No host waits on either side.

A share is a name: the exporter's socket, the share's id and a random
token.  The layout a receiver maps comes from the exporter's answer.

Lifetime: the exporter holds every shared array (through a PJRT external
reference, which also refuses donation) while the share is unreleased or
any receiver holds it.  A receiver holds it through its open connection,
which the kernel closes when the receiver exits or crashes.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import secrets
import selectors
import socket
import struct
import sys
import threading
import weakref
from typing import Any

import jax
import numpy as np

from . import _runtime as rt
from . import _pack, _view
from . import _xla_ext as ext
from . import peers
from ._config import config
from ._dlpack import dtype_code
from ._vocab import KDLCUDA

# Bumped when a Share's fields or the socket protocol change: a receiver
# refuses another version by name instead of misreading it.
SHARE_VERSION = 2
_ALIGN = 256          # each array's offset in a copy=True allocation
_FDS_PER_MESSAGE = 200  # under the kernel's SCM_MAX_FD (253)
_CHUNK = 1 << 16        # bytes of the layout per message (SEQPACKET keeps them framed)
_TOKEN_BYTES = 16


# The socket steps shares and channels (_channel) take alike.
def _peer_uid(conn) -> int:
    """The user id of the process at the other end of `conn`."""
    _, uid, _ = struct.unpack("3i", conn.getsockopt(
        socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return uid


def _send_chunks(conn, data: bytes) -> None:
    for k in range(0, len(data), _CHUNK):
        conn.send(data[k:k + _CHUNK])


def _recv_chunks(conn, size: int, who: str) -> bytes:
    """`size` bytes sent by _send_chunks; a BufferError if `who` closes first."""
    data = bytearray()
    while len(data) < size:
        part = conn.recv(_CHUNK)
        if not part:
            raise BufferError(f"{who} closed the connection mid-answer")
        data += part
    return bytes(data)


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


_BOOT_ID = _boot_id()


class Share:
    """A share of a pytree of GPU arrays: a name, small and picklable, and a
    capability (any process of the same user on this machine that holds it
    can map the memory it names; never send it over a network).

    It carries no layout a receiver trusts: the exporter's socket address,
    the share's id and a random token.  open_shared presents the id and
    token to the exporter, which answers with the authoritative layout
    (GPU, event, tree, each array's allocation and offset) and the
    allocations' descriptors.  Damaged or forged bytes therefore give an
    exception, never another allocation's memory.

    In the exporting process the object also ends the share: ``release()``
    (or its garbage collection, or leaving ``with share(...) as h:``) stops
    new opens, and the arrays are let go once every receiver has let go.

    ``arrays``, ``nbytes``, ``allocations`` (how many), ``exposed_bytes``,
    ``copied``: what the share holds, for display.  ``exposed_bytes``: the
    bytes of the allocations a receiver maps, every JAX buffer in them
    included.  With XLA's preallocated pool that is the whole pool;
    ``share(tree, copy=True)`` exposes one dedicated allocation instead."""

    __slots__ = ("version", "address", "share_id", "token", "pid", "boot_id", "host",
                 "arrays", "nbytes", "allocations", "exposed_bytes", "copied",
                 "_local", "__weakref__")
    version: int          # SHARE_VERSION of the exporter's jax_overlay
    address: str          # the exporter's abstract socket
    share_id: int
    token: bytes          # random, the exporter's: proves the share was handed out
    pid: int              # the exporting process
    boot_id: str          # the kernel's boot id: the machine
    host: str
    arrays: int
    nbytes: int
    allocations: int
    exposed_bytes: int
    copied: bool
    _local: bool          # this object ends the share (the exporter's own)

    def __init__(self, **fields: Any):
        self._local = False
        for k, v in fields.items():
            setattr(self, k, v)

    def __reduce__(self):
        return (_rebuild_share, (_state(self),))

    def __repr__(self):
        return (f"jax_overlay.Share({self.arrays} arrays, {self.nbytes} bytes in "
                f"{self.allocations} allocations of {self.exposed_bytes} bytes, "
                f"process {self.pid}, share {self.share_id}"
                f"{', copied' if self.copied else ''})")

    def release(self) -> None:
        """Ends the share in the exporting process: no new opens; the
        arrays are let go once every receiver has.  A no-op in receivers
        and when called again."""
        if self._local:
            self._local = False
            _EXPORTER.release(self.share_id)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()

    def __del__(self):
        try:
            self.release()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


# Each pickled field and the types it may have: a share is read only
# through these, so damaged bytes are an exception naming the field.
_FIELDS = {"version": int, "address": str, "share_id": int, "token": bytes, "pid": int,
           "boot_id": str, "host": str, "arrays": int, "nbytes": int, "allocations": int,
           "exposed_bytes": int, "copied": bool}


def _state(share) -> dict:
    return {k: getattr(share, k) for k in _FIELDS}


class _ShareUnpickler(pickle.Unpickler):
    """Reads a pickled Share and nothing else: no other global can load."""

    def find_class(self, module, name):
        if (module, name) == (__name__, "_rebuild_share"):
            return _rebuild_share
        raise pickle.UnpicklingError(
            f"these bytes name {module}.{name}, not a jax_overlay share")


def loads(data) -> Share:
    """The Share pickled in `data` (bytes), read without running anything
    else the bytes might name: damaged or foreign bytes give an exception
    (BufferError, or pickle's own for bytes that are no pickle)."""
    try:
        share = _ShareUnpickler(io.BytesIO(data)).load()
    except BufferError:
        raise
    except Exception as e:  # noqa: BLE001 - pickle raises many classes on damaged bytes
        raise BufferError(f"these bytes are not a jax_overlay share ({type(e).__name__}: "
                          f"{e}); send pickle.dumps(share) of a Share") from None
    if not isinstance(share, Share):
        raise BufferError(f"these bytes hold a {type(share).__name__}, not a jax_overlay share")
    return share


def _rebuild_share(state):
    if type(state) is not dict or type(state.get("version")) is not int:
        raise BufferError("these bytes are not a jax_overlay share (damaged in transit?): "
                          "send the Share object as jax_overlay pickles it")
    if state["version"] != SHARE_VERSION:
        raise BufferError(
            f"this share has format version {state['version']}, but this jax_overlay reads "
            f"version {SHARE_VERSION}: use the same jax_overlay in both processes")
    for k, kind in _FIELDS.items():
        v = state.get(k)
        if type(v) is not kind:
            raise BufferError(
                f"this share is damaged: its field {k!r} is {type(v).__name__} {v!r:.60}, "
                f"not {kind.__name__}; send the Share object as jax_overlay pickles it")
    if len(state) != len(_FIELDS) or len(state["token"]) != _TOKEN_BYTES:
        raise BufferError("this share is damaged (its fields or token are not a share's): "
                          "send the Share object as jax_overlay pickles it")
    return Share(**state)


class _Entry:
    """The exporter's record of one share."""

    def __init__(self, tree, keep, ordinal, fds, event, dedicated, holds, token, layout):
        self.tree = tree            # the original pytree (same-process opens)
        self.token = token          # the Share's: an open must present it
        self.layout = layout        # pickled (GPU uuid, event handle, treedef, leaves, allocations)
        self.keep = keep            # jaxlib capsules: PJRT external references
        self.ordinal = ordinal
        self.fds = fds              # one descriptor per allocation
        self.event = event
        self.dedicated = dedicated  # (va, size) of a copy=True allocation
        self.holds = holds          # the Share object or a pending first open, and receivers
        self.released = False
        self.once = False           # a one-shot share: its first open takes its hold


class _Exporter:
    """This process's share server: one thread, one abstract Unix socket."""

    def __init__(self):
        # Reentrant: a Share collected while this thread holds the lock
        # releases itself through it.
        self.lock = threading.RLock()
        self.entries: dict[int, _Entry] = {}
        self.next_id = 1
        self.pid = None
        self.address = None
        self.streams: dict[int, int] = {}
        self.server: socket.socket | None = None

    def forked(self):
        """In a forked child: the parent's socket, connections and entries
        are the parent's.  Kept open here, the listening socket would
        accept connections to the parent's address after the parent died,
        and nobody would answer them."""
        if self.server is not None:
            self.server.close()
        self.server = None
        self.lock = threading.RLock()  # a lock held mid-fork stays held in the child
        self.entries, self.pid, self.address = {}, None, None

    def start(self):
        with self.lock:
            if self.pid == os.getpid():
                return
            # A fork's child inherits no thread: it serves its own shares.
            self.entries, self.next_id, self.streams = {}, 1, {}
            name = f"\0jax_overlay/{os.getpid()}/{secrets.token_hex(16)}"
            srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            srv.bind(name)
            srv.listen(64)
            self.address, self.pid, self.server = name, os.getpid(), srv
            threading.Thread(target=self._serve, args=(srv,), name="jax_overlay-share-server",
                             daemon=True).start()

    def stream(self, ordinal):
        s = self.streams.get(ordinal)
        if s is None:
            s = self.streams[ordinal] = ext.new_stream(ordinal)
        return s

    def add(self, entry) -> int:
        with self.lock:
            sid = self.next_id
            self.next_id += 1
            self.entries[sid] = entry
        return sid

    def release(self, sid):
        """The exporter's own hold ends (once): no new opens."""
        self._drop(sid, release=True)

    def _drop(self, sid, release=False):
        """One hold on share `sid` ends; the last one frees it."""
        with self.lock:
            e = self.entries.get(sid)
            if e is None or (release and e.released):
                return
            e.released = e.released or release
            e.holds -= 1
            dead = e.holds == 0
            if dead:
                del self.entries[sid]
        if dead:
            _free(e)

    def live(self) -> int:
        with self.lock:
            return len(self.entries)

    # The server thread.  A connection is one receiver's open of one share:
    # its first message asks for the share and the descriptors it lacks,
    # and the connection then stays open for as long as the receiver holds
    # the share.  Its end (the receiver let go, exited or crashed: the
    # kernel closes it in every case) drops that hold.
    def _serve(self, srv):
        sel = selectors.DefaultSelector()
        sel.register(srv, selectors.EVENT_READ, None)
        while True:
            for key, _ in sel.select():
                if key.data is None:
                    try:
                        conn, _ = srv.accept()
                    except OSError:
                        continue
                    sel.register(conn, selectors.EVENT_READ, [0])
                    continue
                conn, held = key.fileobj, key.data
                assert isinstance(conn, socket.socket)
                try:
                    msg = conn.recv(65536)
                except OSError:
                    msg = b""
                if msg and not held[0]:
                    held[0] = self._answer(conn, msg)
                    if held[0]:
                        continue
                    msg = b""
                if not msg:  # the receiver let go
                    sel.unregister(conn)
                    conn.close()
                    if held[0]:
                        self._drop(held[0])

    def _answer(self, conn, msg) -> int:
        """Serves one open: the layout, then every allocation's descriptor.
        Returns the share's id when the receiver now holds it."""
        try:
            uid = _peer_uid(conn)
            req = json.loads(msg)
            sid, token = int(req["open"]), bytes.fromhex(req["token"])
        except (OSError, ValueError, KeyError, TypeError):
            return 0
        with self.lock:
            e = self.entries.get(sid)
            why: str | None = None
            if uid != os.getuid():
                why = (f"the receiving process runs as user {uid} and the exporter as user "
                       f"{os.getuid()}: shares open only between processes of one user")
            elif e is None or e.released:
                why = (f"share {sid} of process {os.getpid()} was released: make a new share "
                       "in the exporting process")
            elif not secrets.compare_digest(token, e.token):
                why = (f"this share's token does not match share {sid} of process "
                       f"{os.getpid()}: the share was damaged or forged; send the Share "
                       "object as jax_overlay pickles it")
            else:
                e.holds += 1
                if e.once:  # a one-shot share's pending hold passes to its receiver
                    e.once = False
                    e.holds -= 1
        try:
            if why is not None:
                conn.send(json.dumps({"error": why}).encode())
                return 0
            assert e is not None  # held: not freed meanwhile
            conn.send(json.dumps({"ok": True, "size": len(e.layout), "fds": len(e.fds)}).encode())
            _send_chunks(conn, e.layout)
            for k in range(0, len(e.fds), _FDS_PER_MESSAGE):
                socket.send_fds(conn, [b"fds"], e.fds[k:k + _FDS_PER_MESSAGE])
            return sid
        except OSError:  # the receiver went away mid-answer
            if why is None:
                self._drop(sid)
            return 0


def _free(e: _Entry) -> None:
    """Lets a share's arrays go (every receiver has)."""
    for fd in e.fds:
        os.close(fd)
    try:
        if e.dedicated is not None:
            # The copies into it must be done before it is unmapped.
            while not ext.event_done(e.ordinal, e.event):
                threading.Event().wait(0.0005)
            va, size = e.dedicated
            ext.unmap(e.ordinal, va, size, False)
        ext.destroy_event(e.ordinal, e.event)
    except BufferError:
        pass  # the driver is shutting down with the process
    e.keep = e.tree = None


_EXPORTER = _Exporter()
os.register_at_fork(after_in_child=_EXPORTER.forked)


def _leaf_error(path, x):
    where = jax.tree_util.keystr(path) or "the tree"
    if not isinstance(x, jax.Array):
        return TypeError(
            f"share takes a pytree of jax.Arrays; {where} is a "
            f"{type(x).__module__}.{type(x).__qualname__}: jnp.asarray it first, or "
            "leave it out of the tree")
    try:
        rt.refuse_deleted(x, where, "there is nothing to share")
        rt.refuse_sharded(x, where, BufferError, "share takes single-device arrays: share "
                          "[s.data for s in x.addressable_shards] instead")
    except BufferError as e:
        return e
    dev = next(iter(x.sharding.device_set))
    if getattr(dev, "platform", None) != "gpu":
        return BufferError(
            f"{where} is on {dev} (host memory): share maps GPU memory between processes; "
            "send host arrays by pickling them (multiprocessing copies them), or put them "
            "on the GPU first with jax.device_put")
    kind = getattr(x.sharding, "memory_kind", None)
    if kind not in (None, "device"):
        return BufferError(
            f"{where} is in JAX's {kind!r} memory (pinned host memory, which CUDA's "
            "virtual memory sharing does not cover): move it to the device first with "
            "jax.device_put(x, x.sharding.with_memory_kind('device')), or pickle it")
    return None


def share(tree: Any, *, copy: bool = False, pack: bool = False) -> Share:
    """A :class:`Share` of a pytree of single-device GPU ``jax.Array``s, for
    :func:`open_shared` in another process on the same machine and GPU.

    Zero-copy by default: each XLA allocation holding a leaf is named once,
    with every leaf's offset in it; ``Share.exposed_bytes`` says how much
    memory a receiver can then map (with XLA's preallocated pool, the whole
    pool, every JAX buffer in it included).  ``copy=True`` instead copies
    the leaves, on the GPU, into one dedicated allocation that is all a
    receiver sees (also the way to share from XLA's ``cuda_async``
    allocator, whose pool cannot be exported).

    ``pack=True``, for a tree shared again every step (a weight re-sync):
    one jitted call writes every leaf into one new buffer on the GPU, and
    that buffer is shared; a JAX receiver unpacks it with one jitted call
    into arrays of its own, another framework's receiver views the leaves
    in it.  Two device copies of the tree replace a host-side step per
    array on each side, and the share holds the packed buffer, not the
    leaves (which may then be donated).

    Never waits on the host: receivers are ordered after the leaves'
    pending computations on the GPU.  The exporter holds the leaves (they
    cannot be donated) until the share is released and every receiver has
    let go."""
    return _share(tree, copy=copy, once=False, pack=pack)


def _share(tree, *, copy, once, pack=False):
    leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
    leaves = [x for _, x in leaves_with_path]
    packed = None
    if pack:
        packed, buf, ptrs, ordinal = _packed(leaves_with_path)
        leaves, tree = [buf], _Packed(buf, packed, treedef)
    else:
        ptrs, ordinal = _checked_leaves(leaves_with_path)
    _EXPORTER.start()
    stream = _EXPORTER.stream(ordinal)
    # The share's stream waits on the GPU for every leaf's definition; each
    # capsule is a PJRT external reference that keeps the buffer alive and
    # refuses its donation until the share's entry is freed.
    keep = [rt.order_stream_after(x, stream) for x, p in zip(leaves, ptrs) if p]
    dedicated = None
    if copy:
        mine, spots = _copied(ordinal, leaves, ptrs, stream)
        dedicated = (mine.base, mine.size)
        allocs, bases = [(mine.block_id, mine.size)], [mine.base]
    else:
        allocs, bases, spots = _allocations(ordinal, leaves_with_path, ptrs)
    fds: list[int] = []
    try:
        for b in bases:
            fds.append(ext.export_fd(ordinal, b))
        recorded = ext.record_ipc_event(ordinal, stream)
        event, event_handle = recorded.event, recorded.handle
    except BaseException:
        for fd in fds:
            os.close(fd)
        if dedicated is not None:
            ext.unmap(ordinal, dedicated[0], dedicated[1], True)
        raise
    described = [(i, off, tuple(x.shape), x.dtype.name) for (i, off), x in zip(spots, leaves)]
    whole = None
    if packed is not None:
        # Each leaf where the packed buffer holds it, and the buffer itself
        # (for a JAX receiver's one unpacking call).
        (i, off), = spots
        whole = (i, off, leaves[0].nbytes)
        described = [(i, off + o, shape, name) if i >= 0 else (-1, 0, shape, name)
                     for o, shape, name in packed]
    # What receivers are told over the socket, never read from the Share.
    layout = pickle.dumps((ext.device_uuid(ordinal), event_handle, treedef, described, allocs,
                           whole))
    return _publish(_Entry(tree, keep, ordinal, fds, event, dedicated, 1,
                           secrets.token_bytes(_TOKEN_BYTES), layout), once,
                    arrays=len(described), nbytes=sum(x.nbytes for x in leaves),
                    allocations=len(allocs), exposed_bytes=sum(size for _, size in allocs),
                    copied=bool(copy))


class _Packed:
    """A packed share's tree, for an open in the exporting process: the
    buffer unpacked (the leaves themselves may be donated by then)."""

    def __init__(self, buf, spec, treedef):
        self.buf, self.spec, self.treedef = buf, spec, treedef

    def unpacked(self):
        return jax.tree_util.tree_unflatten(self.treedef, _pack.unpacker(self.spec)(self.buf))


def _packed(leaves_with_path):
    """(spec, the packed buffer, its pointer as a list, its GPU): the leaves
    written into one buffer by one jitted call, checked as one array.  Only
    where that fails is every leaf checked, for the error that names one:
    the check costs a host-side step per leaf, which pack=True exists to
    avoid."""
    for path, x in leaves_with_path:  # wrong types first
        if not isinstance(x, jax.Array):
            raise TypeError(str(_leaf_error(path, x)))
    leaves = [x for _, x in leaves_with_path]
    spec, total = _pack.layout(leaves)
    try:
        buf = _pack.packer(spec, total)(leaves)
        ptrs, ordinal = _checked_leaves([((), buf)])
    except Exception:
        _checked_leaves(leaves_with_path)  # raises the error naming a leaf
        raise
    return spec, buf, ptrs, ordinal


def _checked_leaves(leaves_with_path):
    """(each leaf's pointer, 0 for an empty one; the GPU they are all on):
    every refusal first, wrong types before anything else, each naming the
    leaf."""
    for path, x in leaves_with_path:  # wrong types first, wherever they are
        if not isinstance(x, jax.Array):
            raise TypeError(str(_leaf_error(path, x)))
    for path, x in leaves_with_path:
        err = _leaf_error(path, x)
        if err is not None:
            raise err
    ordinal, ptrs = None, []
    for path, x in leaves_with_path:
        ptr = x.unsafe_buffer_pointer() if x.size else 0
        if ptr:
            info = ext.pointer_info(ptr)
            if info.kind != "device":
                raise BufferError(
                    f"{jax.tree_util.keystr(path)}: its memory is {info.kind}, not GPU "
                    "device memory: jax.device_put it onto a GPU first")
            if ordinal is None:
                ordinal = info.ordinal
            elif info.ordinal != ordinal:
                raise BufferError(
                    f"{jax.tree_util.keystr(path)} is on CUDA device {info.ordinal}, others "
                    f"on device {ordinal}: one share holds the arrays of one GPU; make one "
                    "share per GPU")
        if x.size and rt.byte_strides(x, x.dtype.itemsize) is not None:
            raise BufferError(
                f"{jax.tree_util.keystr(path)} has a non-row-major layout: share row-major "
                "arrays (jnp.copy it with the default layout first)")
        ptrs.append(ptr)
    # Nothing with memory: any visible GPU names the share.
    return ptrs, 0 if ordinal is None else ordinal


def _copied(ordinal, leaves, ptrs, stream):
    """(the dedicated allocation, each leaf's (0, offset) in it or (-1, 0)):
    share(copy=True)'s one exportable allocation, the leaves copied into it
    on the share's stream (after their definitions)."""
    offsets, total = [], 0
    for x, p in zip(leaves, ptrs):
        offsets.append(total if p else -1)
        total += -(-x.nbytes // _ALIGN) * _ALIGN if p else 0
    mine = ext.alloc_exportable(ordinal, max(total, 1))
    for x, p, off in zip(leaves, ptrs, offsets):
        if p:
            ext.copy_async(ordinal, mine.base + off, p, x.nbytes, stream)
    return mine, [(0, off) if off >= 0 else (-1, 0) for off in offsets]


def _allocations(ordinal, leaves_with_path, ptrs):
    """(allocations as (block id, bytes), their bases, each leaf's
    (allocation index, offset) or (-1, 0)): XLA's allocations holding the
    leaves, each named once."""
    by_block: dict[Any, int] = {}
    allocs: list = []
    bases: list = []
    spots: list = []
    for (path, x), p in zip(leaves_with_path, ptrs):
        if not p:
            spots.append((-1, 0))
            continue
        a = ext.allocation_of(ordinal, p)
        base, size, block = a.base, a.size, a.block_id
        if not a.handle_types & ext.HANDLE_POSIX_FD:
            raise BufferError(
                f"{jax.tree_util.keystr(path)}: XLA's allocator gave this buffer memory "
                "that cannot be exported as a file descriptor (XLA's cuda_async "
                "allocator's pool cannot be); share(tree, copy=True) copies the tree "
                "into one exportable allocation, or run with another "
                "XLA_PYTHON_CLIENT_ALLOCATOR")
        if p + x.nbytes > base + size:
            raise BufferError(
                f"{jax.tree_util.keystr(path)} spans two of XLA's allocations; "
                "share(tree, copy=True) copies it into one")
        key = block or base
        i = by_block.get(key)
        if i is None:
            i = by_block[key] = len(allocs)
            allocs.append((block, size))
            bases.append(base)
        spots.append((i, p - bases[i]))
    return allocs, bases, spots


def _publish(entry, once, **what) -> Share:
    """Registers `entry` with this process's server and names it: the
    Share.  `what`: the Share's descriptive fields."""
    entry.once = once
    _EXPORTER.start()
    sid = _EXPORTER.add(entry)
    h = Share(version=SHARE_VERSION, address=_EXPORTER.address, share_id=sid,
              token=entry.token, pid=os.getpid(), boot_id=_BOOT_ID,
              host=socket.gethostname(), **what)
    h._local = not once  # a one-shot share ends with its first receiver
    return h


# The receiver's side.  One mapping per exporter allocation per process,
# shared by every open share that names it and unmapped when the last of
# them is let go.
class _Mapping:
    __slots__ = ("ordinal", "va", "size", "__weakref__")

    def __init__(self, ordinal, va, size):
        self.ordinal, self.va, self.size = ordinal, va, size

    def __del__(self):
        try:
            ext.unmap(self.ordinal, self.va, self.size, False)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


_mappings: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_mappings_lock = threading.Lock()


class _Opened:
    """A receiver's hold on one share: the connection (the exporter's lease)
    and the mappings.  Every opened array holds it; the last one's death
    closes the connection, and the exporter may then reuse the memory."""

    __slots__ = ("conn", "mappings", "sync", "__weakref__")

    def __init__(self, conn, mappings):
        self.conn, self.mappings, self.sync = conn, mappings, None

    def __del__(self):
        try:
            if self.sync is not None:
                # PJRT frees a JAX view only after its last use on the GPU,
                # but PyTorch and CuPy free foreign memory as soon as the
                # tensor dies, work possibly still queued: that work must
                # end before the exporter may reuse the memory.
                ext.synchronize(self.sync)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
        try:
            self.conn.close()
        except Exception:  # noqa: BLE001
            pass


def _request(share):
    """(connection, layout, descriptors): presents `share`'s id and token to
    its exporter, which answers with the share's layout and one descriptor
    per allocation; the open connection is the receiver's hold on the share
    from then on.  The layout is the exporter's, never the share's bytes."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.settimeout(config.share_timeout_s)
    try:
        conn.connect(share.address)
    except (OSError, ValueError) as e:  # ValueError: a NUL where the kernel takes none
        conn.close()
        raise BufferError(
            f"the exporting process (pid {share.pid}) no longer serves its shares ({e}): it "
            "has exited. Arrays opened from it before stay valid (their mappings hold the "
            "memory); make a new share in a live process") from None
    fds: list[int] = []
    try:
        uid = _peer_uid(conn)
        if uid != os.getuid():  # only a process of this user may tell us a layout
            raise BufferError(
                f"the process serving {share.address!r} runs as user {uid}, this one as "
                f"user {os.getuid()}: shares open only between processes of one user")
        conn.send(json.dumps({"open": share.share_id, "token": share.token.hex()}).encode())
        head = conn.recv(_CHUNK)
        reply = json.loads(head) if head else {"error": "the exporter closed the connection"}
        if "error" in reply:
            raise BufferError(reply["error"])
        size, count = int(reply["size"]), int(reply["fds"])
        data = _recv_chunks(conn, size, "the exporter")
        while len(fds) < count:
            _, got, _, _ = socket.recv_fds(conn, 16, _FDS_PER_MESSAGE)
            if not got:
                raise BufferError("the exporter closed the connection mid-answer")
            fds.extend(got)
        # From a process of this user that knew the share's token: its own.
        layout = pickle.loads(data)
        if len(fds) != len(layout[4]):
            raise BufferError(f"the exporter sent {len(fds)} descriptors for "
                              f"{len(layout[4])} allocations")
    except TimeoutError:
        for fd in fds:
            os.close(fd)
        conn.close()
        raise BufferError(
            f"the exporting process (pid {share.pid}) did not answer within "
            f"{config.share_timeout_s} s (jax_overlay.config.share_timeout_s): it is stopped "
            "or gone; make a new share in a live process") from None
    except BaseException:
        for fd in fds:
            os.close(fd)
        conn.close()
        raise
    conn.settimeout(None)  # from here on it only marks the hold
    return conn, layout, fds


def _ordinal_of(uuid: bytes) -> int:
    for i in range(ext.device_count()):
        if ext.device_uuid(i) == uuid:
            return i
    raise BufferError(
        f"this share's GPU (UUID {uuid.hex()}) is not visible to this process, which sees "
        f"{ext.device_count()} GPU(s): open it in a process that sees that GPU "
        "(check CUDA_VISIBLE_DEVICES)")


def open_shared(share: Share | bytes, *, framework: str = "jax") -> Any:
    """The pytree of a :class:`Share` (or of ``pickle.dumps(share)``, read
    without running anything else the bytes might name), zero-copy on the
    same GPU:
    ``jax.Array``s (``framework="jax"``), or PyTorch tensors
    (``"torch"``) or CuPy arrays (``"cupy"``) for a process with no use
    for JAX.  Ordered after the exporter's pending writes on the GPU, for
    every read: JAX arrays are defined after them (host reads and
    computations alike), tensors are ordered on the framework's current
    stream.  The exporter's memory stays held while any opened array
    lives.  In the exporting process itself: the original arrays."""
    if isinstance(share, (bytes, bytearray, memoryview)):
        share = loads(share)
    if not isinstance(share, Share):
        raise TypeError(f"open_shared takes a jax_overlay.Share (from jax_overlay.share) or "
                        f"its pickled bytes, not {type(share).__module__}."
                        f"{type(share).__qualname__}")
    names = peers.share_frameworks()
    if framework not in names:
        raise ValueError(f"framework={framework!r}: pass one of {', '.join(map(repr, names))}")
    if share.boot_id != _BOOT_ID or (not share.boot_id and share.host != socket.gethostname()):
        raise BufferError(
            f"this share was made on another machine ({share.host}, boot {share.boot_id}); "
            "GPU memory is shared between processes of one machine only: send the arrays' "
            "values instead (jax.device_get, then pickle)")
    if share.pid == os.getpid() and share.address == _EXPORTER.address:
        return _same_process(share, framework)
    conn, layout, fds = _request(share)
    mappings: list[Any] = []
    try:
        uuid, event, treedef, leaves, allocations, whole = layout
        ordinal = _ordinal_of(uuid)
        with _mappings_lock:
            for (block, size), fd in zip(allocations, fds):
                m = _mappings.get((share.address, block, size)) if block else None
                if m is None:
                    m = _Mapping(ordinal, ext.map_fd(ordinal, fd, size), size)
                    if block:
                        _mappings[(share.address, block, size)] = m
                mappings.append(m)
    except BaseException:
        conn.close()
        raise
    finally:
        for fd in fds:  # mapped (the mapping holds the memory) or already mapped
            os.close(fd)
    opened = _Opened(conn, mappings)
    if framework == "jax":
        return _open_jax(event, treedef, leaves, opened, ordinal, whole)
    return _open_peer(share, event, treedef, leaves, opened, ordinal, framework)


def _dtype(name):
    return np.dtype(jax.numpy.dtype(name))


def _open_jax(event, treedef, leaves, opened, ordinal, whole=None):
    device = rt.gpu_device(ordinal)
    # A ready stream waits on the GPU for the exporter's event, and each
    # import's definition event is recorded on it behind that wait: every
    # reader of the arrays (computations, np.asarray, copies) waits for the
    # exporter's writes (_runtime.ready_stream).
    stream = rt.ready_stream(device)
    ext.wait_ipc_event(ordinal, event, stream)
    if whole is not None and whole[0] >= 0:
        # A packed share: one view of the buffer, unpacked by one call into
        # arrays of this process.  The view (and through it `opened`) lives
        # until that call's reads of it are done (PJRT frees a view after
        # its last use on the GPU).
        i, off, nbytes = whole
        cap = ext.raw_capsule(opened, opened.mappings[i].va + off, (nbytes,), None,
                              dtype_code(np.dtype(np.uint8)), KDLCUDA, ordinal)
        buf = _view.import_view(cap, device, False, KDLCUDA, stream)
        spec = tuple((o - off, shape, name) for _, o, shape, name in leaves)
        return jax.tree_util.tree_unflatten(treedef, _pack.unpacker(spec)(buf))
    out = []
    for i, off, shape, name in leaves:
        dtype = _dtype(name)
        if i < 0:
            out.append(_view.empty(shape, dtype, device))
            continue
        # The capsule holds `opened` until JAX frees the array.
        cap = ext.raw_capsule(opened, opened.mappings[i].va + off, shape, None,
                              dtype_code(dtype), KDLCUDA, ordinal)
        out.append(_view.import_view(cap, device, False, KDLCUDA, stream))
    return jax.tree_util.tree_unflatten(treedef, out)


def _open_peer(share, event, treedef, leaves, opened, ordinal, framework):
    peer = peers.share_peer(framework)
    opened.sync = ordinal  # the framework frees without waiting for its streams
    ext.wait_ipc_event(ordinal, event, peer.current_stream(ordinal))
    out = []
    for i, off, shape, name in leaves:
        dtype = _dtype(name)
        ptr = opened.mappings[i].va + off if i >= 0 else 0
        cap = ext.raw_capsule(opened, ptr, shape, None, dtype_code(dtype), KDLCUDA, ordinal)
        out.append(peer.wrap_capsule(cap, ordinal))
    peer.came_from_share(out, share, [m.va for m in opened.mappings], open_leaf)
    return jax.tree_util.tree_unflatten(treedef, out)


def open_leaf(share: Share, index: int, framework: str) -> Any:
    """Leaf `index` of a share, opened by `framework` (how a peer passes on
    an array it opened from a share: as the share itself)."""
    return jax.tree_util.tree_leaves(open_shared(share, framework=framework))[index]


def _same_process(share, framework):
    with _EXPORTER.lock:
        e = _EXPORTER.entries.get(share.share_id)
        if e is None or (e.released and not e.once):
            raise BufferError(f"share {share.share_id} of this process was released: make a "
                              "new share")
        if not secrets.compare_digest(share.token, e.token):
            raise BufferError(f"this share's token does not match share {share.share_id} of "
                              "this process: the share was damaged or forged")
        tree, once = e.tree, e.once
        e.once = False
    if once:  # a one-shot share opened here: its hold ends now
        _EXPORTER._drop(share.share_id)
    if isinstance(tree, _Packed):
        tree = tree.unpacked()
    if framework == "jax":
        return tree
    peer = peers.share_peer(framework)

    def wrap(x):
        ordinal = ext.pointer_info(x.unsafe_buffer_pointer()).ordinal if x.size else 0
        return peer.wrap_capsule(x.__dlpack__(), ordinal)
    return jax.tree_util.tree_map(wrap, tree)


def live_shares() -> int:
    """How many shares this process still holds for itself or receivers."""
    return _EXPORTER.live()


if sys.platform != "linux":  # pragma: no cover - abstract sockets are Linux's
    def share(tree: Any, *, copy: bool = False) -> Share:  # type: ignore[no-redef]  # noqa: F811
        raise BufferError("jax_overlay.share needs Linux (CUDA's POSIX descriptor handles)")
