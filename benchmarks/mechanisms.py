"""What each way of running in parallel wins: every workload's first stepnet
item timed with every mechanism on and with each one turned off in turn, in
one process, the variants taking turns round by round (a slow phase of a
shared machine hits them alike; separate processes of the same code can
differ by more than a mechanism wins). The helper's mechanisms are turned off by the bits of its
board (``threads.SHARES``), the others by replacing the function that uses
them.

    python benchmarks/mechanisms.py                    # W1-W9, S1-S3, every mechanism
    python benchmarks/mechanisms.py --workloads W1,W3 --mechanisms ahead,columns
    python benchmarks/mechanisms.py --quick            # W1-W9 at tiny sizes: a smoke test
    python benchmarks/mechanisms.py --busy 1 --workloads W3 --mechanisms pauses

Besides W1-W9, three small runs, the kind the helper is for (handing work to
a Python thread costs more than such a run gains): S1, a GRU over a chunk of
64 streams (8 steps, I=64, H=64); S2, a GRU over one sequence (T=300, I=256,
H=512); S3, a bidirectional LSTM over 4 sequences (T=200, I=64, H=128).

A mechanism's figure on a workload is the median time without it over the
median time with everything, less one: what it wins (negative: what it
costs). "plain again" is everything on, timed as a variant: the noise to read
the figures against. Run it on an otherwise idle machine, with the threads a
user has (``NUMBA_NUM_THREADS``; every core by default); ``--busy N`` runs N
processes that keep a core busy beside it (another program on the helper's
core: what pausing a losing share is for).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]
os.environ.setdefault("STEPNET_TIERED", "0")

import numpy as np  # noqa: E402

import peers  # noqa: E402
import workloads  # noqa: E402
from stepnet.jit import plan, threads, transposed  # noqa: E402


@contextlib.contextmanager
def _replaced(module, name, value):
    before = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, before)


@contextlib.contextmanager
def _board_without(bits):
    before = threads.BOARD[threads.SHARES]
    threads.BOARD[threads.SHARES] = before & ~bits
    try:
        yield
    finally:
        threads.BOARD[threads.SHARES] = before


def _small_run(layer, sequences, steps, inputs, hidden, **options):
    def build(_):
        import stepnet as sn

        module = getattr(sn.nn, layer)(inputs, hidden, seed=1, **options)
        rng = np.random.default_rng(0)
        X = sn.LoDTensor.from_lengths(
            rng.standard_normal((sequences * steps, inputs)).astype(np.float32), [[steps] * sequences])
        return lambda: module(X, backend="numba")
    return build


# the small runs: (label, build)
SMALL = {
    "S1": ("GRU, 64 streams x 8 steps, H=64", _small_run("GRU", 64, 8, 64, 64)),
    "S2": ("GRU, one sequence of 300 steps, H=512", _small_run("GRU", 1, 300, 256, 512)),
    "S3": ("bidirectional LSTM, 4 sequences x 200 steps, H=128",
           _small_run("LSTM", 4, 200, 64, 128, direction="bidirectional_concat")),
}


def _one_group(kernel, rows, width, sequences, count):
    return threads.count(), "Python's threads turned off"


# name: (what it is, a context in which it is off)
MECHANISMS = {
    "plain again": ("everything on (the noise)", contextlib.nullcontext),
    "groups": ("a call's sequences in groups on Python threads (plan)",
               lambda: _replaced(plan, "_one_group", _one_group)),
    "cut": ("a group's sequences cut with the helper (threads.group_cut)",
            lambda: _board_without(threads.CUT)),
    "columns": ("the own loop's products cut by columns with the helper",
                lambda: _board_without(threads.COLUMNS)),
    "rows": ("a library's products cut by rows with the helper",
             lambda: _board_without(threads.ROWS)),
    "ahead": ("the next chunk's input products on the helper (ahead)",
              lambda: _board_without(threads.AHEAD)),
    "columns+ahead": ("both (the chunk ahead goes to the helper where no per-step "
                      "product shares with it)",
                      lambda: _board_without(threads.COLUMNS | threads.AHEAD)),
    "pauses": ("pausing the sharing of products whose handovers lost",
               lambda: _board_without(threads.PAUSING)),
    "pieces": ("weight gradients in pieces on Python threads (transposed.transposed_products)",
               lambda: _replaced(transposed, "_SPLIT_TN_WORK", 1 << 62)),
    "directions": ("a layer's directions at once (threads.run_apart)",
                   lambda: _replaced(threads, "run_apart",
                                     lambda fn, items, work: [fn(item) for item in items])),
    "helper": ("the helper: every one of its mechanisms", lambda: _board_without(threads.EVERY)),
}


def _time(fn, seconds):
    """Seconds a call of ``fn``, over ``seconds`` of calls (two at least)."""
    calls, start = 0, time.perf_counter()
    while calls < 2 or time.perf_counter() < start + seconds:
        fn()
        calls += 1
    return (time.perf_counter() - start) / calls


def measure(key, names, rounds, seconds, quick=False):
    """``{variant: median seconds a call}`` of workload ``key``'s first stepnet item."""
    label, build = SMALL[key] if key in SMALL else peers.PEERS["stepnet"][key][0]
    fn = build(None if key in SMALL else workloads.make(key, quick))
    variants = ["plain"] + names
    times = {name: [] for name in variants}
    for name in variants:  # (the first call of each: compiled, the helper woken)
        with MECHANISMS.get(name, (None, contextlib.nullcontext))[1]():
            fn()
    for r in range(rounds):
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        for name in order:
            with MECHANISMS.get(name, (None, contextlib.nullcontext))[1]():
                times[name].append(_time(fn, seconds))
    return label, {name: float(np.median(ts)) for name, ts in times.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default=",".join(workloads.WORKLOADS + tuple(SMALL)))
    ap.add_argument("--mechanisms", default=",".join(MECHANISMS))
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--seconds", type=float, default=0.3, help="timing per variant and round")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test)")
    ap.add_argument("--busy", type=int, default=0, help="processes spinning beside it")
    args = ap.parse_args(argv)
    names = args.mechanisms.split(",")
    for name in names:
        if name not in MECHANISMS:
            ap.error(f"no mechanism {name!r}; the mechanisms: {', '.join(MECHANISMS)}")
    keys = args.workloads.split(",")
    results = {}
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        for key in keys:
            label, results[key] = measure(key, names, args.rounds, args.seconds, args.quick)
            print(f"{key} {label}: " + ", ".join(f"{n} {t * 1e3:.3f} ms"
                                                 for n, t in results[key].items()), file=sys.stderr)
    finally:
        for process in busy:
            process.kill()
    print(f"{threads.count()} threads{f', {args.busy} busy processes beside' if args.busy else ''}; "
          "what each mechanism wins: the median time without it / with everything - 1")
    print("| | " + " | ".join(keys) + " |")
    print("|---|" + "---:|" * len(keys))
    print("| everything on, ms | " + " | ".join(f"{results[k]['plain'] * 1e3:.2f}" for k in keys)
          + " |")
    for name in names:
        print(f"| {name} | " + " | ".join(f"{results[k][name] / results[k]['plain'] - 1:+.1%}"
                                          for k in keys) + " |")
    for name in names:
        print(f"- {name}: {MECHANISMS[name][0]}")


if __name__ == "__main__":
    main()
