"""The receiving process of tests/cpu/test_ipc_leases.py: asks an exporter
for a share's layout and descriptors over jax_overlay's socket protocol, then does
what the test says with its hold."""

import os


def receive(share, conn):
    from jax_overlay import _ipc
    try:
        sock, layout, fds = _ipc._request(share)
    except BufferError as e:
        conn.send(("BufferError", str(e)))
        return
    # What each descriptor holds: the exporter's bytes, through SCM_RIGHTS;
    # the layout as the exporter told it.
    conn.send(("ok", [os.pread(fd, 64, 0) for fd in fds[:3]], len(fds), layout))
    for fd in fds:
        os.close(fd)
    what = conn.recv()
    if what == "crash":
        os._exit(9)  # the kernel closes the socket: the hold must end anyway
    sock.close()  # let go
    conn.send("closed")
