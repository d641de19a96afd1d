"""Time to first result: each case in a fresh process with an empty
``STEPNET_CACHE_DIR``, as a user meets a new cell.

    python benchmarks/first_result.py                 # every case, the table
    python benchmarks/first_result.py --cases custom,gru --repeats 1

Cases (W5's, W1's and W2's sizes: T=100, B=64, I=128, H=256, float32):

- ``custom``: W5's custom gated cell written in the DSL (benchmarks/peers.py);
- ``gru``, ``lstm``: ``stepnet.nn.GRU`` / ``LSTM``;
- ``onnx-gru``, ``onnx-lstm``: an ONNX model of one GRU / LSTM node, loaded
  by ``stepnet.onnx.InferenceSession`` and run once.

``--timeline`` instead runs one workload's first item of a peer over and
over in a fresh process for ``--seconds`` (``stepnet:W5``: the custom cell's
forward; ``stepnet:W9``: its training step; ``jax:W5``, ``jax:W9``: JAX
compiling the same), stepnet tiered with an empty ``STEPNET_CACHE_DIR``, and
prints when the first result came, a call's median time while the kernels
compile (on the interpreter), when calls first ran on the kernels, when calls
reached full speed (the first call within 1.3x
of the median of the last tenth from which on every ten calls in a row have
their median within 1.3x of it),
that speed, and how many calls were done in the first 20 seconds::

    python benchmarks/first_result.py --timeline stepnet:W5,jax:W5,stepnet:W9,jax:W9
    python benchmarks/first_result.py --timeline stepnet:W5,stepnet:W9 --prepared

``--prepared`` first compiles another cell in the cache (a small GRU's
forward and training step, not tiered) and the first tier's loops: a
researcher's new cell on a machine where stepnet ran before, its helpers,
measurements and the executor's loops (compiled once per install) kept.

Each is measured in three settings: ``tiered`` (the default: a new kernel's
first calls answer on the first tier, the schedule executor or where it
does not run the program the NumPy interpreter, while a worker process
compiles it), ``compiled`` (``STEPNET_TIERED=0``: the first call waits for the
kernel), and ``warm`` (a fresh process with the cache the compiled run left).
Printed per case: the import, the first forward result, the first training
step after it (``sn.vjp`` + pullback; not for ONNX models), and a call made
once the kernels are ready. Figures are medians over ``--repeats`` fresh
processes; the machine's CPU is named.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine import cpu_name

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CASES = ("custom", "gru", "lstm", "onnx-gru", "onnx-lstm")
SETTINGS = ("tiered", "compiled", "warm")


def child(case: str) -> dict:
    """One case in this (fresh) process: seconds to each first result."""
    t0 = time.perf_counter()
    import numpy as np

    import stepnet as sn
    from stepnet.backends import wait_for_kernels

    t_import = time.perf_counter() - t0
    sys.path.insert(0, str(HERE))
    import peers
    import workloads

    wl = workloads.make({"custom": "W5", "lstm": "W2", "onnx-lstm": "W2"}.get(case, "W1"))
    I, H = wl.dims["I"], wl.dims["H"]
    result = {"import_s": t_import}
    if case.startswith("onnx"):
        op = "GRU" if case == "onnx-gru" else "LSTM"
        model = peers._onnx_node_model(op, wl.weights, I, H, False).SerializeToString()
        x = wl.x_time_major()
        t = time.perf_counter()
        session = sn.onnx.InferenceSession(model)
        session.run(None, {"X": x})
        result["forward_s"] = time.perf_counter() - t
        forward = lambda: session.run(None, {"X": x})  # noqa: E731
    else:
        if case == "custom":
            net, X = peers.sn_custom_rnn(sn, wl)
            forward = lambda: net(x=X)  # noqa: E731
            train = lambda: sn.vjp(net, x=X)  # noqa: E731
        else:
            layer = sn.nn.GRU if case == "gru" else sn.nn.LSTM
            net = layer(I, H, seed=0)
            X = sn.LoDTensor.from_lengths(wl.x_packed(), [wl.lengths.tolist()])
            forward = lambda: net(X)  # noqa: E731
            train = lambda: sn.vjp(net, X)  # noqa: E731
        t = time.perf_counter()
        out = forward()
        result["forward_s"] = time.perf_counter() - t
        Y = out if isinstance(out, sn.LoDTensor) else out[0]
        dY = np.ones_like(Y.data)
        t = time.perf_counter()
        outs, pullback = train()
        states = len(net.state_widths()) if case != "custom" else 0  # no gradient for h_n, c_n
        pullback([dY] + [None] * states)
        result["train_s"] = time.perf_counter() - t
    t = time.perf_counter()
    wait_for_kernels()
    result["kernels_ready_s"] = time.perf_counter() - t0
    forward()
    t = time.perf_counter()
    forward()
    result["kernel_call_ms"] = (time.perf_counter() - t) * 1e3
    return result


def timeline_child(spec: str, seconds: float) -> dict:
    """Calls of peer ``spec`` (``peer:KEY``) for ``seconds``: each call's end
    (seconds from the start of its build) and duration, and which ran on the
    kernels (stepnet: whether every kernel was ready before the call)."""
    peer, key = spec.split(":")
    sys.path.insert(0, str(HERE))
    import peers
    import workloads

    if peer == "stepnet":
        from stepnet.backends import kernels_ready as ready
    else:
        def ready():
            return True
    label, build = peers.PEERS[peer][key][0]
    wl = workloads.make(key)
    t0 = time.perf_counter()
    run = build(wl)
    calls = []
    while not calls or time.perf_counter() - t0 < seconds:
        compiled = ready()
        start = time.perf_counter()
        run()
        end = time.perf_counter()
        calls.append((end - t0, end - start, compiled))
    return {"label": label, "calls": calls}


def timeline_row(spec, calls) -> str:
    """One table row of a timeline's calls (``timeline_child``)."""
    times = [d for _, d, _ in calls]
    warm = statistics.median(sorted(times[-max(1, len(times) // 10):]))
    # (the first call within 1.3x of it from which on every ten calls in a
    # row have their median within 1.3x: one slow call on a shared machine
    # is not a slow tier)
    medians = [statistics.median(times[i:i + 10]) for i in range(len(times))]
    full = start = len(times) - 1
    while start > 0 and medians[start - 1] <= 1.3 * warm:
        start -= 1
        full = start if times[start] <= 1.3 * warm else full
    early = [d for _, d, compiled in calls[1:] if not compiled]
    early_ms = f"{statistics.median(early) * 1e3:.0f}" if early else "-"
    kernels = next((end - d for end, d, compiled in calls[1:] if compiled), None)
    kernels_s = "not yet" if kernels is None else f"{kernels:.1f}"
    in_20 = sum(1 for end, _, _ in calls if end <= 20.0)
    return (f"| {spec} | {calls[0][0]:.2f} | {early_ms} | {kernels_s} | "
            f"{calls[full][0] - calls[full][1]:.1f} | {warm * 1e3:.1f} | {in_20} | "
            f"{len(calls)} in {calls[-1][0]:.0f} s |")


def prepare_child() -> dict:
    """Another cell's forward and training step compiled in this cache (not
    tiered), and the executor's loops: stepnet's helpers, measurements and
    first tier are then in it, as any earlier run (tiered: the default) of
    stepnet on the machine leaves them."""
    import numpy as np

    import stepnet as sn
    from stepnet import executor_loop
    from stepnet.backends import wait_for_kernels

    t0 = time.perf_counter()
    layer = sn.nn.GRU(16, 32, seed=0)
    X = sn.LoDTensor.from_lengths(np.ones((12, 16), np.float32), [[5, 4, 3]])
    (Y, _), pullback = sn.vjp(layer, X)
    pullback([np.ones_like(Y.data), None])
    wait_for_kernels()
    for dtype in (np.float32, np.float64):  # (not tiered: compiled here)
        executor_loop.loop(np.dtype(dtype))
    return {"prepared_s": time.perf_counter() - t0}


def timeline(specs, seconds, threads, prepared=False) -> None:
    where = ("a STEPNET_CACHE_DIR where another cell was compiled before (stepnet's helpers, "
             "measurements and the executor's loops in it)" if prepared else "empty STEPNET_CACHE_DIR")
    print(f"Timelines in a fresh process, {where}, stepnet tiered "
          f"({cpu_name()}, {os.cpu_count()} CPUs, {threads} threads); seconds from the build\n")
    print("| peer:workload | first result, s | a call while compiling, ms | on the kernels from, s "
          "| full speed after, s | full speed, ms | calls in 20 s | calls |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for spec in specs:
        cache = Path(tempfile.mkdtemp(prefix="stepnet_timeline_"))
        try:
            if prepared:
                measure(spec, "compiled", cache, threads, ["--prepare-child"])
            found = measure(spec, "tiered", cache, threads, ["--timeline-child", spec,
                                                             "--seconds", str(seconds)])
        finally:
            time.sleep(0.5)
            shutil.rmtree(cache, ignore_errors=True)
        print(timeline_row(spec, found["calls"]), flush=True)


def measure(case, setting, cache, threads, child_args=None):
    env = dict(os.environ, STEPNET_CACHE_DIR=str(cache),
               STEPNET_TIERED="1" if setting == "tiered" else "0")
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS"):
        env[var] = str(threads)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH")
                                                        else []))
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()),
                           *(child_args or ["--child", case])],
                          capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"{case} ({setting}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--repeats", type=int, default=1, help="fresh processes per case and setting")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--timeline", help="peer:KEY,... (stepnet:W5, jax:W9, ...): calls over time")
    ap.add_argument("--seconds", type=float, default=60.0, help="a timeline's length")
    ap.add_argument("--prepared", action="store_true",
                    help="timelines in a cache where another cell was compiled before")
    ap.add_argument("--prepare-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--timeline-child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child)))
        return 0
    if args.prepare_child:
        print(json.dumps(prepare_child()))
        return 0
    if args.timeline_child:
        print(json.dumps(timeline_child(args.timeline_child, args.seconds)))
        return 0
    if args.timeline:
        timeline([s.strip() for s in args.timeline.split(",") if s.strip()], args.seconds,
                 args.threads, args.prepared)
        return 0
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        ap.error(f"unknown case(s) {unknown}; known: {', '.join(CASES)}")
    print(f"First results in a fresh process, empty STEPNET_CACHE_DIR ({cpu_name()}, "
          f"{os.cpu_count()} CPUs, {args.threads} threads); seconds, median of {args.repeats}\n")
    print("| case | setting | import | first forward | first training step | kernels ready "
          "(from start) | a call with the kernels, ms |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for case in cases:
        rows = {s: [] for s in SETTINGS}
        for _ in range(args.repeats):
            for setting in ("tiered", "compiled"):
                cache = Path(tempfile.mkdtemp(prefix="stepnet_first_"))
                try:
                    rows[setting].append(measure(case, setting, cache, args.threads))
                    if setting == "compiled":  # the same cache again: warm
                        rows["warm"].append(measure(case, "warm", cache, args.threads))
                finally:
                    time.sleep(0.5)  # a tiered run's worker may still be writing
                    shutil.rmtree(cache, ignore_errors=True)
        for setting in SETTINGS:
            def med(key, scale=1.0, fmt="{:.2f}", rows=rows[setting]):
                values = [r[key] for r in rows if key in r]
                return fmt.format(statistics.median(values) * scale) if values else "n/a"
            print(f"| {case} | {setting} | {med('import_s')} | {med('forward_s')} | "
                  f"{med('train_s')} | {med('kernels_ready_s')} | "
                  f"{med('kernel_call_ms', fmt='{:.1f}')} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
