"""`python -m jax_overlay doctor` on the CPU: it runs, prints the host rows
and marks GPU rows skipped, its --json follows the documented schema, and
its exit status says whether jax_overlay kept its promises."""

import contextlib
import io
import json
import os
import pathlib
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

import jax_overlay
from jax_overlay import _route
import forge as T
from jax_overlay import doctor

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _doctor_cli(*args):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "jax_overlay", "doctor", "--calls", "20", *args],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)


def _why(p):
    """A failed doctor run, short enough to read in a CI log: its exit
    status, the rows that failed (when it printed its JSON) and the end of
    stderr (a crash at exit prints there after a complete report)."""
    rows = p.stdout[-3000:]
    with contextlib.suppress(ValueError):
        report = json.loads(p.stdout)
        rows = json.dumps([r for r in report["rows"] if r["status"] in doctor.FAILING], indent=1)
    return f"exit status {p.returncode}; failing rows: {rows}; stderr: {p.stderr[-2000:]}"


@pytest.fixture(scope="module")
def plain():
    return _doctor_cli("--plain")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    saved = tmp_path_factory.mktemp("doctor") / "report.json"
    p = _doctor_cli("--json", "--json-file", str(saved))
    assert p.returncode == 0, _why(p)
    printed = json.loads(p.stdout)
    assert json.loads(saved.read_text())["rows"] == printed["rows"]
    return printed


def test_cli_runs_and_exits_zero(plain):
    assert plain.returncode == 0, _why(plain)
    out = plain.stdout
    assert out.startswith("jax_overlay doctor\n")
    assert "stock JAX" in out and "jax_overlay installed" in out
    assert "exit status 0" in out.splitlines()[-1]


def _table(stdout):
    """{(path, protocol, memory): cells} of the plain table (cells are
    separated by two spaces or more; blank cells vanish)."""
    rows = {}
    for line in stdout.splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        if cells[0].isdigit() and len(cells) >= 5:
            rows[tuple(cells[1:4])] = cells[4:]
    return rows


def test_cli_prints_host_rows_and_skips_gpu_rows(plain):
    rows = _table(plain.stdout)
    # works, 0-copy, stream, us for stock, then for jax_overlay, then status
    assert rows[("NumPy -> JAX", "DLPack 1.x", "host")][4:7] == ["yes", "yes", "n/a"]
    assert rows[("NumPy -> JAX", "DLPack 1.x", "host")][-1] == "ok"
    strided = rows[("NumPy -> JAX", "DLPack 1.x", "host, strided")]
    assert strided[0] == "no" and strided[1:4] == ["yes", "no", "n/a"] and strided[-1] == "ok"
    assert rows[("JAX -> NumPy", "DLPack legacy", "host")][-1] == "ok"
    assert rows[("NumPy -> JAX", "CAI", "host")] == ["n/a"]
    gpu = [cells for (path, _, _), cells in rows.items() if "CuPy" in path or "PyTorch" in path]
    assert len(gpu) > 10 and all(cells == ["skipped: no GPU"] for cells in gpu)


def test_json_schema(report):
    assert report["schema"] == doctor.SCHEMA
    assert report["exit_code"] == 0
    env = report["environment"]
    assert tuple(env) == doctor.ENV_KEYS
    assert env["jax"] == jax.__version__ and env["numpy"] == np.__version__
    assert env["gpu"].startswith("no GPU")
    assert {"platform": "cpu", "id": 0, "kind": "cpu"} in env["devices"]
    assert [r["n"] for r in report["rows"]] == list(range(1, len(report["rows"]) + 1))
    for r in report["rows"]:
        assert tuple(r) == doctor.ROW_KEYS
        assert r["direction"] in ("import", "export")
        assert r["protocol"] in doctor.PROTOCOLS
        assert r["status"] in doctor.STATUSES
        assert r["expect"] is None or set(r["expect"]) == {"works", "zero_copy", "stream_safe"}
        for name in ("stock", "overlay"):
            side = r[name]
            if r["status"] in ("skipped",) or r["reason"] == doctor.CAI_ON_HOST:
                assert side is None
                continue
            assert tuple(side) == doctor.SIDE_KEYS
            assert isinstance(side["works"], bool)
            assert side["latency_us"] is None or side["latency_us"] > 0
            assert side["trials"] is None  # the CPU has no streams
            assert side["capsule"] in (None, "versioned", "legacy")


def test_json_rows_say_what_ran(report):
    rows = {(r["direction"], r["peer"], r["protocol"], r["memory"]): r for r in report["rows"]}
    r = rows[("import", "NumPy", "DLPack 1.x", "host")]
    assert r["status"] == "ok" and r["overlay"]["works"] and r["overlay"]["zero_copy"]
    assert r["overlay"]["capsule"] == "versioned"
    legacy = rows[("import", "NumPy", "DLPack legacy", "host")]
    assert legacy["overlay"]["capsule"] == legacy["stock"]["capsule"] == "legacy"
    strided = rows[("import", "NumPy", "DLPack 1.x", "host, strided")]
    assert strided["status"] == "ok" and strided["overlay"]["zero_copy"] is False
    read_only_legacy = rows[("import", "NumPy", "DLPack legacy", "host, read-only")]
    assert read_only_legacy["status"] == "n/a" and "NumPy refuses" in read_only_legacy["reason"]
    gpu = [r for r in report["rows"] if r["peer"] in ("CuPy", "PyTorch", "Numba")]
    assert gpu and all(r["status"] == "skipped" and r["reason"] == "no GPU" for r in gpu)


# --- in-process: the exit status and the in-flight verdicts ---------------------

def _run(rows, **kw):
    buf = io.StringIO()
    code = doctor.run(as_json=True, out=buf, rows=rows, trials=5, calls=10, **kw)
    return code, json.loads(buf.getvalue())


def test_exit_status_one_when_an_overlay_path_fails(monkeypatch):
    def broken(*a, **k):
        raise BufferError("injected")
    monkeypatch.setattr(_route, "placed_from_dlpack", broken)  # every from_dlpack path
    monkeypatch.setattr(doctor, "all_rows", doctor.host_rows)
    buf = io.StringIO()
    assert doctor.main(["--json", "--calls", "10"], out=buf) == 1
    report = json.loads(buf.getvalue())
    assert report["exit_code"] == 1
    failed = [r for r in report["rows"] if r["status"] == "FAILED"]
    assert failed and all(r["direction"] == "import" for r in failed)
    assert all("BufferError: injected" in r["reason"] for r in failed)
    # Stock JAX is measured without the overlay: its side still works.
    assert all(r["stock"]["works"] for r in failed if r["memory"] == "host")
    assert not jax_overlay.installed()


def test_plain_output_explains_a_failure(monkeypatch):
    monkeypatch.setattr(_route, "placed_from_dlpack", lambda *a, **k: 1 / 0)
    monkeypatch.setattr(doctor, "all_rows", doctor.host_rows)
    buf = io.StringIO()
    assert doctor.main(["--plain", "--calls", "10"], out=buf) == 1
    out = buf.getvalue()
    assert "FAILED" in out and "ZeroDivisionError" in out
    assert out.splitlines()[-1].endswith("exit status 1")


def test_installed_state_is_restored():
    jax_overlay.install()
    try:
        code, _ = _run(doctor.host_rows()[:2])
        assert code == 0 and jax_overlay.installed()
    finally:
        jax_overlay.uninstall()


def _host_case(trial_kind):
    """A NumPy producer whose "in-flight" trial is simulated on the host:
    'clean' writes k and stays busy, 'stale' never writes, 'waits' writes
    and is done before the call returns."""
    a = T.aligned_empty((256,), np.float32)
    a[:] = 0

    def trial(k):
        if trial_kind != "stale":
            a[:] = k
        return a, contextlib.nullcontext(), lambda: trial_kind != "waits"

    return doctor.Case(source=a, source_ptr=a.ctypes.data, expected=a.copy(),
                       result_ptr=lambda x: x.unsafe_buffer_pointer(), read=np.asarray,
                       minmax=lambda x: (float(np.min(x)), float(np.max(x))), trial=trial)


def _row(build, expect=doctor.Expect(stream_safe=True)):
    return doctor.Row("import", "NumPy", "DLPack 1.x", "host", "jax.dlpack.from_dlpack(a)",
                      build, expect)


def test_in_flight_verdicts():
    def skip():
        raise doctor.Skip("peer not installed")

    def broken():
        raise RuntimeError("setup bug")

    rows = [_row(lambda: _host_case("clean")), _row(lambda: _host_case("stale")),
            _row(lambda: _host_case("waits")), _row(skip), _row(broken),
            _row(lambda: _host_case("stale"), expect=None)]
    code, report = _run(rows)
    clean, stale, waits, skipped, error, unpromised = report["rows"]
    assert code == 1
    assert clean["status"] == "ok" and clean["overlay"]["stream_safe"] is True
    assert clean["overlay"]["trials"] == {"n": 5, "stale": 0, "in_flight": 5}
    assert stale["status"] == "FAILED" and "stale data in 5 of 5" in stale["reason"]
    assert stale["stock"]["stream_safe"] is False  # NumPy views are never ordered
    assert waits["status"] == "FAILED" and "waited on the host" in waits["reason"]
    assert waits["overlay"]["host_waits"] is True
    assert skipped["status"] == "skipped" and skipped["reason"] == "peer not installed"
    assert error["status"] == "ERROR" and "setup bug" in error["reason"]
    # A row that promises nothing reports, and does not count.
    assert unpromised["status"] == "ok" and unpromised["overlay"]["trials"]["stale"] == 5
    buf = io.StringIO()
    doctor.render_plain(report, buf)
    text = buf.getvalue()
    assert "stale 5/5" in text and "waits" in text and "skipped: peer not installed" in text


def test_exit_status_zero_without_broken_promises():
    code, report = _run([_row(lambda: _host_case("clean")), _row(lambda: _host_case("stale"), None)])
    assert code == 0 and report["exit_code"] == 0


def test_rich_table_when_available():
    pytest.importorskip("rich")
    _, report = _run(doctor.host_rows()[:3])
    buf = io.StringIO()
    doctor.render_rich(report, buf)
    assert "NumPy -> JAX" in buf.getvalue() and "overlay" in buf.getvalue()


def test_help_speaks_to_the_user():
    """`doctor --help` starts with what the command does (no internal
    "Room:" label) and points at files that exist."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "jax_overlay", "doctor", "--help"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout
    assert "Room:" not in text and "doctor.py" not in text, text
    assert "`python -m jax_overlay doctor`: what this machine has" in text, text


def test_a_narrow_terminal_gets_lines_that_fit(monkeypatch):
    """At 80 columns every line fits (the wide table needs about 190): each
    row is its names and status, then a line per side."""
    _, report = _run(doctor.host_rows())
    for width in (80, 100):
        buf = io.StringIO()
        doctor.render_plain(report, buf, width)
        lines = buf.getvalue().splitlines()
        assert max(map(len, lines)) <= width, max(lines, key=len)
        assert any(line.strip().startswith("jax_overlay ") for line in lines)
    assert doctor.terminal_width(io.StringIO()) is None  # a pipe or a file: the wide table

    class Terminal(io.StringIO):
        def isatty(self):
            return True
    monkeypatch.setenv("COLUMNS", "80")
    out = Terminal()
    assert doctor.terminal_width(out) == 80
    assert doctor.main(["--calls", "10"], out=out) == 0
    assert max(map(len, out.getvalue().splitlines())) <= 80
