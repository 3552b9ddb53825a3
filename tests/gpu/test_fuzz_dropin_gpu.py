"""The drop-in fuzz (tests/fuzz_dropin.py) over GPU producers
(tests/gpu/fuzz_gpu.py: CuPy, PyTorch, Numba): a fixed slice of each
family's cases, stock and installed, in 32- and 64-bit mode, failing with a
reproducer line per difference; and proof that the slice can fail: its
in-flight producers were in flight, and an installed import that ignores
their stream is caught.  The long run: tools/fuzz_dropin.py --gpu
(tools/gpu_session.sh 4)."""

from __future__ import annotations

import collections
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import jax_overlay

# Bazel's gpu_pytest ships tests/gpu and dropin.py, not fuzz_dropin.py.
F = pytest.importorskip("fuzz_dropin", reason="tests/fuzz_dropin.py is not beside tests/gpu here")
import fuzz_gpu as G  # noqa: E402 - registers the GPU families in F.FAMILIES

SEED = 20261206
# Cases per family and mode: 2,000 x 3 families x 2 modes.
CASES = int(os.environ.get("JAX_OVERLAY_FUZZ_GPU_CASES", "2000"))


def _family(name):
    why = F.FAMILIES[name].unavailable()
    if why:
        pytest.skip(f"{name}: {why}")


@pytest.fixture
def x64_kept():
    was = bool(jax.config.jax_enable_x64)
    yield
    F.set_x64(was)


TOOL = pathlib.Path(__file__).resolve().parents[2] / "tools" / "fuzz_dropin.py"


def _run_slice(name, x64, tmp_path):
    """The slice, in the long run's worker processes (tools/fuzz_dropin.py):
    a case that crashes its process (stock JAX reading freed memory did, in
    this pytest process, on the H100 on 2026-12-05) is a finding with its
    reproducer, not the end of the suite."""
    out = tmp_path / f"{name}-{x64}.json"
    r = subprocess.run(
        [sys.executable, str(TOOL), "--gpu", name, "--seed", str(SEED), "--cases", str(CASES),
         "--x64", str(x64), "--jobs", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=600)
    assert out.exists(), f"exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return json.loads(out.read_text())


@pytest.mark.parametrize("x64", [0, 1], ids=["x32", "x64"])
@pytest.mark.parametrize("name", G.NAMES)
def test_gpu_slice(name, x64, tmp_path):
    _family(name)
    out = _run_slice(name, x64, tmp_path)
    c = out["counts"]
    lines = [f"{d['reproducer']}\n    {d['case']}\n    stock:     {d['stock']}\n"
             f"    installed: {d['installed']}\n    [{d['category']}] {d['detail']}"
             for d in out["differences"]]
    assert not lines, f"{len(lines)} differences:\n" + "\n".join(lines)
    assert out["cases"] == CASES
    # Cases the libraries cannot make (one GPU for "other GPU", a dtype or a
    # view a library lacks) are counted with why, but most must run.
    not_run = {k: v for k, v in c.items() if k.startswith("not run")}
    assert sum(not_run.values()) < 0.35 * CASES, not_run
    calls = c["in flight: calls returned"]
    assert calls and c["in flight: still pending after the call"] > calls // 4, (
        f"{c['in flight: still pending after the call']} of {calls} in-flight producers were "
        "still busy after the call: the in-flight cases prove little")


def test_generator_covers_every_pool():
    """Each family's slice draws every kind, dtype, layout, state, stream,
    current device, view and wrapper, every entry point and keyword value."""
    for name in G.NAMES:
        fam = F.FAMILIES[name]
        seen = collections.defaultdict(set)
        for i in range(CASES):
            c = F.case(SEED, i, name)
            assert c == F.case(SEED, i, name)
            seen["entry"].add(c.entry)
            for k, v in c.params:
                seen[k].add(v)
            for k, v in c.kwargs:
                seen[f"{c.entry}.{k}"].add(v)
        want = {"kind": set(fam.kinds), "dtype": set(fam.dtypes), "layout": set(fam.layouts),
                "state": set(G.STATES), "current": set(G.CURRENT), "entry": set(fam.entries)}
        want["stream"] = set(G.STREAMS) | ({"-"} if fam.host_kinds else set())
        if name == "torch":
            want["view"] = set(G.TORCH_VIEWS)
        want["wrap"] = {"raw", "cai stream=producer's", "dlpack legacy", *G.CAI_CLAIMS,
                        *G.DLPACK_CLAIMS}
        for entry, pools in fam.keywords.items():
            for k, pool in pools.items():
                want[f"{entry}.{k}"] = set(pool.valid) | set(pool.edge)
        missing = {k: v - seen[k] for k, v in want.items() if v - seen[k]}
        assert not missing, (name, missing)


def test_an_installed_import_that_ignores_the_stream_is_caught(x64_kept):
    """An "installed" jax.dlpack.from_dlpack that reads CuPy's CAI as stock
    jnp.asarray does, unordered: where stock's own from_dlpack (which
    passes its stream) is right, the in-flight cases catch it."""
    _family("cupy")
    real = jax_overlay.install
    stock_asarray = F.STOCK[(jnp, "asarray")]

    def broken():
        real()
        jax.dlpack.from_dlpack = lambda x, *a, **k: stock_asarray(x)
    # Compact, non-empty, on a user stream: stock's jnp.asarray reads these
    # as they are (tests/gpu/test_dlpack_export_gpu.py sees them stale).
    want = {"state": "in flight", "wrap": "raw", "stream": "user", "layout": "C"}
    cases = [c for c in (F.case(SEED, i, "cupy") for i in range(100000))
             if c.entry == "jax.dlpack.from_dlpack" and not c.kwargs
             and want.items() <= dict(c.params).items() and 0 not in dict(c.params)["shape"]][:40]
    try:
        jax_overlay.install = broken
        verdicts = collections.Counter()
        for c in cases:
            try:
                verdicts[F.run_case(c, False).verdict.category] += 1
            except F.Unavailable as e:
                verdicts["not run: " + e.reason] += 1
    finally:
        jax_overlay.install = real
        jax_overlay.uninstall()
    assert len(cases) >= 20 and verdicts["installed unsafe"] > 0, verdicts
