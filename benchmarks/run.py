"""Benchmark orchestrator: stepnet against torch, onnxruntime, jax and numpy.

    python benchmarks/run.py                      # full run, every workload and peer
    python benchmarks/run.py --quick              # tiny sizes, 1 round: a smoke test
    python benchmarks/run.py --workloads W1,W3 --peers stepnet,torch --rounds 7
    python benchmarks/run.py --markdown docs/benchmarks.md   # this machine's section of the page
    python benchmarks/run.py --check              # one call per item: accuracy only

Each peer family runs in its own subprocess (``run.py --worker FAMILY``),
only one of them working at a time, so thread pools never mix; the children
get OMP/MKL/OPENBLAS/NUMBA_NUM_THREADS = ``--threads`` (2). A worker builds
every item, calls it once (``setup s`` = build + first call, JIT compile
included; stepnet's kernel cache is a fresh empty directory unless
``--stepnet-cache`` says otherwise) and warms it up, one worker after
another; then the workers stay alive and their ``--rounds`` timing rounds
are interleaved: round r of every worker (in an order shuffled per round,
0.2 s apart) before round r + 1, so a slow phase of a shared machine falls
on every peer alike rather than on the one timed while it lasts. A round
times each item (shuffled per round, one untimed call before each block) in
a block of >= 2 calls and >= 0.2 s; median and min are over every timed
call. The final hidden states go to .npy
files and are compared here with a float64 NumPy reference (workloads.py).
W8 (a GRU training step: forward, then the gradients of every parameter and of
X) and W9 (the same for W5's custom cell, given the gradient of its all-steps
output) also save each peer's gradients to .npz files (W8 in PyTorch's layout,
W9 in workloads.custom_weights'); the report gives their relative error against
the float64 gradients (a hand-written NumPy BPTT) and stepnet's against
PyTorch's, and each family's split of the step into its forward (stepnet:
``sn.vjp``, workspace kept) and its backward (the pullback) with the size of
the workspace.

Printed: one markdown table; the machine's GEMM ceiling (the threads times
the best single-thread rate of W1's per-step product, over stepnet's own
loop, numpy's matmul and each BLAS stepnet reaches) and one core's FMA
peak; stepnet's share of the ceiling; each target beside the GFLOP/s it
asks for; the compile time of stepnet's W1 kernel in a fresh process with a
cold and then a warm STEPNET_CACHE_DIR; W1, W3, W5, W6 and W9 on stepnet's
first tier, the schedule executor, beside their kernels (``--no-executor``
skips it); and the failures (a peer that is
missing or fails shows as n/a; the run goes on).

Nothing at module level imports numpy or a framework: the torch worker must
import torch before anything that starts a thread pool.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
FAMILIES = ("stepnet", "torch", "onnxruntime", "jax", "numpy", "stepnet-cuda", "torch-cuda",
            "stepnet-int8", "torch-int8", "onnxruntime-int8")
CPU_FAMILIES = FAMILIES[:5]  # the default peers; --cuda adds the GPU families
CUDA_FAMILIES = FAMILIES[5:7]
# the int8 families (quantized_peers.py), each run beside its float32 family
INT8_FAMILIES = {"stepnet-int8": "stepnet", "torch-int8": "torch", "onnxruntime-int8": "onnxruntime"}
INT8_KEYS = ("W1", "W2", "W5", "W7")
ALIASES = {"ort": "onnxruntime", "onnx": "onnxruntime", "np": "numpy"}
WORKLOAD_KEYS = ("W1", "W2", "W3", "W4", "W5", "W6", "W7", "W8", "W9")  # workloads.WORKLOADS
TOLERANCE = 1e-4  # max|dh| above this is listed as a disagreement
INT8_TOLERANCE = 5e-2  # the same for the int8 families (int8's own error)
GRAD_TOLERANCE = 1e-3  # a gradient's relative error (see grad_error) above this, too
# the per-step product of W1 (a batch of 64, H=256, three gates) whose best
# single-thread rate, times the threads, is the machine's GEMM ceiling
CEILING_SHAPE = (64, 256, 768)
# stepnet / the fastest CPU peer each workload aims at (or / one family's
# fastest where named): the speed targets of the CPU engine
TARGETS = {"W1": (0.65, None), "W2": (0.85, None), "W3": (0.75, None), "W4": (0.6, None),
           "W5": (0.65, None), "W6": (0.5, "torch"), "W7": (0.85, None), "W8": (0.8, None),
           "W9": (0.6, "jax")}


# ============================================================================
# workers (run in child processes)


def _setup_paths():
    for p in (str(HERE), str(ROOT)):
        if p not in sys.path:
            sys.path.insert(0, p)


def _reason(exc: BaseException) -> str:
    """One line: the exception and where it came from."""
    tb = traceback.extract_tb(exc.__traceback__)
    where = f" (at {Path(tb[-1].filename).name}:{tb[-1].lineno})" if tb else ""
    msg = " ".join(str(exc).split())
    if len(msg) > 300:
        msg = msg[:300] + "..."
    return f"{type(exc).__name__}: {msg}{where}"


def _timing_params(args):
    if getattr(args, "check", False):
        return {"rounds": 0, "min_block_s": 0.0, "min_calls": 0, "warmup_s": 0.0,
                "warmup_calls": 0}
    if args.quick:
        return {"rounds": args.rounds or 1, "min_block_s": 0.02, "min_calls": 2,
                "warmup_s": 0.0, "warmup_calls": 1}
    return {"rounds": args.rounds or 7, "min_block_s": 0.2, "min_calls": 2, "warmup_s": 0.2,
            "warmup_calls": 2}


# the key of the note of stepnet's small-products table (a line of its own)
_SMALL_NOTE = "stepnet-small-products"
# the lines a worker answers the orchestrator with (its other output is logged)
_READY, _DONE = "[bench-worker] ready", "[bench-worker] done"


def _write_json(path, obj):
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def _family_notes(family, threads):
    notes = {}
    try:
        if family == "torch":
            import torch

            notes["torch"] = f"{torch.__version__}, {torch.get_num_threads()} threads"
        elif family == "onnxruntime":
            import onnx
            import onnxruntime

            notes["onnxruntime"] = f"{onnxruntime.__version__} (onnx {onnx.__version__}), " \
                f"intra_op {threads}, inter_op 1"
        elif family == "jax":
            import jax

            notes["jax"] = f"{jax.__version__}, devices {jax.devices()}"
        elif family == "stepnet":
            import numba

            import stepnet
            from stepnet import info as blas_info
            from stepnet.jit import blas, blas_choice

            blas_note = f"{blas.BLAS_NAME} ({blas_choice.choose()['reason']})"
            notes["stepnet"] = f"{stepnet.__version__}, numba {numba.__version__}, BLAS {blas_note}"
            # (the workloads are float32: that dtype's limits; "small products:" under
            # STEPNET_DETERMINISTIC)
            prefixes = ("small products, float32: ", "small products: ")
            small = [line[len(p):] for line in blas_info.describe().splitlines()
                     for p in prefixes if line.startswith(p)]
            notes[_SMALL_NOTE] = small[0] if small else "unknown"
        elif family == "stepnet-int8":
            from stepnet.jit import int8_gemm

            notes["stepnet-int8"] = f"int8 products by {int8_gemm.int8_path()}"
        elif family == "torch-int8":
            import torch

            notes["torch-int8"] = f"{torch.__version__}, quantized engine " \
                f"{torch.backends.quantized.engine}, {torch.get_num_threads()} threads"
        elif family == "numpy":
            import numpy

            notes["numpy"] = numpy.__version__
        elif family == "stepnet-cuda":
            if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
                notes["stepnet-cuda"] = "Numba's CUDA simulator (timings meaningless)"
            else:
                notes["stepnet-cuda"] = f"GPU {_gpu_name()}"
        elif family == "torch-cuda":
            import torch

            notes["torch-cuda"] = f"{torch.__version__}, GPU {torch.cuda.get_device_name()}, " \
                f"cuDNN {torch.backends.cudnn.version()}"
    except Exception as exc:  # noqa: BLE001 - notes are best effort
        notes[family] = f"(version unknown: {_reason(exc)})"
    return notes


def worker_main(args):
    """Build, first-call, warm up and time every item of one family."""
    family = args.worker
    out_dir = Path(args.outdir)
    tag = args.tag or ""
    result = {"family": family, "tag": tag, "items": [], "notes": {}, "error": None}
    out_file = out_dir / f"{family}{tag}.json"
    if family.startswith("torch"):
        try:  # before numpy or anything else that may start a thread pool
            import torch

            torch.set_num_threads(args.threads)
        except Exception as exc:  # noqa: BLE001 - reported as n/a, never a crash
            result["error"] = f"torch not importable: {_reason(exc)}"
    _setup_paths()
    import numpy as np
    import peers
    import quantized_peers  # noqa: F401 - registers the int8 families' items
    import workloads

    tp = _timing_params(args)
    items = []  # (record, callable)
    for key in args.workloads.split(","):
        entry = peers.PEERS.get(family, {}).get(key)
        if entry is None:
            continue
        if isinstance(entry, str):
            result["items"].append({"workload": key, "family": family, "label": family,
                                    "status": "na", "reason": entry})
            continue
        try:
            wl = workloads.make(key, args.quick)
        except Exception as exc:  # noqa: BLE001 - reported as n/a, never a crash
            result["items"].append({"workload": key, "family": family, "label": family,
                                    "status": "failed", "reason": f"workload: {_reason(exc)}"})
            continue
        for i, (label, builder) in enumerate(entry):
            label += args.label_suffix or ""
            rec = {"workload": key, "family": family, "label": label, "status": "failed"}
            result["items"].append(rec)
            _write_json(out_file, result)  # a crash below still leaves a trace
            if result["error"]:
                rec["reason"] = result["error"]
                continue
            try:
                t0 = time.perf_counter()
                fn = builder(wl)
                out = fn()
                rec["setup_s"] = time.perf_counter() - t0
                h = peers.final_state_numpy(out[1])
                h_file = out_dir / f"{family}{tag}_{key}_{i}.npy"
                np.save(h_file, h)
                rec["h_file"] = str(h_file)
                if len(out) > 2 and out[2] is not None:  # a training step's gradients
                    g_file = out_dir / f"{family}{tag}_{key}_{i}_grads.npz"
                    np.savez(g_file, **peers.gradients_numpy(out[2]()))
                    rec["g_file"] = str(g_file)
                rec["info"] = getattr(fn, "info", {})
                t_end = time.perf_counter() + tp["warmup_s"]
                calls = 0
                while calls < tp["warmup_calls"] or time.perf_counter() < t_end:
                    fn()
                    calls += 1
                rec["status"] = "ok"
                rec["times"] = []
                items.append((rec, fn))
            except Exception as exc:  # noqa: BLE001 - reported as n/a, never a crash
                rec["reason"] = _reason(exc)
    result["notes"] = {k + tag: v for k, v in _family_notes(family, args.threads).items()}
    _write_json(out_file, result)
    # the rounds, as the orchestrator asks for them: "round R" (answered by
    # READY/DONE lines on stdout), then "finish"
    print(_READY, flush=True)
    for line in sys.stdin:
        command = line.split()
        if command[:1] == ["round"]:
            _time_round(items, int(command[1]), tp)
            _write_json(out_file, result)
            print(f"{_DONE} {command[1]}", flush=True)
        elif command[:1] == ["finish"]:
            break
    for rec, _ in items:
        if rec["status"] == "ok":
            ts = sorted(rec.pop("times"))
            rec["n"] = len(ts)
            rec["median_s"] = float(np.median(ts)) if ts else None  # None: --check
            rec["min_s"] = ts[0] if ts else None
    _write_json(out_file, result)


def _time_round(items, r, tp):
    """One timing round of a worker's items (shuffled by ``r``): for each,
    an untimed call, then a block of >= ``min_calls`` calls and
    ``min_block_s`` seconds."""
    order = list(range(len(items)))
    random.Random(r).shuffle(order)
    for j in order:
        rec, fn = items[j]
        if rec["status"] != "ok":
            continue
        try:
            fn()  # untimed: caches back in after the previous item
            times = []
            start = time.perf_counter()
            while len(times) < tp["min_calls"] or time.perf_counter() - start < tp["min_block_s"]:
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
            rec["times"].extend(times)
            rec.setdefault("round_medians", []).append(statistics.median(times))
        except Exception as exc:  # noqa: BLE001 - reported as n/a, never a crash
            rec["status"] = "failed"
            rec["reason"] = f"during timing: {_reason(exc)}"


def ceiling_main(args):
    """The machine's GEMM ceiling, in a child limited to one thread: the
    single-thread rate of the per-step product ``CEILING_SHAPE`` by
    stepnet's own loop, each BLAS library stepnet reaches and numpy's matmul
    (not in an emulated run: NumPy's BLAS keeps this CPU's instructions; the
    best of 5 rounds each), and one core's FMA peak (machine.py)."""
    _setup_paths()
    import machine

    M, K, N = CEILING_SHAPE
    seconds = machine.single_thread_seconds(M, K, N)
    if not _emulated():
        seconds.update(_numpy_seconds(M, K, N))
    rates = {name: 2.0 * M * K * N / s / 1e9 for name, s in seconds.items()}
    _write_json(Path(args.outdir) / "ceiling.json",
                {"rates": rates, "fma_peak": machine.fma_peak_gflops()})


def _numpy_seconds(M, K, N):
    """``{"numpy matmul (its BLAS)": seconds}`` of one ``[M, K] @ [K, N]``
    float32 product by numpy's matmul, the best of 5 rounds of 50."""
    import numpy as np

    rng = np.random.default_rng(0)
    a = rng.standard_normal((M, K)).astype(np.float32)
    b = rng.standard_normal((K, N)).astype(np.float32)
    c = np.empty((M, N), np.float32)
    best = float("inf")
    for _ in range(5):
        np.matmul(a, b, out=c)
        t = time.perf_counter()
        for _ in range(50):
            np.matmul(a, b, out=c)
        best = min(best, (time.perf_counter() - t) / 50)
    try:
        name = np.show_config(mode="dicts")["Build Dependencies"]["blas"]["name"]
    except (TypeError, KeyError, AttributeError):  # older numpy: no mode="dicts"
        name = "its BLAS"
    return {f"numpy matmul ({name})": best}


def probe_main(args):
    """stepnet's first call of W1 in this fresh process (see compile_section)."""
    _setup_paths()
    import workloads

    wl = workloads.make("W1", args.quick)
    t0 = time.perf_counter()
    import peers

    import stepnet  # noqa: F401 - timed: the import is part of a user's first call

    t1 = time.perf_counter()
    fn = peers.stepnet_gru(wl)
    t2 = time.perf_counter()
    fn()
    t3 = time.perf_counter()
    fn()
    t4 = time.perf_counter()
    cache = Path(os.environ["STEPNET_CACHE_DIR"])
    files = sorted(p.name for p in cache.rglob("*") if p.is_file())
    _write_json(Path(args.outdir) / f"probe_{args.probe}.json",
                {"import_s": t1 - t0, "build_s": t2 - t1, "first_call_s": t3 - t2,
                 "total_s": t3 - t0, "second_call_s": t4 - t3, "cache_files": len(files)})


EXECUTOR_KEYS = ("W1", "W3", "W5", "W6", "W9")  # the workloads of the executor's section


def executor_probe_main(args):
    """Each workload's stepnet item on its kernels, then with every program
    the executor runs answered by it (see executor_section): median times."""
    _setup_paths()
    import numpy as np
    import peers
    import quantized_peers  # noqa: F401 - registers the int8 items (W1-int8)
    import workloads

    import importlib

    from stepnet import executor, executor_loop

    backends = importlib.import_module("stepnet.backends")  # (sn.backends is a function)

    t0 = time.perf_counter()
    for dtype in (np.float32, np.float64):
        executor_loop.loop(np.dtype(dtype))  # (STEPNET_TIERED=0: compiled here, or loaded)
    out = {"loops_s": time.perf_counter() - t0, "items": {}}
    seen = set()  # (the step-nets of the workloads before)
    for key in args.workloads.split(","):
        base, family = (key[:-5], "stepnet-int8") if key.endswith("-int8") else (key, "stepnet")
        wl = workloads.make(base, args.quick)
        fn = peers.PEERS[family][base][0][1](wl)
        kernel = _median_call(fn, args.rounds or 7)  # (its first call compiles)
        runs, ran, why = 0, 0, set()
        for compiled in [c for c in backends._every_compiled()
                         if c.backend == "numba" and id(c) not in seen]:
            seen.add(id(compiled))
            swapped = {}
            for table in (compiled._runs, compiled._gradient_runs):
                for k, run in list(table.items()):
                    if isinstance(run, tuple):  # a backward: ([(run, program), ...], layout)
                        pairs = [(_on_executor(r, p, args.threads), p) for r, p in run[0]]
                        why.update(executor.why_not(p) or "" for _, p in run[0])
                        runs += len(pairs)
                        ran += sum(r[0] is not o[0] for r, o in zip(pairs, run[0]))
                        swapped[id(table), k] = (table, (pairs, run[1]))
                    else:
                        new = _on_executor(run, run.program, args.threads)
                        why.add(executor.why_not(run.program) or "")
                        runs, ran = runs + 1, ran + (new is not run)
                        swapped[id(table), k] = (table, new)
            for (_, k), (table, run) in swapped.items():
                table[k] = run
        out["items"][key] = {"kernel_s": kernel, "executor_s": _median_call(fn, args.rounds or 7),
                             "programs": runs, "on_executor": ran,
                             "why_not": sorted(w for w in why if w)}
    _write_json(Path(args.outdir) / "executor.json", out)


def _on_executor(run, program, workers):
    """``run`` answered by the executor on ``workers`` threads (itself where
    the executor does not run ``program``)."""
    from stepnet import executor

    ex = None if getattr(run, "on_executor", False) else executor.compile_program(program)
    if ex is None:  # (not one it runs, or swapped for an earlier workload)
        return run

    def on_executor(args, consts):
        return ex(args, consts, workers=workers)
    on_executor.program, on_executor.on_executor = program, True
    return on_executor


def _median_call(fn, count):
    """The median of ``count`` timed calls after two untimed ones (a kernel
    compiled just before, or a tier just swapped in, warms up first)."""
    fn()
    fn()
    times = []
    for _ in range(count):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


# ============================================================================
# orchestrator


def executor_section(args, keys, tmp, log):
    """The executor beside the kernels, stepnet alone in a child process."""
    keys = [k for k in keys if k in EXECUTOR_KEYS]
    if not keys:
        return [], []
    keys += ["W1-int8"] if "W1" in keys else []  # (W1's GRU quantized: sn.quantize)
    cache = args.stepnet_cache if args.stepnet_cache not in ("fresh", "default") else None
    extra = {"STEPNET_TIERED": "0"}
    if cache or args.stepnet_cache == "fresh":
        extra["STEPNET_CACHE_DIR"] = cache or tempfile.mkdtemp(prefix="stepnet_cache_", dir=tmp)
    argv = ["--worker", "executor-probe", "--workloads", ",".join(keys), "--outdir", str(tmp),
            "--threads", str(args.threads)]
    if args.quick:
        argv.append("--quick")
    if args.rounds:
        argv += ["--rounds", str(args.rounds)]
    ok, secs, msg = run_child(argv, child_env(args.threads, extra), args.timeout, log)
    f = Path(tmp) / "executor.json"
    if not ok or not f.exists():
        return [], [f"executor section: {msg or 'no result'}"]
    found = json.loads(f.read_text())
    lines = [("The schedule executor (the first tier while a new kernel compiles: "
              "STEPNET_FIRST_TIER) beside the fused kernels, each workload's stepnet item "
              f"timed on its kernels, then with every program the executor runs answered by it "
              f"({args.threads} threads; median of calls); its loops compiled or loaded in "
              f"{found['loops_s']:.1f} s, once per install:"),
             "",
             "| workload | kernels ms | executor ms | executor / kernels | programs on the executor |",
             "|---|---:|---:|---:|---:|"]
    for key, item in found["items"].items():
        if item["on_executor"]:
            times = (f"{item['executor_s'] * 1e3:.1f} | "
                     f"{item['executor_s'] / item['kernel_s']:.2f}")
        else:
            times = "n/a | n/a"
        why = f" (the rest: {'; '.join(item['why_not'])})" if item["why_not"] else ""
        lines.append(f"| {key} | {item['kernel_s'] * 1e3:.1f} | {times} | "
                     f"{item['on_executor']} of {item['programs']}{why} |")
    return lines, []



def child_env(threads, extra=None):
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                "NUMBA_NUM_THREADS", "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS"):
        env[var] = str(threads)
    env.setdefault("JAX_PLATFORMS", "cpu")
    env["STEPNET_TIERED"] = "0"  # time stepnet's compiled kernels, never its interpreter tier
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.update(extra or {})
    return env


def run_child(argv, env, timeout, log):
    """Run ``run.py argv`` in a child; returns (ok, seconds, message)."""
    cmd = [sys.executable, str(Path(__file__).resolve())] + argv
    t = time.perf_counter()
    try:
        proc = subprocess.run(cmd, check=False, env=env, cwd=str(ROOT), capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, time.perf_counter() - t, f"timed out after {timeout} s"
    secs = time.perf_counter() - t
    if log is not None:
        log.write(f"$ {' '.join(cmd)}\n{proc.stdout}{proc.stderr}\n")
    if proc.returncode != 0:
        tail = " | ".join(line for line in proc.stderr.strip().splitlines()[-3:])
        return False, secs, f"exit status {proc.returncode}: {tail}"
    return True, secs, ""


# seconds between one worker's round and the next's
_SETTLE_S = 0.2


class Worker:
    """A worker child (``run.py --worker FAMILY``) kept alive between its
    timing rounds: its stdout read line by line on a thread (the lines that
    answer the orchestrator, the rest logged), its stderr into a file."""

    def __init__(self, name, argv, env, tmp, log):
        self.name, self.log, self.busy = name, log, 0.0
        self.cmd = [sys.executable, str(Path(__file__).resolve())] + argv
        self.err_path = tmp / f"worker_{len(list(tmp.glob('worker_*')))}.stderr"
        self.err = open(self.err_path, "w")
        self.proc = subprocess.Popen(self.cmd, env=env, cwd=str(ROOT), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.err, text=True, bufsize=1)
        self.lines = queue.Queue()
        self.output = []

        def read():
            for line in self.proc.stdout:
                self.lines.put(line.rstrip("\n"))
            self.lines.put(None)

        threading.Thread(target=read, daemon=True).start()

    def wait_for(self, answer, timeout):
        """Read the worker's lines until ``answer``: (ok, message)."""
        start = time.perf_counter()
        try:
            while True:
                try:
                    line = self.lines.get(timeout=max(0.0, start + timeout - time.perf_counter()))
                except queue.Empty:
                    return False, f"timed out after {timeout} s"
                if line is None:
                    self.proc.wait()
                    return False, self.message()
                if line == answer:
                    return True, ""
                self.output.append(line)
        finally:
            self.busy += time.perf_counter() - start

    def send(self, command, answer, timeout):
        try:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
        except OSError:
            self.proc.wait()
            return False, self.message()
        return self.wait_for(answer, timeout)

    def finish(self, timeout):
        """Tell the worker to write its medians and exit; whether it did."""
        try:
            self.proc.stdin.write("finish\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=timeout)
        except (OSError, subprocess.TimeoutExpired):
            self.stop()
            return False
        self.wait_for(None, 10)  # (the rest of its output, to the log)
        self._close()
        return self.proc.returncode == 0

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._close()

    def _close(self):
        if not self.err.closed:
            self.err.close()
            if self.log is not None:
                self.log.write(f"$ {' '.join(self.cmd)}\n" + "\n".join(self.output) + "\n"
                               + self.err_path.read_text() + "\n")

    def seconds(self):
        """The seconds the orchestrator waited on this worker (its build,
        first calls and rounds; not the other workers' rounds)."""
        return self.busy

    def message(self):
        if self.proc.returncode in (0, None):
            return ""
        lines = self.err_path.read_text().strip().splitlines() if self.err_path.exists() else []
        return f"exit status {self.proc.returncode}: " + " | ".join(lines[-3:])


def _fmt_ms(s):
    if s is None:
        return "n/a"
    ms = s * 1e3
    return f"{ms:.3f}" if ms < 10 else f"{ms:.2f}"


def _fmt_s(s):
    return f"{s:.3f}" if s < 1 else f"{s:.2f}"


def _emulated():
    """The CPU stepnet's kernels are compiled for where it is not this one
    (``NUMBA_CPU_NAME``), else ''."""
    name = os.environ.get("NUMBA_CPU_NAME", "")
    return "" if name == "host" else name


# the peers that run another CPU's instructions where asked to (PyTorch by
# ATEN_CPU_CAPABILITY and ONEDNN_MAX_CPU_ISA); onnxruntime, JAX and NumPy's
# OpenBLAS keep this CPU's widest, so an emulated run weighs stepnet against these
EMULATING_FAMILIES = ("torch", "torch-int8")


def _compared(family):
    """Whether stepnet is weighed against ``family``'s rows in this run."""
    return not _emulated() or family in EMULATING_FAMILIES


def _cpu_model():
    """The CPU as ``lscpu`` names it, with its family and whether it has
    AVX-512 (``avx512f``): what a figure depends on."""
    name, family, flags = None, None, None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = (part.strip() for part in line.partition(":"))
            if key == "model name" and name is None:
                name = value
            elif key == "cpu family" and family is None:
                family = value
            elif key == "flags" and flags is None:
                flags = value.split()
    except OSError:
        pass
    name = name or platform.processor() or "unknown CPU"
    details = ([f"family {family}"] if family else []) + (
        [f"avx512f {'yes' if 'avx512f' in flags else 'no'}"] if flags is not None else [])
    if _emulated():
        # another CPU's instructions (docs/benchmarks.md): a section of its own
        details.append(f"emulating {_emulated()}")
    return f"{name} ({', '.join(details)})" if details else name


def _gpu_name():
    """The GPU as numba-cuda names it."""
    from numba import cuda

    name = cuda.get_current_device().name
    return name.decode() if isinstance(name, bytes) else name


def _gpu_model():
    """The GPU, with the CPU beside it."""
    return f"{_gpu_name()} (GPU; CPU {_cpu_model()})"


def write_markdown(path, report, machine=None):
    """``report`` into ``path``. Where the file is a benchmarks page (it has
    a ``## Results`` section, as docs/benchmarks.md), the report becomes
    this machine's section of it, headed by ``machine`` (the CPU by default,
    the GPU for a run of GPU peers only), replacing the section an earlier
    run on the same machine wrote and keeping the others; any other file is
    replaced by the report."""
    path = Path(path)
    text = path.read_text() if path.exists() else ""
    marker = "\n## Results\n"
    if marker not in text:
        path.write_text(report + "\n")
        return
    head, rest = text.split(marker, 1)
    end = rest.find("\n## ")
    results, tail = (rest, "") if end < 0 else (rest[:end + 1], rest[end + 1:])
    intro, *sections = re.split(r"(?m)^(?=### )", results)
    cpu = machine or _cpu_model()
    # (the report's own headings two levels down, under the machine's)
    body = re.sub(r"(?m)^(#{2,3}) ", lambda m: "#" * (len(m.group(1)) + 2) + " ", report.strip())
    sections = [s for s in sections if not s.startswith(f"### {cpu}\n")]
    sections = sorted(sections + [f"### {cpu}\n\n{body}\n\n"])
    intro = intro.replace("No table has been recorded yet.\n\n", "")
    path.write_text(head + marker + intro + "".join(sections) + tail)


def compile_section(args, tmp, log):
    """stepnet W1's first call in a fresh process, cold then warm cache."""
    cache = Path(tempfile.mkdtemp(prefix="stepnet_cache_", dir=tmp))
    sizes = ("quick sizes: the generated kernel is specialized on the hidden size, so this "
             "compiles the quick-size kernel" if args.quick else "full sizes")
    lines = [(f"stepnet W1 ({sizes}), first call in a fresh process with STEPNET_CACHE_DIR = "
              "a new empty temp dir (cold), then in another fresh process with the same dir "
              "(warm):"),
             "",
             ("| cache | import stepnet s | build s | first call s | import+build+first call s "
              "| second call ms | process wall s |"),
             "|---|---:|---:|---:|---:|---:|---:|"]
    failures = []
    for probe in ("cold", "warm"):
        argv = ["--worker", "compile-probe", "--probe", probe, "--outdir", str(tmp)]
        if args.quick:
            argv.append("--quick")
        ok, secs, msg = run_child(argv, child_env(args.threads, {"STEPNET_CACHE_DIR": str(cache)}),
                                  args.timeout, log)
        f = Path(tmp) / f"probe_{probe}.json"
        if not ok or not f.exists():
            lines.append(f"| {probe} | n/a | n/a | n/a | n/a | n/a | {secs:.1f} |")
            failures.append(f"compile probe ({probe} cache): {msg or 'no result'}")
            continue
        p = json.loads(f.read_text())
        lines.append(f"| {probe} ({p['cache_files']} files in the cache dir after) | "
                     f"{p['import_s']:.2f} | {p['build_s']:.3f} | {p['first_call_s']:.2f} | "
                     f"{p['total_s']:.2f} | {p['second_call_s'] * 1e3:.2f} | {secs:.1f} |")
    return lines, failures


def orchestrate(args):
    keys = [k.strip().upper() for k in args.workloads.split(",") if k.strip()]
    bad = [k for k in keys if k not in WORKLOAD_KEYS]
    if bad:
        sys.exit(f"unknown workload(s) {bad}; known: {', '.join(WORKLOAD_KEYS)}")
    keys = sorted(set(keys), key=WORKLOAD_KEYS.index)
    fams = []
    for p in args.peers.split(","):
        p = ALIASES.get(p.strip().lower(), p.strip().lower())
        if p not in FAMILIES:
            sys.exit(f"unknown peer {p!r}; known: {', '.join(FAMILIES)}")
        if p not in fams:
            fams.append(p)
    if args.cuda:
        fams += [f for f in CUDA_FAMILIES if f not in fams]
    if not args.no_quantized and set(keys) & set(INT8_KEYS):
        fams += [f for f, base in INT8_FAMILIES.items() if base in fams and f not in fams]
    fams.sort(key=FAMILIES.index)

    tmp = Path(tempfile.mkdtemp(prefix="stepnet_bench_"))
    with open(tmp / "children.log", "w") as log:  # every child's stdout and stderr
        report = _run_all(args, keys, fams, tmp, log)
    print(report)
    if args.markdown:
        gpu_only = set(fams) <= set(CUDA_FAMILIES) and "NUMBA_ENABLE_CUDASIM" not in os.environ
        write_markdown(args.markdown, report, _gpu_model() if gpu_only else None)
    if args.keep:
        print(f"\n(worker files kept in {tmp})", file=sys.stderr)
    else:
        shutil.rmtree(tmp, ignore_errors=True)


def _run_all(args, keys, fams, tmp, log):
    """Run the workers, the ceiling probe and the compile probes; returns the report."""
    t_run = time.perf_counter()
    failures, results, worker_secs = [], [], {}
    runs = [(fam, None) for fam in fams]
    if ("stepnet" in fams and os.environ.get("OPENBLAS_CORETYPE") and not args.no_openblas_auto
            and not _emulated()):
        # stepnet's GEMMs are OpenBLAS's: run it again with OpenBLAS choosing
        # its kernels for this CPU (the other peers do not use OpenBLAS; in an
        # emulated run OPENBLAS_CORETYPE is the emulated CPU's, and stays)
        runs.insert(fams.index("stepnet") + 1, ("stepnet", "auto"))
    workers = []  # (family, variant, its Worker or None where it failed, why)
    for fam, variant in runs:
        extra, remove = {}, []
        if fam in ("stepnet", "stepnet-int8"):
            cache = args.stepnet_cache
            if cache == "fresh":
                cache = tempfile.mkdtemp(prefix="stepnet_cache_", dir=tmp)
            if cache != "default":
                extra["STEPNET_CACHE_DIR"] = str(cache)
        argv = ["--worker", fam, "--workloads", ",".join(keys), "--outdir", str(tmp),
                "--threads", str(args.threads)]
        if variant == "auto":
            remove.append("OPENBLAS_CORETYPE")
            argv += ["--tag", "_auto", "--label-suffix",
                     " [OPENBLAS_CORETYPE unset: OpenBLAS picks its kernels]"]
        if args.quick:
            argv.append("--quick")
        if args.rounds:
            argv += ["--rounds", str(args.rounds)]
        if args.check:
            argv.append("--check")
        name = fam + (f" ({variant})" if variant else "")
        print(f"[bench] worker {name}: build, first calls, warm-up ...", file=sys.stderr,
              flush=True)
        env = child_env(args.threads, extra)
        for var in remove:
            env.pop(var, None)
        worker = Worker(name, argv, env, tmp, log)
        ok, msg = worker.wait_for(_READY, args.timeout)
        workers.append((fam, variant, worker if ok else None, msg))
        if not ok:
            worker.stop()
    rounds = _timing_params(args)["rounds"]
    for r in range(rounds):
        print(f"[bench] timing round {r + 1} of {rounds} ...", file=sys.stderr, flush=True)
        order = [w for w in workers if w[2] is not None]
        random.Random(r).shuffle(order)
        for entry in order:
            worker = entry[2]
            time.sleep(_SETTLE_S)  # (the last worker's thread pools stop spinning)
            ok, msg = worker.send(f"round {r}", f"{_DONE} {r}", args.timeout)
            if not ok:
                workers[workers.index(entry)] = entry[:2] + (None, msg)
                worker.stop()
    for fam, variant, worker, msg in workers:
        name = fam + (f" ({variant})" if variant else "")
        ok = worker is not None and worker.finish(args.timeout)
        if worker is not None:
            msg = worker.message()
        worker_secs[name] = worker.seconds() if worker is not None else 0.0
        f = tmp / f"{fam}{'_' + variant if variant else ''}.json"
        data = json.loads(f.read_text()) if f.exists() else {"items": [], "notes": {}}
        for rec in data["items"]:
            if not ok and rec["status"] == "ok" and "median_s" not in rec:
                rec["status"], rec["reason"] = "failed", f"worker died: {msg}"
                rec.pop("times", None)
            elif not ok and rec["status"] == "failed" and "reason" not in rec:
                rec["reason"] = f"worker died: {msg}"
        if not ok and not data["items"]:
            failures.append(f"{fam}: worker failed before any item: {msg}")
        results.append(data)

    print("[bench] GEMM ceiling ...", file=sys.stderr, flush=True)
    ceiling = None
    env = child_env(1)
    if not _emulated():
        env.pop("OPENBLAS_CORETYPE", None)  # the machine's ceiling: OpenBLAS's own kernels
    ok, _, msg = run_child(["--worker", "ceiling", "--outdir", str(tmp)], env, args.timeout, log)
    if ok and (tmp / "ceiling.json").exists():
        ceiling = json.loads((tmp / "ceiling.json").read_text())
        ceiling["gflops"] = args.threads * max(ceiling["rates"].values())
        ceiling["peak"] = args.threads * ceiling["fma_peak"]
    else:
        failures.append(f"GEMM ceiling: {msg}")

    compile_lines = []
    if "stepnet" in fams and not args.no_compile:
        print("[bench] stepnet compile probes ...", file=sys.stderr, flush=True)
        compile_lines, fails = compile_section(args, tmp, log)
        failures += fails
    if "stepnet" in fams and not args.no_executor:
        print("[bench] the executor beside the kernels ...", file=sys.stderr, flush=True)
        lines, fails = executor_section(args, keys, tmp, log)
        failures += fails
        if lines:
            compile_lines += ["", "### stepnet's first tier: the executor", ""] + lines

    print("[bench] float64 references ...", file=sys.stderr, flush=True)
    return build_report(args, keys, fams, results, ceiling, compile_lines, failures,
                        worker_secs, time.perf_counter() - t_run)


def build_report(args, keys, fams, results, ceiling, compile_lines, failures, worker_secs,
                 run_secs):
    _setup_paths()
    import numpy as np
    import workloads

    wls = {k: workloads.make(k, args.quick) for k in keys}
    refs = {}
    for k in keys:
        try:
            refs[k] = workloads.reference(wls[k])
        except Exception as exc:  # noqa: BLE001 - reported, never a crash
            failures.append(f"{k} float64 reference: {_reason(exc)}")

    recs = [r for data in results for r in data["items"]]
    for rec in recs:
        if rec["status"] == "failed":
            failures.append(f"{rec['workload']} {rec['label']}: {rec.get('reason', '?')}")
        rec["dh"] = None
        if rec.get("h_file") and rec["workload"] in refs:
            h = np.load(rec["h_file"])
            ref = refs[rec["workload"]]
            if h.shape != ref.shape:
                failures.append(f"{rec['workload']} {rec['label']}: final state shape "
                                f"{h.shape}, reference {ref.shape}")
            else:
                rec["dh"] = float(np.max(np.abs(h - ref))) if h.size else 0.0

    out = []
    mode = "quick (tiny sizes; timings meaningless)" if args.quick else "full sizes"
    if args.check:
        mode += ", --check (one call per item: accuracy only, no timing)"
    out.append(f"## stepnet benchmark: {mode}")
    out.append("")
    out.append(f"Machine: {_cpu_model()}, {os.cpu_count()} cores, {platform.system()} "
               f"{platform.machine()}; python {platform.python_version()}; every peer limited "
               f"to {args.threads} threads, each family in its own process. "
               f"Rounds: {_timing_params(args)['rounds']}, blocks of >= 2 calls and >= "
               f"{_timing_params(args)['min_block_s']} s; median/min over every timed call.")
    notes = {k: v for data in results for k, v in data.get("notes", {}).items()}
    small = {k: notes.pop(k) for k in list(notes) if k.startswith(_SMALL_NOTE)}
    if notes:
        out.append("Versions: " + "; ".join(f"{k} {v}" for k, v in notes.items()) + ".")
    for k, v in small.items():
        out.append(f"{k.replace(_SMALL_NOTE, 'stepnet', 1)}'s small products (measured at its first "
                   f"call of this run, or read from its cache): {v}.")
    out.append("")
    out.append("| workload | peer | median ms | min ms | n | GFLOP/s | ratio | max\\|dh\\| | setup s "
               "| rounds ms |")
    out.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    disagreements = []
    stepnet_gflops = {}
    for k in keys:
        wl = wls[k]
        rows = [r for r in recs if r["workload"] == k]
        rows.sort(key=lambda r: FAMILIES.index(r["family"]))
        bases = {own: next((r.get("median_s") for r in rows if r["family"] == own
                            and r["status"] == "ok" and _role(r) == "step"), None)
                 for own in ("stepnet", "stepnet-cuda", "stepnet-int8")}
        for r in rows:
            # GPU peers are compared with stepnet's cuda backend, int8 ones with its int8
            # run, CPU peers with its CPU one
            base = bases[next((own for own in ("stepnet-cuda", "stepnet-int8")
                               if r["family"].endswith(own[7:])), "stepnet")]
            name = f"{k} {wl.name}"
            if r["status"] == "na":
                out.append(f"| {name} | {r['family']}: n/a ({r['reason']}) | n/a | n/a | n/a "
                           "| n/a | n/a | n/a | n/a | n/a |")
                continue
            if r["status"] == "ok" and r.get("median_s") is None:  # --check: no timing
                dh = f"{r['dh']:.1e}" if r["dh"] is not None else "n/a"
                if r["dh"] is not None and r["dh"] > _tolerance(r):
                    disagreements.append(f"{k} {r['label']}: max|dh| {r['dh']:.2e} vs float64")
                out.append(f"| {name} | {r['label']} | - | - | 0 | - | - | {dh} | "
                           f"{r['setup_s']:.2f} | - |")
                continue
            if r["status"] != "ok" or r.get("median_s") is None:
                setup = f"{r['setup_s']:.2f}" if r.get("setup_s") is not None else "n/a"
                out.append(f"| {name} | {r['label']}: n/a (failed, see Failures) | n/a | n/a "
                           f"| n/a | n/a | n/a | n/a | {setup} | n/a |")
                continue
            med, mn = r["median_s"], r["min_s"]
            gfl = workloads.flops(wl, _role(r)) / med / 1e9
            if r["family"] == "stepnet" and _role(r) == "step":
                # (its first row, as the targets' table takes: not a later
                # one of the same workload, such as stepnet.jax's W9)
                stepnet_gflops.setdefault(k, gfl)
            ratio = f"{med / base:.2f}" if base else "n/a"
            dh = f"{r['dh']:.1e}" if r["dh"] is not None else "n/a"
            if r["dh"] is not None and r["dh"] > _tolerance(r):
                disagreements.append(f"{k} {r['label']}: max|dh| {r['dh']:.2e} vs float64")
            rounds = r.get("round_medians") or [med]
            out.append(f"| {name} | {r['label']} | {_fmt_ms(med)} | {_fmt_ms(mn)} | {r['n']} | "
                       f"{gfl:.1f} | {ratio} | {dh} | {_fmt_s(r['setup_s'])} | "
                       f"{_fmt_ms(min(rounds))}-{_fmt_ms(max(rounds))} |")
        if not rows:
            out.append(f"| {k} {wl.name} | (no peer selected) | | | | | | | | |")
    out.append("")
    out.append("ratio = peer median / stepnet median (> 1: stepnet is faster; GPU rows: / stepnet "
               "cuda median). GFLOP/s = sum of "
               "2*M*N*K of every matmul (valid tokens only) / median. max|dh| = max abs "
               "difference of the final hidden state (W6: every paragraph vector and every "
               "chapter's last state) from a float64 NumPy loop. setup s = build + first call "
               "(JIT compile included; stepnet with STEPNET_CACHE_DIR "
               f"{'= a fresh empty dir' if args.stepnet_cache == 'fresh' else args.stepnet_cache}). "
               "rounds ms = the lowest and the highest of the rounds' medians (a shared "
               "machine's slow phases show as a wide range).")
    trained = [k for k in keys if k in workloads.TRAINS]
    if trained:
        out.append(f"{', '.join(trained)} (training steps): GFLOP/s counts the backward's matmuls "
                   "too (3x the forward's; a forward alone a third, a backward alone two "
                   "thirds); max|dh| is the forward's final state; a forward or backward timed "
                   "alone has as ratio its share of stepnet's step.")
    out.append("")
    for k in trained:
        out += training_section(k, wls[k], results, disagreements, failures)
    if ceiling:
        M, K, N = CEILING_SHAPE
        rates = sorted(ceiling["rates"].items(), key=lambda kv: -kv[1])
        out.append(f"GEMM ceiling: {args.threads} x the best single-thread rate of the per-step "
                   f"product ({M}x{K})@({K}x{N}) float32 ("
                   + ", ".join(f"{name} {g:.1f}" for name, g in rates)
                   + f" GFLOP/s): {ceiling['gflops']:.1f} GFLOP/s. FMA peak (one core, "
                   f"independent multiply-adds on registers): {ceiling['fma_peak']:.1f} GFLOP/s; "
                   f"the ceiling is {ceiling['gflops'] / ceiling['peak']:.2f} of "
                   f"{args.threads} cores' peak.")
        best = max(ceiling["rates"].values())
        if best > 1.05 * ceiling["fma_peak"]:  # no product outruns the multiply-adds it is made of
            failures.append(f"FMA peak probe: {ceiling['fma_peak']:.1f} GFLOP/s, below the "
                            f"{best:.1f} of a product on the same core (a noisy machine?)")
        if stepnet_gflops:
            out.append("stepnet GFLOP/s as a fraction of the ceiling: " + ", ".join(
                f"{k} {g / ceiling['gflops']:.2f}" for k, g in stepnet_gflops.items()) + ".")
    else:
        out.append("GEMM ceiling: n/a (see Failures).")
    out += targets_section(keys, wls, recs, stepnet_gflops, ceiling)
    out += quantized_section(keys, recs)
    if compile_lines:
        if compile_lines[0]:  # (else only the executor's section, its own heading)
            out += ["", "### stepnet compile time", ""]
        out += compile_lines
    out.append("")
    out.append(f"### Numerical disagreements (max|dh| > {TOLERANCE:g}, int8 rows > "
               f"{INT8_TOLERANCE:g}; gradients: relative error > {GRAD_TOLERANCE:g})")
    out.append("")
    out += [f"- {d}" for d in disagreements] or ["- none"]
    out.append("")
    out.append("### Failures")
    out.append("")
    out += [f"- {f}" for f in failures] or ["- none"]
    out.append("")
    out.append("Worker wall time (import + build + compile + warm-up + timing): " + ", ".join(
        f"{f} {s:.1f} s" for f, s in worker_secs.items()) + f"; whole run {run_secs:.1f} s.")
    return "\n".join(out)


# stepnet int8 / stepnet float32, and / the fastest int8 peer, each workload aims at
INT8_TARGETS = {"W1": (0.65, None), "W2": (0.6, 0.7), "W5": (0.65, None), "W7": (0.6, 0.7)}


def quantized_section(keys, recs):
    """stepnet int8 beside its float32 run and the int8 peers (the same
    run), against ``INT8_TARGETS``."""
    timed = [r for r in recs if r["status"] == "ok" and r.get("median_s") is not None
             and _role(r) == "step"]

    def first(k, family):
        return next((r for r in timed if r["workload"] == k and r["family"] == family), None)

    lines = []
    for k in keys:
        ours, fp32 = first(k, "stepnet-int8"), first(k, "stepnet")
        if ours is None or fp32 is None:
            continue
        peers = [r for r in timed if r["workload"] == k and r["family"] in INT8_FAMILIES
                 and r["family"] != "stepnet-int8" and _compared(r["family"])]
        best = min(peers, key=lambda r: r["median_s"]) if peers else None
        of_fp32 = ours["median_s"] / fp32["median_s"]
        of_peer = ours["median_s"] / best["median_s"] if best else None
        goal_fp32, goal_peer = INT8_TARGETS.get(k, (None, None))
        met = [of_fp32 <= goal_fp32] if goal_fp32 else []
        if goal_peer and of_peer is not None:
            met.append(of_peer <= goal_peer)
        peer = f"{best['label']} {_fmt_ms(best['median_s'])} | {of_peer:.2f}" if best else "n/a | n/a"
        dh = f"{ours['dh']:.1e}" if ours.get("dh") is not None else "n/a"
        lines.append(f"| {k} | {_fmt_ms(fp32['median_s'])} | {_fmt_ms(ours['median_s'])} | "
                     f"{of_fp32:.2f} | {peer} | {goal_fp32 or 'n/a'} / {goal_peer or 'n/a'} | "
                     f"{'n/a' if not met else 'yes' if all(met) else 'no'} | {dh} |")
    if not lines:
        return []
    return ["", "### int8 (sn.quantize) against float32 and the int8 peers", "",
            "Medians of the same run; each family in its own process. The int8 peers: PyTorch's "
            "dynamic quantization (torch.ao.quantization.quantize_dynamic)"
            + (", the one that emulates this run's CPU" if _emulated() else
               ", onnxruntime's DynamicQuantizeLSTM (onnxruntime.quantization.quantize_dynamic)")
            + ". Targets: stepnet int8 "
            "/ stepnet float32, and / the fastest int8 peer; max|dh| of stepnet int8's final state "
            "from the float64 reference.", "",
            "| workload | stepnet float32 ms | stepnet int8 ms | int8 / float32 | fastest int8 peer "
            "ms | stepnet int8 / peer | targets | met | max\\|dh\\| |",
            "|---|---:|---:|---:|---|---:|---|---|---:|", *lines]


def _tolerance(rec):
    return INT8_TOLERANCE if rec["family"] in INT8_FAMILIES else TOLERANCE


def targets_section(keys, wls, recs, stepnet_gflops, ceiling):
    """stepnet's time (its first whole-workload row) over the fastest CPU
    peer's (or the named family's), against ``TARGETS``; and the GFLOP/s a
    target asks for, beside the cores' FMA peak and the GEMM ceiling."""
    import workloads

    timed = [r for r in recs if r["status"] == "ok" and r.get("median_s") is not None
             and _role(r) == "step" and r["family"] in CPU_FAMILIES]
    lines = []
    for k in keys:
        ours = next((r for r in timed if r["workload"] == k and r["family"] == "stepnet"), None)
        target, family = TARGETS.get(k, (None, None))
        if _emulated():
            family = None  # (the named family may not emulate: the emulating ones)
        peers = [r for r in timed if r["workload"] == k and r["family"] != "stepnet"
                 and (family is None or r["family"] == family) and _compared(r["family"])]
        if ours is None or not peers:
            continue
        fastest = min(peers, key=lambda r: r["median_s"])
        ratio = ours["median_s"] / fastest["median_s"]
        met = "n/a" if target is None else ("yes" if ratio <= target else "no")
        share = (f"{stepnet_gflops[k] / ceiling['gflops']:.2f}"
                 if ceiling and k in stepnet_gflops else "n/a")
        needs = peak = of_ceiling = "n/a"
        if target is not None:
            asked = workloads.flops(wls[k], "step") / (target * fastest["median_s"]) / 1e9
            needs = f"{asked:.1f}"
            if ceiling:
                peak = f"{asked / ceiling['peak']:.2f}"
                of_ceiling = f"{asked / ceiling['gflops']:.2f}"
        lines.append(f"| {k} | {_fmt_ms(ours['median_s'])} | {fastest['label']} "
                     f"{_fmt_ms(fastest['median_s'])} | {ratio:.2f} | "
                     f"{'n/a' if target is None else target} | {met} | {share} | {needs} "
                     f"| {peak} | {of_ceiling} |")
    if not lines:
        return []
    return ["", "### stepnet against the fastest peer", "",
            "Medians; stepnet's row is its first for the workload (a layer where there is one); "
            + ("the peers are PyTorch's, which run the emulated CPU's instructions as "
               "stepnet does (onnxruntime, JAX and NumPy run this CPU's). " if _emulated() else
               "the peers are the CPU ones (W6: PyTorch's, W9: JAX's). ") + "*target needs*: the "
            "workload's GFLOP/s at the target's time, and its share of the cores' FMA peak "
            "(above 0.9 no GEMM reaches it, with the gates and the memory traffic beside) "
            "and of the GEMM ceiling (near 0.9 and above, the products would have to run "
            "faster than the machine's fastest GEMM does them: a workload's gate arithmetic "
            "and memory traffic take 5-15 % of its time).", "",
            "| workload | stepnet ms | fastest peer ms | stepnet / fastest | target | met "
            "| share of ceiling | target needs GFLOP/s | of FMA peak | of ceiling |",
            "|---|---:|---|---:|---:|---|---:|---:|---:|---:|", *lines]


def _role(rec):
    """What a record times: ``"step"`` (the whole workload), or for a training
    workload ``"forward"``, ``"backward"`` or ``"inference"`` (peers.py)."""
    return rec.get("info", {}).get("role", "step")


def grad_error(g, ref):
    """Per gradient, ``max|g - ref| / max|ref|``: relative to the tensor's
    largest entry, so that entries near zero do not dominate; None where the
    gradient is missing or its shape differs."""
    import numpy as np

    err = {}
    for name, b in ref.items():
        a = g.get(name)
        if a is None or a.shape != b.shape:
            err[name] = None
            continue
        diff = float(np.max(np.abs(a - b))) if a.size else 0.0
        scale = float(np.max(np.abs(b))) if b.size else 0.0
        err[name] = diff / scale if scale > 0 else diff
    return err


def training_section(k, wl, results, disagreements, failures):
    """A training workload's gradient errors and each family's split of the
    step into its forward and its backward (the records' ``info["role"]``)."""
    import numpy as np
    import workloads

    try:
        ref = workloads.gradient_reference(wl)
    except Exception as exc:  # noqa: BLE001 - reported, never a crash
        failures.append(f"{k} float64 gradient reference: {_reason(exc)}")
        return []
    names = list(workloads.gradient_names(wl))
    layout, oracle = (("the layout of workloads.custom_weights", "workloads.custom_train")
                      if wl.kind == "custom-train" else ("PyTorch's layout", "workloads.gru_train"))
    out = [f"### {k} {wl.name}: gradients", "",
           f"Relative error of each gradient ({layout}; x: dX) = max|g - g_ref| / "
           "max|g_ref| over that tensor; the float64 reference is a NumPy forward and "
           f"backpropagation through time ({oracle}).", "",
           "| peer | compared with | " + " | ".join(names) + " | max |",
           "|---|---|" + "---:|" * (len(names) + 1)]
    recs = [r for data in results for r in data["items"]
            if r["workload"] == k and r["status"] == "ok"]
    graded = [r for r in recs if r.get("g_file")]
    torch_step = next((r for r in graded if r["family"] == "torch" and _role(r) == "step"), None)
    torch_g = dict(np.load(torch_step["g_file"])) if torch_step else None
    for r in graded:
        g = dict(np.load(r["g_file"]))
        against = [("float64 NumPy", ref)]
        if r["family"] == "stepnet" and torch_g is not None:
            against.append((torch_step["label"], torch_g))
        for what, other in against:
            err = grad_error(g, {n: other[n] for n in names})
            missing = [n for n, e in err.items() if e is None]
            if missing:
                failures.append(f"{k} {r['label']}: gradient(s) {missing} missing or shaped "
                                f"unlike {what}'s")
            worst = max((e for e in err.values() if e is not None), default=0.0)
            if worst > GRAD_TOLERANCE:
                which = max((n for n in names if err[n] is not None), key=err.get)
                disagreements.append(f"{k} {r['label']}: gradient relative error {worst:.2e} "
                                     f"({which}) vs {what}")
            cells = " | ".join("n/a" if err[n] is None else f"{err[n]:.1e}" for n in names)
            out.append(f"| {r['label']} | {what} | {cells} | {worst:.1e} |")
    if not graded:
        out.append("| (no peer gave gradients) | |" + " |" * (len(names) + 1))
    out += ["", "Split of the step (median ms, each part timed on its own):", ""]
    Y_bytes = wl.dims["T"] * wl.dims["B"] * wl.dims["H"] * wl.x.dtype.itemsize
    for data in results:
        role = {}
        for r in data["items"]:
            if r["workload"] == k and r["status"] == "ok":
                role.setdefault(_role(r), r)
        if "forward" not in role and "backward" not in role:
            continue
        name = data["family"] + (f" ({data['tag'].lstrip('_')})" if data.get("tag") else "")

        median = {what: r.get("median_s") for what, r in role.items()}  # None with --check
        fwd, bwd, step, inf = (median.get(w) for w in ("forward", "backward", "step", "inference"))
        line = f"- {name}: " + " + ".join(
            f"{what} {_fmt_ms(median[what])} ms ({role[what]['label']})" if what in role
            else f"{what} n/a" for what in ("forward", "backward"))
        if fwd and bwd:
            line += f" = {_fmt_ms(fwd + bwd)} ms"
        if step:
            line += f"; the step timed whole {_fmt_ms(step)} ms ({role['step']['label']})"
        if inf:
            line += f"; the forward without a workspace {_fmt_ms(inf)} ms"
            if fwd:
                line += f" (keeping it costs {(fwd - inf) * 1e3:+.2f} ms)"
        ws = role.get("forward", {}).get("info", {}).get("workspace_bytes")
        if ws is not None:
            line += (f"; workspace kept: {ws} bytes ({ws / 2**20:.2f} MiB, {ws / Y_bytes:.2f}x "
                     f"Y's {Y_bytes} bytes)")
        out.append(line + ".")
    out.append("")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="tiny sizes (T=5, B=4, I=8, H=16 ...), 1 round: a smoke test")
    ap.add_argument("--workloads", default=",".join(WORKLOAD_KEYS),
                    help="comma-separated, e.g. W1,W3 (default: all)")
    ap.add_argument("--peers", default=",".join(CPU_FAMILIES),
                    help=f"comma-separated from {', '.join(FAMILIES)} (default: the CPU ones)")
    ap.add_argument("--cuda", action="store_true",
                    help="also run stepnet's cuda backend and PyTorch on the GPU (cuDNN GRU, "
                    "an eager loop for the custom cell)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="timing rounds (default 7; 1 with --quick)")
    ap.add_argument("--check", action="store_true",
                    help="accuracy only: build and call every item once, no timing")
    ap.add_argument("--markdown", metavar="FILE",
                    help="also write the report to FILE; into a page with a '## Results' "
                         "section (docs/benchmarks.md) as this machine's section of it")
    ap.add_argument("--threads", type=int, default=2, help="threads per peer (default 2)")
    ap.add_argument("--stepnet-cache", default="fresh", metavar="fresh|default|DIR",
                    help="STEPNET_CACHE_DIR of the stepnet worker: a new empty dir (fresh, the "
                    "default: setup s includes compiling), the user's (default), or DIR")
    ap.add_argument("--no-compile", action="store_true",
                    help="skip the stepnet compile-time section")
    ap.add_argument("--no-quantized", action="store_true",
                    help="skip the int8 families (W1, W2, W5, W7: stepnet's sn.quantize, PyTorch's "
                         "and onnxruntime's dynamic quantization) and their section")
    ap.add_argument("--no-executor", action="store_true",
                    help="skip the executor's section (W1, W3, W5, W6, W9 on the executor)")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per child process")
    ap.add_argument("--keep", action="store_true", help="keep the workers' files and log")
    ap.add_argument("--no-openblas-auto", action="store_true",
                    help="skip the second stepnet run with OPENBLAS_CORETYPE unset (made when "
                         "the environment sets it)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--tag", help=argparse.SUPPRESS)
    ap.add_argument("--label-suffix", help=argparse.SUPPRESS)
    ap.add_argument("--outdir", help=argparse.SUPPRESS)
    ap.add_argument("--probe", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker == "ceiling":
        ceiling_main(args)
    elif args.worker == "compile-probe":
        probe_main(args)
    elif args.worker == "executor-probe":
        executor_probe_main(args)
    elif args.worker:
        worker_main(args)
    else:
        orchestrate(args)


if __name__ == "__main__":
    main()
