"""Where a workload's kernel time goes, by subtraction: stepnet's generated
kernel for one group of sequences, run on one thread (no helper) as it is
and with parts of it left out: its per-step products (``gemm_packed``), its
input products by chunks of steps (``gemm_steps``), its products over every
step's rows (``gemm_hoisted``), or all of them. What is left without any
product is the gate loops, the gathers and the time loop.

    python benchmarks/parts.py W2            # the workload's first stepnet row
    python benchmarks/parts.py W6 --seconds 1
    python benchmarks/parts.py W3 --quick     # tiny sizes: a smoke test
    python benchmarks/parts.py W2 --int8      # the workload quantized to int8

A kernel without a part computes other numbers (its values are not
checked), in the same amount of arithmetic elsewhere: the differences are
the parts' times. One group of a batched workload is what one core runs
(two groups run at once on two cores in ``run.py``); Numba's JIT code has
no symbols a sampling profiler can name, which is why the parts are timed
this way.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]
os.environ.setdefault("STEPNET_TIERED", "0")

import numpy as np  # noqa: E402

import peers  # noqa: E402
import workloads  # noqa: E402
from stepnet.jit import loading, numba_cpu, threads  # noqa: E402

# a part: the calls left out (the first name of each line's call)
PARTS = {
    "per-step products": ("gemm_own", "gemm_packed"),
    "input products by chunks": ("gemm_steps", "gemm_steps_ahead"),
    "products over every step": ("gemm_hoisted", "gemm_hoisted_acc"),
    "quantized products (sn.quantize)": ("int8_rows", "int8_row_sums", "bf16_rows"),
}


def _without(source, calls):
    """``source`` with every statement calling one of ``calls`` left out (a
    call that is an ``if``'s condition, the chunk ahead's, taken as false;
    a per-step product's ``if not gemm_own(...): gemm_packed(...)`` line
    left out whole)."""
    for call in calls:
        source = re.sub(rf"^(\s+){call}\(", rf"\1pass  # {call}(", source, flags=re.M)
        source = re.sub(rf"^(\s+)if {call}\(", rf"\1if False and {call}(", source, flags=re.M)
        # (a product by the own loop, else the library's: the whole line)
        source = re.sub(rf"^(\s+)if not {call}\((.*)$", rf"\1pass  # if not {call}(\2", source,
                        flags=re.M)
    return source


def _one_group(key, label, quick=False, family="stepnet"):
    """The generated module and the arguments of one group's program() call
    of the workload's ``label`` item (its last call)."""
    captured = {}
    run = numba_cpu.NumbaProgram._run

    def capture(self, const_args, board, args, buffers):
        captured["call"] = (self.module, const_args, self._call_args(args), buffers)
        return run(self, const_args, board, args, buffers)

    numba_cpu.NumbaProgram._run = capture
    try:
        entry = dict(peers.PEERS[family][key])
        label = label or next(iter(entry))
        entry[label](workloads.make(key, quick))()
    finally:
        numba_cpu.NumbaProgram._run = run
    if "call" not in captured:
        sys.exit(f"{key} {label!r}: no Numba kernel was called")
    return label, captured["call"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("workload", help="W1 ... W9")
    ap.add_argument("--label", help="a stepnet item of the workload (default: its first)")
    ap.add_argument("--int8", action="store_true", help="the workload quantized (run.py's stepnet-int8)")
    ap.add_argument("--seconds", type=float, default=0.6, help="timing per variant and round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="the workload's tiny sizes (a smoke test)")
    args = ap.parse_args(argv)
    key = args.workload.upper()
    if args.int8:
        import quantized_peers  # noqa: F401  (registers the stepnet-int8 items)
    label, (module, const_args, call_args, buffers) = _one_group(
        key, args.label, args.quick, "stepnet-int8" if args.int8 else "stepnet")
    source = Path(module.__file__).read_text()
    variants = {"whole kernel": source}
    for name, calls in PARTS.items():
        if any(re.search(rf"^\s+(if (not )?)?{call}\(", source, flags=re.M) for call in calls):
            variants[f"without {name}"] = _without(source, calls)
    variants["without any product"] = _without(source, [c for cs in PARTS.values() for c in cs])
    modules = {}
    with tempfile.TemporaryDirectory(prefix="stepnet_parts_") as tmp:
        for i, (name, text) in enumerate(variants.items()):
            path = Path(tmp) / f"stepnet_parts_{i}.py"
            path.write_text(text)
            spec = importlib.util.spec_from_file_location(path.stem, path)
            modules[name] = importlib.util.module_from_spec(spec)
            sys.modules[path.stem] = modules[name]
            spec.loader.exec_module(modules[name])
            loading.link_helpers(modules[name])
        times = {name: [] for name in modules}
        for _ in range(args.rounds):  # (the variants in turn: a slow phase hits them alike)
            for name, mod in modules.items():
                mod.program(*const_args, threads.ALONE, numba_cpu.ROWS_IN_ORDER, *call_args, *buffers)
                end = time.perf_counter() + args.seconds
                while time.perf_counter() < end or len(times[name]) < 3:
                    t = time.perf_counter()
                    mod.program(*const_args, threads.ALONE, numba_cpu.ROWS_IN_ORDER, *call_args, *buffers)
                    times[name].append(time.perf_counter() - t)
    whole = float(np.median(times["whole kernel"]))
    print(f"{key} {label}: one group's kernel on one thread, median (min) ms")
    for name, ts in times.items():
        median = float(np.median(ts))
        line = f"  {name:36s} {median * 1e3:8.3f} ({min(ts) * 1e3:8.3f})"
        if name != "whole kernel":
            line += f"  the part: {(whole - median) * 1e3:7.3f} ({(whole - median) / whole:4.0%})"
        print(line)

if __name__ == "__main__":
    main()
