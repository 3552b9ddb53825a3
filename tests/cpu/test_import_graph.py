"""The package's import graph has no circles: every import of one of
jax_overlay's modules by another, at module level or inside a function,
read with `ast` (an import deferred into a function is still an arrow).
Calls go downwards: the vocabulary (_vocab) at the bottom imports nothing
of the package but the native module, and a peer imports no feature."""

from __future__ import annotations

import ast
import pathlib

import jax_overlay

PACKAGE = pathlib.Path(jax_overlay.__file__).resolve().parent
# The features: what users call, built on the peers, never below them.
FEATURES = {"jax_overlay._cai", "jax_overlay._dlpack", "jax_overlay._foreign",
            "jax_overlay._install", "jax_overlay._ipc", "jax_overlay._route",
            "jax_overlay._shards", "jax_overlay.multiprocessing", "jax_overlay.doctor"}


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


# The native module, by its stub (built or not): a leaf.
NATIVE = {f"jax_overlay.{p.name.split('.')[0]}" for p in PACKAGE.glob("*.pyi")}


def _imports(name: str, path: pathlib.Path, known) -> set[str]:
    """The package's modules `name` imports anywhere in its file."""
    is_package = path.name == "__init__.py"
    here = name.split(".") if is_package else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[:len(here) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # `from P import a`: the module P.a where there is one, else a
            # name P's own file defines (an arrow to P, even for a parent).
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known or f"{mod}.{a.name}" in NATIVE else mod
                       for a in node.names]
        else:
            continue
        for t in targets:
            if t in NATIVE:
                continue  # the native module imports none of ours
            while t and t not in known:  # a name inside a module: the module
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, mods) for name, path in mods.items()}


def circles(g) -> list[list[str]]:
    """Each strongly connected component of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    assert circles(graph()) == []


def test_the_checker_sees_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_deferred_imports_are_arrows():
    g = graph()
    # _foreign imports the peers inside functions only: still an arrow.
    assert any(t.startswith("jax_overlay.peers") for t in g["jax_overlay._foreign"]), g["jax_overlay._foreign"]


def test_the_vocabulary_is_at_the_bottom():
    assert graph()["jax_overlay._vocab"] <= {"jax_overlay._xla_ext"}


def test_peers_import_no_feature():
    g = graph()
    for name, targets in g.items():
        if name.startswith("jax_overlay.peers"):
            assert not targets & FEATURES, (name, targets & FEATURES)


def test_a_name_from_the_parent_package_is_an_arrow_to_it(tmp_path):
    """`from . import register` in a child reads a name of the package's own
    file, which imports the child: a circle (the peers' registry was one)."""
    (tmp_path / "pkg").mkdir()
    init, child = tmp_path / "pkg" / "__init__.py", tmp_path / "pkg" / "child.py"
    init.write_text("from . import child\n")
    child.write_text("from . import register\nfrom . import child as me\n")
    known = {"pkg": init, "pkg.child": child}
    g = {"pkg": _imports("pkg", init, known), "pkg.child": _imports("pkg.child", child, known)}
    assert g == {"pkg": {"pkg.child"}, "pkg.child": {"pkg"}}
    assert circles(g) == [["pkg", "pkg.child"]]
