"""The GPU stress run's planning and reporting (benchmarks/stress_gpu.py),
which need no GPU: trials are reproducible from the seed, draw only what a
producer library supports, and are counted exactly."""

import importlib.util
import pathlib

_PATH = pathlib.Path(__file__).parents[2] / "benchmarks" / "stress_gpu.py"
_spec = importlib.util.spec_from_file_location("stress_gpu_plan", _PATH)
stress = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(stress)

ALL = {"cupy", "torch", "numba", "numba_dlpack"}


def test_plan_is_reproducible_and_seed_dependent():
    a = stress.plan("cai_import", 50, 3, ALL)
    assert a == stress.plan("cai_import", 50, 3, ALL)
    assert a != stress.plan("cai_import", 50, 4, ALL)
    assert a != stress.plan("dlpack_import", 50, 3, ALL)


def test_plan_draws_only_supported_combinations():
    for path in stress.PATHS:
        for t in stress.plan(path, 400, 0, ALL):
            assert t["lib"] in stress.producers_for(path, ALL)
            assert t["stream"] in stress.streams_for(t["lib"])
            assert t["dtype"] in stress.dtypes_for(t["lib"], path)
            assert stress.V_RANGE[0] <= t["v"] <= stress.V_RANGE[1]
            assert stress.W_RANGE[0] <= t["w"] <= stress.W_RANGE[1]
            assert t["v"] != stress.Z


def test_plan_covers_every_producer_and_stream():
    seen = {(t["lib"], t["stream"]) for t in stress.plan("cai_import", 2000, 0, ALL)}
    assert seen == {(lib, s) for lib in ("cupy", "torch", "numba")
                    for s in stress.streams_for(lib)}


def test_missing_libraries_are_not_drawn():
    assert stress.plan("cai_export_torch", 10, 0, {"cupy"}) == []
    assert {t["lib"] for t in stress.plan("dlpack_import", 300, 0, {"cupy", "numba"})} == {"cupy"}
    assert "bfloat16" not in stress.dtypes_for("cupy", "dlpack_import")
    # The CAI has no typestr for bfloat16: only PyTorch over DLPack draws it.
    assert "bfloat16" not in stress.dtypes_for("torch", "cai_import")
    assert "bfloat16" in stress.dtypes_for("torch", "dlpack_export_torch")
    assert {t["dtype"] for t in stress.plan("cai_export_torch", 500, 0, ALL)} == set(stress.DTYPES) - {"bfloat16"}


def test_summarize_counts_each_outcome():
    trials = stress.plan("cai_import", 6, 0, {"cupy"})
    codes = [stress.OK, stress.OK, stress.STALE, stress.REUSED, stress.OTHER, stress.OK]
    r = stress.summarize("cai_import", trials, codes, [True, False] * 3, 1.234)
    assert (r["trials"], r["ok"], r["stale"], r["reused"], r["other"], r["in_flight"]) == (6, 3, 1, 1, 1, 3)
    assert sum(sum(c.values()) for c in r["by_producer_stream"].values()) == 6
    text = stress.table({"paths": {"cai_import": r}, "controls": {}})
    assert "cai_import" in text and text.splitlines()[2].split()[1:6] == ["6", "3", "1", "1", "1"]


class _CountingGpu:
    """Stands in for the GPU side: every trial is ok, every other one busy."""

    def __init__(self):
        self.batches = 0

    def import_trials(self, path, chunk, ordered):
        self.batches += 1
        return [stress.OK] * len(chunk), [i % 2 == 0 for i in range(len(chunk))]


def test_run_path_reports_after_every_batch():
    todo = stress.plan("cai_import", 25, 0, ALL)
    seen = []
    r = stress._run_path(_CountingGpu(), "cai_import", todo, 10, True, on_batch=seen.append)
    assert [s["trials"] for s in seen] == [10, 20, 25]
    assert r["trials"] == 25 and r["ok"] == 25 and r["in_flight"] == 13


def test_run_path_past_its_deadline_reports_the_trials_it_ran():
    todo = stress.plan("cai_import", 25, 0, ALL)
    gpu = _CountingGpu()
    r = stress._run_path(gpu, "cai_import", todo, 10, True, deadline=float("-inf"))
    assert gpu.batches == 0 and r["trials"] == 0
