"""The drop-in rule, fuzzed (tests/fuzz_dropin.py, run by tools/fuzz_dropin.py):
a fixed slice of seeded random cases on stock JAX and installed, with one
and two CPU devices, in 32- and 64-bit mode; and proof that the harness can
fail: a broken "installed", an uninstall() that leaves JAX installed, and a
replayed case that must read as it did inside its batch."""

from __future__ import annotations

import collections
import hashlib
import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.array import ArrayImpl
from numpy.lib.array_utils import byte_bounds

import fuzz_dropin as F
import jax_overlay

# The CI slice: cases [0, CASES) of SEED in each of the four configurations
# (1 or 2 devices x x64 off or on), 60,000 in all: the four run at once, in
# about a minute on 2 cores (about 1.6 ms a case).
SEED = 20261205
CASES = 15000

CLI = pathlib.Path(__file__).resolve().parents[2] / "tools" / "fuzz_dropin.py"
CONFIGS = [(devices, x64) for devices in (1, 2) for x64 in (0, 1)]


@pytest.fixture(scope="module")
def ci_slice(tmp_path_factory):
    """{(devices, x64): (exit status, output, figures)}: the four
    configurations run at once, each in its own worker process."""
    tmp = tmp_path_factory.mktemp("fuzz_dropin")
    runs = {}
    for devices, x64 in CONFIGS:
        out = tmp / f"{devices}-{x64}.json"
        cmd = [sys.executable, str(CLI), "--seed", str(SEED), "--cases", str(CASES),
               "--devices", str(devices), "--x64", str(x64), "--json", str(out)]
        runs[devices, x64] = (subprocess.Popen(cmd, stdout=subprocess.PIPE,
                                               stderr=subprocess.STDOUT, text=True), out)
    done = {}
    for key, (proc, out) in runs.items():
        text, _ = proc.communicate(timeout=1200)
        done[key] = (proc.returncode, text, json.loads(out.read_text()) if out.exists() else None)
    return done


@pytest.mark.parametrize("devices,x64", CONFIGS, ids=[f"{d}dev-x64={x}" for d, x in CONFIGS])
def test_ci_slice(ci_slice, devices, x64):
    rc, text, figures = ci_slice[devices, x64]
    assert figures is not None, text
    assert figures["cases"] == CASES, text
    # The pools mix edge values in, but most calls must still reach the paths.
    assert figures["counts"]["stock raised"] < 0.75 * CASES
    lines = [f"{d['reproducer']}\n    {d['case']}\n    stock:     {d['stock']}\n"
             f"    installed: {d['installed']}\n    [{d['category']}] {d['detail']}"
             for d in figures["differences"]]
    assert not lines, f"{len(lines)} differences:\n" + "\n".join(lines)
    assert rc == 0, text


def test_generator_covers_every_pool():
    """The slice draws every producer family, dtype, layout, entry point
    and keyword value at least once."""
    seen = collections.defaultdict(set)
    for i in range(CASES):
        c = F.case(SEED, i)
        seen["family"].add(c.family)
        seen["entry"].add(c.entry)
        for k, v in c.params:
            seen[f"{c.family}.{k}"].add(v)
        for k, v in c.kwargs:
            seen[f"{c.entry}.{k}"].add(v)
    want = {"family": {"numpy", "jax", "weak", "protocol", "cai", "capsule", "jax_array", "junk"},
            "entry": set(F.KEYWORDS), "numpy.dtype": {d.name for d in F.DTYPES},
            "numpy.layout": set(F.LAYOUTS), "jax.place": set(F.JAX_PLACES),
            "jax.state": set(F.JAX_STATES), "cai.variant": set(F.CAI_VARIANTS),
            "protocol.device": set(F.PROTO_DEVICES), "junk.value": set(F.JUNK)}
    for entry, pools in F.KEYWORDS.items():
        for k, pool in pools.items():
            want[f"{entry}.{k}"] = set(pool.valid) | set(pool.edge)
    missing = {k: v - seen[k] for k, v in want.items() if v - seen[k]}
    assert not missing


def test_cases_release_what_they_make(balanced):
    """Every capsule the harness reads is consumed, its deleter called once;
    every tensor either run makes is released."""
    F.run_range(SEED, 0, 500, True)


def test_case_is_a_function_of_seed_and_index():
    assert F.case(SEED, 123) == F.case(SEED, 123)
    assert F.case(SEED, 123) != F.case(SEED + 1, 123)


# The first 3,000 cases of SEED, described, as they were when the GPU
# families (tests/gpu/fuzz_gpu.py, streams of their own) were added: the
# reproducers of every earlier CPU run still name the same cases.
STREAM_SHA256 = "52356a821425af06949ff5e614b23279331214fc837196aaaceaf1dd07f98890"


def test_the_case_stream_is_pinned():
    text = "\n".join(F.case(SEED, i).describe() for i in range(3000))
    assert hashlib.sha256(text.encode()).hexdigest() == STREAM_SHA256


# --- the harness can fail ----------------------------------------------------------

def _results(entry, n, wrap):
    """The first `n` cases of `entry`, run with install() also wrapping the
    installed `jnp.<entry>` in `wrap` (uninstall() restores stock's)."""
    real = jax_overlay.install
    name = entry.split(".")[-1]

    def broken():
        real()
        setattr(jnp, name, wrap(getattr(jnp, name)))
    cases = [c for c in (F.case(SEED, i) for i in range(2000)) if c.entry == entry]
    results = []
    try:
        jax_overlay.install = broken
        for c in cases:
            try:
                results.append(F.run_case(c, False))
            except F.Unavailable:  # a producer this NumPy cannot make
                continue
            if len(results) == n:
                break
        return results
    finally:
        jax_overlay.install = real
        jax_overlay.uninstall()


def test_detects_a_wrong_dtype():
    def wrap(ours):
        return lambda *a, **k: ours(*a, **k).astype(np.int8)
    results = _results("jnp.asarray", 60, wrap)
    returned = [r for r in results if r.stock.error is None and r.stock.fields["dtype"] != "int8"]
    assert len(returned) > 5
    # Each differs: by dtype, or (stock's result a deleted array) by outcome.
    assert all(r.verdict.category for r in returned), [r.describe() for r in returned]
    assert sum(r.verdict.category == "dtype" for r in returned) > 5


def test_detects_a_wrong_exception_class():
    def wrap(ours):
        def raising(*a, **k):
            raise KeyError("broken")
        return raising
    results = _results("jnp.from_dlpack", 60, wrap)
    cats = collections.Counter(r.verdict.category for r in results)
    assert cats["exception class"] > 5 and cats["outcome"] > 5, cats
    # Refusing is allowed only where stock's result was unsafe.
    assert all(r.verdict.category or "stock unsafe" in r.verdict.counts for r in results)


def test_detects_an_alias_on_copy():
    """An installed copy=True that returns the producer's own JAX array."""
    def wrap(ours):
        return lambda x, *a, **k: x if isinstance(x, jax.Array) else ours(x, *a, **k)
    results = _results("jnp.array", 120, wrap)
    unsafe = [r for r in results if r.verdict.category == "installed unsafe"]
    assert unsafe and all("alias" in r.verdict.detail for r in unsafe)


def _leave_dlpack_installed(real):
    def uninstall():
        ours = ArrayImpl.__dict__["__dlpack__"]
        real()
        ArrayImpl.__dlpack__ = ours
    return uninstall


@pytest.mark.parametrize("patch", [
    ("uninstall", lambda real: lambda: None),
    ("uninstall", _leave_dlpack_installed),
    ("install", lambda real: lambda: None),
], ids=["uninstall is a no-op", "uninstall leaves __dlpack__", "install is a no-op"])
def test_stock_is_stock(patch):
    name, make = patch
    real = getattr(jax_overlay, name)
    try:
        setattr(jax_overlay, name, make(real))
        with pytest.raises(AssertionError, match="JAX's own"):
            for i in range(2):
                F.run_case(F.case(SEED, i), False)
    finally:
        setattr(jax_overlay, name, real)
        jax_overlay.uninstall()
        ArrayImpl.__dlpack__ = F.STOCK[(ArrayImpl, "__dlpack__")]
    F.assert_stock()


def test_replay_reads_as_in_the_batch():
    """A case replayed alone, here or in a fresh process through the CLI,
    reads exactly as it did inside its batch."""
    batch = F.run_range(SEED, 0, 80, False, record=True)["records"]
    assert len(batch) == 80
    for i in (79, 17, 3, 41):
        if batch[i].startswith("not run"):  # a producer this NumPy cannot make
            continue
        r = F.run_case(F.case(SEED, i), False)
        jax_overlay.uninstall()
        assert r.describe() == batch[i]
    out = subprocess.run([sys.executable, str(CLI), "--seed", str(SEED), "--case", "17",
                          "--devices", str(jax.device_count()), "--x64", "0"],
                         capture_output=True, text=True, timeout=300)
    assert batch[17] in out.stdout, out.stdout + out.stderr


# --- the capsule reader, on NumPy's capsules ------------------------------------------

@pytest.mark.parametrize("max_version", [None, (1, 0)])
def test_read_capsule(max_version):
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    a = base[::-1, ::2]
    refs = sys.getrefcount(base)
    f = F.read_capsule(a.__dlpack__(max_version=max_version), [byte_bounds(base)])
    assert f["capsule name"] == ("dltensor" if max_version is None else "dltensor_versioned")
    assert f["capsule device"] == (1, 0) and f["dl dtype"] == (2, 32, 1)
    assert f["shape"] == (4, 3) and f["strides"] == (-6, 2)
    assert f["bytes"] == hashlib.sha1(np.ascontiguousarray(a).tobytes()).hexdigest()[:12]
    assert f["alias"] is True
    if max_version is not None:
        assert f["version major"] == 1 and f["flags"] & F.READ_ONLY == 0
    del a
    assert sys.getrefcount(base) == refs  # the deleter ran, once


# --- the whitelists: counted, and never hiding anything else ---------------------------

def _capsule(name, minor=None, flags=None, device=(1, 0)):
    f = {"type": "PyCapsule", "capsule name": name, "capsule device": device}
    if minor is not None:
        f.update({"version major": 1, "version minor": minor, "flags": flags})
    return F.Outcome(fields=f)


EXPORT = F.Case(SEED, 0, "jax", (), "x.__dlpack__", (("max_version", "(1, 0)"),))


def test_version_minor_fails_unless_allowed():
    s, o = _capsule("dltensor_versioned", 3, 0), _capsule("dltensor_versioned", 1, 0)
    assert F.judge(EXPORT, s, o).category == "version minor"
    v = F.judge(EXPORT, s, o, allow_version_minor=True)
    assert v.category is None and "allowed: version minor" in v.counts


@pytest.mark.parametrize("extension,allowed", [(498, True), (499, False)])
def test_legacy_jaxlib_versioned_capsule(monkeypatch, extension, allowed):
    monkeypatch.setattr(F, "jaxlib_extension_version", extension)
    s, o = _capsule("dltensor"), _capsule("dltensor_versioned", 0, F.READ_ONLY)
    v = F.judge(EXPORT, s, o)
    assert (v.category is None) == allowed
    assert (("allowed: " + F.LEGACY_JAXLIB_VERSIONED) in v.counts) == allowed
    # The whitelist covers the capsule's kind only, not what it holds.
    o.fields["capsule device"] = (1, 1)
    assert F.judge(EXPORT, s, o).category == ("capsule device" if allowed else "capsule name")


def test_stock_unsafe_is_counted_not_failed():
    c = F.Case(SEED, 0, "numpy", (), "jnp.from_dlpack", (("copy", "True"),))
    stock = F.Outcome(fields={"dtype": "float32", "values": "a", "truth": True, "alias": True})
    ours = F.Outcome(fields={"dtype": "float32", "values": "a", "truth": True, "alias": False})
    v = F.judge(c, stock, ours)
    assert v.category is None and "stock unsafe" in v.counts
    assert F.judge(c, ours, stock).category == "installed unsafe"
    assert "stock unsafe, installed too" in F.judge(c, stock, stock).counts


def test_sum_adds_runs_and_refuses_overlapping_ranges(tmp_path):
    """--sum: committed runs of distinct ranges add up (cases, counts,
    differences, exit status); two runs over the same cases are refused,
    naming both files."""
    def run(name, ranges, cases, diffs, counts):
        p = tmp_path / name
        p.write_text(json.dumps({"seed": 9, "ranges": ranges, "cases": cases, "seconds": 1.0,
                                 "counts": counts, "differences": diffs, "stock unsafe": [],
                                 "allowed": []}))
        return str(p)
    a = run("a.json", [["cupy", 0, 0, 100], ["torch", 1, 0, 50]], 150, [],
            {"stock raised": 40, "stock unsafe": 3})
    b = run("b.json", [["cupy", 0, 100, 70]], 70, [{"category": "shape"}],
            {"stock raised": 5})
    c = run("c.json", [["cupy", 0, 150, 10]], 10, [], {})
    out = subprocess.run([sys.executable, str(CLI), "--sum", a, b], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 1, out.stderr  # b's difference
    assert "220 cases, 1 differences (stock raised 45," in out.stdout
    assert "stock unsafe 3" in out.stdout
    out = subprocess.run([sys.executable, str(CLI), "--sum", a], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and "150 cases, 0 differences" in out.stdout, out
    out = subprocess.run([sys.executable, str(CLI), "--sum", a, b, c], capture_output=True,
                         text=True, timeout=60)
    words = out.stderr.replace(str(tmp_path) + "/", "")
    assert out.returncode != 0 and "c.json and b.json both ran cases 150.." in words, words
