#!/usr/bin/env python3
"""Damaged shares: each case mutates the bytes of ``pickle.dumps(share)``
and gives them to ``open_shared`` in a process of its own.  A case passes
when that process raises a Python exception or opens the right arrays; a
signal (a crash), a hang or wrong values fail it.

    python tools/fuzz_share.py [--cases 10000] [--seed 0] [--jobs 2] [--json FILE]

The exporter is this process, on the CPU: a share over a memfd descriptor
with the real server and protocol (as tests/cpu/test_ipc_leases.py makes).
Every byte of the pickle is in play; what a receiver maps comes from the
exporter's answer only, so an intact open stops at the GPU lookup with a
BufferError here, and maps the exporter's own layout on a GPU.  Children
are forked, JAX on the CPU.  Exits 1 when any case fails.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pickle
import platform
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MUTATIONS = ("flip", "bytes", "run", "truncate", "insert", "duplicate", "field")


def forged(share, rng: random.Random) -> bytes:
    """The share with one field changed, pickled whole: a well-formed
    share that names another share, token, address or process."""
    from jax_overlay import _ipc
    state = _ipc._state(share)
    k = rng.choice(["token", "share_id", "address", "pid", "nbytes", "arrays"])
    v = state[k]
    if k == "token":
        t = bytearray(v)
        t[rng.randrange(len(t))] ^= 1 << rng.randrange(8)
        v = bytes(t)
    elif k == "address":
        i = rng.randrange(1, len(v))
        v = v[:i] + chr(rng.randrange(32, 127)) + v[i + 1:]
    else:
        v = v + rng.choice([-1, 1, 2, 1 << 20, -(1 << 40)])
    state[k] = v
    return pickle.dumps(_ipc.Share(**state))


def mutate(data: bytes, rng: random.Random, share) -> tuple[str, bytes]:
    """One damaged copy of `data` (the pickle of `share`) and the name of
    the damage."""
    kind = rng.choice(MUTATIONS)
    if kind == "field":
        return kind, forged(share, rng)
    b = bytearray(data)
    n = len(b)
    if kind == "flip":
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(n)] ^= 1 << rng.randrange(8)
    elif kind == "bytes":
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(n)] = rng.randrange(256)
    elif kind == "run":
        i = rng.randrange(n)
        b[i:i + 4] = rng.randbytes(min(4, n - i))
    elif kind == "truncate":
        del b[rng.randrange(n):]
    elif kind == "insert":
        i = rng.randrange(n + 1)
        b[i:i] = rng.randbytes(rng.randint(1, 8))
    else:
        i = rng.randrange(n)
        j = min(n, i + rng.randint(1, 16))
        b[i:i] = b[i:j]
    return kind, bytes(b)


def fake_share():
    """A share over one memfd, served by this process's real server."""
    from jax_overlay import _ipc
    _ipc._EXPORTER.start()
    fd = os.memfd_create("jax_overlay-fuzz")
    os.write(fd, b"\0" * 4096)
    layout = pickle.dumps((b"\1" * 16, b"\0" * 64, None, [(0, 0, (4,), "float32")], [(0, 4096)], None))
    entry = _ipc._Entry(None, [], 0, [fd], 0, None, 1, os.urandom(16), layout)
    return _ipc._publish(entry, False, arrays=1, nbytes=16, allocations=1,
                         exposed_bytes=4096, copied=False), None


# A passing child's exit code says how far its bytes got.
PASSES = {20: "bytes refused (not a share)", 21: "exporter refused (id or token)",
          22: "no exporter at that address", 23: "intact: stopped at the GPU lookup",
          24: "other Python exception", 25: "opened the right arrays"}


def _phase(e: Exception) -> int:
    msg = str(e)
    if "not a jax_overlay share" in msg or "damaged" in msg or "format version" in msg:
        return 20
    if "token does not match" in msg or "was released" in msg:
        return 21
    if "no longer serves" in msg or "did not answer" in msg:
        return 22
    if "GPU" in msg or "CUDA" in msg or "libcuda" in msg:
        return 23
    return 24


def child(data: bytes, expected) -> int:
    """In the forked child: a code of PASSES, or 3 for wrong arrays."""
    import numpy as np

    from jax_overlay import _ipc, config
    config.share_timeout_s = 5.0
    try:
        tree = _ipc.open_shared(data)
    except Exception as e:  # noqa: BLE001 - any Python exception is a pass
        return _phase(e)
    if expected is None:
        return 25
    import jax
    got = [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]
    ok = len(got) == len(expected) and all(np.array_equal(g, e) for g, e in zip(got, expected))
    return 25 if ok else 3


def run(cases, seed, jobs, budget):
    share, expected = fake_share()
    data = pickle.dumps(share)
    rng = random.Random(seed)
    tally: collections.Counter = collections.Counter()
    failures = []
    running: dict[int, tuple] = {}
    t0 = time.monotonic()
    started = 0

    def reap(block):
        while running:
            pid, status = os.waitpid(-1, 0 if block else os.WNOHANG)
            if pid == 0:
                break
            case, kind, t = running.pop(pid)
            if os.WIFSIGNALED(status):
                outcome = f"signal {os.WTERMSIG(status)}"
            else:
                code = os.WEXITSTATUS(status)
                outcome = PASSES.get(code) or {3: "wrong arrays"}.get(code, f"exit {code}")
            tally[outcome] += 1
            if outcome not in PASSES.values():
                failures.append({"case": case, "mutation": kind, "outcome": outcome})
            if not block:
                continue
            return
        for pid, (case, kind, t) in list(running.items()):
            if time.monotonic() - t > 60:  # a hang
                os.kill(pid, 9)

    while started < cases and (budget is None or time.monotonic() - t0 < budget):
        kind, bad = mutate(data, rng, share)
        while len(running) >= jobs:
            reap(True)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                # Damaged pickles make CPython print its own complaints
                # (e.g. a SystemError about a bytearray): outcomes only.
                os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
                code = child(bad, expected)
            finally:
                os._exit(code)
        running[pid] = (started, kind, time.monotonic())
        started += 1
        if started % 1000 == 0:
            print(f"{started} cases, {dict(tally)}", flush=True)
    while running:
        reap(True)
    share.release()
    return {"cases": started, "seed": seed, "outcomes": dict(tally), "failures": failures[:50],
            "seconds": round(time.monotonic() - t0, 1)}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", type=int, default=10000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--budget", type=float, default=None, help="stop starting cases after S seconds")
    p.add_argument("--json", default="")
    args = p.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import warnings
    warnings.filterwarnings("ignore", message=".*fork.*")
    out = run(args.cases, args.seed, args.jobs, args.budget)
    import jax
    import jax_overlay
    out["meta"] = {"python": platform.python_version(), "jax": jax.__version__,
                   "jax_overlay": jax_overlay.__version__, "exporter": "memfd (no GPU)",
                   "date": time.strftime("%Y-%m-%d")}
    print(json.dumps({k: out[k] for k in ("cases", "outcomes", "seconds")}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")
    return 1 if out["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
