"""The performance report (benchmarks/report.py, tools/make_perf_table.py)
on a small results file in run_all's schema: ratios, targets, the README's
generated block, the chart's optional dependency."""

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
if not (ROOT / "benchmarks" / "report.py").exists():
    pytest.skip("benchmarks/ is not here: the Bazel suite stages the package and its tests only",
                allow_module_level=True)
sys.path.insert(0, str(ROOT / "benchmarks"))

import report  # noqa: E402


def _lat(group, direction, who, call, us, error=None):
    return {"group": group, "direction": direction, "who": who, "call": call, "us": us, "error": error}


def _flight(call, idle, inflight, max_call_us, busy_after, who="jax_overlay", direction="import"):
    return {"group": "g", "direction": direction, "who": who, "call": call, "producer": "CuPy user stream",
            "idle_us": idle, "inflight_us": inflight, "busy_after_every_round": busy_after,
            "round_ms": 150, "probe": {"calls": 500, "kernel_ms": 500, "median_call_us": idle,
                                       "max_call_us": max_call_us, "producer_busy_after": busy_after},
            "error": None}


def results():
    g = "CuPy → JAX, DLPack"
    return {
        "schema": report.SCHEMA,
        "meta": {"gpu": "NVIDIA H200", "gpu_short": "h200", "date": "2026-12-03", "driver": "580.1",
                 "cuda_driver_api": "13.0", "jax": "0.11.2", "jaxlib": "0.11.2", "cupy": "14.2.0",
                 "torch": "2.11.0", "numba": "0.68", "python": "3.12.3",
                 "statistic": "median of 7 round means of 500 calls", "source_digest": "x"},
        "latency": [
            _lat(g, "import", "stock", "jax.dlpack.from_dlpack(a)", 34.0),
            _lat(g, "import", "jax_overlay", "jax_overlay.from_dlpack(a)", 17.0),
            _lat(g, "import", "jax_overlay installed", "jnp.asarray(a)", 18.0),
            _lat(g, "import", "peer", "torch.from_dlpack(a)", 5.0),
            _lat(g, "import", "peer", "numba.cuda.as_cuda_array(a)", 8.5),
            _lat("CuPy → JAX, CAI", "import", "stock", "jnp.asarray(a)", None, "fails: JaxRuntimeError: x"),
            _lat("CuPy → JAX, CAI", "import", "jax_overlay", "jax_overlay.from_cuda_array_interface(a)", 9.0),
            _lat("export property, CAI", "export", "stock", report.EXPORT_PROPERTY, 0.7),
            _lat("export property, CAI", "export", "jax_overlay", report.EXPORT_PROPERTY, 2.5),
        ],
        "inflight": [
            _flight("jax_overlay.from_dlpack(a)", 17.0, 40.0, 60.0, True),
            _flight("jax.dlpack.from_dlpack(a)", 34.0, 300.0, 499000.0, False, who="stock"),
            _flight(report.EXPORT_PROPERTY, 2.5, 3.0, 90.0, True, direction="export"),
        ],
        "floors": [{"part": "peer", "name": "CuPy a.__dlpack__", "us": 6.0, "error": None},
                   {"part": "jax_overlay native", "name": "plan_dlpack_import", "us": 1.0, "error": None},
                   {"part": "jaxlib", "name": "DLPack import, no stream event", "us": 5.0, "error": None}],
        "breakdown": [{"call": "jax_overlay.from_dlpack(a) (CuPy)",
                       "total": f"{g}|jax_overlay|jax_overlay.from_dlpack(a)",
                       "parts": ["CuPy a.__dlpack__", "plan_dlpack_import", "DLPack import, no stream event"]}],
        "sizes": {"bytes": [4, 1 << 30], "zero_copy_us": {"jax_overlay.from_dlpack(a)": [15.0, 15.5]},
                  "copy_bytes": [1 << 10, 1 << 30],
                  "copy_gbps": {report.D2D: [1.0, 2000.0], report.STRIDED: [0.5, 1200.0],
                                report.COPY_TRUE: [0.9, 1900.0], report.PINNED: [0.1, 50.0],
                                report.H2D: [0.2, 55.0]}},
    }


def test_short_gpu_names():
    assert report.short_gpu_name("NVIDIA H200") == "h200"
    assert report.short_gpu_name("NVIDIA A100-SXM4-80GB") == "a100"
    assert report.short_gpu_name("NVIDIA H100 80GB HBM3") == "h100"
    assert report.short_gpu_name("NVIDIA GeForce RTX 4090") == "rtx-4090"
    assert report.results_stem(results()["meta"]) == "h200-2026-12-03"


def test_latency_table_ratios_against_stock_and_the_fastest_peer():
    table = report.latency_table(results(), "import")
    row = next(ln for ln in table.splitlines() if "jax_overlay.from_dlpack(a)" in ln)
    cells = [c.strip() for c in row.split("|")]
    assert cells[2].startswith("34.0") and cells[3].startswith("17.0")
    assert cells[4] == "0.50×" and cells[6] == "3.40×"  # 17/34 and 17/5
    installed = next(ln for ln in table.splitlines() if "`jnp.asarray(a)`" in ln and "18.0" in ln)
    assert "0.53×" in installed
    assert "stock fails" in next(ln for ln in table.splitlines() if "from_cuda_array_interface" in ln)


def test_targets_come_from_the_data():
    got = {t.split(":")[0]: ok for t, _, ok in report.targets(results())}
    assert got["import ≤ 15 µs idle"] is False  # 17 µs
    assert got["import ≤ 32 µs in flight"] is False  # 40 µs
    assert got["export property ≤ 4 µs"] is True
    assert got["never blocks the host"] is True
    assert got["strided import ≥ 50% of memcpy at 1 GiB"] is True  # 1200 of 2000
    assert got["zero-copy latency flat from 4 B to 1 GiB (largest / smallest ≤ 1.5)"] is True
    r = results()
    r["sizes"]["zero_copy_us"]["jax_overlay.from_dlpack(a)"][1] = 40.0
    r["sizes"]["copy_gbps"][report.STRIDED][1] = 900.0
    got = {t.split(":")[0]: ok for t, _, ok in report.targets(r)}
    assert got["zero-copy latency flat from 4 B to 1 GiB (largest / smallest ≤ 1.5)"] is False
    assert got["strided import ≥ 50% of memcpy at 1 GiB"] is False  # 900 of 2000
    table = report.inflight_table(results())
    stock = next(ln for ln in table.splitlines() if "stock" in ln)
    assert "**yes**" in stock  # the producer was done: the host was blocked


def test_copy_table_compares_with_its_memcpy():
    table = report.copy_table(results())
    last = table.splitlines()[-1]
    assert "1200.0 (60% of D2D memcpy)" in last
    assert "50.0 (91% of H2D memcpy)" in last


def test_breakdown_leaves_the_glue_as_the_rest():
    row = report.breakdown_table(results()).splitlines()[-1]
    assert row.endswith("| 5.00 |")  # 17 - 6 - 1 - 5


def test_markdown_refuses_other_files():
    with pytest.raises(ValueError, match="bench/1"):
        report.markdown({"schema": "something else"})


def test_readme_summary_pairs_stock_and_ours_per_path():
    r = results()
    for e in r["inflight"][:2]:
        e["group"] = "CuPy → JAX, DLPack"
    table = report.summary_table(r)
    row = next(ln for ln in table.splitlines() if ln.startswith("| CuPy → JAX, DLPack"))
    assert "| 0.50× |" in row  # 17/34: the first jax_overlay call against stock's
    assert row.endswith("| 499.0 ms (**host blocked**) / 60.0 µs |")
    assert "stock fails" in next(ln for ln in table.splitlines() if ln.startswith("| CuPy → JAX, CAI"))
    met = report.targets(r)
    text = report.markdown(r, "readme")
    assert f"**Targets**: {sum(ok for _, _, ok in met)} of {len(met)} met; strided import" in text
    assert "**Floors**" not in text and "**Imports**" not in text and "docs/PERFORMANCE.md" in text


README = """# x

intro

## Performance

old table

## Later

kept
"""


def test_readme_section_is_replaced_then_regenerated_in_place():
    once = report.update_text(README, results(), "benchmarks/results/h200-2026-12-03.png")
    assert "old table" not in once and "## Later\n\nkept" in once and once.startswith("# x\n\nintro\n")
    assert "![jax_overlay latency and bandwidth](benchmarks/results/h200-2026-12-03.png)" in once
    assert "(readme)" in once and "docs/PERFORMANCE.md" in once
    twice = report.update_text(once, results(), "benchmarks/results/h200-2026-12-03.png")
    assert twice == once
    r = results()
    r["latency"][1]["us"] = 16.0
    again = report.update_text(once, r, None)
    assert "16.0" in again and again.count("BEGIN generated") == 1 and "## Later" in again


def test_full_block_between_markers():
    text = "# Perf\n\nprose\n\n" + report.BEGIN.format(flavour="full") + "\n" + report.END + "\n\nmore\n"
    out = report.update_text(text, results(), None)
    assert "**Floors**" in out and "**Zero-copy latency by size**" in out
    assert out.startswith("# Perf\n\nprose\n\n") and out.endswith("\nmore\n")


def test_chart_needs_matplotlib(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    why = report.chart(results(), str(tmp_path / "c.png"))
    assert why.startswith("no chart: matplotlib is not installed")
    assert not (tmp_path / "c.png").exists()


def test_chart_is_drawn(tmp_path):
    pytest.importorskip("matplotlib")
    assert report.chart(results(), str(tmp_path / "c.png")) is None
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_source_digest_follows_the_sources(tmp_path):
    (tmp_path / "jax_overlay").mkdir()
    (tmp_path / "jax_overlay" / "a.py").write_text("x = 1\n")
    first = report.source_digest(str(tmp_path))
    assert report.source_digest(str(tmp_path)) == first
    (tmp_path / "jax_overlay" / "a.py").write_text("x = 2\n")
    assert report.source_digest(str(tmp_path)) != first


def test_make_perf_table_cli(tmp_path):
    path = tmp_path / "h200-2026-12-03.json"
    path.write_text(json.dumps(results()))
    readme = tmp_path / "README.md"
    readme.write_text(README)
    tool = [sys.executable, str(ROOT / "tools" / "make_perf_table.py"), str(path)]
    p = subprocess.run(tool, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("Measured on NVIDIA H200") and "**Floors**" in p.stdout
    assert "DIFFERENT" in p.stderr  # the digest "x" is no tree's
    p = subprocess.run(tool + ["--write", str(readme)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "updated" in p.stderr and "**Targets**" in readme.read_text()


def test_run_all_help_needs_no_gpu_library():
    """`benchmarks/run_all.py --help` answers anywhere; a run without CuPy
    says what it needs instead of a traceback."""
    script = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "run_all.py"
    out = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "usage: run_all.py" in out.stdout, out.stderr[-2000:]
    try:
        import cupy  # noqa: F401
    except ImportError:
        out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 1 and "needs CuPy and a GPU" in out.stderr, out.stderr[-2000:]
