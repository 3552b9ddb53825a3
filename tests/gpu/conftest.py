"""The GPU suite runs on a loaded GPU: another process keeps it busy
(tests/gpu/load.py) for as long as any test of this folder runs, as in
production.  A race that only an idle GPU hides is still a race.

JAX_OVERLAY_GPU_LOAD: unset or "1", this session starts its own load
process (each pytest-xdist worker its own); "external", a load the runner
started is already running (tools/gpu_session.sh starts one for all
workers); "0", an idle GPU (to compare, never to prove)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

LOAD = pathlib.Path(__file__).parent / "load.py"


@pytest.fixture(scope="session", autouse=True)
def gpu_load():
    mode = os.environ.get("JAX_OVERLAY_GPU_LOAD", "1")
    if mode in ("0", "external"):
        yield mode
        return
    proc = subprocess.Popen([sys.executable, str(LOAD)], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().strip()
        if line != "ready":
            pytest.fail(f"the GPU load process did not start ({proc.poll()=}, {line!r})")
        yield proc
    finally:
        proc.kill()
        proc.wait()
