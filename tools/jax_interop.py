#!/usr/bin/env python3
"""Run JAX's own tests/array_interoperability_test.py stock and with
jax_overlay installed, and report the tests the overlay breaks.

    python tools/jax_interop.py JAX_CHECKOUT [--python PY] [--out RESULT.json]
                                [-k EXPR] [--timeout S]

JAX_CHECKOUT holds tests/array_interoperability_test.py of some JAX tree (a
checkout, or `git archive COMMIT tests | tar -x -C DIR`).  Only that file is
copied, into a temporary directory, and run from there, so the tests import the
INSTALLED jax of PY, never the checkout's jax/ (checked: the run stops if
jax.__file__ lies in the checkout).  Two pytest runs with PY, same environment:
  stock      plain pytest
  installed  pytest -p jax_interop_plugin (tools/jax_interop_plugin.py), which
             calls jax_overlay.install() before any test module is imported
The pytest settings are JAX's own (pyproject.toml): warnings are errors.

Environment: JAX_PLATFORMS is left as the user set it; unset, it is pinned to
the platforms PY's jax finds (e.g. "cuda,cpu" on a GPU machine, "cpu" here),
so a GPU that fails to start fails loudly instead of falling back to the CPU.
XLA_PYTHON_CLIENT_PREALLOCATE defaults to false.  No network is needed; PY
needs jax, pytest and absl-py (JAX's test_util imports absl).

Exit: 0 iff no regressions (every test that passes stock passes installed),
1 if there are any, 2 for usage or environment errors.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

TOOLS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TOOLS)
TEST = "array_interoperability_test.py"
PLUGIN_HEADER = "jax_interop_plugin: jax_overlay.install() called"

# JAX's [tool.pytest.ini_options] (pyproject.toml), the parts that apply here.
PYTEST_INI = """[pytest]
filterwarnings =
    error
    ignore:Transparent hugepages
    ignore:jax.cloud_tpu_init was deprecated
"""

# Run by PY in the test environment: what the test runs will import.
PROBE = r"""
import json, os, sys
out = {}
def need(mod, pip):
    try:
        __import__(mod)
    except Exception as e:
        print(json.dumps({"missing": mod, "pip": pip, "error": f"{type(e).__name__}: {e}"}))
        sys.exit(0)
need("pytest", "pytest")
need("absl.testing.absltest", "absl-py")
need("jax", "jax")
import jax, pytest
out.update(jax_file=jax.__file__, jax_version=jax.__version__,
           pytest_version=pytest.__version__, python=sys.version.split()[0])
try:
    import jax_overlay
    out["overlay_file"] = jax_overlay.__file__
except Exception as e:
    out["overlay_error"] = f"{type(e).__name__}: {e}"
try:
    import jax._src.test_util
except Exception as e:
    out["test_util_error"] = f"{type(e).__name__}: {e}"
from jax._src import xla_bridge
out["backend"] = jax.default_backend()
out["platforms"] = sorted(xla_bridge.backends(), key=lambda p: p == "cpu")
out["devices"] = [str(d) for d in jax.devices()]
print(json.dumps(out))
"""

OUTCOMES = ("passed", "failed", "skipped", "error")


def die(msg):
    print(f"jax_interop: error: {msg}", file=sys.stderr)
    sys.exit(2)


def inside(path, directory):
    path, directory = os.path.realpath(path), os.path.realpath(directory)
    return os.path.commonpath([path, directory]) == directory


def probe(py, env, cwd, checkout):
    r = subprocess.run([py, "-c", PROBE], env=env, cwd=cwd, capture_output=True, text=True)
    lines = r.stdout.strip().splitlines()
    if r.returncode or not lines:
        die(f"{py} could not import jax:\n{r.stderr[-3000:]}")
    info = json.loads(lines[-1])
    if "missing" in info:
        die(f"{py} cannot import {info['missing']} ({info['error']}).\n"
            f"  Install it: {py} -m pip install {info['pip']}\n"
            f"  Offline: on a machine with network, `pip download {info['pip']} -d wheels/`;"
            f" copy wheels/ here; `{py} -m pip install --no-index --find-links wheels/ {info['pip']}`"
            + ("\n  (JAX's test_util, jax._src.test_util, imports absl.testing)"
               if info["pip"] == "absl-py" else ""))
    print(f"python:     {py} ({info['python']}, pytest {info['pytest_version']})")
    print(f"jax:        {info['jax_version']} at {info['jax_file']}")
    if inside(info["jax_file"], checkout):
        die(f"jax is imported from the checkout ({info['jax_file']}), not the installed"
            " package: remove the checkout from PYTHONPATH")
    if "test_util_error" in info:
        die(f"the installed jax's test_util cannot be imported: {info['test_util_error']}")
    if "overlay_error" in info:
        die(f"jax_overlay cannot be imported from {ROOT}: {info['overlay_error']}\n"
            f"  Build it: cd {ROOT} && {py} setup.py -q build_ext --inplace")
    if not inside(info["overlay_file"], ROOT):
        die(f"jax_overlay is imported from {info['overlay_file']}, not from {ROOT}")
    print(f"jax_overlay: {info['overlay_file']}")
    print(f"backend:    {info['backend']}; devices: {', '.join(info['devices'])}")
    return info


def parse_junit(path):
    """{test id: (outcome, message, details)}; a test's worst report wins."""
    rank = {o: i for i, o in enumerate(("passed", "skipped", "failed", "error"))}
    tests, props = {}, {}
    root = ET.parse(path).getroot()
    for p in root.iter("property"):
        props[p.get("name")] = p.get("value")
    for case in root.iter("testcase"):
        cls = case.get("classname", "").rpartition(".")[2]
        tid = f"{cls}::{case.get('name')}" if cls else case.get("name")
        outcome, message, details = "passed", "", ""
        for tag in ("error", "failure", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                message = (el.get("message") or "").strip()
                details = (el.text or "").strip()[-4000:]
                break
        old = tests.get(tid)
        if old is None or rank[outcome] > rank[old[0]]:
            tests[tid] = (outcome, message, details)
    return tests, props


def run_pytest(name, py, env, tmp, args, plugin):
    xml = os.path.join(tmp, f"{name}.xml")
    cmd = [py, "-m", "pytest", TEST, "-c", "pytest.ini", "--rootdir", tmp,
           "-p", "no:cacheprovider", "-rfE", f"--junitxml={xml}"]
    if plugin:
        cmd += ["-p", "jax_interop_plugin"]
    if args.k:
        cmd += ["-k", args.k]
    print(f"\n== {name}: {' '.join(cmd)}", flush=True)
    try:
        r = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True,
                           timeout=args.timeout)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        print(out[-3000:])
        die(f"{name} run exceeded --timeout {args.timeout}s")
    log = r.stdout + r.stderr
    tail = [l for l in log.splitlines() if l.strip()][-1:]
    print(f"   pytest exit {r.returncode}: {tail[0] if tail else '(no output)'}")
    if not os.path.exists(xml):
        print(log[-6000:])
        die(f"{name} run wrote no junit xml (pytest exit {r.returncode})")
    tests, props = parse_junit(xml)
    return {"cmd": cmd, "returncode": r.returncode, "log_tail": log[-6000:],
            "plugin_header": next((l for l in log.splitlines() if PLUGIN_HEADER in l), None),
            "properties": props, "tests": tests}


def counts(tests):
    c = dict.fromkeys(OUTCOMES, 0)
    for outcome, _, _ in tests.values():
        c[outcome] += 1
    return c


def first_line(s):
    return s.splitlines()[0] if s else ""


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkout", help="JAX tree holding tests/" + TEST)
    ap.add_argument("--python", default=sys.executable, help="python with jax, pytest, absl-py")
    ap.add_argument("--out", help="write the full result as JSON here")
    ap.add_argument("-k", help="pytest -k expression")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per pytest run")
    args = ap.parse_args()

    checkout = os.path.abspath(args.checkout)
    src = os.path.join(checkout, "tests", TEST)
    if not os.path.isfile(src):
        die(f"{src} not found (JAX_CHECKOUT must hold tests/{TEST})")
    py = shutil.which(args.python) or args.python
    if not os.path.exists(py):
        die(f"python {args.python} not found")

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [TOOLS, ROOT] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    env.pop("PYTEST_ADDOPTS", None)  # both runs get exactly the options below

    with tempfile.TemporaryDirectory(prefix="jax_interop_") as tmp:
        shutil.copy(src, os.path.join(tmp, TEST))
        with open(os.path.join(tmp, "pytest.ini"), "w") as f:
            f.write(PYTEST_INI)
        print(f"test file:  {src}")
        info = probe(py, env, tmp, checkout)
        if "JAX_PLATFORMS" not in env:
            env["JAX_PLATFORMS"] = ",".join(info["platforms"])
        print(f"JAX_PLATFORMS={env['JAX_PLATFORMS']} "
              f"XLA_PYTHON_CLIENT_PREALLOCATE={env['XLA_PYTHON_CLIENT_PREALLOCATE']}")
        runs = {"stock": run_pytest("stock", py, env, tmp, args, plugin=False),
                "installed": run_pytest("installed", py, env, tmp, args, plugin=True)}

    stock, inst = runs["stock"], runs["installed"]
    if stock["returncode"] not in (0, 1):  # 2: collection (import) error, 5: no tests
        print(stock["log_tail"])
        die(f"the stock run did not run the tests (pytest exit {stock['returncode']}, see above)")
    if inst["returncode"] not in (0, 1):
        print(inst["log_tail"])
    # The installed run must prove the overlay was installed throughout.
    if "installed()=True" not in (inst["plugin_header"] or "") or \
            inst["properties"].get("jax_overlay_installed", "True") != "True":
        die("the installed run shows no sign of jax_interop_plugin's install()")
    print(f"\ninstalled run header: {inst['plugin_header']}")
    if inst["properties"].get("jax_overlay_installed_at_end", "True") != "True" or \
            inst["returncode"] == 3:
        print(inst["log_tail"])
        die("jax_overlay was not installed at the end of the installed run")
    if stock["plugin_header"] or "jax_overlay_installed" in stock["properties"]:
        die("the stock run had jax_overlay installed")

    ids = sorted(set(stock["tests"]) | set(inst["tests"]))
    missing = ("missing", "", "")
    table = {t: (stock["tests"].get(t, missing), inst["tests"].get(t, missing)) for t in ids}
    regressions = [t for t, (s, i) in table.items() if s[0] == "passed" and i[0] != "passed"]
    fixed = [t for t, (s, i) in table.items() if s[0] in ("failed", "error") and i[0] == "passed"]

    print(f"\n{'':10} {'passed':>7} {'failed':>7} {'skipped':>7} {'error':>7}")
    for name, run in runs.items():
        c = counts(run["tests"])
        print(f"{name:10} " + " ".join(f"{c[o]:>7}" for o in OUTCOMES))
    print(f"\nregressions (pass stock, not installed): {len(regressions)}")
    for t in regressions:
        s, i = table[t]
        print(f"  {t}\n      installed: {i[0]}: {first_line(i[1])}\n      stock:     {s[0]}")
    print(f"fixed (fail stock, pass installed): {len(fixed)}")
    for t in fixed:
        s, i = table[t]
        print(f"  {t}\n      stock: {s[0]}: {first_line(s[1])}")

    code = 1 if regressions else 0
    if args.out:
        def entry(r):
            return {"outcome": r[0], "message": r[1], "details": r[2]}
        result = {
            "checkout": checkout, "test_file": src, "python": py, "probe": info,
            "env": {k: env[k] for k in ("JAX_PLATFORMS", "XLA_PYTHON_CLIENT_PREALLOCATE")},
            "runs": {n: {"cmd": r["cmd"], "returncode": r["returncode"],
                         "counts": counts(r["tests"]), "properties": r["properties"],
                         "plugin_header": r["plugin_header"],
                         "log_tail": r["log_tail"]} for n, r in runs.items()},
            "regressions": [{"id": t, "stock": entry(table[t][0]),
                             "installed": entry(table[t][1])} for t in regressions],
            "fixed": [{"id": t, "stock": entry(table[t][0]),
                       "installed": entry(table[t][1])} for t in fixed],
            "tests": {t: {"stock": s[0], "installed": i[0],
                          "stock_message": first_line(s[1]),
                          "installed_message": first_line(i[1])}
                      for t, (s, i) in table.items()},
            "exit_code": code,
        }
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"\nwrote {args.out}")
    return code


if __name__ == "__main__":
    sys.exit(main())
