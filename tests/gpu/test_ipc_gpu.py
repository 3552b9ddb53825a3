"""Sharing GPU jax.Arrays between processes (jax_overlay.share /
open_shared, jax_overlay.multiprocessing), several processes on one GPU:
round trips, in-flight writes, lifetime, crashes, exits, errors and XLA's
allocators.  This process is the exporter unless a test says otherwise;
the other processes run tests/gpu/ipc_worker.py."""

import functools
import gc
import multiprocessing
import os
import pickle
import time

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jax_overlay
from jax_overlay import _ipc

import ipc_worker

SPAWN = multiprocessing.get_context("spawn")
TRIALS = 1000


class Peer:
    """Another process running ipc_worker.serve."""

    def __init__(self, env=None, framework="jax", queue=None, ctx=SPAWN):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=ipc_worker.serve, args=(child, env, framework, queue),
                                daemon=True)
        self.proc.start()
        child.close()

    def ask(self, *msg, timeout=120):
        self.conn.send(msg)
        if not self.conn.poll(timeout):
            raise TimeoutError(f"{msg[0]}: no answer in {timeout} s")
        return self.conn.recv()

    def ok(self, *msg, **kw):
        r = self.ask(*msg, **kw)
        assert r[0] == "ok", r
        return r[1]

    def close(self):
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()


@pytest.fixture
def peer():
    p = Peer()
    yield p
    p.close()


@pytest.fixture
def torch_peer():
    pytest.importorskip("torch")
    p = Peer(framework="torch")
    yield p
    p.close()


def wait_until(pred, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.02)
    return pred()


def tree_of_everything():
    return {"w": jnp.arange(3 * 1024, dtype=jnp.float32).reshape(3, 1024),
            "b": (jnp.arange(7, dtype=jnp.bfloat16), jnp.arange(5, dtype=jnp.int64 if
                                                                   jax.config.x64_enabled else jnp.int32)),
            "empty": jnp.zeros((0, 4), jnp.float32),
            "big": jnp.full((1 << 22,), 3.5, jnp.float32),
            "flag": jnp.array([True, False])}


def test_jax_to_jax_round_trip(peer):
    tree = tree_of_everything()
    h = _ipc.share(tree)
    assert h.nbytes == sum(x.nbytes for x in jax.tree_util.tree_leaves(tree))
    assert 1 <= h.allocations <= len(jax.tree_util.tree_leaves(tree)) == h.arrays
    assert h.exposed_bytes >= h.nbytes and not h.copied
    values, kinds = peer.ok("open", pickle.loads(pickle.dumps(h)))
    for got, want, kind in zip(values, jax.tree_util.tree_leaves(tree), kinds):
        w = np.asarray(want)
        np.testing.assert_array_equal(got, w.astype(np.float32) if w.dtype.name == "bfloat16" else w)
        assert kind[:3] == ("jax", str(want.dtype), want.shape)
        assert "cuda" in kind[3].lower() or "gpu" in kind[3].lower()


def test_one_handle_per_allocation_and_cached_opens(peer):
    xs = [jnp.full((1000 + i,), float(i), jnp.float32) for i in range(200)]
    h = _ipc.share(xs)
    # XLA sub-allocates: far fewer allocations than arrays.
    assert h.allocations < 20, h
    values, _ = peer.ok("open", h)
    assert all((v == i).all() for i, v in enumerate(values))
    h2 = _ipc.share(xs)
    values, _ = peer.ok("open", h2)  # mapped already: the mapping is reused
    assert all((v == i).all() for i, v in enumerate(values))


def test_copy_mode_exposes_one_dedicated_allocation(peer):
    tree = tree_of_everything()
    h = _ipc.share(tree, copy=True)
    assert h.copied and h.allocations == 1
    assert h.exposed_bytes < h.nbytes + (4 << 20)
    values, _ = peer.ok("open", h)
    for got, want in zip(values, jax.tree_util.tree_leaves(tree)):
        w = np.asarray(want)
        np.testing.assert_array_equal(got, w.astype(np.float32) if w.dtype.name == "bfloat16" else w)


def test_jax_to_torch(torch_peer):
    tree = tree_of_everything()
    values, kinds = torch_peer.ok("open", _ipc.share(tree))
    for got, want, kind in zip(values, jax.tree_util.tree_leaves(tree), kinds):
        w = np.asarray(want)
        np.testing.assert_array_equal(got, w.astype(np.float32) if w.dtype.name == "bfloat16" else w)
        assert kind[0] == "torch" and "cuda" in kind[3]


def test_jax_to_cupy():
    pytest.importorskip("cupy")
    p = Peer(framework="cupy")
    try:
        x = jnp.arange(4096, dtype=jnp.float32)
        values, kinds = p.ok("open", _ipc.share([x]))
        np.testing.assert_array_equal(values[0], np.asarray(x))
        assert kinds[0][0] == "cupy"
    finally:
        p.close()


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_inflight_exporter_no_stale_reads(framework):
    """The exporter's computation is still running when the receiver reads:
    0 stale reads in TRIALS, the receiver reading straight to the host."""
    if framework == "torch":
        pytest.importorskip("torch")
    a = jnp.full((2048, 2048), 1e-3, jnp.float32)

    @jax.jit
    def slow(k):
        y = a @ a @ a  # about a millisecond on an H100/H200
        # 0 unless y is NaN: the fill depends on the whole product.
        return jnp.full((1 << 20,), k, jnp.float32) + jnp.minimum(jnp.abs(y[0, 0]), 0.0)

    slow(0.0).block_until_ready()
    p = Peer(framework=framework)
    try:
        stale = in_flight = 0
        for k in range(1, TRIALS + 1):
            x = slow(float(k))
            in_flight += not x.is_ready()
            with _ipc.share(x) as h:
                stale += not p.ok("check_k", h, k)
        assert stale == 0, f"{stale} of {TRIALS} reads were stale"
        assert in_flight > TRIALS // 2, f"only {in_flight} shares were made in flight"
    finally:
        p.close()


# The in-flight window of the tree test: a chain of matmuls of about this
# many ms (idle H200) writes every leaf; the load process stretches it.
TREE_MS = 55
TREE_ROUNDS = int(os.environ.get("JAX_OVERLAY_IPC_TREE_ROUNDS", "10"))


@pytest.mark.parametrize("framework,pack", [("jax", False), ("torch", False), ("cupy", False),
                                            ("jax", True), ("torch", True)])
def test_inflight_tree_of_long_work_read_to_the_host(framework, pack):
    """A trainer-style tree of 200 arrays, all written at the end of about
    TREE_MS of matmuls, shared while that chain runs; the receiver opens it
    and reads every array straight to the host.  0 stale, TREE_ROUNDS rounds
    (JAX_OVERLAY_IPC_TREE_ROUNDS; the long run's figures are in
    benchmarks/results)."""
    if framework == "torch":
        pytest.importorskip("torch")
    m = jnp.full((4096, 4096), 1e-4, jnp.float32)

    @functools.partial(jax.jit, static_argnums=1)
    def chain(k, steps):
        y = m
        for _ in range(steps):
            y = jnp.tanh(y @ m)
        # k everywhere unless y is NaN: every leaf depends on the whole chain.
        zero = jnp.minimum(jnp.abs(y[0, 0]), 0.0)
        return [jnp.full((4096 + i,), k, jnp.float32) + zero for i in range(200)]

    jax.block_until_ready(chain(0.0, 8))  # compiled
    t0 = time.perf_counter()
    jax.block_until_ready(chain(0.0, 8))
    per_step = (time.perf_counter() - t0) / 8
    steps = max(1, round(TREE_MS / 1e3 / per_step))
    jax.block_until_ready(chain(0.0, steps))
    p = Peer(framework=framework)
    try:
        p.ok("init")
        stale = in_flight = 0
        for k in range(1, TREE_ROUNDS + 1):
            tree = chain(float(k), steps)
            in_flight += not tree[-1].is_ready()
            with _ipc.share(tree, pack=pack) as h:
                stale += p.ok("stale_leaves", h, k)
        assert stale == 0, f"{stale} of {200 * TREE_ROUNDS} arrays were stale"
        assert in_flight == TREE_ROUNDS, f"only {in_flight} of {TREE_ROUNDS} trees shared in flight"
    finally:
        p.close()


def test_share_of_an_inflight_import():
    """An import of a CuPy producer still writing, shared at once (CuPy's
    memory is no XLA allocation: copy=True copies it on the GPU, after the
    import's definition): the receiver's host read waits for the producer
    too."""
    cp = pytest.importorskip("cupy")
    from producers import spin_fill
    s = cp.cuda.Stream(non_blocking=True)
    a = cp.zeros(1 << 20, cp.float32)
    p = Peer()
    try:
        p.ok("init")
        stale = 0
        with s:
            for k in range(1, 21):
                spin_fill(a, float(k), ms=20.0, stream=s)
                x = jax_overlay.from_dlpack(a)
                with _ipc.share(x, copy=True) as h:
                    stale += not p.ok("check_k", h, k)
                del x
        s.synchronize()
        assert stale == 0, f"{stale} of 20 reads were stale"
    finally:
        p.close()


def test_lifetime_exporter_drops_while_receiver_holds(peer):
    n = 1 << 24  # 64 MiB
    x = jnp.full((n,), 7.0, jnp.float32)
    h = _ipc.share(x)
    peer.ok("hold", h)
    del x
    h.release()
    gc.collect()
    assert _ipc.live_shares() == 1  # the receiver's hold keeps it
    # The pool would reuse a freed block for these.
    churn = [jnp.full((n,), -1.0, jnp.float32) for _ in range(4)]
    jax.block_until_ready(churn)
    (got,) = peer.ok("read_held")
    assert (got == 7.0).all()
    peer.ok("drop")
    assert wait_until(lambda: _ipc.live_shares() == 0)
    with pytest.raises(BufferError, match="released"):
        _ipc.open_shared(h)


def test_memory_reclaimed_through_free_memory():
    """Platform allocator (buffers are freed to the device at once): the
    memory stays in use while a receiver maps it, and returns to the
    device once the exporter has dropped it and the receiver has let go."""
    size = 1 << 28  # floats: 1 GiB
    exporter = Peer(env={"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"})
    receiver = Peer()
    try:
        exporter.ok("init")
        receiver.ok("init")
        free0 = exporter.ok("free")
        h = exporter.ok("share", size, 2.0, {})
        free1 = exporter.ok("free")
        assert free0 - free1 > (3 << 28)
        receiver.ok("hold", h)
        assert exporter.ok("forget") == 1  # still held by the receiver
        time.sleep(0.2)
        assert exporter.ok("free") < free1 + (1 << 28)
        (got,) = receiver.ok("read_held")
        assert (got == 2.0).all()
        assert receiver.ok("drop") == 0  # unmapped
        assert wait_until(lambda: exporter.ok("live") == 0)
        wait_until(lambda: exporter.ok("free") > free0 - (1 << 28))
        free3 = exporter.ok("free")
        assert free3 > free0 - (1 << 28), (free0, free1, free3)
    finally:
        receiver.close()
        exporter.close()


def test_receiver_crash_releases_its_hold():
    p = Peer()
    x = jnp.ones((1 << 20,), jnp.float32)
    h = _ipc.share(x)
    assert p.ask("crash", h)[0] == "ok"
    h.release()
    p.proc.join(30)
    assert p.proc.exitcode == 3
    assert wait_until(lambda: _ipc.live_shares() == 0, 10)


def test_exporter_exit_clear_error_and_open_memory_stays_valid():
    exporter = Peer()
    receiver = Peer()
    try:
        h = exporter.ok("share", 1 << 20, 5.0, {})
        receiver.ok("hold", h)
        exporter.close()
        assert exporter.proc.exitcode is not None
        (got,) = receiver.ok("read_held")
        assert (got == 5.0).all()  # CUDA keeps an imported, mapped allocation alive
        r = receiver.ask("open", h)
        assert r[0] == "error" and r[1] == "BufferError" and "no longer serves" in r[2], r
    finally:
        receiver.close()


@pytest.mark.parametrize("allocator", ["default", "platform", "cuda_async"])
def test_allocators(allocator, peer):
    env = {"default": {"XLA_PYTHON_CLIENT_PREALLOCATE": "true",
                       "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.2"},
           "platform": {"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"},
           "cuda_async": {"XLA_PYTHON_CLIENT_ALLOCATOR": "cuda_async"}}[allocator]
    exporter = Peer(env=env)
    try:
        h = exporter.ok("share", 1 << 20, 9.0, {})
        if allocator == "cuda_async":
            assert h[0] == "BufferError" and "copy=True" in h[1], h
            h = exporter.ok("share", 1 << 20, 9.0, {"copy": True})
        if allocator == "default":
            assert h.exposed_bytes > 100 * h.nbytes  # the whole pool: say so
        (got,), _ = peer.ok("open", h)
        assert (got == 9.0).all()
    finally:
        exporter.close()


def test_multiprocessing_queue_sends_a_share():
    import jax_overlay.multiprocessing as jmp
    ctx = jmp.get_context("spawn")
    q = ctx.Queue()
    p = Peer(queue=q, ctx=ctx)
    try:
        x = jnp.arange(1 << 16, dtype=jnp.float32)
        q.put(x)
        got, kind = p.ok("queue_get")
        np.testing.assert_array_equal(got, np.asarray(x))
        assert kind[0] == "jax"
        assert wait_until(lambda: _ipc.live_shares() == 0)  # one-shot: ended by its receiver
    finally:
        p.close()


def test_torch_multiprocessing_into_jax():
    torch = pytest.importorskip("torch")
    import torch.multiprocessing as tmp
    ctx = tmp.get_context("spawn")
    q = ctx.Queue()
    p = Peer(queue=q, ctx=ctx)
    try:
        t = torch.arange(1 << 16, dtype=torch.float32, device="cuda")
        want = t.cpu().numpy()
        p.conn.send(("torch_queue_get",))
        q.put(t)
        assert p.conn.poll(120)
        r = p.conn.recv()
        assert r == ("ok", True), r  # zero-copy into JAX
        del t
        gc.collect()
        p.conn.send("go")
        r = p.conn.recv()
        assert r[0] == "ok", r
        np.testing.assert_array_equal(r[1], want)  # PyTorch's storage stayed alive
    finally:
        p.close()


def test_same_process_open_returns_the_originals():
    tree = tree_of_everything()
    with _ipc.share(tree) as h:
        got = _ipc.open_shared(pickle.loads(pickle.dumps(h)))
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(tree)):
            assert a is b


def test_errors():
    x = jnp.ones(16)
    with pytest.raises(BufferError, match="host memory"):
        _ipc.share(jax.device_put(x, jax.devices("cpu")[0]))
    pinned = jax.device_put(x, x.sharding.with_memory_kind("pinned_host"))
    with pytest.raises(BufferError, match="pinned_host"):
        _ipc.share(pinned)
    h = _ipc.share(x)
    other = pickle.loads(pickle.dumps(h))
    other.boot_id = "another"
    with pytest.raises(BufferError, match="another machine"):
        _ipc.open_shared(other)
    with pytest.raises(BufferError, match="not visible"):
        _ipc._ordinal_of(b"\0" * 16)  # the GPU the exporter's layout names
    forged = pickle.loads(pickle.dumps(h))
    forged.token, forged.pid = bytes(16), 1  # another process's open, with a wrong token
    with pytest.raises(BufferError, match="token does not match"):
        _ipc.open_shared(forged)
    y = jnp.ones(16)
    y.delete()
    with pytest.raises(BufferError, match="deleted"):
        _ipc.share(y)
    h.release()
    with pytest.raises(BufferError, match="released"):
        _ipc.open_shared(h)


def test_shared_array_cannot_be_donated():
    x = jnp.ones((1 << 20,), jnp.float32)
    h = _ipc.share(x)
    try:
        y = jax.jit(lambda a: a + 1, donate_argnums=0)(x)
        assert float(y[0]) == 2.0
    except Exception as e:  # noqa: BLE001 - PJRT may refuse the donation outright
        assert "external" in str(e).lower(), e
    # Either way the shared buffer was not given away: x lives on, unchanged.
    assert not x.is_deleted() and float(x[0]) == 1.0
    h.release()


def test_torch_passes_an_opened_tensor_on():
    """A tensor opened from a share goes on through torch.multiprocessing
    (as the share); a slice of it, which PyTorch's IPC refuses, gets an
    error naming what to send instead."""
    pytest.importorskip("torch")
    import torch.multiprocessing as tmp
    ctx = tmp.get_context("spawn")
    q = ctx.Queue()
    middle = Peer(framework="torch", queue=q, ctx=ctx)
    last = Peer(queue=q, ctx=ctx)
    try:
        x = jnp.arange(1 << 16, dtype=jnp.float32)
        h = _ipc.share([x])
        last.conn.send(("torch_queue_get",))
        why = middle.ok("pass_on", h)
        assert "send the jax_overlay.Share itself" in why, why
        assert last.conn.poll(120)
        assert last.conn.recv() == ("ok", True)  # zero-copy into JAX at the end
        last.conn.send("go")
        r = last.conn.recv()
        assert r[0] == "ok", r
        np.testing.assert_array_equal(r[1], np.asarray(x))
    finally:
        middle.close()
        last.close()


def packed_tree():
    t = tree_of_everything()
    t["z"] = (jnp.arange(6, dtype=jnp.float32) + 1j).astype(jnp.complex64)
    t["i8"] = jnp.arange(-3, 3, dtype=jnp.int8)
    t["h"] = jnp.arange(9, dtype=jnp.float16).reshape(3, 3)[:, ::-1]  # a computed leaf
    t["s"] = jnp.float32(2.5)
    return t


@pytest.mark.parametrize("framework", ["jax", "torch", "cupy"])
def test_packed_round_trip(framework):
    """share(tree, pack=True): every dtype, shape and value comes back, as
    the receiver's framework's arrays (JAX: unpacked into its own arrays;
    others: views of the packed buffer)."""
    if framework != "jax":
        pytest.importorskip(framework)
    tree = packed_tree()
    if framework == "cupy":  # CuPy has no bfloat16
        tree["b"] = (jnp.arange(7, dtype=jnp.float32), tree["b"][1])
    p = Peer(framework=framework)
    try:
        h = _ipc.share(tree, pack=True)
        assert h.arrays == len(jax.tree_util.tree_leaves(tree)) and h.allocations == 1
        values, kinds = p.ok("open", pickle.loads(pickle.dumps(h)))
        for got, want, kind in zip(values, jax.tree_util.tree_leaves(tree), kinds):
            w = np.asarray(want)
            np.testing.assert_array_equal(got, w.astype(np.float32) if w.dtype.name == "bfloat16" else w)
            assert kind[0] == framework and kind[2] == want.shape, (kind, want.shape)
            if framework == "jax":
                assert kind[1] == str(want.dtype)
        h.release()
    finally:
        p.close()


def test_packed_share_leaves_may_be_donated(peer):
    """A packed share holds its buffer, not the leaves: they can be donated
    at once, and the receiver reads the values they had."""
    x = jnp.full((1 << 20,), 1.0, jnp.float32)
    h = _ipc.share({"x": x}, pack=True)
    y = jax.jit(lambda a: a + 1, donate_argnums=0)(x)
    assert x.is_deleted() and float(y[0]) == 2.0
    values, _ = peer.ok("open", h)
    assert (values[0] == 1.0).all()
    got = _ipc.open_shared(h)  # in this process too: unpacked, not the donated leaf
    assert float(got["x"][0]) == 1.0 and got["x"] is not x
    h.release()


def test_packed_errors():
    with pytest.raises(TypeError, match=r"\['b'\]"):
        _ipc.share({"a": jnp.ones(3), "b": np.ones(3)}, pack=True)
    cpu = jax.device_put(jnp.ones(3), jax.devices("cpu")[0])
    with pytest.raises(BufferError, match=r"\['c'\].*host memory"):
        _ipc.share({"a": jnp.ones(3), "c": cpu}, pack=True)
    with pytest.raises(BufferError, match="int4"):
        _ipc.share([jnp.zeros(4, jnp.int4)], pack=True)
    y = jnp.ones(16)
    y.delete()
    with pytest.raises(BufferError, match="deleted"):
        _ipc.share([jnp.ones(2), y], pack=True)
