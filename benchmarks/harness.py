"""The benchmarks' one harness: timing, alternating rounds with controls,
per-round ratios, JSON with the run's metadata, and tables.

Every script in benchmarks/ is a plug-in on it: the script declares what it
times (named arms, jax-free controls among them, or cases timed one by one)
and the harness times, alternates, summarises, prints and saves.  The rules
it keeps:

* speed is measured here, never in tests;
* a ratio comes from ONE process: stock JAX and jax_overlay alternate within
  each round, with jax-free control arms in every round (hosts drift 1.5-2x
  within minutes); it is taken within each round, then the median over
  rounds is reported;
* absolute µs are for floor analysis only;
* every figure in README/docs points to the committed results file that
  shows it (benchmarks/README.md).

Standard library only at import (jax and the GPU libraries on first use), so
that the stress run's planning (tests/cpu/test_stress_plan.py) loads it
anywhere.  Imported before jax, it makes XLA's allocator grow on demand
(XLA_PYTHON_CLIENT_PREALLOCATE=false) unless the environment says otherwise:
the frameworks share the GPU.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib
import json
import operator
import os
import platform
import statistics
import subprocess
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")



def graph_small_programs():
    """Adds --xla_gpu_graph_min_graph_size=1 to XLA_FLAGS unless a minimum is
    set: XLA then puts programs of any size into command buffers, which
    foreign(..., replay=True) needs.  Call it before jax loads (XLA reads
    its flags once); it applies to every case of the run."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "graph_min_graph_size" not in flags:
        os.environ["XLA_FLAGS"] = (flags + " --xla_gpu_graph_min_graph_size=1").strip()


HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
ALLOCATOR_ENV = ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_ALLOCATOR",
                 "XLA_PYTHON_CLIENT_MEM_FRACTION")

# --- timing ---------------------------------------------------------------------

clock = time.perf_counter_ns  # every timer here: integer nanoseconds
REPEATS, ROUNDS = 500, 7  # median_us's defaults: median of 7 round means of 500 calls
ROUND_MEANS: list = []  # each median_us call's round means (µs), in call order


def since_ms(t0, digits=3):
    """Milliseconds since clock() returned `t0`."""
    return round((clock() - t0) / 1e6, digits)


def warm(fn, make_arg, calls=50):
    """Untimed calls first: caches, jit, allocators."""
    for _ in range(calls):
        fn(make_arg())


def median_us(fn, make_arg, repeats=REPEATS, rounds=ROUNDS, keep=None,
              before_round=None, after_round=None):
    """Median over `rounds` of the mean per-call time (µs) of `repeats`
    calls fn(make_arg()), the arguments made before the round.  Results go
    to `keep`, so none dies inside the timed region (or, for in-flight runs,
    before the producer's kernel ends).  `before_round` and `after_round` run
    untimed around each round (start and drain a busy producer).  The round
    means are appended to ROUND_MEANS."""
    per_round = []
    keep = [] if keep is None else keep
    for _ in range(rounds):
        if before_round:
            before_round()
        args = [make_arg() for _ in range(repeats)]
        # As timeit does: the cyclic collector stays off while timed (it runs
        # after the round), so a collection of this large process (over
        # 270,000 objects on the H200 run) does not land in whichever call
        # crosses its threshold.  Reference counting still frees as usual.
        gc.disable()
        try:
            t0 = clock()
            for a in args:
                keep.append(fn(a))
            per_round.append((clock() - t0) / repeats / 1e3)
        finally:
            gc.enable()
        if after_round:
            after_round()
    ROUND_MEANS.append([round(r, 2) for r in per_round])
    return statistics.median(per_round)


def per_call_us(fn, calls, *args):
    """µs per call of fn(*args), `calls` calls back to back, each result
    dropped at once, as a caller's would be."""
    t0 = clock()
    for _ in range(calls):
        fn(*args)
    return (clock() - t0) / calls / 1e3


def median_per_call_us(fn, calls, rounds, *, after_round=None):
    """Median over `rounds` of per_call_us(fn, calls); `after_round` runs
    untimed after each (a device synchronize)."""
    out = []
    for _ in range(rounds):
        out.append(per_call_us(fn, calls))
        if after_round:
            after_round()
    return statistics.median(out)


def seconds(op, repeats, *, before=None):
    """Median wall seconds of op(), which waits for its own completion,
    after one untimed call; `before` runs untimed ahead of each timed call
    (a device synchronize: the device idle before each)."""
    op()
    times = []
    for _ in range(repeats):
        if before:
            before()
        t0 = clock()
        op()
        times.append((clock() - t0) / 1e9)
    return statistics.median(times)


def event_seconds(launch, stream, repeats):
    """Median device seconds of launch(stream) between two CUDA events on
    the CuPy `stream`, after one untimed launch."""
    import cupy as cp
    launch(stream)
    out = []
    for _ in range(repeats):
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        launch(stream)
        stop.record(stream)
        stop.synchronize()
        out.append(cp.cuda.get_elapsed_time(start, stop) / 1e3)
    return statistics.median(out)


# --- alternating rounds ---------------------------------------------------------

class Arm:
    """One thing timed once per round.  `sample()` returns its measurement
    (µs, or a dict of them); `setup()` runs untimed before each sample and
    the warm-up (install() or uninstall(), a stream's context); `warm()`
    once before the first round; `control`: a jax-free call, timed in every
    round to show the host's drift."""

    def __init__(self, name, sample, *, setup=None, warm=None, control=False):
        self.name, self.sample, self.setup, self.warm, self.control = name, sample, setup, warm, control


def rotated(names, r):
    """`names` rotated by the round number: each arm leads in turn."""
    names = list(names)
    k = r % len(names) if names else 0
    return names[k:] + names[:k]


def paired(cases, sides, r, controls=()):
    """The controls, then each case's sides back to back as (case, side),
    their order swapped every other round so neither always runs warm."""
    order = list(sides) if r % 2 == 0 else list(reversed(sides))
    return list(controls) + [(c, s) for c in cases for s in order]


def failure(err):
    """A sample that raised, as recorded: the type and the first line."""
    return f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:100]}"


def alternate(arms, rounds, order=None, *, record_failures=False):
    """Times every arm once per round, in order(r) (a list of arm names;
    default: rotated), after each arm's warm-up.  Returns {name: [one
    sample per round]}.  With `record_failures`, a sample that raises is
    recorded as failure(err) and the rounds go on."""
    by_name = {a.name: a for a in arms}
    for a in by_name.values():
        if a.warm:
            if a.setup:
                a.setup()
            try:
                a.warm()
            except Exception:  # noqa: BLE001 - its samples will say how it fails
                if not record_failures:
                    raise
    samples = {name: [] for name in by_name}
    for r in range(rounds):
        for name in (order(r) if order else rotated(by_name, r)):
            a = by_name[name]
            if a.setup:
                a.setup()
            try:
                value = a.sample()
            except Exception as err:  # noqa: BLE001 - a failing arm is a finding
                if not record_failures:
                    raise
                value = failure(err)
            samples[name].append(value)
    return samples


def numbers(xs):
    return [v for v in xs if isinstance(v, (int, float)) and not isinstance(v, bool)]


def med(xs):
    """Median of the numeric samples, else the first sample (a failure)."""
    nums = numbers(xs)
    return statistics.median(nums) if nums else next(iter(xs), None)


def spread(xs):
    """{median, min, max, q1, q3} of the numeric samples (None if none)."""
    nums = sorted(numbers(xs))
    if not nums:
        return None
    q1, _, q3 = statistics.quantiles(nums, n=4) if len(nums) > 1 else (nums[0],) * 3
    return {"median": statistics.median(nums), "min": nums[0], "max": nums[-1], "q1": q1, "q3": q3}


def drift(arms, samples):
    """Each control arm's spread over the rounds: how far the host drifted."""
    return {a.name: spread(samples[a.name]) for a in arms if a.control}


def per_round(f, *series):
    """f over each round's samples of the series (all from the same rounds),
    for the rounds where every one is a number."""
    return [f(*vals) for vals in zip(*series) if len(numbers(vals)) == len(vals)]


def ratios(samples, arm, baseline):
    """Per-round ratios of `arm` to `baseline` (taken within each round)."""
    return per_round(operator.truediv, samples[arm], samples[baseline])


def differences(samples, arm, baseline):
    return per_round(operator.sub, samples[arm], samples[baseline])


# --- metadata, JSON, tables -----------------------------------------------------

def log(msg):
    print(msg, file=sys.stderr, flush=True)


def git_rev(root=ROOT):
    """The tree's commit, '+uncommitted changes' if it has some; None
    outside a git checkout."""
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "--short=12", "HEAD"],
                              capture_output=True, text=True, timeout=20)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=20).stdout.strip()
        return head.stdout.strip() + ("+uncommitted changes" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def allocator():
    """XLA's allocator settings, as the environment has them."""
    return {k: os.environ.get(k) for k in ALLOCATOR_ENV}


def meta(*, imports=(), **extra):
    """The run's device and versions: the versions of the libraries this
    process imported (and of those named in `imports`, imported here where
    they can be), JAX's first device, the date, the tree's commit and XLA's
    allocator settings; `extra` added (or overriding)."""
    for name in imports:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - absent or unusable: left out
            pass
    out = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "python": platform.python_version(), "platform": platform.platform(), "git": git_rev()}
    for name in dict.fromkeys(("jax", "jaxlib", "jax_overlay", "numpy", "cupy", "torch", "numba", *imports)):
        mod = sys.modules.get(name)
        if mod is not None:
            out[name] = getattr(mod, "__version__", None)
    if "jax" in sys.modules:
        try:
            out["device"] = sys.modules["jax"].devices()[0].device_kind
        except Exception as err:  # noqa: BLE001 - metadata never stops a run
            out["device"] = failure(err)
    out["allocator"] = allocator()
    out.update(extra)
    return out


def save(path, data):
    """Writes `data` to `path`: text as it is, anything else as JSON
    (nothing when `path` is empty)."""
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        if isinstance(data, str):
            f.write(data)
        else:
            json.dump(data, f, indent=1, default=str)
            f.write("\n")


def finish(text, path, data):
    """Prints `text` (the table) and the run's metadata (data["meta"], one
    JSON line, where there is one), and saves `data` to `path`."""
    print(text)
    if isinstance(data, dict) and "meta" in data:
        print(json.dumps(data["meta"], default=str))
    save(path, data)


def cell(v, spec=""):
    """A table cell: numbers formatted by `spec`, None as '—', the rest as text."""
    if v is None:
        return "—"
    if spec and isinstance(v, (int, float)) and not isinstance(v, bool):
        return format(v, spec)
    return str(v)


def _numeric(text):
    try:
        float(text)
        return True
    except ValueError:
        return False


def table(header, rows, *, markdown=False):
    """Text or markdown table of `rows` (sequences of cells; see cell()):
    the first column and columns of text to the left, the others (any cell
    a number) to the right."""
    rows = [[cell(c) for c in row] for row in rows]
    right = [i > 0 and any(_numeric(r[i]) for r in rows) for i in range(len(header))]
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" if r else "---" for r in right) + "|"]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
    widths = [max(len(r[i]) for r in [list(header)] + rows) for i in range(len(header))]

    def line(r):
        return "  ".join(c.rjust(w) if right[i] else c.ljust(w)
                         for i, (c, w) in enumerate(zip(r, widths))).rstrip()
    return "\n".join([line(header), "  ".join("-" * w for w in widths)] + [line(r) for r in rows])


def listing(values, header=("case", "value")):
    """A two-column table of a {name: value} dict."""
    return table(list(header), [(k, cell(v)) for k, v in values.items()])


def arguments(doc, *, json_file=False, out=None, rounds=None, calls=None, repeats=None):
    """The parser with the options the plug-ins share, each where asked:
    --json FILE, --out DIR (default `out`, or $OUT), --rounds, --calls and
    --repeats with the given defaults.  Its description is the doc's first
    paragraph."""
    p = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    if json_file:
        p.add_argument("--json", default="", help="also write the results here (JSON)")
    if out is not None:
        p.add_argument("--out", default=os.environ.get("OUT", out), help="folder for the results")
    if rounds is not None:
        p.add_argument("--rounds", type=int, default=rounds, help="alternating rounds")
    if calls is not None:
        p.add_argument("--calls", type=int, default=calls, help="calls per timing")
    if repeats is not None:
        p.add_argument("--repeats", type=int, default=repeats, help="timed repeats per median")
    return p
