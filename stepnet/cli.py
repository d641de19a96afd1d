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
writes the outputs the same way. With ``--cluster`` the batch is split by
top-level sequences across Dask workers (docs/distributed.md); an ``--input``
directory of ``.npz`` shards is read shard by shard by the workers, and
``--output`` is then a directory of one output file per shard. See
docs/yaml.md and docs/onnx-export.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time

import numpy as np

from .errors import Error
from .lod import LoDTensor


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


def _parser():
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="stepnet",
        description="Run, check and benchmark recurrent step-nets defined in YAML (docs/yaml.md).",
    )
    parser.add_argument("--version", action="version", version=f"stepnet {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def model_args(p):
        p.add_argument("model", metavar="MODEL.yaml", help="the network file")
        p.add_argument("--params", metavar="PARAMS.npz",
                       help="parameter values by name (override the file's initializers)")
        p.add_argument("--seed", type=int, default=0,
                       help="seed of the parameter initializers and of random data (default 0)")

    def data_args(p):
        p.add_argument("--input", metavar="DATA.npz",
                       help="input data (default: random data of the declared shapes and a random LoD)")
        p.add_argument("--backend", default=None,
                       help="interpreter or numba (default: numba when available)")
        p.add_argument("--sequences", type=int, default=4, metavar="N",
                       help="random data: number of top-level sequences (default 4)")
        p.add_argument("--max-length", type=int, default=6, metavar="L",
                       help="random data: longest sequence at each LoD level (default 6)")
        p.add_argument("--quiet", "-q", action="store_true", help="no progress line on stderr")

    run = sub.add_parser("run", help="run a network and print a summary of its outputs",
                         description="Run a YAML network once and print its outputs' shapes and LoD.")
    model_args(run)
    data_args(run)
    run.add_argument("--output", "-o", metavar="OUT.npz", help="write the outputs to an .npz file")
    run.add_argument("--cluster", metavar="local:N|tcp://HOST:PORT",
                     help="run on Dask workers: a new local cluster of N processes, or a scheduler")
    run.add_argument("--partitions", type=int, default=None, metavar="P",
                     help="with --cluster: pieces of the batch (default: one per worker)")
    run.set_defaults(func=cmd_run)

    check = sub.add_parser("check", help="validate a network and print its IR",
                           description="Load a YAML network, validate it and print its IR.")
    model_args(check)
    check.set_defaults(func=cmd_check)

    bench = sub.add_parser("bench", help="time compilation and runs",
                           description="Time the first call (compilation included) and the median "
                                       "of repeated runs.")
    model_args(bench)
    data_args(bench)
    bench.add_argument("--repeat", type=int, default=10, metavar="N",
                       help="timed runs after the first call (default 10)")
    bench.set_defaults(func=cmd_bench)

    export = sub.add_parser("export", help="write a network as an ONNX model",
                            description="Write a YAML network of one net (nested nets included) "
                                        "or one built-in layer as an ONNX model (opset 17) that "
                                        "onnxruntime runs; see docs/onnx-export.md.")
    model_args(export)
    export.add_argument("--output", "-o", required=True, metavar="MODEL.onnx",
                        help="the ONNX file to write")
    export.add_argument("--scan", action="store_true",
                        help="built-in layers as Scan nodes, not ONNX GRU/LSTM/RNN nodes")
    export.set_defaults(func=cmd_export)
    return parser


# ----------------------------------------------------------------------------
# commands


def cmd_check(args) -> int:
    model = _load(args)
    print(f"{args.model}: ok")
    _print_model(model)
    print()
    print(model.ir())
    return 0


def cmd_run(args) -> int:
    from .backends import default_backend

    model = _load(args)
    backend = args.backend or default_backend()
    if args.cluster:
        return _run_on_cluster(model, args, backend)
    feeds = _feeds(model, args)
    with Progress(enabled=not args.quiet) as progress:
        start = time.perf_counter()
        outputs = model(feeds, backend=backend, progress=progress.stage)
        seconds = time.perf_counter() - start
    print(f"model    {args.model} ({model.name})")
    print(f"backend  {backend}")
    return _report(args, feeds, outputs, f"{_seconds(seconds)} (one call; compilation included "
                                         "on a first run)")


def _report(args, feeds, outputs, time_line) -> int:
    """The inputs, outputs and time of a run, and ``--output`` written."""
    print("inputs")
    _print_values(feeds)
    print("outputs")
    _print_values(outputs)
    print(f"time     {time_line}")
    if args.output:
        save_npz(args.output, outputs)
        print(f"wrote    {args.output}")
    return 0


def _run_on_cluster(model, args, backend) -> int:
    from pathlib import Path

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
    from .backends import default_backend

    if args.repeat < 1:
        raise Error("--repeat must be at least 1")
    model = _load(args)
    feeds = _feeds(model, args)
    backend = args.backend or default_backend()
    times = []
    with Progress(enabled=not args.quiet) as progress:
        progress.stage("first call (compiling)")
        start = time.perf_counter()
        model(feeds, backend=backend)
        first = time.perf_counter() - start
        for i in range(args.repeat):
            progress.stage(f"run {i + 1}/{args.repeat}")
            start = time.perf_counter()
            model(feeds, backend=backend)
            times.append(time.perf_counter() - start)
    median = statistics.median(times)
    rows = sum(v.shape[0] for v in feeds.values() if isinstance(v, LoDTensor))
    print(f"model    {args.model} ({model.name})")
    print(f"backend  {backend}")
    print("inputs")
    _print_values(feeds)
    print(f"compile  {_seconds(max(first - median, 0.0))} (first call {_seconds(first)} minus the "
          "median run; kernels cached on disk load faster than they compile)")
    print(f"run      median {_seconds(median)} over {args.repeat} runs "
          f"(min {_seconds(min(times))}, max {_seconds(max(times))}); "
          f"{rows / median:,.0f} rows/s")
    return 0


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

    return load_yaml(args.model, params=args.params, seed=args.seed)


def _feeds(model, args):
    if args.input:
        return load_npz(args.input, model)
    if args.sequences < 1 or args.max_length < 1:
        raise Error("--sequences and --max-length must be at least 1")
    return model.random_feeds(seed=args.seed, num_sequences=args.sequences,
                              max_length=args.max_length)


def load_npz(path, model):
    """The model's inputs from an ``.npz`` file (see the module docstring)."""
    try:
        with np.load(path) as npz:
            arrays = {k: npz[k] for k in npz.files}
    except (OSError, ValueError) as exc:
        raise Error(f"cannot read input data {path!r}: {exc}") from None
    feeds = {}
    for name, spec in model.inputs.items():
        if name not in arrays:
            raise Error(f"{path}: no array {name!r} for input {name!r} "
                        f"(it has {', '.join(sorted(arrays)) or 'nothing'})")
        data = arrays[name]
        if spec.lod_level == 0:
            feeds[name] = data
            continue
        offsets = [arrays.get(f"{name}.lod.{k}") for k in range(spec.lod_level)]
        lengths = [arrays.get(f"{name}.lengths.{k}") for k in range(spec.lod_level)]
        if all(o is not None for o in offsets):
            feeds[name] = LoDTensor(data, offsets)
        elif all(n is not None for n in lengths):
            feeds[name] = LoDTensor.from_lengths(data, lengths)
        else:
            raise Error(f"{path}: input {name!r} has lod_level {spec.lod_level}; give its LoD as "
                        + ", ".join(f"{name}.lod.{k}" for k in range(spec.lod_level))
                        + " (offsets) or as " + ", ".join(f"{name}.lengths.{k}" for k in
                                                          range(spec.lod_level)))
    return feeds


def save_npz(path, values):
    """Write named arrays and LoDTensors (``name``, ``name.lod.K``) to ``.npz``."""
    arrays = {}
    for name, value in values.items():
        if isinstance(value, LoDTensor):
            arrays[name] = value.data
            for k, offsets in enumerate(value.levels):
                arrays[f"{name}.lod.{k}"] = np.asarray(offsets)
        else:
            arrays[name] = np.asarray(value)
    try:
        np.savez(path, **arrays)
    except OSError as exc:
        raise Error(f"cannot write {path!r}: {exc.strerror or exc}") from None


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


def _print_values(values):
    width = max((len(n) for n in values), default=0)
    for name, value in values.items():
        if isinstance(value, LoDTensor):
            print(f"  {name:<{width}}  LoDTensor {value.dtype} {list(value.shape)}  "
                  f"lod {_short_lod(value.lod)}")
        else:
            value = np.asarray(value)
            print(f"  {name:<{width}}  ndarray   {value.dtype} {list(value.shape)}")


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
    """A one-line progress indication on stderr for work that takes more than
    ``delay`` seconds: the current stage and the time so far. On a terminal the
    line is redrawn in place and erased at the end; elsewhere each stage is
    printed once."""

    def __init__(self, enabled=True, delay=1.0, stream=None, interval=0.2):
        self.enabled = enabled
        self.delay = delay
        self.stream = stream if stream is not None else sys.stderr
        self.interval = interval
        self.text = "starting"
        self._start = None
        self._stop = threading.Event()
        self._thread = None
        self._shown = None
        self._width = 0

    def stage(self, text):
        self.text = text

    def __enter__(self):
        self._start = time.perf_counter()
        if self.enabled:
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            if self._shown is not None and self._tty():
                self.stream.write("\r" + " " * self._width + "\r")
                self.stream.flush()
        return False

    def _tty(self):
        return getattr(self.stream, "isatty", lambda: False)()

    def _loop(self):
        while not self._stop.wait(self.interval):
            elapsed = time.perf_counter() - self._start
            if elapsed < self.delay:
                continue
            if self._tty():
                line = f"stepnet: {self.text} ... {elapsed:.1f} s"
                self.stream.write("\r" + line.ljust(self._width))
                self._width = max(self._width, len(line))
                self._shown = self.text
            elif self._shown != self.text:
                self.stream.write(f"stepnet: {self.text} ... ({elapsed:.1f} s so far)\n")
                self._shown = self.text
            self.stream.flush()


if __name__ == "__main__":
    sys.exit(main())
