"""The ``stepnet`` command: run, check and benchmark YAML networks.

    stepnet run examples/hierarchical.yaml            # random data of the declared shapes
    stepnet run model.yaml --input data.npz --output out.npz --backend interpreter
    stepnet check model.yaml                          # validate, print the IR
    stepnet bench model.yaml --repeat 20              # compile time, median run time
    stepnet export model.yaml -o model.onnx           # an ONNX model onnxruntime runs
    stepnet run model.yaml --input big.npz --cluster local:2       # on 2 Dask workers
    stepnet run model.yaml --input shards/ --output out/ --cluster tcp://host:8786

Data files are ``.npz``: an input ``x`` with a LoD is the array ``x`` (its data
rows) plus ``x.lod.0``, ``x.lod.1``, ... (offsets, coarsest level first) or
``x.lengths.0``, ...; a ``lod_level: 0`` input is the array alone. ``--output``
writes the outputs the same way. An ``--input`` directory of ``.npz`` shards
is run one shard at a time (one in memory at once), and ``--output`` is then a
directory of one output file per shard, named as the shard. With
``--cluster`` the batch is split by top-level sequences across Dask workers
(docs/distributed.md), and the workers read the shards of a directory
themselves. See docs/yaml.md and docs/onnx-export.md.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from . import sizes
from .errors import Error, StepNetError
from .lod import LoDTensor
from .npz import load_npz, save_npz, shard_files, shard_output_path


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except Error as exc:
        print(f"stepnet: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("stepnet: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went (stepnet check m.yaml | head): no more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (Python's flush at exit)
        return 141
    except Exception as exc:  # noqa: BLE001  (never a traceback, unless asked for)
        if getattr(args, "debug", False):
            raise
        what = "out of memory" if isinstance(exc, MemoryError) else type(exc).__name__
        print(f"stepnet: error: {what}: {exc} (--debug shows where)", file=sys.stderr)
        return 1


def _seed(text):
    """A seed as argparse reads it: a whole number from 0."""
    try:
        seed = int(text)
    except ValueError:
        seed = -1
    if seed < 0:
        raise argparse.ArgumentTypeError(f"expects a whole number >= 0, got {text!r}")
    return seed


def _model_args(p, quantize=True):
    """The arguments of every command that reads a network file (``--quantize``
    where a quantized model can go: not to ONNX)."""
    p.add_argument("model", metavar="MODEL.yaml", help="the network file")
    p.add_argument("--params", metavar="PARAMS.npz",
                   help="parameter values by name (override the file's initializers)")
    p.add_argument("--seed", type=_seed, default=0,
                   help="seed of the parameter initializers and of random data (default 0)")
    p.add_argument("--debug", action="store_true",
                   help="on an unexpected error, show Python's traceback (else one line)")
    if quantize:
        p.add_argument("--quantize", choices=("int8", "bf16"), default=None,
                       help="run the network's products by weights in int8 or bf16 "
                            "(docs/quantization.md; the file's quantize: key does the same)")


def _data_args(p):
    """The arguments of every command that runs a network on data."""
    p.add_argument("--input", metavar="DATA.npz",
                   help="input data (default: random data of the declared shapes and a random "
                        "LoD); for run also a directory of .npz shards, run one at a time")
    p.add_argument("--backend", default=None,
                   help=f"{_backend_names()} (default: numba when available)")
    p.add_argument("--sequences", type=int, default=4, metavar="N",
                   help="random data: number of top-level sequences (default 4)")
    p.add_argument("--max-length", type=int, default=6, metavar="L",
                   help="random data: longest sequence at each LoD level (default 6)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress line on stderr")


def _parser():
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="stepnet",
        description="Run, check and benchmark recurrent step-nets defined in YAML (docs/yaml.md).",
    )
    parser.add_argument("--version", action="version", version=f"stepnet {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    run = sub.add_parser("run", help="run a network and print a summary of its outputs",
                         description="Run a YAML network once and print its outputs' shapes, LoD "
                                     "and a summary of their values.")
    _model_args(run)
    _data_args(run)
    run.add_argument("--output", "-o", metavar="OUT.npz",
                     help="write the outputs to an .npz file (a directory of them for a directory "
                          "of shards)")
    run.add_argument("--cluster", metavar="local:N|tcp://HOST:PORT",
                     help="run on Dask workers: a new local cluster of N processes, or a scheduler")
    run.add_argument("--partitions", type=int, default=None, metavar="P",
                     help="with --cluster and one batch: pieces of the batch (default: one per worker)")
    run.set_defaults(func=cmd_run)

    compile_ = sub.add_parser(
        "compile", help="compile a network's kernels into the cache ahead of use",
        description="Compile a YAML network's Numba kernels into STEPNET_CACHE_DIR (for a "
                    "deployment or CI), running it once on random inputs of its declared kinds "
                    "(or --input); a later process loads them at its first call.")
    _model_args(compile_)
    _data_args(compile_)
    compile_.set_defaults(func=cmd_compile)

    check = sub.add_parser("check", help="validate a network and print its IR",
                           description="Load a YAML network, validate it and print its IR.")
    _model_args(check)
    check.set_defaults(func=cmd_check)

    bench = sub.add_parser("bench", help="time compilation and runs",
                           description="Time the first call (compilation included) and the median "
                                       "of repeated runs.")
    _model_args(bench)
    _data_args(bench)
    bench.add_argument("--repeat", type=int, default=10, metavar="N",
                       help="timed runs after the first call (default 10)")
    bench.set_defaults(func=cmd_bench)

    export = sub.add_parser("export", help="write a network as an ONNX model",
                            description="Write a YAML network (its layers, then its nets, nested nets "
                                        "included) as one ONNX model (opset 17) that onnxruntime "
                                        "runs; see docs/onnx-export.md.")
    _model_args(export, quantize=False)  # (a quantized model has no ONNX form yet)
    export.add_argument("--output", "-o", required=True, metavar="MODEL.onnx",
                        help="the ONNX file to write")
    export.add_argument("--scan", action="store_true",
                        help="built-in layers as Scan nodes, not ONNX GRU/LSTM/RNN nodes")
    export.set_defaults(func=cmd_export)

    info = sub.add_parser("info", help="print the versions, the BLAS and the threads in use",
                          description="Print stepnet's and Numba's versions, the cache directory, "
                                      "the backends, the BLAS the Numba backend calls (chosen by "
                                      "measurement unless STEPNET_BLAS names one, with the "
                                      "figures), the number of threads and what the compile "
                                      "worker is compiling.")
    info.add_argument("--measure", action="store_true",
                      help="measure the BLAS choice and stepnet's own loop again (they are kept "
                           "in the cache directory) and print what changed")
    info.set_defaults(func=cmd_info)
    return parser


# ----------------------------------------------------------------------------
# commands


# the measurements `stepnet info --measure` takes again (blas_choice keeps them)
MEASUREMENTS = ("blas.json", "small_products.json", "small_products_float64.json",
                "transposed_products.json")


def cmd_info(args) -> int:
    import numba

    from . import __version__
    from .backends import backends
    from . import info
    from .jit import compile_worker
    from .jit.cache import cache_dir

    if args.measure:
        return _measure_again(cache_dir())
    print(f"stepnet {__version__}, numba {numba.__version__}, numpy {np.__version__}")
    print(f"cache: {cache_dir()}")
    print(f"backends: {', '.join(backends())}")
    print(info.describe())
    print(f"threads: {numba.get_num_threads()} (sequence groups run in parallel; "
          "NUMBA_NUM_THREADS or numba.set_num_threads changes it)")
    print(_compiling(compile_worker.status(cache_dir())))
    return 0


def _measure_again(cache) -> int:
    """``stepnet info --measure``: this process's measurements (kept in
    ``cache``), removed and taken again by a new process (the BLAS is chosen
    when stepnet is imported), whose ``stepnet info`` is printed, then what
    changed."""
    import difflib

    from . import info

    before = info.describe().splitlines()
    for name in MEASUREMENTS:
        (cache / name).unlink(missing_ok=True)
    child = subprocess.run(
        [sys.executable, "-c", "from stepnet import info; print(info.describe())"],
        capture_output=True, text=True, check=False)
    if child.returncode != 0:
        sys.stderr.write(child.stderr)
        return child.returncode
    sys.stdout.write(child.stdout)
    after = child.stdout.splitlines()
    changed = [line for line in difflib.unified_diff(before, after, "before", "measured again",
                                                     n=0, lineterm="")
               if not line.startswith(("---", "+++", "@@"))]
    print("changed by measuring again:" if changed else "measured again: nothing changed")
    for line in changed:
        print(f"  {line}")
    return 0


def _compiling(found) -> str:
    """The compile worker's line of ``stepnet info``."""
    if found is None:
        return "compile worker: none running"
    from .jit.compile_worker import PACKAGE_FOLDER

    lines = [f"compile worker: process {found['pid']}, "
             + ("compiling " + found["compiling"]["what"] if found["compiling"] else "idle")]
    if found.get("stepnet", PACKAGE_FOLDER) != PACKAGE_FOLDER:  # (it refuses our kernels)
        lines.append(f"  it runs the stepnet in {found['stepnet']}, not this one's "
                     f"({PACKAGE_FOLDER}): this process compiles its own kernels")
    lines += [f"  queued: {item['what']}" for item in found["queued"]]
    return "\n".join(lines)


def cmd_compile(args) -> int:
    from .backends import compile_ahead
    from .jit.cache import cache_dir

    model = _load(args)
    feeds = _feeds(model, args)
    start = time.perf_counter()
    with Progress(enabled=not args.quiet) as progress:
        progress.stage("compiling the kernels")
        new = compile_ahead(model, feeds, backend=args.backend or "numba")
    print(f"compiled {new} new kernel{'s' * (new != 1)} of {args.model} into {cache_dir()} "
          f"in {_seconds(time.perf_counter() - start)}")
    return 0


def cmd_check(args) -> int:
    model = _load(args)
    print(f"{args.model}: ok")
    _print_model(model)
    print()
    print(model.ir())
    return 0


def cmd_run(args) -> int:
    from .backends import default_backend

    if args.partitions is not None:
        if not args.cluster:
            raise Error("--partitions cuts the batch among --cluster's workers: give --cluster too")
        if args.partitions < 1:
            raise Error("--partitions must be at least 1")
        if args.input and Path(args.input).is_dir():
            raise Error(f"--partitions cuts one batch; --input {args.input!r} is a directory of "
                        "shards, each one piece")
    shards = bool(args.input and Path(args.input).is_dir())
    if args.output and not shards and (Path(args.output).is_dir() or args.output.endswith("/")):
        raise Error(f"--output {args.output!r} is a directory; one batch's outputs go to one "
                    f"file: give its name (such as {str(Path(args.output) / 'outputs.npz')!r})")
    if args.output and not shards:
        _writable_folder(Path(args.output).parent, args.output)
    model = _load(args)
    backend = args.backend or default_backend()
    if args.cluster:
        return _run_on_cluster(model, args, backend)
    if shards:
        return _run_shards(model, args, backend)
    feeds = _feeds(model, args)
    with Progress(enabled=not args.quiet) as progress:
        start = time.perf_counter()
        outputs = model(feeds, backend=backend, progress=progress.stage)
        seconds = time.perf_counter() - start
    print(f"model    {args.model} ({model.name})")
    print(f"backend  {backend}")
    return _report(args, feeds, outputs, f"{_seconds(seconds)} (one call; {_answered_by(backend)})")


def _answered_by(backend) -> str:
    """Which tier answered this process's one call on ``backend``: the
    schedule executor or the interpreter where a kernel it met is still
    compiling after it, else the compiled kernels (compiled in the call
    where not tiered)."""
    from .backends import backend as backend_info, first_tiers, kernels_ready

    if not backend_info(backend).compiles:
        return f"on the {backend} backend"
    if not kernels_ready():
        tiers = " and the ".join(sorted(first_tiers())) or "first tier"
        return (f"answered on the {tiers} while new kernels compile in the background: "
                "a later run uses them")
    return "answered by the compiled kernels (their compile included where new and not tiered)"


def _report(args, feeds, outputs, time_line) -> int:
    """The inputs, outputs and time of a run, and ``--output`` written."""
    print("inputs")
    _print_values(feeds)
    print("outputs")
    _print_values(outputs, summary=True)
    print(f"time     {time_line}")
    if args.output:
        print(f"wrote    {save_npz(args.output, outputs)}")
    return 0


def _run_shards(model, args, backend) -> int:
    """Every ``.npz`` shard of the ``--input`` directory, one at a time in this
    process: read it, run it, write its outputs (``--output DIR/<shard
    name>``, as the workers of ``--cluster`` name them), let it go."""
    files = shard_files(args.input)
    out_dir = Path(args.output) if args.output else None
    if out_dir is not None:
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise Error(f"--output {args.output!r} must be a directory for a directory of shards: "
                        f"{exc.strerror or exc}") from None
    print(f"model    {args.model} ({model.name})")
    print(f"backend  {backend}, one shard at a time in this process")
    warned = set()
    total = 0
    start = time.perf_counter()
    with Progress(enabled=not args.quiet) as progress:
        for i, path in enumerate(files, 1):
            where = f"shard {i}/{len(files)} {path.name}: "
            progress.stage(where + "reading", log=False)
            feeds = load_npz(path, model, warn=lambda text: _warn_once(text, warned))
            shard_start = time.perf_counter()
            outputs = model(feeds, backend=backend,
                            progress=lambda text, where=where: progress.stage(where + text))
            shard_seconds = time.perf_counter() - shard_start
            rows = _rows(feeds)
            total += rows
            line = f"shard    {path}: {rows} rows, {_seconds(shard_seconds)}"
            if out_dir is not None:
                target = shard_output_path(out_dir, path)
                save_npz(target, outputs)
                line += f" -> {target}"
            progress.write(line)
            del feeds, outputs  # one shard in memory at a time
    seconds = time.perf_counter() - start
    print(f"time     {_seconds(seconds)} for {len(files)} shard(s); {total / seconds:,.0f} rows/s")
    if out_dir is not None:
        print(f"wrote    {out_dir}/ (one .npz per shard)")
    else:
        print("wrote    nothing (give --output DIR to keep one .npz of outputs per shard)")
    return 0


def _run_on_cluster(model, args, backend) -> int:
    from . import distributed

    client = distributed.connect(args.cluster)
    try:
        workers = len(client.scheduler_info()["workers"])
        print(f"model    {args.model} ({model.name})")
        print(f"backend  {backend}, on {workers} Dask worker(s) ({args.cluster})")
        start = time.perf_counter()
        if args.input and Path(args.input).is_dir():
            total = 0
            for path, tokens, _ in distributed.run_shards(model, args.input, client,
                                                          out_dir=args.output, backend=backend):
                total += tokens
                print(f"shard    {path}: {tokens} rows")
            seconds = time.perf_counter() - start
            print(f"time     {_seconds(seconds)}; {total / seconds:,.0f} rows/s")
            if args.output:
                print(f"wrote    {args.output}/ (one .npz per shard)")
            return 0
        feeds = _feeds(model, args)
        outputs = distributed.run(model, feeds, client=client, partitions=args.partitions,
                                  backend=backend)
        seconds = time.perf_counter() - start
    finally:
        client.close()
    return _report(args, feeds, outputs, f"{_seconds(seconds)} (one call, spread over the workers)")


def cmd_bench(args) -> int:
    from .backends import default_backend, first_tiers, kernels_ready, wait_for_kernels

    if args.repeat < 1:
        raise Error("--repeat must be at least 1")
    model = _load(args)
    feeds = _feeds(model, args)
    backend = args.backend or default_backend()
    times = []
    with Progress(enabled=not args.quiet) as progress:
        start = time.perf_counter()
        model(feeds, backend=backend, progress=lambda text: progress.stage(f"first call: {text}"))
        first_s = time.perf_counter() - start
        first = first_tiers()
        tiered = not kernels_ready()
        if tiered:  # a new kernel's first calls answer on the first tier
            progress.stage("waiting for the compiled kernels")
            wait_for_kernels()
        ready = time.perf_counter() - start
        progress.stage(f"timing {args.repeat} runs")
        for i in range(args.repeat):
            where = f"timing run {i + 1}/{args.repeat}: "
            start = time.perf_counter()
            model(feeds, backend=backend,
                  progress=lambda text, where=where: progress.stage(where + text, log=False))
            times.append(time.perf_counter() - start)
    median = statistics.median(times)
    rows = _rows(feeds)
    print(f"model    {args.model} ({model.name})")
    print(f"backend  {backend}")
    print("inputs")
    _print_values(feeds)
    if tiered:  # the first call's time says nothing of compiling
        print(f"compile  {_seconds(ready)} from the start to the compiled kernels; the first call "
              f"({_seconds(first_s)}) answered on the {' and the '.join(sorted(first)) or 'first tier'}"
              " meanwhile (STEPNET_TIERED=0: wait for them)")
    else:
        print(f"compile  {_compile_line(backend, first_s, median)}")
    print(f"run      median {_seconds(median)} over {args.repeat} runs "
          f"(min {_seconds(min(times))}, max {_seconds(max(times))}); "
          f"{rows / median:,.0f} rows/s")
    return 0


def _compile_line(backend, first, median) -> str:
    """What the first call's extra time says about compiling (never a negative figure)."""
    from .backends import backend as backend_info

    if not backend_info(backend).compiles:
        return f"none (the {backend} compiles nothing; first call {_seconds(first)})"
    extra = first - median
    if extra <= 0:
        return (f"none measured (first call {_seconds(first)}, no slower than the median run: "
                "the kernels were already compiled)")
    return (f"{_seconds(extra)} (first call {_seconds(first)} minus the median run; kernels "
            "cached on disk load faster than they compile)")


def _writable_folder(folder, output):
    """Refuse ``--output`` before the run where its folder cannot take it."""
    if not folder.is_dir():
        raise Error(f"--output {output!r}: no folder {str(folder)!r} to write it in")
    if not os.access(folder, os.W_OK):
        raise Error(f"--output {output!r}: the folder {str(folder)!r} is not writable")


def cmd_export(args) -> int:
    from .onnx.export import export

    model = _load(args)
    onnx_model = export(model, args.output, as_scan=args.scan)
    print(f"model    {args.model} ({model.name})")
    print("inputs")
    _print_value_infos(onnx_model.graph.input)
    print("outputs")
    _print_value_infos(onnx_model.graph.output)
    ops = sorted({node.op_type for node in onnx_model.graph.node})
    print(f"nodes    {len(onnx_model.graph.node)} ({', '.join(ops)}), opset "
          f"{onnx_model.opset_import[0].version}")
    print(f"wrote    {args.output}")
    return 0


# ----------------------------------------------------------------------------
# helpers


def _print_value_infos(values):
    from .onnx.export_graph import _onnx

    to_dtype = _onnx().helper.tensor_dtype_to_np_dtype
    width = max((len(v.name) for v in values), default=0)
    for value in values:
        tensor = value.type.tensor_type
        dims = []
        for dim in tensor.shape.dim:
            if dim.dim_param:
                dims.append(dim.dim_param)
            else:
                dims.append(str(dim.dim_value) if dim.HasField("dim_value") else "?")
        print(f"  {value.name:<{width}}  {to_dtype(tensor.elem_type)} [{', '.join(dims)}]")


def _load(args):
    from .yaml import load_yaml

    model = load_yaml(args.model, params=args.params, seed=args.seed)
    asked = getattr(args, "quantize", None)
    if asked and asked != model.quantized:
        if model.quantized:
            raise StepNetError(f"--quantize {asked}: {args.model} says quantize: "
                               f"{model.quantized}; give one of them")
        from .quantize import quantize

        model = quantize(model, asked)
    return model


def _feeds(model, args):
    if args.input:
        if Path(args.input).is_dir():
            raise Error(f"--input {args.input!r} is a directory; `stepnet run` runs a directory of "
                        f".npz shards, `stepnet {args.command}` reads one .npz file")
        return load_npz(args.input, model, warn=_warn)
    if args.sequences < 1 or args.max_length < 1:
        raise Error("--sequences and --max-length must be at least 1")
    for name, spec in model.inputs.items():  # (drawn as float64, at most this many rows)
        rows = args.sequences * args.max_length ** spec.lod_level
        sizes.check(f"{args.model}: random input {name!r} of up to", (rows, *spec.shape),
                    np.float64)
    return model.random_feeds(seed=args.seed, num_sequences=args.sequences,
                              max_length=args.max_length)


def _backend_names() -> str:
    """stepnet's backends as a phrase: ``"interpreter, numba or cuda"``."""
    from .backends import BACKENDS

    names = list(BACKENDS)
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def _warn(text):
    print(f"stepnet: warning: {text}", file=sys.stderr)


def _warn_once(text, seen):
    if text not in seen:
        seen.add(text)
        _warn(text)


def _rows(feeds) -> int:
    """Data rows of the LoD inputs (tokens)."""
    return sum(v.data.shape[0] for v in feeds.values() if isinstance(v, LoDTensor))


def _print_model(model):
    print("inputs")
    for name, spec in model.inputs.items():
        print(f"  {name:<20} {spec.dtype} rows of {list(spec.shape)}, lod_level {spec.lod_level}")
    print("parameters")
    for name, p in model.parameters.items():
        print(f"  {name:<20} {p.dtype} {list(p.shape)}")
    print("outputs")
    for name in model.outputs:
        print(f"  {name}")


def _print_values(values, summary=False):
    width = max((len(n) for n in values), default=0)
    for name, value in values.items():
        if isinstance(value, LoDTensor):
            print(f"  {name:<{width}}  LoDTensor {value.dtype} {list(value.shape)}  "
                  f"lod {_short_lod(value.lod)}")
            data = value.data
        else:
            data = np.asarray(value)
            print(f"  {name:<{width}}  ndarray   {data.dtype} {list(data.shape)}")
        if summary:
            print(f"  {'':<{width}}  {_value_summary(data)}")


def _value_summary(data, first=4) -> str:
    """min / mean / max of the finite values, NaN and inf counted, and the first
    few values in row-major order."""
    flat = np.asarray(data).ravel()
    if flat.size == 0:
        return "no values"
    if flat.dtype.kind == "b":
        flat = flat.astype(np.int8)
    parts = []
    finite = flat
    if flat.dtype.kind in "fc":
        is_finite = np.isfinite(flat)
        finite = flat[is_finite]
        nan = int(np.isnan(flat).sum())
        inf = int(flat.size - is_finite.sum()) - nan
    else:
        nan = inf = 0
    if finite.size:
        parts.append(f"min {_number(finite.min())}  mean {_number(finite.mean(dtype=np.float64))}  "
                     f"max {_number(finite.max())}")
    if nan:
        parts.append(f"{nan} NaN")
    if inf:
        parts.append(f"{inf} inf")
    head = ", ".join(_number(x) for x in flat[:first]) + (", ..." if flat.size > first else "")
    parts.append(f"first [{head}]")
    return "  ".join(parts)


def _number(x) -> str:
    return f"{x.item() if isinstance(x, np.generic) else x:.4g}"


def _short_lod(lod, limit=10):
    levels = []
    for level in lod:
        if len(level) > limit:
            level = [str(x) for x in level[:limit - 2]] + ["...", str(level[-1])]
        levels.append("[" + ", ".join(map(str, level)) + "]")
    return "[" + ", ".join(levels) + "]"


def _seconds(s) -> str:
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} us"


class Progress:
    """What the command is doing, on stderr, while it works.

    ``stage(text)`` names the work under way (``"compiling net 'enc' (1/2)"``).
    On a terminal one live line shows it with the time so far, e.g.
    ``stepnet: compiling net 'enc' (1/2) ... 3.4 s``: a tqdm bar of text only,
    redrawn every ``interval`` seconds by a daemon thread (a compile holds the
    main thread for many seconds, mostly in Numba and LLVM, which let that
    thread run), shown once the work has taken ``delay`` seconds and erased at
    the end. Elsewhere (a file, a pipe, a CI log) each stage is one plain line
    with the time it started, and the end one more. ``enabled=False``
    (``--quiet``) prints nothing.

    >>> with Progress() as progress:                        # doctest: +SKIP
    ...     progress.stage("compiling net 'gru' (1/1)")
    """

    def __init__(self, enabled=True, stream=None, interval=0.25, delay=0.5):
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.interval = interval
        self.delay = delay
        self.text = "starting"
        self._start = None
        self._stop = threading.Event()
        self._thread = None
        self._bar = None
        self._logged = None

    def stage(self, text, log=True):
        """The work now under way; ``log=False`` shows it on a terminal only
        (no plain line: for the many repeats of one logged stage)."""
        self.text = text
        if self.enabled and log and not self._tty() and self._start is not None:
            if text != self._logged:
                self._line(f"stepnet: {text} (at {self._elapsed():.1f} s)")
                self._logged = text

    def write(self, line):
        """Print ``line`` on stdout without tearing the live line."""
        if self._bar is not None:
            from tqdm import tqdm

            self._bar.set_description_str(self._live_text(), refresh=False)  # redrawn below it
            tqdm.write(line, file=sys.stdout)
        else:
            print(line)

    def __enter__(self):
        self._start = time.perf_counter()
        if self.enabled and self._tty():
            self._thread = threading.Thread(target=self._loop, name="stepnet-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, kind, exc, tb):
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            if self._bar is not None:
                self._bar.close()  # leave=False: the line is erased
        elif self.enabled and self._logged is not None and kind is None:
            self._line(f"stepnet: done (at {self._elapsed():.1f} s)")
        return False

    def _elapsed(self):
        return time.perf_counter() - self._start

    def _tty(self):
        isatty = getattr(self.stream, "isatty", None)
        return bool(isatty and isatty())

    def _line(self, text):
        self.stream.write(text + "\n")
        self.stream.flush()

    def _loop(self):
        while not self._stop.wait(self.interval):
            elapsed = self._elapsed()
            if elapsed < self.delay:
                continue
            width = self._width()
            if self._bar is None:
                from tqdm import tqdm

                # the size is ours to give: a terminal that reports 0 x 0 (a
                # pseudo-terminal of `script`) would make tqdm print nothing
                self._bar = tqdm(file=self.stream, bar_format="{desc}", leave=False,
                                 ncols=width, nrows=24)
            self._bar.ncols = width  # follows a resized terminal
            self._bar.set_description_str(self._live_text())

    def _live_text(self):
        return f"stepnet: {self.text} ... {self._elapsed():.1f} s"

    def _width(self) -> int:
        """The terminal's width (``COLUMNS`` or 80 where it reports none)."""
        try:
            columns = os.get_terminal_size(self.stream.fileno()).columns
        except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
            columns = 0
        return columns if columns > 0 else shutil.get_terminal_size((80, 24)).columns


if __name__ == "__main__":
    sys.exit(main())
