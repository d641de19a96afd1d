"""A network loaded from YAML: :class:`Model` (its inputs checked, its
layers and nets run in the file's order, random feeds of the declared
shapes), :class:`InputSpec`, and the records the builder fills for each
layer, net and output (where each value comes from at call time).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import sizes
from ..backends import backend as backend_info, is_compiled
from ..errors import Error, ShapeError, StepNetError
from ..lod import LoDTensor


@dataclass(frozen=True)
class InputSpec:
    """A declared model input: rows of ``shape`` with ``lod_level`` LoD levels
    (0: a dense ``[num_sequences, *shape]`` array).

    One entry of the file's ``inputs:`` (``model.inputs[name]``).

    Parameters
    ----------
    name : str
        The input's name, the key of ``feeds``.
    shape : tuple of int
        The shape of one row, without the rows axis.
    dtype : numpy.dtype
        float16, float32 or float64; fed values are cast to it.
    lod_level : int
        How many LoD levels a fed LoDTensor has; 0: a dense array.
    random : {"normal", "uniform", "onehot"}, default "normal"
        What ``Model.random_feeds`` (and ``stepnet run`` without data) draws
        for it: standard normal values, uniform in ``[-1, 1]``, or one-hot
        rows over the last axis.
    """

    name: str
    shape: tuple
    dtype: np.dtype
    lod_level: int
    random: str = "normal"


@dataclass
class Source:
    """Where a top-level binding's value comes from at call time."""

    input: str | None = None  # a model input
    net: str | None = None  # or an earlier net's result
    mode: str = "all"
    index: int = 0


class TopNet:
    """A top-level net: its step-net, where each of its bindings comes from
    at call time, and which of its outputs the model reads (and how)."""

    def __init__(self, name, rnn, output_names):
        self.name = name
        self.rnn = rnn
        self.output_names = output_names
        self.sources = {}  # binding name -> Source
        self.needed = {}  # output index -> {"all", "last"}: what callers read

    def feed_names(self) -> str:
        """How this net's binding names map to the model's inputs, for errors."""
        pairs = [f"{b} <- {s.input}" for b, s in self.sources.items()
                 if s.input is not None and s.input != b]
        return f" (bindings: {', '.join(pairs)})" if pairs else ""

    def runs(self):
        """The ``output_all_steps`` flags of the calls that give every output
        read: one call with a flag per output, or two when some output is read
        both ways."""
        if not self.needed:
            return []
        if all(len(modes) == 1 for modes in self.needed.values()):
            return [tuple("all" in self.needed.get(i, ()) for i in range(len(self.output_names)))]
        return [(True,) * len(self.output_names), (False,) * len(self.output_names)]


class LayerEntry:
    """A built-in layer of ``stepnet.nn``: ``.all`` is its output Y, ``.last``
    its final states (``h_n``, and ``c_n`` for an LSTM)."""

    def __init__(self, name, layer, source, input_levels, attention=None):
        self.name = name
        self.layer = layer
        self.source = source
        self.attention = attention  # an AUGRU's scores: a Source, else None
        self.input_levels = input_levels
        self.last_names = [f"{s}_n" for s in layer.kind.states]

    def outputs(self, mode):
        return ["y"] if mode == "all" else self.last_names

    def width(self):
        layer = self.layer
        return layer.output_size * (2 if layer.direction == "bidirectional_concat" else 1)

    def run(self, X, backend, attention=None):
        if attention is None:
            Y, state = self.layer(X, backend=backend)
        else:  # one score per token: [tokens] or [tokens, 1] rows
            scores = attention.data.reshape(attention.data.shape[0], 1)
            Y, state = self.layer(X, LoDTensor(scores, attention.lod), backend=backend)
        states = state if isinstance(state, tuple) else (state,)
        return Y, states


class Model:
    """A network loaded from YAML: ``model(feeds)`` -> dict of outputs.

    ``feeds`` maps each declared input name to a LoDTensor (``lod_level`` >= 1)
    or an array ``[num_sequences, *shape]`` (``lod_level: 0``). Attributes:
    ``inputs`` (name -> InputSpec), ``parameters`` (name -> Parameter),
    ``nets`` (name -> the top-level RNNOp), ``outputs`` (names in order).

    Made by :func:`stepnet.load_yaml`, which fills it.

    Parameters
    ----------
    path : str or os.PathLike
        The YAML file it was loaded from.
    name : str
        The model's name (the file's ``name:``, else the file's stem).
    description : str
        The file's ``description:`` ("" without one).

    Examples
    --------
    >>> import stepnet as sn
    >>> model = sn.load_yaml("examples/custom_cell.yaml")          # doctest: +SKIP
    >>> outs = model(model.random_feeds(seed=0), backend="interpreter")  # doctest: +SKIP
    """

    quantized = None  # "int8" or "bf16" (``sn.quantize``, the file's ``quantize:``)

    def __init__(self, path, name, description):
        self.path = Path(path)
        self.name = name
        self.description = description
        self.inputs = {}
        self.parameters = {}
        self.nets = {}
        self.layers = {}
        self.cells = {}
        self.outputs = []
        self._layers = []
        self._nets = []
        self._output_sources = {}

    def __repr__(self):
        return (f"<stepnet.yaml.Model {self.name!r}: inputs {list(self.inputs)}, "
                f"nets {list(self.nets)}, outputs {self.outputs}>")

    def _batch_axis(self, name) -> int:
        """The batch axis of output ``name``: 1 for a layer's final states
        (``layer.last``: ``[num_layers * num_directions, B, H]``), else 0."""
        source = self._output_sources[name]
        return 1 if source.net in self.layers and source.mode == "last" else 0

    def ir(self) -> str:
        """The built-in layers, then the IR of every top-level net, in run order."""
        layers = [f"layer {e.name}: {e.layer!r}" for e in self._layers]
        return "\n".join(layers + [f"net {net.name}:\n{net.rnn.ir()}" for net in self._nets])

    def __call__(self, feeds=None, backend=None, progress=None):
        """Run the network; returns ``{output name: LoDTensor or ndarray}``.

        The built-in layers run first, then the top-level nets, in the
        file's order.

        Parameters
        ----------
        feeds : dict, optional
            Every declared input by name, no other: a LoDTensor with
            ``lod_level`` levels, or for ``lod_level: 0`` an array
            ``[num_sequences, *shape]``; rows of the declared shape, numeric,
            cast to the declared dtype.
        backend : str, optional
            ``"interpreter"``, ``"numba"`` or ``"cuda"``; None:
            ``default_backend()``.
        progress : callable, optional
            Called with a short text before each layer and net runs, in run
            order: ``"compiling net 'encoder' (1/2)"`` before a call that
            compiles first (that net is not compiled yet in this process for
            this backend; the call then runs it; on a tiered Numba backend
            ``"running on the first tier while compiling ..."``: the
            executor, else the interpreter), ``"running
            net 'encoder' (1/2)"`` otherwise.

        Returns
        -------
        dict
            ``{output name: LoDTensor or ndarray}`` in the file's
            ``outputs`` order.

        Raises
        ------
        StepNetError
            An unknown or missing input; a net's own error, its message
            prefixed with the net's name.
        ShapeError
            An input of another kind, number of levels, row shape or a
            non-numeric dtype.
        """
        feeds = self._check_feeds(dict(feeds or {}))
        results = {}
        nets = [net for net in self._nets if net.runs()]
        total = len(self._layers) + len(nets)
        if progress is not None:
            from ..backends import answers_while_compiling, default_backend

            backend_name = backend or default_backend()
            first_tier = "compiling"
            if answers_while_compiling(backend_name):  # a new kernel's first calls: the first tier
                first_tier = "running on the first tier while compiling"  # (which: known after)

        def report(position, kind, name, compiled):
            if progress is not None:
                verb = "running" if compiled else first_tier
                progress(f"{verb} {kind} {name!r} ({position}/{total})")

        for position, entry in enumerate(self._layers, 1):
            if progress is not None:  # a layer builds its step-nets on its first call
                report(position, "layer", entry.name,
                       _compiled_here(list(entry.layer._nets.values()), backend_name))
            attention = (None if entry.attention is None
                         else self._resolve(entry.attention, feeds, results))
            Y, states = entry.run(self._resolve(entry.source, feeds, results), backend, attention)
            results[(entry.name, "all", 0)] = Y
            for index, value in enumerate(states):
                results[(entry.name, "last", index)] = value
        for position, net in enumerate(nets, len(self._layers) + 1):
            bindings = {b: self._resolve(src, feeds, results) for b, src in net.sources.items()}
            for flags in net.runs():
                if progress is not None:
                    report(position, "net", net.name, _compiled_here([net.rnn], backend_name, flags))
                try:
                    out = net.rnn(output_all_steps=flags, backend=backend, **bindings)
                except Error as exc:
                    raise type(exc)(f"net {net.name}: {exc}{net.feed_names()}") from None
                out = out if isinstance(out, tuple) else (out,)
                for index, (flag, value) in enumerate(zip(flags, out)):
                    results[(net.name, "all" if flag else "last", index)] = value
        return {name: self._resolve(src, feeds, results) for name, src in self._output_sources.items()}

    @staticmethod
    def _resolve(source, feeds, results):
        if source.input is not None:
            return feeds[source.input]
        return results[(source.net, source.mode, source.index)]

    def _check_feeds(self, feeds):
        unknown = sorted(set(feeds) - set(self.inputs))
        if unknown:
            raise StepNetError(
                f"model {self.name}: unknown input(s) {unknown}; it takes {sorted(self.inputs)}"
            )
        missing = [n for n in self.inputs if n not in feeds]
        if missing:
            raise StepNetError(
                f"model {self.name}: missing input(s) {missing} "
                "(random_feeds() makes data of the declared shapes)"
            )
        out = {}
        for name, spec in self.inputs.items():
            value = feeds[name]
            if spec.lod_level:
                if not isinstance(value, LoDTensor):
                    raise ShapeError(
                        f"input {name}: expects a LoDTensor with {spec.lod_level} LoD level(s), "
                        f"got {type(value).__name__}"
                    )
                if value.num_levels != spec.lod_level:
                    raise ShapeError(
                        f"input {name}: has {value.num_levels} LoD level(s), declared lod_level "
                        f"{spec.lod_level}"
                    )
                features = value.shape[1:]
            else:
                if isinstance(value, LoDTensor):
                    raise ShapeError(f"input {name}: declared lod_level 0, expects a dense array")
                value = np.asarray(value)
                features = value.shape[1:] if value.ndim else None
            if features != spec.shape:
                got = value.shape
                raise ShapeError(
                    f"input {name}: shape {list(got)} does not fit the declared rows of "
                    f"{list(spec.shape)} ([rows, {', '.join(map(str, spec.shape))}])"
                )
            if value.dtype.kind not in "iubf":
                raise ShapeError(f"input {name}: dtype {value.dtype} is not numeric")
            if value.dtype != spec.dtype:
                value = value.astype(spec.dtype)
            out[name] = value
        return out

    def random_feeds(self, seed=0, num_sequences=4, max_length=6):
        """Random inputs of the declared shapes and a random LoD.

        One random LoD of the deepest declared level is drawn; an input with
        ``lod_level`` k takes its first k levels, so every input of the model
        agrees with every other. Top-level sequences have 1..max_length
        elements, deeper ones 0..max_length (empty sub-sequences included).

        Parameters
        ----------
        seed : int, default 0
            Seed of the draws.
        num_sequences : int, default 4
            Top-level sequences (the rows of a ``lod_level: 0`` input).
        max_length : int, default 6
            The longest a sequence may be, at every level.

        Returns
        -------
        dict
            Feeds for ``model(feeds)``: each input's values drawn as its
            ``random`` says, in its dtype.
        """
        rng = np.random.default_rng(seed)
        depth = max([s.lod_level for s in self.inputs.values()] + [1])
        lengths = [rng.integers(1, max_length + 1, size=num_sequences).tolist()]
        for _ in range(depth - 1):
            lengths.append(rng.integers(0, max_length + 1, size=sum(lengths[-1])).tolist())
        feeds = {}
        for name, spec in self.inputs.items():
            k = spec.lod_level
            data = _random_rows(rng, spec, sum(lengths[k - 1]) if k else num_sequences)
            feeds[name] = LoDTensor.from_lengths(data, lengths[:k]) if k else data
        return feeds


def _compiled_here(rnns, backend, flags=None) -> bool:
    """Whether calling the step-nets ``rnns`` on ``backend`` (with these
    ``output_all_steps`` flags; any, if None) runs code already compiled in
    this process. The interpreter compiles nothing; no step-nets yet (a layer
    not called yet) means a compile to come."""
    if not backend_info(backend).compiles:
        return True
    return bool(rnns) and all(is_compiled(rnn, backend, flags) for rnn in rnns)


def _random_rows(rng, spec, rows):
    shape = (rows,) + spec.shape
    sizes.check(f"random input {spec.name!r}", shape, np.float64)  # (drawn in float64)
    if spec.random == "onehot":
        data = np.zeros(shape)
        index = rng.integers(0, spec.shape[-1] if spec.shape else 1, size=shape[:-1])
        np.put_along_axis(data, index[..., None], 1.0, axis=-1)
    elif spec.random == "uniform":
        data = rng.uniform(-1.0, 1.0, size=shape)
    else:
        data = rng.standard_normal(shape)
    return data.astype(spec.dtype)


__all__ = ["InputSpec", "Model"]
