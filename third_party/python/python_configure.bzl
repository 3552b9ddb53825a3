"""local_python: the Python found by $PYTHON_BIN_PATH (default python3), as
C/C++ headers, an embeddable libpython, pybind11's headers and a py_runtime
toolchain, so that builds and tests use exactly the Python the user chose."""

# Printed as JSON by the configured Python itself, so a venv, pyenv or
# Debian Python each report their own layout.
_QUERY = """
import importlib.metadata, json, os, sys, sysconfig
import pybind11
var = sysconfig.get_config_var
if var("Py_ENABLE_SHARED"):
    libdir = var("LIBDIR")
    linkopts = ["-L" + libdir, "-Wl,-rpath," + libdir, "-lpython" + var("LDVERSION")]
else:
    linkopts = [os.path.join(var("LIBPL"), var("LIBRARY"))]
    linkopts += (var("LIBS") or "").split() + (var("SYSLIBS") or "").split()
    linkopts += ["-Wl,--export-dynamic"]
print(json.dumps({
    "executable": sys.executable,
    "python_include": sysconfig.get_paths()["include"],
    "pybind11_include": pybind11.get_include(),
    "linkopts": linkopts,
    "version": sys.version.split()[0],
    "packages": sorted(
        "%s==%s" % (d.metadata["Name"], d.version)
        for d in importlib.metadata.distributions()),
}))
"""

def _local_python_impl(ctx):
    python = ctx.os.environ.get("PYTHON_BIN_PATH", "python3")
    if "/" not in python:
        found = ctx.which(python)
        if not found:
            fail("local_python: %s is not on PATH; set PYTHON_BIN_PATH" % python)
        python = str(found)
    result = ctx.execute([python, "-c", _QUERY])
    if result.return_code != 0:
        fail(("local_python: %s cannot describe itself (it needs pybind11 " +
              "installed):\n%s") % (python, result.stderr))
    info = json.decode(result.stdout)

    # Symlinked rather than copied: the headers stay the ones of that Python.
    ctx.symlink(info["python_include"], "python_include")
    ctx.symlink(info["pybind11_include"], "pybind11_include")
    # What the py_tests depend on, so that a different Python or a changed
    # package set reruns them instead of reusing cached results.
    ctx.file("environment.txt", "\n".join(
        [info["executable"], info["version"]] + info["packages"]) + "\n")
    ctx.template("BUILD.bazel", ctx.attr._build_tpl, {
        "%{interpreter}": info["executable"],
        "%{linkopts}": repr(info["linkopts"]),
        "%{version}": info["version"],
    }, executable = False)

local_python = repository_rule(
    implementation = _local_python_impl,
    environ = ["PYTHON_BIN_PATH", "PATH"],
    configure = True,
    local = True,
    attrs = {
        "_build_tpl": attr.label(default = Label("//third_party/python:BUILD.tpl")),
    },
)
