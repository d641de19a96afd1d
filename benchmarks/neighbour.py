"""stepnet and PyTorch in one process: each one's W1 alone, then the two
taking turns, call by call (a model that runs a stepnet layer and a PyTorch
layer one after the other), with PyTorch's default threads and settings and
no environment variable set. Each call is timed on its own; printed per peer:
the median alone, the median beside the other, and their ratio (the target:
at most 1.10 each).

    python benchmarks/neighbour.py                 # W1, 7 rounds of 20 calls
    python benchmarks/neighbour.py --workload W5 --rounds 9
    python benchmarks/neighbour.py --quick         # tiny sizes: a smoke test

Rounds alternate the order of the three phases (stepnet alone, PyTorch
alone, both in turns), so that a slow phase of a shared machine hits them
alike.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]
os.environ.setdefault("STEPNET_TIERED", "0")

import peers  # noqa: E402
import workloads  # noqa: E402
from machine import cpu_name  # noqa: E402


def _timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(key, rounds, calls, quick=False):
    """``{"stepnet": (alone, beside), "torch": (alone, beside)}``: median
    seconds a call, over every call of every round."""
    wl = workloads.make(key, quick)
    ours = peers.PEERS["stepnet"][key][0][1](wl)
    theirs = peers.PEERS["torch"][key][0][1](wl)
    for _ in range(3):  # (compiled, warmed up)
        ours()
        theirs()
    times = {(p, s): [] for p in ("stepnet", "torch") for s in ("alone", "beside")}

    def alone():
        times["stepnet", "alone"].extend(_timed(ours) for _ in range(calls))

    def torch_alone():
        times["torch", "alone"].extend(_timed(theirs) for _ in range(calls))

    def turns():
        for _ in range(calls):
            times["stepnet", "beside"].append(_timed(ours))
            times["torch", "beside"].append(_timed(theirs))

    phases = [alone, torch_alone, turns]
    for r in range(rounds):
        for phase in phases[r % 3:] + phases[:r % 3]:
            phase()
    return {p: (statistics.median(times[p, "alone"]), statistics.median(times[p, "beside"]))
            for p in ("stepnet", "torch")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="W1")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=20, help="calls per phase and round")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test)")
    args = ap.parse_args(argv)
    import numba
    import torch

    found = measure(args.workload, args.rounds, args.calls, args.quick)
    print(f"{args.workload} in one process ({cpu_name()}, {os.cpu_count()} CPUs; torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads; numba "
          f"{numba.get_num_threads()} threads); median ms a call\n")
    print("| peer | alone | beside the other | ratio |")
    print("|---|---:|---:|---:|")
    for name, (alone, beside) in found.items():
        print(f"| {name} | {alone * 1e3:.3f} | {beside * 1e3:.3f} | {beside / alone:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
