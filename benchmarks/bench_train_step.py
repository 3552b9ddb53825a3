"""A training step written in PyTorch, run from JAX with jax_overlay.foreign,
against the same step in eager PyTorch and in JAX: same process, alternating
rounds.

The model: an MLP 256 -> 512 -> 10 (tanh), batch 128, float32, loss the mean
square of its output.  One step is value_and_grad + SGD, dispatched and
waited for (its new parameters ready), one step at a time (by default;
--pipelined below):
  torch eager       loss.backward() and p -= lr * p.grad, then synchronize
                    (jax-free: the control of every round)
  jax               jit(value_and_grad(the model in JAX) + SGD)
  foreign saved     jit(... foreign(model, vjp="autograd")): the forward's
                    graph kept for the backward call (the default)
  foreign recompute the same, recompute=True: the backward call runs the
                    model again under autograd
  foreign replay    the same, replay=True: forward and backward traced into
                    XLA's command buffer and replayed without Python (it
                    needs XLA_FLAGS=--xla_gpu_graph_min_graph_size=1, set
                    for the whole run, every case, when the flag is absent);
                    the tensors the model's graph saves pass to the
                    backward as residuals
  foreign replay recompute  replay=True, recompute=True: the backward runs
                    the model again (what replay did before residuals)
  torch2jax         wrap_torch2jax.torch2jax of the model, where it installs
Reported: µs per step, median over rounds, and per round each case's ratio
to torch eager and to jax, medians over rounds.  --pipelined: the steps
back to back, one wait after the last (each step still takes the one
before's parameters), as a training loop that does not read its loss runs.

    python benchmarks/bench_train_step.py [--rounds 7] [--calls 200] [--out DIR]
        [--shape BATCH,FEATURES,HIDDEN] [--pipelined]

writes DIR/train-step.txt and .json (train-step-BxFxH.* for another shape,
train-step-pipelined.* pipelined;
the values are checked against JAX for the default one only).  Runs on the CPU backend too (PyTorch
CPU tensors), where it is a check of the script, not a measurement.
"""

from __future__ import annotations

import os
import sys

import harness  # first: XLA's allocator setting, before jax loads

harness.graph_small_programs()  # before jax loads, too

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import jax_overlay  # noqa: E402

sys.path.insert(0, os.path.join(harness.ROOT, "tests"))  # workloads.py: the tests' MLP too
from workloads import LR, jax_mlp, mlp_params, sgd, torch_mlp  # noqa: E402

CONTROL = "torch eager"
RUNS = [0]  # the replayed model's Python runs (traces, and the checks' first calls)
STEPS: dict = {}  # steps taken, by case
REPLAYED: list = []  # the replayed model's foreign function
PIPELINED = [False]  # --pipelined: no wait per step


def _counted(model):
    def counted(*args):
        RUNS[0] += 1
        return model(*args)
    return counted


def cases(batch, features, hidden, check):
    x, *p0 = mlp_params(batch, features, hidden)
    on_gpu = jax.devices()[0].platform == "gpu"
    dev = "cuda" if on_gpu else "cpu"
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    spec = jax.ShapeDtypeStruct((), jnp.float32)

    def jax_arm(step, name=""):
        state = [list(p0)]

        def run():
            STEPS[name] = STEPS.get(name, 0) + 1
            v, state[0] = step(x, *state[0])
            if not PIPELINED[0]:
                jax.block_until_ready(state[0])
        run.wait = lambda: jax.block_until_ready(state[0])  # type: ignore[attr-defined]
        return run
    tx = torch.from_numpy(np.array(x)).to(dev)
    tp = [torch.from_numpy(np.array(a)).to(dev).requires_grad_(True) for a in p0]

    def torch_eager():
        loss = torch_mlp(tx, *tp)
        loss.backward()
        with torch.no_grad():
            for a in tp:
                a -= LR * a.grad
                a.grad = None
        if not PIPELINED[0]:
            sync()
    torch_eager.wait = sync  # type: ignore[attr-defined]
    saved = jax_overlay.foreign(torch_mlp, framework="torch", result_shape_dtypes=spec,
                                vjp="autograd")
    redo = jax_overlay.foreign(torch_mlp, framework="torch", result_shape_dtypes=spec,
                               vjp="autograd", recompute=True)
    replay = jax_overlay.foreign(_counted(torch_mlp), framework="torch", result_shape_dtypes=spec,
                                 vjp="autograd", replay=True)
    REPLAYED.append(replay)
    replay_redo = jax_overlay.foreign(torch_mlp, framework="torch", result_shape_dtypes=spec,
                                      vjp="autograd", replay=True, recompute=True)
    out = {CONTROL: torch_eager, "jax": jax_arm(sgd(jax_mlp)),
           "foreign saved": jax_arm(sgd(saved)), "foreign recompute": jax_arm(sgd(redo)),
           "foreign replay": jax_arm(sgd(replay), "foreign replay"),
           "foreign replay recompute": jax_arm(sgd(replay_redo))}
    # One step of each from the same parameters: the same loss and update.
    with jax.default_matmul_precision("highest" if check else None):
        want = sgd(jax_mlp)(x, *p0)
    for name, loss in (("foreign saved", saved), ("foreign recompute", redo),
                       ("foreign replay", replay),
                       ("foreign replay recompute", replay_redo))[:4 * check]:
        got = sgd(loss)(x, *p0)
        np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-3, err_msg=name)
        for a, b in zip(got[1], want[1]):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-3, atol=1e-4,
                                       err_msg=name)
    try:
        import wrap_torch2jax
        t2j = wrap_torch2jax.torch2jax(torch_mlp, tx, *tp, depth=0)
        out["torch2jax"] = jax_arm(sgd(t2j))
        out["torch2jax"]()
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        out["torch2jax"] = f"{type(e).__name__}: {e}"[:200]
    return out


def per_step_us(run, calls):
    """µs per step of `calls` steps; the wait for the last one inside the
    time (a no-op where each step waited for itself)."""
    t0 = harness.clock()
    for _ in range(calls):
        run()
    run.wait()
    return (harness.clock() - t0) / calls / 1e3


def main():
    p = harness.arguments(__doc__, out=".", rounds=7, calls=200)
    p.add_argument("--shape", default="128,256,512",
                   help="batch,features,hidden (default: the small model above)")
    p.add_argument("--pipelined", action="store_true",
                   help="steps back to back, one wait after the last")
    args = p.parse_args()
    PIPELINED[0] = args.pipelined
    batch, features, hidden = map(int, args.shape.split(","))
    default = (batch, features, hidden) == (128, 256, 512)
    made = cases(batch, features, hidden, check=default)
    runnable = {k: v for k, v in made.items() if callable(v)}
    samples = harness.alternate(
        [harness.Arm(k, lambda fn=fn: per_step_us(fn, args.calls), warm=fn,
                     control=k == CONTROL) for k, fn in runnable.items()], args.rounds)
    res = {"us": {}, "x_torch_eager": {}, "x_jax": {},
           "unavailable": {k: v for k, v in made.items() if not callable(v)}}
    for k, ts in samples.items():
        res["us"][k] = harness.med(ts)
        res["x_torch_eager"][k] = harness.med(harness.ratios(samples, k, CONTROL))
        res["x_jax"][k] = harness.med(harness.ratios(samples, k, "jax"))
    res["saved_over_recompute"] = harness.med(
        harness.ratios(samples, "foreign saved", "foreign recompute"))
    res["replay_over_replay_recompute"] = harness.med(
        harness.ratios(samples, "foreign replay", "foreign replay recompute"))
    a = REPLAYED[0].saved  # what the graph saves found, used, never disagreed with
    res["replay_residuals"] = (bool(a.found) and None not in a.found.values()
                               and not a.broken and a.backwards["recompute"] == 0
                               and a.backwards["template"] > 0)
    res["replay_backwards"] = dict(a.backwards)
    res["control_range_us"] = [min(samples[CONTROL]), max(samples[CONTROL])]
    res["samples"] = samples
    res["replay_model_runs"] = {"runs": RUNS[0], "steps": STEPS.get("foreign replay", 0)}
    meta = harness.meta()
    env = (f"{meta.get('device')}, jax {jax.__version__}, torch {torch.__version__}, "
           f"Python {meta['python']}, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    lo, hi = res["control_range_us"]
    text = "\n".join([
        f"# MLP {features}-{hidden}-10 training step (value_and_grad + SGD, batch {batch}, "
        f"float32), µs per step, "
        f"{'pipelined (one wait per round)' if args.pipelined else 'each step waited for'}, "
        f"{args.rounds} alternating rounds of {args.calls} steps; {env}",
        harness.table(["case", "us", "x torch eager", "x jax"], [
            (k, f"{res['us'][k]:.1f}", f"{res['x_torch_eager'][k]:.3f}", f"{res['x_jax'][k]:.3f}")
            for k in res["us"]]),
        *[f"{k}: unavailable: {why}" for k, why in res["unavailable"].items()],
        f"foreign saved / foreign recompute: {res['saved_over_recompute']:.3f} (median of "
        f"per-round ratios); control (torch eager) {lo:.1f}-{hi:.1f} µs across rounds",
        f"foreign replay / foreign replay recompute: {res['replay_over_replay_recompute']:.3f} "
        f"(median of per-round ratios); the replayed backward read residuals: "
        f"{res['replay_residuals']}",
        f"foreign replay: the model's Python ran {RUNS[0]} times in "
        f"{STEPS.get('foreign replay', 0)} steps (each trace; warm-ups and checks included)"])
    print(text)
    tag = ("" if default else f"-{batch}x{features}x{hidden}") + (
        "-pipelined" if args.pipelined else "")
    harness.save(os.path.join(args.out, f"train-step{tag}.json"), {"results": res, "meta": meta})
    harness.save(os.path.join(args.out, f"train-step{tag}.txt"), text + "\n")


if __name__ == "__main__":
    main()
