#!/usr/bin/env python3
"""What CUDA's driver allows on XLA's buffers for interprocess sharing, under
each of XLA's allocators (a fact sheet for jax_overlay.share; GPU only).

    python benchmarks/probe_ipc.py [--json FILE]

For every allocator (default pool, XLA_PYTHON_CLIENT_PREALLOCATE=false,
platform, cuda_async) a child process puts three arrays on the GPU and asks
the driver, through ctypes alone (no jax_overlay), for each buffer's pointer
attributes (legacy IPC capable, allowed handle types, mapping base and size,
memory block id), whether cuIpcGetMemHandle and cuMemRetainAllocationHandle
+ cuMemExportToShareableHandle(POSIX fd) succeed, and then sends the fd over
a Unix socket (SCM_RIGHTS) to a grandchild that imports, reserves, maps and
reads it back.
"""

from __future__ import annotations

import argparse
import ctypes as C
import json
import os
import socket
import subprocess
import sys

ALLOCATORS = {
    "default": {},
    "no_preallocate": {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"},
    "platform": {"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"},
    "cuda_async": {"XLA_PYTHON_CLIENT_ALLOCATOR": "cuda_async"},
}


class Loc(C.Structure):
    _fields_ = [("type", C.c_int), ("id", C.c_int)]


class Prop(C.Structure):
    _fields_ = [("type", C.c_int), ("handle_types", C.c_int), ("location", Loc),
                ("win32", C.c_void_p), ("flags", C.c_ubyte * 8)]


class Access(C.Structure):
    _fields_ = [("location", Loc), ("flags", C.c_int)]


def _cu():
    cu = C.CDLL("libcuda.so.1")
    assert cu.cuInit(0) == 0
    return cu


def _attr(cu, ptr, attr, ctype):
    v = ctype()
    r = cu.cuPointerGetAttribute(C.byref(v), attr, C.c_ulonglong(ptr))
    return v.value if r == 0 else f"error {r}"


def exporter():
    import numpy as np
    import jax
    import jax.numpy as jnp
    cu = _cu()
    xs = [jnp.arange(n, dtype=jnp.float32) + 1 for n in (1000, 4096, 1 << 20)]
    jax.block_until_ready(xs)
    out = []
    for x in xs:
        p = x.unsafe_buffer_pointer()
        row = {"bytes": x.nbytes,
               "legacy_ipc_capable": _attr(cu, p, 10, C.c_int),
               "allowed_handle_types": _attr(cu, p, 14, C.c_ulonglong),
               "range_start_offset": (lambda s: p - s if isinstance(s, int) else s)(
                   _attr(cu, p, 11, C.c_ulonglong)),
               "range_size": _attr(cu, p, 12, C.c_size_t),
               "mapping_size": _attr(cu, p, 18, C.c_size_t),
               "memory_block_id": _attr(cu, p, 20, C.c_ulonglong)}
        base = _attr(cu, p, 19, C.c_ulonglong)
        row["mapping_offset"] = p - base if isinstance(base, int) else base
        h = (C.c_byte * 64)()
        row["cuIpcGetMemHandle"] = cu.cuIpcGetMemHandle(h, C.c_ulonglong(p))
        gh = C.c_ulonglong()
        row["cuMemRetainAllocationHandle"] = r = cu.cuMemRetainAllocationHandle(
            C.byref(gh), C.c_void_p(p))
        if r == 0:
            prop = Prop()
            row["props"] = cu.cuMemGetAllocationPropertiesFromHandle(C.byref(prop), gh)
            row["requested_handle_types"] = prop.handle_types
            fd = C.c_int(-1)
            row["cuMemExportToShareableHandle"] = e = cu.cuMemExportToShareableHandle(
                C.byref(fd), gh, 1, C.c_ulonglong(0))
            if e == 0 and isinstance(row["mapping_size"], int) and isinstance(base, int):
                row["child"] = _send_to_child(fd.value, p - base, row["mapping_size"],
                                              np.asarray(x)[:4].tolist(), x.nbytes)
                os.close(fd.value)
            cu.cuMemRelease(gh)
        out.append(row)
    print(json.dumps(out))


def _send_to_child(fd, offset, size, head, nbytes):
    a, b = socket.socketpair()
    child = subprocess.Popen([sys.executable, __file__, "--importer", str(b.fileno()),
                              str(offset), str(size), str(nbytes)], pass_fds=(b.fileno(),),
                             stdout=subprocess.PIPE, text=True)
    b.close()
    socket.send_fds(a, [b"fd"], [fd])
    got = json.loads(child.communicate(timeout=60)[0])
    got["expected_head"] = head
    return got


def importer(sockfd, offset, size, nbytes):
    cu = _cu()
    s = socket.socket(fileno=sockfd)
    _, fds, _, _ = socket.recv_fds(s, 16, 1)
    ctx = C.c_void_p()
    assert cu.cuDevicePrimaryCtxRetain(C.byref(ctx), 0) == 0
    assert cu.cuCtxSetCurrent(ctx) == 0
    res = {}
    h = C.c_ulonglong()
    res["import"] = cu.cuMemImportFromShareableHandle(C.byref(h), C.c_void_p(fds[0]), 1)
    os.close(fds[0])
    va = C.c_ulonglong()
    res["reserve"] = cu.cuMemAddressReserve(C.byref(va), C.c_size_t(size), C.c_size_t(0),
                                            C.c_ulonglong(0), C.c_ulonglong(0))
    res["map"] = cu.cuMemMap(va, C.c_size_t(size), C.c_size_t(0), h, C.c_ulonglong(0))
    acc = Access(Loc(1, 0), 3)
    res["set_access"] = cu.cuMemSetAccess(va, C.c_size_t(size), C.byref(acc), C.c_size_t(1))
    buf = (C.c_float * 4)()
    res["read"] = cu.cuMemcpyDtoH_v2(buf, C.c_ulonglong(va.value + offset), C.c_size_t(16))
    res["head"] = list(buf)
    cu.cuMemUnmap(va, C.c_size_t(size))
    cu.cuMemAddressFree(va, C.c_size_t(size))
    cu.cuMemRelease(h)
    ev = C.c_void_p()
    res["ipc_event_create"] = cu.cuEventCreate(C.byref(ev), 0x2 | 0x4)
    eh = (C.c_byte * 64)()
    res["cuIpcGetEventHandle"] = cu.cuIpcGetEventHandle(eh, ev)
    print(json.dumps(res))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--exporter", action="store_true")
    ap.add_argument("--importer", nargs=4, type=int)
    a = ap.parse_args()
    if a.exporter:
        return exporter()
    if a.importer:
        return importer(*a.importer)
    facts = {}
    for name, env in ALLOCATORS.items():
        p = subprocess.run([sys.executable, __file__, "--exporter"], env=dict(os.environ, **env),
                           capture_output=True, text=True, timeout=240)
        try:
            facts[name] = json.loads(p.stdout.strip().splitlines()[-1])
        except (IndexError, ValueError):
            facts[name] = {"rc": p.returncode, "stderr": p.stderr[-2000:]}
        print(name, json.dumps(facts[name], indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(facts, f, indent=1)


if __name__ == "__main__":
    main()
