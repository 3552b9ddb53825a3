"""Room: the doctor.  `python -m jax_overlay doctor`: what this machine has, and a live round
trip on every interchange path it can run, with stock JAX and with
jax_overlay installed, in one table.

Rows are (direction, peer, protocol, memory): imports (peer -> JAX) and
exports (JAX -> peer) with NumPy on the host, and CuPy, PyTorch and Numba on
the GPU, over the CUDA Array Interface (CAI), legacy DLPack (the producer has
the pre-2023 ``__dlpack__(stream=None)``) and DLPack 1.x, on host, device,
pinned host and managed memory.  Each row runs the same user-level call
twice: with stock JAX (``jax_overlay.uninstall()``) and with jax_overlay
installed (``install()``).  CAI rows hand the consumer a view that has only
``__cuda_array_interface__``, so it cannot pick DLPack instead.

Columns, for each side:

* works: the call returned the source's values;
* zero-copy: the result has the source's data pointer;
* stream (stream-safe): `--trials` times, the producer's kernel is still
  running when the call is made (a CuPy kernel or PyTorch's sleep on the
  producer's own stream, then a write of k; for exports, a JAX computation
  that writes k); the result is then read on the GPU (a JAX reduction, or the
  consumer's own).  "yes": no stale read, and the call returned while the
  producer was still busy (for exports: when JAX's export method returned);
  "stale i/n": i reads saw old data; "waits": never stale, but the host
  waited for the producer every time; "fails": the call raised; "n/a": no
  stream is involved (host memory, or a producer that exports none);
* us: median of single-call durations, idle producer, after a warm-up.

Exit status: 0 when every row has the result jax_overlay promises for it
(skipped and n/a rows are fine), 1 otherwise.

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

Statuses: "ok" (jax_overlay did what it promises, or the row promises
nothing and works), "FAILED" (a promise was broken: counts for the exit
status), "ERROR" (the doctor could not set the row up: counts too),
"unsupported" (a row that promises nothing did not work), "skipped" (cannot
run here: no GPU, a peer not installed), "n/a" (the path does not exist, or
the peer refuses it with stock JAX and with jax_overlay alike).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys

# The rooms: _model (rows, cases, measuring a side, the verdict), _probes (the
# environment, what a row needs, the host rows), _gpu (the GPU rows), producers
# (busy producers, protocol views), _render (the table); the command line is here.
from ._model import (CAI_ON_HOST, FAILING, HOST_NO_STREAM, PROTOCOLS, ROW_KEYS, SCHEMA, SIDE_KEYS,
                     STATUSES, Case, Expect, NotApplicable, Row, Skip, describe, evaluate,
                     latency_us, not_applicable, timed_calls)
from ._probes import (ENV_KEYS, environment, gpu_skip_reason, host_rows, need,
                      need_gpu, nvidia_driver)
from .producers import CAIView, DLPackView
from ._render import (HEADER, footnotes, render_plain, render_rich, summary, table_rows,
                      terminal_width)

__all__ = ["CAIView", "CAI_ON_HOST", "Case", "DLPackView", "ENV_KEYS", "Expect", "FAILING",
           "HEADER", "HOST_NO_STREAM", "NotApplicable", "PROTOCOLS", "ROW_KEYS", "Row", "SCHEMA",
           "SIDE_KEYS", "STATUSES", "Skip", "add_arguments", "all_rows", "describe", "description",
           "environment", "evaluate", "footnotes", "gpu_skip_reason", "host_rows", "latency_us",
           "main", "need", "need_gpu", "not_applicable", "nvidia_driver", "render_plain",
           "render_rich", "run", "summary", "table_rows", "timed_calls"]


def all_rows():
    from . import _gpu as _doctor_gpu
    return host_rows() + _doctor_gpu.rows()


# --- output -------------------------------------------------------------------------

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
        if was_installed:
            _install.install()
        else:
            _install.uninstall()
    code = 1 if any(r["status"] in FAILING for r in records) else 0
    report = {"schema": SCHEMA, "environment": env, "rows": records, "exit_code": code}
    if json_file:
        with open(json_file, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
    if as_json:
        json.dump(report, out, indent=2)
        out.write("\n")
    elif not plain and _has_rich():
        render_rich(report, out)
    else:
        render_plain(report, out, terminal_width(out))
    return code


def _has_rich():
    return importlib.util.find_spec("rich") is not None


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
