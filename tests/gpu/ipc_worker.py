"""The other processes of tests/gpu/test_ipc_gpu.py (started with the spawn
context, so nothing here imports JAX before a role sets its environment).

Each role serves requests on a multiprocessing connection until None:
(op, *args) -> ("ok", result) or ("error", class name, message)."""

from __future__ import annotations

import ctypes
import gc
import os


def free_memory(ordinal=0):
    """The device's free bytes (cuMemGetInfo in its primary context)."""
    cu = ctypes.CDLL("libcuda.so.1")
    cu.cuInit(0)
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    cu.cuDeviceGet(ctypes.byref(dev), ordinal)
    cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)
    cu.cuCtxPushCurrent_v2(ctx)
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    cu.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
    cu.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
    return free.value


def _host(leaf):
    import numpy as np
    if type(leaf).__module__.startswith("torch"):
        t = leaf.detach()
        return t.float().cpu().numpy() if t.dtype.is_floating_point else t.cpu().numpy()
    if type(leaf).__module__.startswith("cupy"):
        return leaf.get()
    # A JAX array read straight to the host (XLA's device-to-host stream,
    # not a computation): the read an import must order, too.
    a = np.asarray(leaf)
    return a.astype(np.float32) if a.dtype.name == "bfloat16" else a


def _describe(leaf):
    dev = getattr(leaf, "device", None)
    lib = type(leaf).__module__.split(".")[0]
    lib = "jax" if lib in ("jax", "jaxlib") else lib  # jax.Array's type lives in jaxlib
    return (lib, str(leaf.dtype), tuple(leaf.shape), str(dev))


def _busy(ms):
    """A call that keeps XLA's compute stream busy for about `ms`
    milliseconds, not waited for (None for 0)."""
    if not ms:
        return None
    import time
    import jax
    import jax.numpy as jnp
    m = jnp.full((4096, 4096), 1e-4, jnp.float32)
    step = jax.jit(lambda y: jnp.tanh(y @ m))
    jax.block_until_ready(step(m))
    t0 = time.perf_counter()
    jax.block_until_ready(step(step(step(step(m)))))
    reps = max(1, round(ms / 1e3 / ((time.perf_counter() - t0) / 4)))

    def busy():
        y = m
        for _ in range(reps):
            y = step(y)
        return y
    return busy


def serve(conn, env=None, framework="jax", queue=None):
    os.environ.update(env or {})
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax
    import numpy as np

    import jax_overlay
    held = []
    while True:
        msg = conn.recv()
        if msg is None:
            return
        op, *args = msg
        try:
            if op == "open":  # open, read every leaf on the host, let go
                tree = jax_overlay.open_shared(args[0], framework=framework)
                leaves = jax.tree_util.tree_leaves(tree)
                out = ([_host(x) for x in leaves], [_describe(x) for x in leaves])
                del tree, leaves
            elif op == "check_k":  # open an in-flight share; all values == k?
                (x,) = jax.tree_util.tree_leaves(jax_overlay.open_shared(args[0], framework=framework))
                h = _host(x)
                out = bool(h.min() == h.max() == args[1])
                del x
            elif op == "stale_leaves":  # open an in-flight share; how many leaves are not k?
                tree = jax_overlay.open_shared(args[0], framework=framework)
                out = 0
                for x in jax.tree_util.tree_leaves(tree):
                    h = _host(x)
                    out += not (h.min() == h.max() == args[1])
                del tree, x
            elif op == "hold":
                held.append(jax_overlay.open_shared(args[0], framework=framework))
                out = len(held)
            elif op == "read_held":
                out = [_host(x) for x in jax.tree_util.tree_leaves(held)]
            elif op == "drop":
                held.clear()
                gc.collect()
                out = len(jax_overlay._ipc._mappings)  # mappings still alive here
            elif op == "crash":
                held.append(jax_overlay.open_shared(args[0], framework=framework))
                conn.send(("ok", "holding"))
                os._exit(3)
            elif op == "share":  # exporter roles: share a new array of `value`
                n, value, kw = args
                held.append(jax.numpy.full((n,), value, jax.numpy.float32))
                try:  # no local name holds the array: "forget" must free it
                    out = jax_overlay.share(held[-1], **kw)
                    held.append(out)  # the exporter's Share: its death would end the share
                except BufferError as e:
                    out = ("BufferError", str(e))
                    held.pop()
            elif op == "forget":  # drop the arrays and release every share of them
                held.clear()
                out = None
                gc.collect()
                out = jax_overlay._ipc.live_shares()
            elif op == "channel_open":
                held.append(jax_overlay.open_channel(args[0]))
                out = True
            elif op == "channel_recv":  # n steps; each leaf read to the host: its values
                n, busy_ms, latest = args  # busy_ms: XLA's stream kept busy before each recv
                rx = next(h for h in reversed(held) if isinstance(h, jax_overlay.Receiver))
                busy = _busy(busy_ms)
                out = []
                for _ in range(n):
                    if busy is not None:
                        busy()  # the unpack queues behind it: the sender runs ahead
                    tree = rx.recv(timeout=60, latest=latest)
                    out.append(sorted({float(v) for x in jax.tree_util.tree_leaves(tree)
                                       for v in np.unique(_host(x))}))
                    del tree
            elif op == "channel_close":
                for h in held:
                    if isinstance(h, jax_overlay.Receiver):
                        h.close()
                held.clear()
                out = True
            elif op == "init":  # JAX's GPU client (its context's memory) up front
                jax.block_until_ready(jax.numpy.zeros(1))
                out = True
            elif op == "live":
                out = jax_overlay._ipc.live_shares()
            elif op == "free":
                out = free_memory()
            elif op == "pass_on":  # open as torch, pass leaf 0 on with torch's queue
                from multiprocessing.reduction import ForkingPickler
                (t,) = jax.tree_util.tree_leaves(jax_overlay.open_shared(args[0], framework="torch"))
                ForkingPickler.dumps(t)  # sent as the share: no error
                queue.put(t)
                try:
                    ForkingPickler.dumps(t[1:])  # a view of the mapping: PyTorch refuses
                    out = "no error"
                except BufferError as e:
                    out = str(e)
            elif op == "queue_get":  # a jax_overlay.multiprocessing queue
                x = queue.get(timeout=60)
                out = (_host(x), _describe(x))
                del x
            elif op == "torch_queue_get":  # a torch.multiprocessing queue, into JAX
                t = queue.get(timeout=60)
                x = jax_overlay.from_dlpack(t)
                same = x.unsafe_buffer_pointer() == t.data_ptr()
                del t
                gc.collect()
                conn.send(("ok", same))
                conn.recv()  # the sender has dropped its tensor by now
                out = _host(x)
                del x
            else:
                raise ValueError(f"unknown op {op!r}")
            conn.send(("ok", out))
        except Exception as e:  # noqa: BLE001 - reported to the test
            conn.send(("error", type(e).__name__, str(e)))
