"""Scale out on Dask (the ``distributed`` extra): sharded inference and
data-parallel training across workers.

- :func:`run` splits a batch by whole top-level sequences (a sequence and all
  its nested sub-sequences stay together) into partitions of about the same
  number of tokens, runs each on a Dask worker, and gives the outputs back in
  the caller's order with the original LoD. The model is sent to each worker
  once (``client.scatter(..., broadcast=True)``), so each worker compiles its
  kernels once. Dask retries the tasks of a worker that dies.
- :func:`data_parallel` makes a training step for ``stepnet.optim.train``:
  each worker computes the loss and gradient *sums* of its shard with the
  current parameters, the sums are added up and divided by the batch size, so
  the step equals the single-process one up to float rounding.
- :func:`run_shards` runs a YAML model on every ``.npz`` shard of a
  directory, one task per shard, each worker reading its own shard, for
  input larger than memory.

Without ``client=``, :func:`run` starts a ``LocalCluster`` of one worker
process per core (``local_client``) and stops it when done. ``stepnet run
MODEL.yaml --cluster local:N`` (or ``--cluster tcp://HOST:8786``) uses this
module from the command line.
"""

from __future__ import annotations

import os
import warnings
from concurrent.futures import CancelledError
from pathlib import Path

import numpy as np

from .errors import ShapeError, StepNetError, optional_import
from .lod import LoDTensor
from .npz import load_npz, save_npz, shard_files, shard_output_path


def _dask():
    return optional_import("distributed", "stepnet.distributed", "pip install 'stepnet[distributed]'")


def local_client(n_workers=None, threads_per_worker=1):
    """A client of a new ``LocalCluster`` of worker processes (one per core by
    default, one thread each); closing the client stops the cluster.

    Parameters
    ----------
    n_workers : int, optional
        How many worker processes; None (or 0): one per core.
    threads_per_worker : int, default 1
        Threads of each worker.

    Returns
    -------
    distributed.Client
        Usable as a context manager; its dashboard is on a free port.

    Raises
    ------
    UnsupportedError
        Dask's ``distributed`` is not installed.
    """
    distributed = _dask()
    n = n_workers or os.cpu_count() or 1
    # the client starts the cluster, so closing the client stops it too
    return distributed.Client(n_workers=n, threads_per_worker=threads_per_worker, processes=True,
                              dashboard_address=":0")


def connect(spec):
    """A client for ``"local"`` or ``"local:N"`` (a new LocalCluster) or a
    scheduler address (``"tcp://host:8786"``, ``"localhost:8786"``).

    What ``stepnet run --cluster SPEC`` calls.

    Parameters
    ----------
    spec : str
        Exactly ``"local"`` (one worker per core) or ``"local:N"`` (``N``
        worker processes, ``N`` a positive integer); anything else is the
        address of a running scheduler, which ``distributed.Client``
        connects to (so ``"localhost:8786"`` is an address, not a cluster).

    Returns
    -------
    distributed.Client

    Raises
    ------
    StepNetError
        ``spec`` is not a string, or is ``"local:N"`` with ``N`` not a
        positive integer; nothing is started.
    UnsupportedError
        Dask's ``distributed`` is not installed.
    """
    if not isinstance(spec, str):
        raise StepNetError(f"cluster spec must be a string ('local', 'local:N' or a scheduler "
                           f"address), got {type(spec).__name__}")
    distributed = _dask()
    if spec == "local":
        return local_client()
    if spec.startswith("local:"):
        n = spec[len("local:"):]
        if not (n.isascii() and n.isdigit() and int(n) > 0):
            raise StepNetError(f"cluster {spec!r}: expected local:N with N a positive number "
                               f"of workers")
        return local_client(int(n))
    try:
        return distributed.Client(spec)
    except (ValueError, OSError) as exc:  # (an address that is none, or nobody there)
        raise StepNetError(f"cluster {spec!r}: expected 'local', 'local:N' or a scheduler's "
                           f"address (tcp://HOST:PORT): {exc}") from exc


# ----------------------------------------------------------------------------
# partitions by whole top-level sequences


def tokens_per_sequence(X: LoDTensor) -> np.ndarray:
    """The number of data rows under each top-level sequence of ``X``.

    Parameters
    ----------
    X : LoDTensor
        With at least one level.

    Returns
    -------
    ndarray
        int64 ``[num_sequences]``.

    Examples
    --------
    >>> import numpy as np, stepnet as sn
    >>> from stepnet.distributed import tokens_per_sequence
    >>> X = sn.LoDTensor(np.zeros(14), [[0, 2, 5], [0, 3, 5, 9, 10, 14]])
    >>> tokens_per_sequence(X).tolist()
    [5, 9]
    """
    bounds = np.asarray(X.levels[0])
    for level in X.levels[1:]:
        bounds = np.asarray(level)[bounds]
    return np.diff(bounds)


def partition_bounds(tokens, partitions) -> list:
    """Contiguous ranges ``(start, stop)`` of sequences with about the same
    number of tokens each; never an empty range, at most ``partitions``.

    Parameters
    ----------
    tokens : array_like of int
        The tokens of each sequence, in order (e.g.
        :func:`tokens_per_sequence`).
    partitions : int
        How many ranges are wanted; fewer come back where there are fewer
        sequences (and at least one when there is one).

    Returns
    -------
    list of tuple of int
        ``(start, stop)`` sequence indices, covering every sequence in
        order; empty when there are no sequences.

    Examples
    --------
    >>> from stepnet.distributed import partition_bounds
    >>> partition_bounds([5, 1, 1, 1, 1, 1], 2)
    [(0, 1), (1, 6)]
    """
    tokens = np.asarray(tokens, np.int64)
    n = len(tokens)
    if n == 0:
        return []
    partitions = max(1, min(int(partitions), n))
    cum = np.cumsum(tokens)
    total = int(cum[-1])
    cuts = [0]
    for k in range(1, partitions):
        # the first sequence past this share of the tokens starts the next partition
        share = total * k / partitions
        cut = int(np.searchsorted(cum, share, side="right")) if total else n * k // partitions
        cut = min(max(cut, cuts[-1] + 1), n - (partitions - k))
        cuts.append(cut)
    cuts.append(n)
    return [(a, b) for a, b in zip(cuts[:-1], cuts[1:]) if b > a]


def _num_sequences(feeds):
    for value in feeds.values():
        if isinstance(value, LoDTensor):
            return value.num_sequences, value
    raise StepNetError("stepnet.distributed: the feeds hold no LoDTensor to split by sequences")


def _partitions(partitions, what):
    """``partitions`` checked: None or a whole number from 1."""
    if partitions is not None and (isinstance(partitions, (bool, np.bool_)) or not isinstance(
            partitions, (int, np.integer)) or partitions < 1):
        raise StepNetError(f"{what}: partitions must be a whole number >= 1 (or None), "
                           f"got {partitions!r}")
    return partitions


def _rows(X, start, stop, finest):
    """The rows of a per-sequence array that top-level sequences ``[start,
    stop)`` of ``X`` own: the same range, or, ``finest``, those of their
    sequences of ``X``'s finest level (a layer's ``h0``: a row per sequence
    it runs over)."""
    for level in X.levels[:-1] if finest else ():
        start, stop = int(level[start]), int(level[stop])
    return start, stop


def _check_sizes(feeds, batch_axis, X, name, finest):
    """What one process checks of the batch's sizes, before it is split
    (split, a value of more rows or sequences would lose them): every
    LoDTensor of ``X``'s sequences, every per-sequence array of its rows."""
    rows = _rows(X, 0, X.num_sequences, finest)[1]
    for key, value in feeds.items():
        if isinstance(value, LoDTensor):
            if value.num_sequences != X.num_sequences:
                raise ShapeError(f"stepnet.distributed.run: {key!r} has {value.num_sequences} "
                                 f"sequences, {name!r} {X.num_sequences}")
            continue
        axis = None if value is None else batch_axis(key, value)
        if axis is not None and (np.ndim(value) <= axis or np.shape(value)[axis] != rows):
            raise ShapeError(f"stepnet.distributed.run: {key!r} of shape {list(np.shape(value))} "
                             f"needs {rows} rows along axis {axis}, one per sequence of {name!r}")


def _split(feeds, batch_axis, X, start, stop, finest):
    """The feeds of sequences ``[start, stop)`` of ``X``: LoDTensors by their
    top-level sequences, per-sequence arrays along ``batch_axis(name,
    value)``, the rest (``None``) whole."""
    part = {}
    for name, value in feeds.items():
        if isinstance(value, LoDTensor):
            part[name] = value.select(np.arange(start, stop))
            continue
        axis = None if value is None else batch_axis(name, value)
        if axis is None:
            part[name] = value
        else:
            index = [slice(None)] * np.ndim(value)
            index[axis] = slice(*_rows(X, start, stop, finest))
            part[name] = np.ascontiguousarray(np.asarray(value)[tuple(index)])
    return part


def _join(parts, axis=0):
    """Outputs of consecutive partitions back into one (same structure),
    arrays along ``axis``."""
    first = parts[0]
    if isinstance(first, dict):
        return {k: _join([p[k] for p in parts], axis) for k in first}
    if isinstance(first, (tuple, list)):
        return type(first)(_join([p[i] for p in parts], axis) for i in range(len(first)))
    if isinstance(first, LoDTensor):
        return LoDTensor.concat(parts)
    return np.concatenate([np.asarray(p) for p in parts], axis=axis)


# ----------------------------------------------------------------------------
# what runs on a worker


def _run_part(obj, kind, feeds, backend, output_all_steps):
    if kind == "rnn":
        return obj(output_all_steps=output_all_steps, backend=backend, **feeds)
    if kind == "layer":
        feeds = dict(feeds)
        X = feeds.pop("X")
        if obj.kind.states[1:]:  # (an LSTM takes its states as one pair)
            return obj(X, (feeds.pop("h0", None), feeds.pop("c0", None)), backend=backend, **feeds)
        return obj(X, backend=backend, **feeds)
    return obj(feeds, backend=backend)


def _describe(obj, feeds):
    """(kind, feeds, batch_axis(name, value)) for a step-net, a layer or a
    YAML model; ``batch_axis`` is the axis of a per-sequence array, or None
    for a value every partition gets whole."""
    from .dsl import RNNOp
    from .nn.base import _RecurrentLayer
    from .yaml.model import Model

    if isinstance(obj, RNNOp):
        obj.bind(**dict(feeds or {}))  # one process's checks, of the whole batch
        # names not given keep their bound values (split like the rest)
        feeds = {**{n: b.value for n, b in obj.bindings.items()}, **dict(feeds or {})}
        num_seq, _ = _num_sequences(feeds)

        def batch_axis(name, value):
            b = obj.bindings.get(name)
            if b is None:
                raise StepNetError(f"stepnet.distributed.run: {name!r} is not an input of "
                                   f"{obj.name}; its inputs are {sorted(obj.bindings)}")
            shape = np.shape(value)
            per_sequence = b.kind == "static" or (
                b.kind == "init" and shape[:1] == (num_seq,)
                and tuple(shape[1:]) == tuple(b.memory_shape))
            return 0 if per_sequence else None

        return "rnn", feeds, batch_axis
    if isinstance(obj, _RecurrentLayer):
        feeds = dict(feeds or {})
        if not isinstance(feeds.get("X"), LoDTensor):
            raise StepNetError("stepnet.distributed.run of a layer: feeds['X'] must be a LoDTensor")
        known = {"X", "h0", *(("c0",) if obj.kind.states[1:] else ()),
                 *(("attention",) if obj.kind.attention else ())}
        if set(feeds) - known:
            raise StepNetError(f"stepnet.distributed.run: feeds {sorted(set(feeds) - known)} are not "
                               f"inputs of the {type(obj).__name__} layer (it takes {sorted(known)})")
        # h0, c0 are [L * D, B, H]: split along their batch axis (B: the
        # sequences of X's finest level)
        return "layer", feeds, lambda name, value: 1 if name in ("h0", "c0") else None
    if isinstance(obj, Model):
        feeds = obj._check_feeds(dict(feeds or {}))
        return "model", feeds, lambda name, value: 0
    raise StepNetError(f"stepnet.distributed.run: expects a step-net, a stepnet.nn layer or a "
                       f"YAML model, got {type(obj).__name__}")


def run(obj, feeds=None, client=None, partitions=None, backend=None, output_all_steps=True):
    """Run ``obj`` (a step-net, an ``nn`` layer or a YAML model) on ``feeds``
    across the workers of ``client``; returns what ``obj`` returns on the
    whole batch, in the caller's order with the original LoD.

    The batch is split by whole top-level sequences into partitions of
    about the same number of tokens; per-sequence arrays (static inputs,
    per-sequence initial memories, a layer's ``h0``/``c0``) are split with
    them, other values go whole to every partition.

    Parameters
    ----------
    obj : RNNOp, stepnet.nn layer or stepnet.yaml.Model
        What to run; sent to each worker once.
    feeds : dict, optional
        A step-net's inputs by name (those not given: their bound values); a
        layer's ``{"X": LoDTensor, "h0": ..., "c0": ...}``; a YAML model's
        inputs. At least one LoDTensor, the one split by sequences.
    client : distributed.Client, optional
        The cluster's client. None: a ``LocalCluster`` of one worker per
        core, started for this call and stopped after it.
    partitions : int, optional
        How many pieces; None: one per worker.
    backend : str, optional
        The backend each worker runs on; None: the worker's
        ``default_backend()``.
    output_all_steps : bool or sequence of bool, default True
        Step-nets only: as in ``rnn(output_all_steps=...)``.

    Returns
    -------
    object
        What ``obj`` returns on the whole batch (outputs joined in the
        caller's sequence order, with the original LoD).

    Raises
    ------
    StepNetError, ShapeError
        Before any cluster starts: ``obj`` is of another kind, a feed is not
        an input, ``partitions`` not a whole number from 1, or a value one
        process refuses (``rnn.bind``'s checks; a LoDTensor, or a
        per-sequence array, of another number of sequences).
    UnsupportedError
        Dask's ``distributed`` is not installed.
    """
    kind, feeds, batch_axis = _describe(obj, feeds)  # bad input fails before any cluster starts
    partitions = _partitions(partitions, "stepnet.distributed.run")
    _, X = _num_sequences(feeds)
    _check_sizes(feeds, batch_axis, X, next(k for k, v in feeds.items() if v is X), kind == "layer")
    own = client is None
    client = local_client() if own else client
    try:
        if partitions is None:
            partitions = max(1, len(client.scheduler_info()["workers"]))
        bounds = partition_bounds(tokens_per_sequence(X), partitions)
        if not bounds:  # no sequence at all: nothing to distribute
            return _run_part(obj, kind, feeds, backend, output_all_steps)
        parts = [_split(feeds, batch_axis, X, a, b, kind == "layer") for a, b in bounds]
        for attempt in range(2):
            shared = client.scatter(obj, broadcast=True, hash=False)
            # Each partition's data travels inside its task: the scheduler keeps
            # it, so a task whose worker dies runs again elsewhere (data
            # scattered to that worker alone would be lost with it).
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Sending large graph",
                                        category=UserWarning)
                futures = [client.submit(_run_part, shared, kind, part, backend, output_all_steps,
                                         pure=False) for part in parts]
                try:
                    return _join_outputs(obj, kind, client.gather(futures))
                except CancelledError:
                    # a worker died before the model reached the others (Dask:
                    # "lost scattered data"): its tasks are cancelled, not
                    # rerun; the run is sent again, once
                    if attempt:
                        raise
    finally:
        if own:
            client.close()


def _join_outputs(obj, kind, parts):
    """The partitions' outputs as ``obj``'s: a layer's final states
    (``h_n``, ``c_n``: ``[num_layers * num_directions, B, H]``, as a YAML
    model's ``layer.last``) join along their batch axis, 1."""
    if kind == "model":
        return {name: _join([p[name] for p in parts], obj._batch_axis(name)) for name in parts[0]}
    if kind != "layer":
        return _join(parts)
    return LoDTensor.concat([p[0] for p in parts]), _join([p[1] for p in parts], axis=1)


# ----------------------------------------------------------------------------
# data-parallel training


def _shard_sums(model, shard_fn, values, shard):
    for p, v in zip(model.parameters(), values):
        p.value[...] = v
    return shard_fn(model, shard)


def data_parallel(model, shard_fn, client, partitions=None):
    """A step function ``step(batch) -> (loss, grads)`` for ``optim.train``
    that computes on the workers of ``client``.

    ``shard_fn(model, shard) -> (loss_sum, grad_sums, count)`` gives the
    *sums* over a shard's examples (and how many there are); ``batch`` is a
    tuple of arrays with one row per example, split by rows. The step sends the
    current parameter values with each shard, adds the sums up and returns the
    mean loss and mean gradients: the single-process step, up to rounding.

    Parameters
    ----------
    model : object
        What ``shard_fn`` computes with, with a ``parameters()`` method (a
        ``stepnet.nn`` layer, a step-net, a YAML model); sent to each worker
        once, now. Its Parameters on the driver are the ones the optimizer
        updates.
    shard_fn : callable
        ``shard_fn(model, shard) -> (loss_sum, grad_sums, count)``, run on a
        worker: ``shard`` is a tuple of the batch's arrays cut to the
        shard's rows, ``grad_sums`` one array per ``model.parameters()``.
        Must be picklable.
    client : distributed.Client
        The cluster's client.
    partitions : int, optional
        How many shards a batch is cut into; None: one per worker at the
        time ``data_parallel`` is called.

    Returns
    -------
    callable
        ``step(batch) -> (loss, grads)``: ``batch`` a tuple of arrays with
        one row per example, ``loss`` the mean loss and ``grads`` the mean
        gradients, in ``model.parameters()``'s order. ``step`` raises
        StepNetError, before anything is sent to the workers, for a batch
        without examples (the mean over none is undefined) or whose arrays
        have different numbers of rows; and if the shards' counts add up to
        zero.
    """
    partitions = _partitions(partitions, "data_parallel")
    shared = client.scatter(model, broadcast=True, hash=False)
    workers = partitions or max(1, len(client.scheduler_info()["workers"]))

    def step(batch):
        arrays = [np.asarray(a) for a in batch]
        rows = [a.shape[0] if a.ndim else None for a in arrays]
        if not arrays or None in rows or len(set(rows)) > 1:
            raise StepNetError(f"data_parallel step: the batch must be a tuple of arrays with "
                               f"one row per example each, got rows {rows}")
        n = rows[0]
        if n == 0:
            raise StepNetError("data_parallel step: the batch has no examples (0 rows); the mean "
                               "loss and gradients over no examples are undefined")
        bounds = partition_bounds(np.ones(n), workers)
        values = [p.value for p in model.parameters()]
        futures = [client.submit(_shard_sums, shared, shard_fn, values,
                                 tuple(a[lo:hi] for a in arrays), pure=False)
                   for lo, hi in bounds]
        loss, grads, count = 0.0, None, 0
        for part_loss, part_grads, part_count in client.gather(futures):
            loss += part_loss
            count += part_count
            grads = list(part_grads) if grads is None else [g + h for g, h in zip(grads, part_grads)]
        if count <= 0:
            raise StepNetError(f"data_parallel step: shard_fn counted {count} examples in a "
                               f"batch of {n} rows; the means need at least one")
        return loss / count, [g / count for g in grads]

    return step


# ----------------------------------------------------------------------------
# input larger than memory: a directory of .npz shards


def _run_shard(model, path, out_dir, backend):
    feeds = load_npz(path, model)
    outputs = model(feeds, backend=backend)
    tokens = sum(v.data.shape[0] for v in feeds.values() if isinstance(v, LoDTensor))
    if out_dir is not None:
        save_npz(shard_output_path(out_dir, path), outputs)
        return path, tokens, None
    return path, tokens, outputs


def run_shards(model, directory, client, out_dir=None, backend=None):
    """Run a YAML ``model`` on every ``.npz`` shard of ``directory``, one task
    per shard: each worker reads its shard itself (the driver never holds the
    whole input) and writes ``out_dir/<shard name>`` when ``out_dir`` is given.
    Yields ``(shard path, tokens, outputs or None)`` in shard order.

    A generator: nothing is submitted until it is first iterated.

    Parameters
    ----------
    model : stepnet.yaml.Model
        The model; sent to each worker once. Each shard holds its inputs as
        ``stepnet.npz`` writes them (``x``, ``x.lod.K`` or ``x.lengths.K``).
    directory : str or os.PathLike
        The folder whose ``*.npz`` files are the shards, run in name order.
    client : distributed.Client
        The cluster's client; its workers must see ``directory`` (and
        ``out_dir``) at the same path.
    out_dir : str or os.PathLike, optional
        Where each shard's outputs are written, under the shard's file
        name; made if missing. None: the outputs come back to the driver.
    backend : str, optional
        The backend each worker runs on; None: the worker's
        ``default_backend()``.

    Yields
    ------
    tuple
        ``(path, tokens, outputs)``: the shard's path (str), the data rows
        of its LoD inputs, and the model's outputs, or None when they were
        written to ``out_dir``.

    Raises
    ------
    StepNetError
        ``directory`` holds no ``.npz`` shard.
    Error
        A shard that cannot be read or lacks an input, or an output that
        cannot be written (raised where the shard's result is taken).
    """
    files = shard_files(directory)
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
    shared = client.scatter(model, broadcast=True, hash=False)
    futures = [client.submit(_run_shard, shared, str(f), out_dir and str(out_dir), backend, pure=False)
               for f in files]
    for future in futures:
        yield future.result()
