"""from_shards and to_shards under JAX's own distributed runtime: 2 and 4
local processes on the CPU backend (2 CPU devices each, gloo collectives),
each passing only its own shards.  The global array feeds a jitted
reduction across every process.  A bad shard in one process (its dtype,
a missing shard, a global shape that does not tile) is the same clear error
in every process, and a process that never calls from_shards makes the
others raise after config.agree_timeout_s: no case hangs (every run is
bounded by a timeout here)."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest

WORKER = pathlib.Path(__file__).with_name("shards_worker.py")
# Every process of a run, together: imports, joins, seven cases.
RUN_TIMEOUT_S = 240


def _free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _run(n, *extra):
    port = _free_port()
    import jax_overlay
    # The jax_overlay this run tests (a checkout's or an installed one).
    where = str(pathlib.Path(jax_overlay.__file__).resolve().parent.parent)
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=2",
               PYTHONPATH=os.pathsep.join([where, os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(n), str(i), str(port), *extra],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for i in range(n)]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=RUN_TIMEOUT_S)
            outs.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # a hang: the assertion below names it
    results = []
    for i, (rc, out, err) in enumerate(outs):
        assert rc == 0, f"process {i} exited {rc}:\n{err[-3000:]}"
        cases = {}
        for line in out.splitlines():
            if line.startswith("{"):
                case = json.loads(line)
                cases[case.pop("case")] = case
        results.append(cases)
    return results


def _same_error(results, case, cls, *words):
    """Every process raised one error, of `cls`, naming `words`."""
    errors = {r[case].get("error") for r in results}
    assert len(errors) == 1 and None not in errors, [r[case] for r in results]
    error = errors.pop()
    for r in results:
        assert cls in r[case]["mro"], r[case]
        assert r[case]["seconds"] < 30, r[case]  # at once, not after a collective times out
    for w in words:
        assert w in error, error
    return error


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"{n}proc")
def run(request):
    return request.param, _run(request.param)


def test_global_array_from_local_shards_feeds_a_cross_process_reduction(run):
    n, results = run
    for r in results:
        for case in ("good", "good_again"):
            ok = r[case]["ok"]
            assert ok["sum"] == ok["want"], ok
            assert ok["shape"] == [2 * n * 4, 3] and ok["dtype"] == "float32", ok
            assert ok["shards"] == 2 and ok["shards_match"], ok  # to_shards: this process's own
            assert ok["zero_copy"], ok  # to_shards' data are the very NumPy buffers


def test_a_bad_dtype_in_one_process_fails_every_process(run):
    n, results = run
    _same_error(results, "bad_dtype_in_one_process", "ValueError",
                f"process {n - 1}:", "is int32 but", "is float32", f"every one of the {n} processes")


def test_processes_that_disagree_on_the_dtype_all_fail(run):
    n, results = run
    _same_error(results, "another_dtype_in_one_process", "ValueError",
                "disagree on the dtype", "process 0: int32", "process 1: float32")


def test_a_missing_shard_in_one_process_fails_every_process(run):
    n, results = run
    _same_error(results, "missing_shard_in_one_process", "ValueError",
                f"process {n - 1}:", "got 1 arrays, but the sharding has 2 addressable devices")


def test_a_global_shape_that_does_not_tile_fails_every_process(run):
    n, results = run
    _same_error(results, "uneven_global_shape", "ValueError",
                "does not fit the sharding", f"every one of the {n} processes")


def test_a_process_that_never_calls_makes_the_others_raise_not_hang(run):
    n, results = run
    assert results[n - 1]["one_process_never_calls"]["ok"] == "skipped the call"
    for r in results[:-1]:
        case = r["one_process_never_calls"]
        assert case["class"] == "BufferError", case
        assert f"process {n - 1} of {n} gave no account of its shards within 3 s" in case["error"]
        assert 2.5 < case["seconds"] < 30, case  # the agreement's timeout, then the error


def test_torch_cpu_tensors_as_shards():
    import torch_or_skip
    torch_or_skip.torch()
    results = _run(2, "torch")
    for r in results:
        ok = r["good"]["ok"]
        assert ok["sum"] == ok["want"] and ok["shards_match"], ok
