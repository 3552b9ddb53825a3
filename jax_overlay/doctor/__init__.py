"""Room: the doctor's face: its command line and the report's rendering.
`python -m jax_overlay doctor`: what this machine has, and a live round
trip on every interchange path it can run, with stock JAX and with
jax_overlay installed, in one table.

Exit status: 0 when every row has the result jax_overlay promises for it
(skipped and n/a rows are fine), 1 otherwise.  What the rows, columns and
statuses mean: docs/DOCTOR.md.

``--json`` prints one object (schema ``SCHEMA``):

* ``schema``: ``"jax_overlay.doctor/2"``; ``exit_code``: as above;
* ``environment``: the keys in ``ENV_KEYS`` (versions are strings or null when
  not installed; ``devices`` a list of ``{"platform", "id", "kind"}``;
  ``gpu``: null when GPU rows can run, else why not);
* ``rows``: objects with the keys in ``ROW_KEYS``: ``n`` (row number),
  ``direction`` ("import" | "export"), ``peer``, ``protocol`` (one of
  ``PROTOCOLS``), ``memory``, ``call`` (the user-level call), ``status`` (one
  of ``STATUSES``), ``reason`` (why skipped, n/a, failed; else null),
  ``expect`` (null, or ``{"works", "zero_copy", "stream_safe"}``, each a bool
  or null for "no promise"), ``stock`` and ``overlay`` (null when the row did
  not run, else objects with the keys in ``SIDE_KEYS``: ``works``,
  ``zero_copy``, ``stream_safe``, ``host_waits`` (bools or null), ``trials``
  (null or ``{"n", "stale", "in_flight"}``), ``latency_us`` (number or null),
  ``capsule`` ("versioned" | "legacy" | null: the DLPack capsule exchanged),
  ``error`` and ``note`` (strings or null)).
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import re
import shutil
import sys
import textwrap

# The rooms: _model (rows, cases, views, measuring, the verdict), _probes (the machine,
# what a row needs, host rows, busy producers), _gpu (GPU rows); the CLI and rendering here.
from ._model import (CAI_ON_HOST, FAILING, HOST_NO_STREAM, PROTOCOLS, ROW_KEYS, SCHEMA, SIDE_KEYS,
                     STATUSES, CAIView, Case, DLPackView, Expect, NotApplicable, Row, Skip,
                     describe, evaluate, latency_us, not_applicable, timed_calls)
from ._probes import (CLOCK_HZ, ENV_KEYS, JAX_N, SPIN_SRC, WithStream, _gpu_peers, aligned_empty,
                      cycles, environment, gpu_skip_reason, host_rows, jax_busy, jax_fill, need,
                      need_gpu, nvidia_driver, seed, spin_fill, torch_sleep)

__all__ = ["CAIView", "CAI_ON_HOST", "CLOCK_HZ", "Case", "DLPackView", "ENV_KEYS", "Expect",
           "FAILING", "HEADER", "HOST_NO_STREAM", "JAX_N", "NotApplicable", "PROTOCOLS", "ROW_KEYS",
           "Row", "SCHEMA", "SIDE_KEYS", "SPIN_SRC", "STATUSES", "Skip", "WithStream",
           "add_arguments", "aligned_empty", "all_rows", "cycles", "describe", "description",
           "environment", "evaluate", "footnotes", "gpu_skip_reason", "host_rows", "jax_busy",
           "jax_fill", "latency_us", "main", "need", "need_gpu", "not_applicable", "nvidia_driver",
           "render_plain", "render_rich", "run", "seed", "spin_fill", "summary", "table_rows",
           "terminal_width", "timed_calls", "torch_sleep"]


def all_rows():
    from . import _gpu as _doctor_gpu
    return host_rows() + _doctor_gpu.rows()


def run(*, as_json=False, plain=False, trials=20, calls=200, out=None, rows=None, json_file=None):
    """Measures every row; writes the report (and the JSON report to
    `json_file` too, if given); returns the exit status."""
    out = sys.stdout if out is None else out
    from .. import _install
    was_installed = _install.installed()
    env = environment()
    try:
        records = [evaluate(row, i + 1, trials, calls)
                   for i, row in enumerate(all_rows() if rows is None else rows)]
    finally:
        (_install.install if was_installed else _install.uninstall)()
    code = 1 if any(r["status"] in FAILING for r in records) else 0
    report = {"schema": SCHEMA, "environment": env, "rows": records, "exit_code": code}
    text = json.dumps(report, indent=2) + "\n"
    if json_file:
        with open(json_file, "w") as f:
            f.write(text)
    if as_json:
        out.write(text)
    elif not plain and importlib.util.find_spec("rich") is not None:
        render_rich(report, out)
    else:
        render_plain(report, out, terminal_width(out))
    return code


def description() -> str:
    """The command's help text: the module doc's first paragraph, without
    its "Room:" label (a note for the code's readers)."""
    return re.sub(r"^Room: [^.]*\.\s*", "", __doc__.split("\n\n")[0])


def add_arguments(p):
    p.add_argument("--json", action="store_true",
                   help=f"print one JSON object (schema {SCHEMA}; its fields: "
                   "help(jax_overlay.doctor))")
    p.add_argument("--json-file", metavar="PATH", help="also write the JSON report to PATH")
    p.add_argument("--plain", action="store_true", help="plain text even where rich is installed")
    p.add_argument("--trials", type=int, default=20, metavar="N",
                   help="in-flight trials per row and side (default 20)")
    p.add_argument("--calls", type=int, default=200, metavar="N",
                   help="timed calls per row and side (default 200)")
    return p


def main(argv=None, out=None):
    """`python -m jax_overlay doctor [--json] [--plain] [--trials N] [--calls N]`;
    returns the exit status."""
    args = add_arguments(argparse.ArgumentParser(
        prog="python -m jax_overlay doctor", description=description())).parse_args(argv)
    return run(as_json=args.json, plain=args.plain, trials=args.trials, calls=args.calls, out=out,
               json_file=args.json_file)


# --- rendering --------------------------------------------------------------------

def _yes(v):
    return "" if v is None else "yes" if v else "no"


def _stream_cell(side):
    if side is None or not side["works"]:
        return ""
    t = side["trials"]
    if t is None:
        return "n/a"
    if side["error"] and side["error"].startswith(("in flight", "waiting")):
        return "fails"
    if t["stale"]:
        return f"stale {t['stale']}/{t['n']}"
    return "waits" if side["host_waits"] else "yes"


def _cells(side):
    if side is None:
        return ["", "", "", ""]
    us = "" if side["latency_us"] is None else f"{side['latency_us']:.1f}"
    return [_yes(side["works"]), _yes(side["zero_copy"]), _stream_cell(side), us]


HEADER = ["#", "path", "protocol", "memory", "works", "0-copy", "stream", "us",
          "works", "0-copy", "stream", "us", "status"]


def table_rows(report):
    """The table's cells; skip reasons inline, other reasons in the notes."""
    out = []
    for r in report["rows"]:
        status = f"skipped: {r['reason']}" if r["status"] == "skipped" else r["status"]
        path = f"{r['peer']} -> JAX" if r["direction"] == "import" else f"JAX -> {r['peer']}"
        sides = (None, None) if r["status"] == "n/a" else (r["stock"], r["overlay"])
        out.append([str(r["n"]), path, r["protocol"], r["memory"], *_cells(sides[0]),
                    *_cells(sides[1]), status])
    return out


def footnotes(report):
    """Why rows are n/a, failed or unsupported, and each side's errors and
    notes (once when both sides say the same; host memory having no stream
    goes without saying)."""
    lines = []
    for r in report["rows"]:
        if r["status"] in ("n/a", "FAILED", "ERROR", "unsupported") and r["reason"]:
            lines.append(f"{r['n']:>3} {r['status']}: {r['reason']}")
        if r["status"] == "n/a" or r["stock"] is None:
            continue
        for key in ("error", "note"):
            said = {name: r[name][key] for name in ("stock", "overlay")}
            said = {k: v for k, v in said.items() if v and v != HOST_NO_STREAM
                    and not (r["reason"] and v in r["reason"])}
            if len(said) == 2 and said["stock"] == said["overlay"]:
                lines.append(f"{r['n']:>3} both: {said['stock']}")
                continue
            lines += [f"{r['n']:>3} {'stock' if k == 'stock' else 'jax_overlay'}: {v}"
                      for k, v in said.items()]
    return lines


def summary(report):
    counts = collections.Counter(r["status"] for r in report["rows"])
    parts = [f"{counts[s]} {s}" for s in STATUSES if counts.get(s)]
    return f"{len(report['rows'])} rows: {', '.join(parts)}; exit status {report['exit_code']}"


def _env_lines(env):
    def v(x):
        return "not installed" if x is None else str(x)
    devices = ", ".join(f"{d['platform']}:{d['id']} ({d['kind']})" for d in env["devices"]) or "none"
    return [
        ("jax_overlay", f"{env['jax_overlay']} (installed before this run: {env['jax_overlay_installed']})"),
        ("python", f"{env['python']} on {env['platform']}"),
        ("numpy", env["numpy"]),
        ("jax / jaxlib", f"{env['jax']} / {env['jaxlib']}"),
        ("jax CUDA plugin", v(env["jax_cuda_plugin"])),
        *((p.name, v(env[p.name])) for p in _gpu_peers()),
        ("libcuda", env["libcuda"]),
        ("CUDA driver API", v(env["cuda_driver_api"]) if env["cuda_driver_api"] else "-"),
        ("NVIDIA driver", env["nvidia_driver"] or "-"),
        ("devices", devices),
        ("GPU rows", env["gpu"] or "run"),
    ]


def terminal_width(out):
    """The width to fit where `out` is a terminal (its width, or $COLUMNS);
    None, the wide table, for a pipe or a file."""
    isatty = getattr(out, "isatty", None)
    if isatty is not None and isatty():
        return shutil.get_terminal_size().columns
    return None


def render_plain(report, out, width=None):
    """The report as text: the wide table, or where it would not fit in
    `width` columns, each row in a few lines that do."""
    out.write("jax_overlay doctor\n")
    for k, v in _env_lines(report["environment"]):
        text = f"  {k:<16} {v}"
        if width is not None and len(text) > width:
            text = "\n".join(textwrap.wrap(text, width, subsequent_indent=" " * 19))
        out.write(text + "\n")
    rows = [HEADER] + table_rows(report)
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER) - 1)]
    wide = 4 + sum(w + 2 for w in widths) + max(len(r[-1]) for r in rows)
    if width is not None and wide > width:
        _narrow(rows[1:], out, width)
    else:
        _wide(rows, widths, out)
    notes = footnotes(report)
    if notes:
        out.write("\nnotes (by row):\n")
        for n in notes:
            out.write((textwrap.fill(n, width, initial_indent="  ", subsequent_indent="    ")
                       if width else "  " + n) + "\n")
    out.write("\n" + summary(report) + "\n")


def _narrow(rows, out, width):
    """Each row as its names and status, then one line per side."""
    out.write("\n  #  path, protocol, memory: status\n"
              "       each side: works, zero-copy, stream-ordered, µs per call\n")
    for r in rows:
        head = f"{r[0]:>3}  {r[1]}, {r[2]}, {r[3]}: {r[-1]}"
        out.write(textwrap.fill(head, width, subsequent_indent=" " * 7) + "\n")
        for name, cells in (("stock", r[4:8]), ("jax_overlay", r[8:12])):
            if any(cells):
                out.write(f"       {name:<12} {', '.join(c or '-' for c in cells)}\n")


def _wide(rows, widths, out):
    stock_at = sum(w + 2 for w in widths[:4])
    overlay_at = stock_at + sum(w + 2 for w in widths[4:8])
    out.write("\n" + " " * (2 + stock_at) + "stock JAX".ljust(overlay_at - stock_at)
              + "jax_overlay installed\n")
    right = {0, 7, 11}
    for r in rows:
        cells = [c.rjust(widths[i]) if i in right else c.ljust(widths[i])
                 for i, c in enumerate(r[:-1])]
        out.write("  " + "  ".join(cells) + "  " + r[-1] + "\n")


def render_rich(report, out):
    from rich.console import Console
    from rich.table import Table
    width = terminal_width(out)
    if width is not None and width < 170:
        return render_plain(report, out, width)  # rich's table does not fit: the narrow text
    console = Console(file=out, width=max(170, Console(file=out).width))
    env = Table.grid(padding=(0, 2))
    for k, v in _env_lines(report["environment"]):
        env.add_row(k, str(v))
    console.print("[bold]jax_overlay doctor[/bold]")
    console.print(env)
    t = Table(show_lines=False, header_style="bold")
    for i, h in enumerate(HEADER):
        side = "stock\n" if 4 <= i < 8 else "overlay\n" if 8 <= i < 12 else "\n"
        t.add_column(side + (h if h != "us" else "µs"), justify="right" if i in (0, 7, 11) else "left",
                     no_wrap=i != 12, min_width=16 if i == 12 else None)
    colour = {"ok": "green", "FAILED": "bold red", "ERROR": "bold red", "unsupported": "yellow"}
    for r, rec in zip(table_rows(report), report["rows"]):
        c = colour.get(rec["status"])
        t.add_row(*r[:-1], f"[{c}]{r[-1]}[/{c}]" if c else r[-1])
    console.print(t)
    for n in footnotes(report):
        console.print(n, markup=False, highlight=False)
    console.print(summary(report), markup=False, highlight=False)
