"""The GPU stress run (benchmarks/stress_gpu.py) at a small trial count, so
the suite runs the same code: every path, every producer and stream, work in
flight and pools reused, zero stale or corrupt reads, and the controls
(ordering off) must see stale reads."""

import importlib.util
import pathlib

import pytest

pytest.importorskip("cupy")

_PATH = pathlib.Path(__file__).parents[2] / "benchmarks" / "stress_gpu.py"
_spec = importlib.util.spec_from_file_location("stress_gpu", _PATH)
stress = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(stress)


def test_stress_small():
    report = stress.run(trials=60, seed=1, batch=20, controls=40, log=lambda *a: None)
    assert not report["errors"], report["errors"]
    assert report["paths"], "no path ran"
    for name, r in report["paths"].items():
        assert r["trials"] == 60, (name, r)
        assert (r["stale"], r["reused"], r["other"]) == (0, 0, 0), (name, r)
    for name, r in report["controls"].items():
        assert r["trials"] > r["ok"], f"{name}: the detector saw nothing with ordering off"


@pytest.mark.parametrize("path", ["dlpack_export_cupy", "dlpack_export_torch", "cai_export_torch"])
def test_exports_to_a_consumers_own_stream(path):
    """Consumers on their own non-blocking streams, at scale.  Regression for
    the stress run itself: it once stacked the codes on the default stream
    without waiting for those streams, and reported the last trials of a
    batch as stale (1 to 4 such reports in 4,000 trials of each path)."""
    gpu = stress.Gpu()
    if not stress.producers_for(path, gpu.have):
        pytest.skip(f"{path}: its consumer library is not installed")
    gpu.jax_overlay.install()
    try:
        todo = [dict(t, stream="user") for t in stress.plan(path, 4000, 7, gpu.have)]
        r = stress._run_path(gpu, path, todo, 200, True)
    finally:
        gpu.jax_overlay.uninstall()
        gpu.jax.config.update("jax_enable_x64", gpu.x64)
    assert r["in_flight"] > 2000, r
    assert (r["stale"], r["reused"], r["other"]) == (0, 0, 0), r["bad_trials"][:5]
