"""Streaming latency: ``stepnet.onnx.InferenceSession`` against onnxruntime.

    python benchmarks/onnx_streaming.py                 # the table
    python benchmarks/onnx_streaming.py --calls 500 --rounds 9 --repeats 3 --threads 2
    python benchmarks/onnx_streaming.py --stepnet-cache default

Small recurrent models called once per chunk of 512 audio samples, their state
fed back from each call to the next, as a voice-activity detector runs
(tests/onnx_models.py exports them from PyTorch, offline):

- ``vad``: shaped like Silero VAD (opset 16): ``If`` on the sample rate
  around two branches (reflect-padded STFT conv, Conv1d, an LSTM over the
  frames carrying ``[2, B, 32]``), and ``Shape``/``Gather``/``Slice``/``Pad``/
  ``Cast``/``Equal``/``Not``/``Size`` around them;
- ``stream_gru``: an STFT conv, a GRU carrying ``[1, B, 48]`` and a Linear:
  no control flow;
- ``silero``: Silero VAD's own ``silero_vad.onnx`` (opset 16, state ``[2, B, 128]``,
  chunks of 64 + 512 samples, the only length it takes), where the ``silero-vad``
  package (the ``silero`` extra) is installed; its row is left out otherwise;
- ``identity``: one ``Identity`` node, the cost of a call itself.

Each is run with one stream (batch 1, the state carried over 8 chunks that
repeat) and with 64 streams in one call. Each runtime runs in its own
subprocess (thread pools never mix), with OMP, OpenBLAS, MKL and Numba
threads and onnxruntime's intra-op threads set to ``--threads`` (default: the
cores); the two alternate ``--repeats`` times, so that a load that comes and
goes on the machine hits both. A session is made, called once (stepnet
compiles its kernels there; with ``--stepnet-cache fresh``, the default, into
an empty cache directory), warmed up, then timed: ``--rounds`` blocks of
``--calls`` calls (64 streams: a tenth as many); a block's time is its mean
per call; the table gives the median and the minimum over all blocks, and
the ratio of the medians and of the minimums. stepnet's worker also counts
the programs compiled after the first call, across both batch sizes and a
chunk of 1024 samples (the session must not compile again when only the
batch or the sequence length changes), and the functions compiled after
the first batch size's calls (programs and fused elementwise loops: a
session makes a key's loops after a call of it and, this worker not being
tiered, compiles each at its first use; docs/onnx.md). Printed: a markdown
table with the ratios and the targets, and the CPU (lscpu's model name).
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
MODELS = ("vad", "stream_gru", "silero", "identity")
STATE = {"vad": "state", "stream_gru": "h", "silero": "state"}  # the state input of each model
STATE_OUT = {"vad": 1, "stream_gru": 1, "silero": 1}  # ... and the output that feeds it
BATCHES = (1, 64)
CHUNKS = 8  # distinct chunks per stream, repeated
TARGETS = {1: "< 1", 64: "<= 0.7"}  # stepnet / onnxruntime: one stream faster, many far faster


# ----------------------------------------------------------------------------
# the parent: models and feeds, then one worker per runtime


def export_models(directory: Path):
    """Each model as ``<name>.onnx`` and its feeds per batch as
    ``<name>_<batch>.npz`` (the chunks stacked on a first axis)."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper

    sys.path.insert(0, str(ROOT / "tests"))
    import onnx_models

    for name in ("vad", "stream_gru"):
        ex = onnx_models.BUILDERS[name]()
        onnx.save(ex.model, str(directory / f"{name}.onnx"))
        for batch in BATCHES:
            chunks = [ex.feeds(batch=batch, seed=i) for i in range(CHUNKS)]
            np.savez(directory / f"{name}_{batch}.npz",
                     **{k: np.stack([c[k] for c in chunks]) for k in chunks[0]})
        longer = ex.feeds(batch=3, samples=1024, seed=99)  # for the compile count
        np.savez(directory / f"{name}_long.npz", **{k: v[None] for k, v in longer.items()})
    silero = _silero_model()
    if silero is not None:
        shutil.copyfile(silero, directory / "silero.onnx")
        r = np.random.default_rng(0)

        def chunk(batch, samples):
            return {"input": (0.3 * r.standard_normal((batch, 64 + samples))).astype(np.float32),
                    "state": np.zeros((2, batch, 128), np.float32), "sr": np.array(16000, np.int64)}

        for batch in BATCHES:
            chunks = [chunk(batch, 512) for _ in range(CHUNKS)]
            np.savez(directory / f"silero_{batch}.npz",
                     **{k: np.stack([c[k] for c in chunks]) for k in chunks[0]})
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "identity",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 512])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", 512])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(directory / "identity.onnx"))
    for batch in BATCHES:
        x = np.random.default_rng(0).standard_normal((CHUNKS, batch, 512)).astype(np.float32)
        np.savez(directory / f"identity_{batch}.npz", x=x)


def _silero_model():
    """``silero_vad.onnx`` of the installed ``silero-vad`` package, found
    without importing it (it imports torchaudio), or None."""
    import importlib.util

    spec = importlib.util.find_spec("silero_vad")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "silero_vad.onnx"
    return path if path.exists() else None


def run_worker(family, directory, args):
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
        env[var] = str(args.threads)
    cache = None
    if family == "stepnet" and args.stepnet_cache == "fresh":
        cache = tempfile.mkdtemp(prefix="stepnet-cache-")
        env["STEPNET_CACHE_DIR"] = cache
    env["STEPNET_TIERED"] = "0"  # time the compiled kernels, never the interpreter tier
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", family, "--dir",
           str(directory), "--calls", str(args.calls), "--rounds", str(args.rounds),
           "--threads", str(args.threads)]
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    finally:
        if cache:
            shutil.rmtree(cache, ignore_errors=True)
    if done.returncode != 0:
        raise RuntimeError(f"{family} worker failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------
# a worker: one runtime, every model and batch


def _session(family, path, threads):
    if family == "onnxruntime":
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    from stepnet.onnx import InferenceSession

    return InferenceSession(path)


def _stream(session, name, chunks):
    """``call()``: one call on the next chunk, the state carried."""
    import numpy as np

    n = len(next(iter(chunks.values())))
    position = [0]
    state = {STATE[name]: chunks[STATE[name]][0]} if name in STATE else {}

    def call():
        i = position[0] % n
        position[0] += 1
        feeds = {k: np.asarray(v[i]) for k, v in chunks.items()}
        feeds.update(state)
        outs = session.run(None, feeds)
        if name in STATE:
            state[STATE[name]] = outs[STATE_OUT[name]]
        return outs

    assert all(isinstance(o, np.ndarray) for o in call())
    return call


def _time(call, calls, rounds):
    for _ in range(max(calls // 4, 20)):  # warm up
        call()
    blocks = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        blocks.append((time.perf_counter() - start) / calls * 1e6)
    return blocks


def worker(family, directory, calls, rounds, threads):
    import numpy as np

    directory = Path(directory)
    counter, kernels = None, lambda: 0
    if family == "stepnet":
        from stepnet.backends import _module
        from stepnet.jit.loading import _MODULES

        def kernels():  # the functions of stepnet's generated modules compiled so far
            return sum(len(getattr(m, f).signatures) for m in list(_MODULES.values())
                       for f in ("program", "fused") if hasattr(m, f))

        module = _module("numba")
        original = module.compile_program
        counter = [0]

        def counting(program):
            counter[0] += 1
            return original(program)

        module.compile_program = counting
    results = {"items": [], "compiles_after_first_call": {}, "kernels_after_first_batch": {}}
    for name in MODELS:
        if not (directory / f"{name}.onnx").exists():
            continue
        start = time.perf_counter()
        session = _session(family, str(directory / f"{name}.onnx"), threads)
        made = time.perf_counter() - start
        first = None
        compiled_before = None
        for batch in BATCHES:
            chunks = dict(np.load(directory / f"{name}_{batch}.npz"))
            start = time.perf_counter()
            call = _stream(session, name, chunks)
            if first is None:
                first = time.perf_counter() - start
                compiled_before = counter[0] if counter else 0
            blocks = _time(call, calls if batch == 1 else max(calls // 10, 10), rounds)
            if batch == BATCHES[0]:
                kernels_before = kernels()
            results["items"].append({"model": name, "batch": batch, "blocks_us": blocks,
                                     "session_s": made, "first_call_s": first})
        long = directory / f"{name}_long.npz"
        if long.exists():
            _stream(session, name, dict(np.load(long)))
        if counter is not None:
            results["compiles_after_first_call"][name] = counter[0] - compiled_before
            results["kernels_after_first_batch"][name] = kernels() - kernels_before
    print(json.dumps(results))


# ----------------------------------------------------------------------------
# the report


def _merged(runs):
    """One worker's results over repeats: every block of an item together."""
    items = {}
    for run in runs:
        for r in run["items"]:
            item = items.setdefault((r["model"], r["batch"]), dict(r, blocks_us=[]))
            item["blocks_us"] += r["blocks_us"]
    for item in items.values():
        item["median_us"] = statistics.median(item["blocks_us"])
        item["min_us"] = min(item["blocks_us"])
    compiles = {}
    for run in runs:
        for what in ("compiles_after_first_call", "kernels_after_first_batch"):
            for name, n in run.get(what, {}).items():
                compiles[what, name] = compiles.get((what, name), 0) + n
    return items, compiles


def report(ours, theirs, args):
    ours, compiles = _merged(ours)
    theirs, _ = _merged(theirs)
    lines = [f"CPU: {cpu_name()}; threads: {args.threads}; {args.repeats} x {args.rounds} rounds "
             f"of {args.calls} calls (64 streams: a tenth); microseconds per call, median (min) "
             "over rounds",
             "",
             "| model | streams per call | onnxruntime | stepnet | stepnet / onnxruntime, "
             "median (min) | target |",
             "|---|---|---|---|---|---|"]
    for key, r in ours.items():
        t = theirs[key]
        target = TARGETS[r["batch"]] if r["model"] != "identity" else ""
        lines.append(f"| {r['model']} | {r['batch']} | {t['median_us']:.1f} ({t['min_us']:.1f}) | "
                     f"{r['median_us']:.1f} ({r['min_us']:.1f}) | "
                     f"{r['median_us'] / t['median_us']:.2f} ({r['min_us'] / t['min_us']:.2f}) | "
                     f"{target} |")
    lines.append("")
    for (name, batch), r in ours.items():
        if batch == BATCHES[0]:
            lines.append(f"stepnet {name}: session made in {r['session_s']:.2f} s, first call "
                         f"{r['first_call_s']:.2f} s (compiles); programs compiled after it "
                         f"(batch 1, 64, 1024 samples where it takes them), over {args.repeats} "
                         "processes: "
                         f"{compiles.get(('compiles_after_first_call', name), 0)}; functions "
                         "compiled after the calls of batch 1 (programs, fused loops): "
                         f"{compiles.get(('kernels_after_first_batch', name), 0)}")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2,
                        help="each runtime's worker runs this many times, alternating")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--stepnet-cache", choices=("fresh", "default"), default="fresh",
                        help="fresh: an empty kernel cache (kernels compiled in the worker)")
    parser.add_argument("--worker", choices=("stepnet", "onnxruntime"), help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.dir, args.calls, args.rounds, args.threads)
        return
    with tempfile.TemporaryDirectory(prefix="onnx-streaming-") as directory:
        directory = Path(directory)
        export_models(directory)
        theirs, ours = [], []
        for _ in range(args.repeats):
            theirs.append(run_worker("onnxruntime", directory, args))
            ours.append(run_worker("stepnet", directory, args))
    print(report(ours, theirs, args))


if __name__ == "__main__":
    main()
