"""pytest plugin: run a test suite with jax_overlay installed.

    python -m pytest -p jax_interop_plugin ...   (tools/ and the repo root on PYTHONPATH)

At pytest_configure, before any test module is imported, it imports
jax_overlay and calls jax_overlay.install().  It proves that it did: a line in
the pytest header, the junit testsuite properties ``jax_overlay_installed``
(session start) and ``jax_overlay_installed_at_end`` (session end), and a check
at session end that jax_overlay.installed() still holds (else the run exits 3,
pytest's internal-error code).  tools/jax_interop.py loads it for its
"installed" run.
"""

import pytest

HEADER = "jax_interop_plugin: jax_overlay.install() called"
_state = {}


def pytest_configure(config):
    import jax
    import jax_overlay

    jax_overlay.install()
    _state.update(jax=jax.__file__, jax_version=jax.__version__,
                  overlay=jax_overlay.__file__,
                  installed=jax_overlay.installed())


def pytest_report_header(config):
    return [f"{HEADER}; installed()={_state['installed']}; "
            f"jax_overlay={_state['overlay']}; jax {_state['jax_version']} at {_state['jax']}"]


@pytest.fixture(scope="session", autouse=True)
def _jax_interop_installed(record_testsuite_property):
    import jax_overlay

    record_testsuite_property("jax_overlay_installed", str(jax_overlay.installed()))
    record_testsuite_property("jax_overlay_file", _state["overlay"])
    record_testsuite_property("jax_file", _state["jax"])
    yield
    record_testsuite_property("jax_overlay_installed_at_end", str(jax_overlay.installed()))


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session, exitstatus):
    import jax_overlay

    if not jax_overlay.installed():
        tr = session.config.pluginmanager.get_plugin("terminalreporter")
        msg = "jax_interop_plugin: FAILED: jax_overlay.installed() is False at session end"
        if tr is not None:
            tr.write_line(msg, red=True)
        else:
            print(msg)
        session.exitstatus = pytest.ExitCode.INTERNAL_ERROR
