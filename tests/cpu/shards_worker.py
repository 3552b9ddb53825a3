"""One process of tests/cpu/test_shards_distributed.py: joins JAX's
distributed runtime (CPU backend, gloo collectives), runs every scenario in
the same order as the other processes, and prints one JSON line per
scenario: {"case": ..., "ok": ...} or {"case": ..., "error": ...,
"class": ..., "seconds": ...}.

    python shards_worker.py N PROCESS_ID PORT [torch]
"""

import json
import sys
import time

n, me, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
use_torch = sys.argv[4:] == ["torch"]

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=n,
                           process_id=me)

import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jax_overlay  # noqa: E402
from jax_overlay import _runtime as rt  # noqa: E402
from jax_overlay.doctor import aligned_empty  # noqa: E402

mesh = jax.make_mesh((len(jax.devices()),), ("x",))
rows = NamedSharding(mesh, P("x"))
replicated = NamedSharding(mesh, P())
GLOBAL = np.arange(len(jax.devices()) * 4 * 3, dtype=np.float32).reshape(-1, 3)


def local_blocks(global_array, sharding=rows):
    """This process's blocks, in the sharding's order of its devices, each
    in aligned memory (JAX's CPU client views aligned host memory)."""
    index = sharding.addressable_devices_indices_map(global_array.shape)
    out = []
    for d in rt.addressable_devices(sharding):
        block = global_array[index[d]]
        out.append(aligned_empty(block.shape, block.dtype))
        out[-1][...] = block
    return out


def as_torch(blocks):
    import torch
    return [torch.from_numpy(b) for b in blocks]


def report(case, fn):
    start = time.monotonic()
    try:
        out = {"case": case, "ok": fn()}
    except Exception as e:  # noqa: BLE001 - reported to the test, which judges it
        out = {"case": case, "error": str(e), "class": type(e).__name__,
               "mro": [c.__name__ for c in type(e).__mro__]}
    out["seconds"] = round(time.monotonic() - start, 3)
    print(json.dumps(out), flush=True)


def good():
    blocks = local_blocks(GLOBAL)
    x = jax_overlay.from_shards(as_torch(blocks) if use_torch else blocks, rows)
    # A jitted reduction across every process's devices reads every shard.
    total = jax.jit(lambda a: (a * 2).sum(), out_shardings=replicated)(x)
    shards = jax_overlay.to_shards(x)
    return {"sum": float(total), "want": float(GLOBAL.sum() * 2), "shape": list(x.shape),
            "dtype": str(x.dtype),
            "shards_match": all(np.array_equal(np.asarray(s.data), GLOBAL[s.index]) for s in shards),
            "shards": len(shards), "zero_copy": all(
                np.asarray(s.data).ctypes.data == b.ctypes.data for s, b in zip(shards, blocks))
            if not use_torch else None}


def bad_dtype_in_one_process():
    blocks = local_blocks(GLOBAL)
    if me == n - 1:
        blocks[-1] = blocks[-1].astype(np.int32)
    return str(jax_overlay.from_shards(blocks, rows).dtype)


def another_dtype_in_one_process():
    blocks = local_blocks(GLOBAL)
    if me == 0:
        blocks = [b.astype(np.int32) for b in blocks]
    return str(jax_overlay.from_shards(blocks, rows).dtype)


def missing_shard_in_one_process():
    blocks = local_blocks(GLOBAL)
    if me == n - 1:
        blocks = blocks[:-1]
    return list(jax_overlay.from_shards(blocks, rows).shape)


def uneven_global_shape():
    blocks = local_blocks(GLOBAL)
    return list(jax_overlay.from_shards(blocks, rows, global_shape=(GLOBAL.shape[0] + 1, 3)).shape)


def good_again():
    return good()


def one_process_never_calls():
    jax_overlay.config.agree_timeout_s = 3.0
    if me == n - 1:
        return "skipped the call"
    return list(jax_overlay.from_shards(local_blocks(GLOBAL), rows).shape)


for name, case in [("good", good), ("bad_dtype_in_one_process", bad_dtype_in_one_process),
                   ("another_dtype_in_one_process", another_dtype_in_one_process),
                   ("missing_shard_in_one_process", missing_shard_in_one_process),
                   ("uneven_global_shape", uneven_global_shape), ("good_again", good_again),
                   ("one_process_never_calls", one_process_never_calls)]:
    report(name, case)
