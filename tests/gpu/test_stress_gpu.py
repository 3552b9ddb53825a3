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
