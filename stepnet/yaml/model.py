"""Building a network from a YAML document with the step-net DSL.

The builder makes exactly the DSL calls a Python user would make
(``create_rnn_op``, ``add_input``, ``add_memory``, operators and
``stepnet.ops`` functions, ``add_outputs``), so a YAML model's IR is the one
the same network written in Python gives, and both run to the same numbers.

The DSL traces with data in hand; a YAML file declares shapes only. Each net
is therefore traced on a placeholder (one sequence of one element per LoD
level, with the declared feature shape and dtype), and every call rebinds the
real arrays by name, which never re-traces (docs/design.md §2).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import sizes
from ..backends import backend as backend_info, is_compiled
from ..dsl import MemoryHandle, create_rnn_op
from ..errors import Error, ShapeError, SizeError, StepNetError, YAMLError
from ..lod import LoDTensor
from ..nn import cells
from ..tracing import Parameter, Value
from . import document
from .expressions import (
    FUNCTIONS,
    LIST_FUNCTIONS,
    Evaluator,
    ExpressionError,
    NestedNet,
    Scope,
    call_function,
    parse_assignment,
    parse_expression,
)
from .initializers import InitError, generator, initialize

TOP_KEYS = ("name", "description", "dtype", "inputs", "parameters", "layers", "cells", "nets",
            "outputs")
INPUT_KEYS = ("shape", "dtype", "lod_level", "random", "description")
PARAM_KEYS = ("shape", "dtype", "init", "from", "description", "mean", "std", "low", "high",
              "gain", "value")
NET_KEYS = ("inputs", "static_inputs", "memories", "step", "outputs", "reverse", "description")
NESTED_KEYS = ("net",) + NET_KEYS
MEMORY_KEYS = ("shape", "init", "dtype", "description")
RANDOM_KINDS = ("normal", "uniform", "onehot")
DTYPES = ("float16", "float32", "float64")
_COMMON_LAYER = ("type", "input", "description", "hidden_size", "num_layers", "direction",
                 "combine", "activations", "activation_alpha", "activation_beta", "clip", "dtype")
# a cell that reads a score per token (AUGRU) takes it as ``attention``
LAYER_TYPES = {c.name: _COMMON_LAYER + ("attention",) * c.attention + c.options
               for c in cells.CELLS.values()}
LAYER_KEYS = tuple(dict.fromkeys(k for keys in LAYER_TYPES.values() for k in keys))
# a cell: one step of a layer, called inside a step (``h = cell(x, h.pre)``)
# (an AUGRU cell's attention is its call's third argument: ``cell(x, h.pre, a)``)
CELL_TYPES = {kind: ("type", "description", "input_size") + tuple(
    k for k in keys if k not in ("type", "input", "description", "num_layers", "direction",
                                 "combine", "attention"))
    for kind, keys in LAYER_TYPES.items()}
CELL_KEYS = tuple(dict.fromkeys(k for keys in CELL_TYPES.values() for k in keys))
_REF = re.compile(r"^([A-Za-z_]\w*)(?:\.(all|last)(?:\.([A-Za-z_]\w*))?)?$")


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
class _Source:
    """Where a top-level binding's value comes from at call time."""

    input: str | None = None  # a model input
    net: str | None = None  # or an earlier net's result
    mode: str = "all"
    index: int = 0


class _TopNet:
    def __init__(self, name, rnn, output_names):
        self.name = name
        self.rnn = rnn
        self.output_names = output_names
        self.sources = {}  # binding name -> _Source
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


class _LayerEntry:
    """A built-in layer of ``stepnet.nn``: ``.all`` is its output Y, ``.last``
    its final states (``h_n``, and ``c_n`` for an LSTM)."""

    def __init__(self, name, layer, source, input_levels, attention=None):
        self.name = name
        self.layer = layer
        self.source = source
        self.attention = attention  # an AUGRU's scores: a _Source, else None
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
            ``"running on the interpreter while compiling ..."``), ``"running
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
            if answers_while_compiling(backend_name):  # a new kernel's first calls run on the interpreter
                first_tier = "running on the interpreter while compiling"

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


# ----------------------------------------------------------------------------
# building


def load_yaml(path, params=None, seed=0) -> Model:
    """Load a YAML network (see docs/yaml.md) into a :class:`Model`.

    Parameters
    ----------
    path : str or path-like
        The YAML file.
    params : dict or str or path-like, optional
        Parameter values that override the file's initializers: a dict, or
        the path of an ``.npz`` file, keyed by parameter name.
    seed : int, default 0
        Seed of the parameter initializers.

    Returns
    -------
    Model
        The network, built with the step-net DSL; ``model(feeds)`` runs it.

    Raises
    ------
    YAMLError
        Any error in the file or the overrides, naming the file, line and key.

    Examples
    --------
    >>> import stepnet as sn
    >>> model = sn.load_yaml("examples/char_gru.yaml")   # doctest: +SKIP
    >>> outputs = model(model.random_feeds(seed=1))       # doctest: +SKIP
    """
    doc = document.read(path)
    return _Builder(doc, params, seed).build()


class _Builder:
    def __init__(self, doc, params, seed):
        self.doc = doc
        self.seed = seed
        self.overrides = params
        self.model = None
        self.dtype = np.dtype(np.float32)

    def error(self, path, message):
        return self.doc.error(path, message)

    def build(self) -> Model:
        doc = self.doc
        data = doc.mapping(doc.data, (), TOP_KEYS, required=("inputs", "outputs"))
        name = data.get("name", doc.path.stem)
        if not isinstance(name, str):
            raise self.error(("name",), f"the model's name must be a string, got {name!r}")
        self.model = Model(doc.path, name, data.get("description", ""))
        if "dtype" in data:
            self.dtype = self._dtype(data["dtype"], ("dtype",))
        self._inputs(data.get("inputs"))
        self._parameters(data.get("parameters"))
        for layer_name, spec in doc.mapping(data.get("layers"), ("layers",)).items():
            self._layer(layer_name, spec, ("layers", layer_name))
        for cell_name, spec in doc.mapping(data.get("cells"), ("cells",)).items():
            self._cell(cell_name, spec, ("cells", cell_name))
        self._check_overrides_used()
        nets = doc.mapping(data.get("nets"), ("nets",))
        if not nets and not self.model.layers:
            raise self.error(("nets",), "a model needs at least one net or layer")
        for net_name, spec in nets.items():
            self._top_net(net_name, spec, ("nets", net_name))
        self._outputs(data.get("outputs"))
        return self.model

    def _dtype(self, value, path):
        if value not in DTYPES:
            raise self.error(path, f"dtype {value!r} is not supported; use one of {', '.join(DTYPES)}"
                             + document.did_you_mean(value, DTYPES))
        return np.dtype(value)

    # -- inputs and parameters ---------------------------------------------

    def _inputs(self, inputs):
        doc = self.doc
        inputs = doc.mapping(inputs, ("inputs",))
        if not inputs:
            raise self.error(("inputs",), "a model needs at least one input")
        for name, spec in inputs.items():
            path = ("inputs", name)
            doc.name(name, path)
            spec = doc.mapping(spec, path, INPUT_KEYS, required=("shape",))
            shape = doc.shape(spec["shape"], path + ("shape",))
            dtype = self._dtype(spec["dtype"], path + ("dtype",)) if "dtype" in spec else self.dtype
            lod_level = spec.get("lod_level", 1)
            if isinstance(lod_level, bool) or not isinstance(lod_level, int) or not 0 <= lod_level <= 32:
                raise self.error(path + ("lod_level",),
                                 f"lod_level is a count of LoD levels (0, 1, 2, ... 32), got {lod_level!r}")
            random = spec.get("random", "normal")
            if random not in RANDOM_KINDS:
                raise self.error(path + ("random",), f"random must be one of {', '.join(RANDOM_KINDS)}, "
                                 f"got {random!r}")
            self.model.inputs[name] = InputSpec(name, shape, dtype, lod_level, random)

    def _parameters(self, params):
        doc = self.doc
        params = doc.mapping(params, ("parameters",))
        overrides = self._load_overrides()
        for name, spec in params.items():
            path = ("parameters", name)
            doc.name(name, path)
            if name in self.model.inputs:
                raise self.error(path, f"{name!r} is already an input; names must be unique")
            if name in FUNCTIONS:
                raise self.error(path, f"{name!r} is the name of a function; choose another name")
            spec = doc.mapping(spec, path, PARAM_KEYS)
            dtype = self._dtype(spec["dtype"], path + ("dtype",)) if "dtype" in spec else self.dtype
            shape = doc.shape(spec["shape"], path + ("shape",)) if "shape" in spec else None
            if name in overrides:
                value = self._fit(np.asarray(overrides[name]), shape, path, "the given parameters")
            elif "from" in spec:
                if "init" in spec:
                    raise self.error(path + ("from",), "give either init or from, not both")
                value = self._fit(self._from_file(spec["from"], name, path + ("from",)), shape,
                                  path + ("from",), f"{spec['from']!r}")
            else:
                if shape is None:
                    raise self.error(path, "missing key 'shape' (or load the array with from: file.npz:key)")
                kind = spec.get("init", "zeros")
                options = {k: v for k, v in spec.items()
                           if k not in ("shape", "dtype", "init", "description")}
                try:
                    value = initialize(kind, shape, dtype, options, generator(self.seed, name), name)
                except InitError as exc:  # (a size that cannot fit: SizeError, before it is made)
                    error = self.error(path + (exc.key or ("init" if "init" in spec else "shape"),), str(exc))
                    raise (SizeError(*error.args) if exc.size else error) from None
            self.model.parameters[name] = Parameter(value.astype(dtype, copy=False), name=name)
        self._overrides = overrides
        self._used_overrides = set(overrides) & set(params)

    def _check_overrides_used(self):
        unused = sorted(set(self._overrides) - self._used_overrides)
        if unused:
            owners = [(e.name, e.layer) for e in self.model._layers] + list(self.model.cells.items())
            known = sorted(self.model.parameters) + sorted(
                f"{name}.{p.name}" for name, layer in owners for p in layer.parameters())
            raise self.error(("parameters",), f"the given parameters have key(s) {unused} that are "
                             f"not parameters of this model (it has {', '.join(known)})")

    def _load_overrides(self):
        if self.overrides is None:
            return {}
        if isinstance(self.overrides, dict):
            return self.overrides
        try:
            with np.load(self.overrides) as npz:
                return {k: npz[k] for k in npz.files}
        except (OSError, ValueError) as exc:
            raise self.error(("parameters",), f"cannot read parameters from {str(self.overrides)!r}: "
                             f"{exc}") from None

    def _from_file(self, ref, name, path):
        if not isinstance(ref, str):
            raise self.error(path, f"from: expects 'file.npz:key', got {ref!r}")
        file, _, key = ref.rpartition(":") if ":" in ref else (ref, "", name)
        key = key or name
        full = Path(file)
        if not full.is_absolute():
            full = self.doc.path.parent / full
        try:
            with np.load(full) as npz:
                if key not in npz.files:
                    raise self.error(path, f"{file} has no array {key!r} (it has {', '.join(npz.files)})"
                                     + document.did_you_mean(key, npz.files))
                return npz[key]
        except (OSError, ValueError) as exc:
            raise self.error(path, f"cannot read {str(full)!r}: {exc}") from None

    def _fit(self, value, shape, path, where):
        if shape is not None and value.shape != shape:
            raise self.error(path, f"{where} holds shape {list(value.shape)} but the parameter is "
                             f"declared with shape {list(shape)}")
        if value.dtype.kind not in "iuf":
            raise self.error(path, f"{where} holds dtype {value.dtype}, not numbers")
        return value

    def _top_name(self, name, path):
        self.doc.name(name, path)
        model = self.model
        if any(name in names for names in (model.inputs, model.parameters, model.layers,
                                           model.cells, model.nets)):
            raise self.error(path, f"{name!r} is already an input, parameter, layer, cell or net; "
                             "names must be unique")

    # -- built-in layers -------------------------------------------------------

    def _layer(self, name, spec, path):
        from .. import nn

        doc = self.doc
        self._top_name(name, path)
        spec = doc.mapping(spec, path, LAYER_KEYS, required=("type", "input", "hidden_size"))
        kind = spec["type"]
        if not isinstance(kind, str) or kind not in LAYER_TYPES:
            raise self.error(path + ("type",), f"unknown layer type {kind!r}; expected one of "
                             f"{', '.join(LAYER_TYPES)}" + document.did_you_mean(kind, LAYER_TYPES))
        fixed = ("type", "input") + ("attention",) * cells.CELLS[kind].attention
        options = self._options(spec, path, kind, LAYER_TYPES, "layer", fixed)
        placeholder, source = self._top_source(spec["input"], path + ("input",), want="sequence")
        if placeholder.data.ndim != 2:
            raise self.error(path + ("input",), f"a layer reads rows of one dimension, "
                             f"{spec['input']!r} has rows of {list(placeholder.shape[1:])}")
        attention = self._attention(spec, path, kind, placeholder)
        options["dtype"] = self._dtype(options["dtype"], path + ("dtype",)) if "dtype" in options \
            else np.promote_types(placeholder.dtype, np.float32)  # float16 data runs in float32
        seed = int(generator(self.seed, name).integers(2 ** 31))
        try:
            layer = nn.layers.LAYERS[kind](placeholder.shape[1], seed=seed, **options)
        except (Error, TypeError, ValueError) as exc:
            key = next((k for k in options if k in str(exc)), None)
            raise self.error(path + ((key,) if key else ()), f"{kind} layer: {exc}") from None
        self._override_weights(name, layer)
        entry = _LayerEntry(name, layer, source, placeholder.num_levels, attention)
        self.model.layers[name] = layer
        self.model._layers.append(entry)

    def _attention(self, spec, path, kind, placeholder):
        """An AUGRU layer's ``attention``: the source of one score per token
        of its input (the same LoD, checked at call time); None for the
        other layers."""
        if not cells.CELLS[kind].attention:
            return None
        if "attention" not in spec:
            raise self.error(path, f"an {kind} layer needs 'attention': an input of one score "
                             "per token of its input (shape [] or [1], the input's lod_level)")
        where = path + ("attention",)
        scores, source = self._top_source(spec["attention"], where, want="sequence")
        if source.input is None:
            raise self.error(where, f"{spec['attention']!r} is a layer's output; an {kind} "
                             "layer's attention is an input of the model")
        if scores.data.shape[1:] not in ((), (1,)):
            raise self.error(where, f"an attention score per token has shape [] or [1], "
                             f"{spec['attention']!r} has rows of {list(scores.data.shape[1:])}")
        if scores.num_levels != placeholder.num_levels:
            raise self.error(where, f"{spec['attention']!r} has {scores.num_levels} LoD "
                             f"level(s), the layer's input {placeholder.num_levels}")
        return source

    def _options(self, spec, path, kind, types, what, fixed):
        """A layer's or cell's options (its keys but ``fixed`` and the
        description), each checked against what a ``kind`` takes."""
        options = {k: v for k, v in spec.items() if k not in fixed + ("description",)}
        for key in options:
            if key not in types[kind]:
                raise self.error(path + (key,), f"a {kind} {what} has no option {key!r} (it takes "
                                 f"{', '.join(types[kind])})" + document.did_you_mean(key, types[kind]))
        return options

    def _override_weights(self, name, layer):
        """Replace a layer's or cell's weights given as ``name.weight_name``."""
        for p in layer.parameters():
            key = f"{name}.{p.name}"
            if key in self._overrides:
                value = self._fit(np.asarray(self._overrides[key]), p.shape, ("parameters",),
                                  f"the given parameter {key!r}")
                p.value = value.astype(p.dtype)
                self._used_overrides.add(key)

    def _cell(self, name, spec, path):
        """A built-in cell (``stepnet.nn.GRUCell``, ...): called in a step as
        ``cell(x, h.pre)`` (LSTM ``cell(x, h.pre, c.pre)``, giving ``h, c``;
        AUGRU ``cell(x, h.pre, a)``, ``a`` the step's attention score)."""
        from .. import nn

        self._top_name(name, path)
        if isinstance(spec, dict) and "attention" in spec:
            raise self.error(path + ("attention",), "a cell takes no 'attention' key: an augru "
                             f"cell is given its score in the step, {name}(x, h.pre, a)")
        spec = self.doc.mapping(spec, path, CELL_KEYS, required=("type", "input_size", "hidden_size"))
        kind = spec["type"]
        if not isinstance(kind, str) or kind not in CELL_TYPES:
            raise self.error(path + ("type",), f"unknown cell type {kind!r}; expected one of "
                             f"{', '.join(CELL_TYPES)}" + document.did_you_mean(kind, CELL_TYPES))
        options = self._options(spec, path, kind, CELL_TYPES, "cell", ("type",))
        options["dtype"] = self._dtype(options["dtype"], path + ("dtype",)) if "dtype" in options \
            else np.promote_types(self.dtype, np.float32)
        seed = int(generator(self.seed, name).integers(2 ** 31))
        try:
            cell = nn.layers.CELLS[kind](seed=seed, **options)
        except (Error, TypeError, ValueError) as exc:
            key = next((k for k in options if k in str(exc)), None)
            raise self.error(path + ((key,) if key else ()), f"{kind} cell: {exc}") from None
        self._override_weights(name, cell)
        self.model.cells[name] = cell

    # -- nets ----------------------------------------------------------------

    def _top_net(self, name, spec, path):
        doc = self.doc
        self._top_name(name, path)
        spec = doc.mapping(spec, path, NET_KEYS, required=("inputs", "step", "outputs"))
        outputs = self._output_names(spec, path)
        reverse = self._reverse(spec, path)
        rnn = create_rnn_op(output_num=len(outputs), reverse=reverse, name=name)
        net = _TopNet(name, rnn, outputs)
        scope = Scope(globals_={**self.model.parameters, **self.model.cells})
        with self._wrap(path), rnn.stepnet():
            for local, ref in doc.mapping(spec["inputs"], path + ("inputs",)).items():
                p = path + ("inputs", local)
                self._new_local(scope, local, p)
                placeholder, source = self._top_source(ref, p, want="sequence")
                binding = self._binding_name(rnn, name, local)
                scope.names[local] = self._dsl(p, rnn.add_input, placeholder, name=binding)
                net.sources[binding] = source
            for local, ref in doc.mapping(spec.get("static_inputs"), path + ("static_inputs",)).items():
                p = path + ("static_inputs", local)
                self._new_local(scope, local, p)
                placeholder, source = self._top_source(ref, p, want="static")
                binding = self._binding_name(rnn, name, local)
                scope.names[local] = self._dsl(p, rnn.add_static_input, placeholder, name=binding)
                net.sources[binding] = source
            memories = self._memories(rnn, name, spec, path, scope, None, net)
            self._body(rnn, spec, path, scope, memories)
        self.model.nets[name] = rnn
        self.model._nets.append(net)

    def _wrap(self, path):
        builder = self

        class _Wrap:
            def __enter__(self):
                return self

            def __exit__(self, kind, exc, tb):
                if isinstance(exc, Error) and not isinstance(exc, YAMLError):
                    raise builder.error(path, str(exc)) from None
                return False

        return _Wrap()

    def _dsl(self, path, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except YAMLError:
            raise
        except Error as exc:
            raise self.error(path, str(exc)) from None

    def _new_local(self, scope, name, path):
        self.doc.name(name, path)
        if name in FUNCTIONS:
            raise self.error(path, f"{name!r} is the name of a function; choose another name")
        try:
            existing = scope.lookup(name)
        except KeyError:
            return
        what = "a parameter" if isinstance(existing, Parameter) and name in scope.globals else "defined"
        raise self.error(path, f"name {name!r} is already {what} here; each name is defined once")

    @staticmethod
    def _binding_name(rnn, net_name, local):
        """The DSL name of a binding: the YAML name unless another net of the
        same program took it (then ``net_local``)."""
        names = rnn.frame.state.names
        candidate = local
        counter = 1
        while candidate in names:
            candidate = f"{net_name}_{local}" if counter == 1 else f"{net_name}_{local}_{counter}"
            counter += 1
        return candidate

    def _reverse(self, spec, path):
        reverse = spec.get("reverse", False)
        if not isinstance(reverse, bool):
            raise self.error(path + ("reverse",), f"reverse is true or false, got {reverse!r}")
        return reverse

    def _output_names(self, spec, path):
        outputs = spec["outputs"]
        if isinstance(outputs, str):
            outputs = [outputs]
        outputs = self.doc.sequence(outputs, path + ("outputs",))
        if not outputs:
            raise self.error(path + ("outputs",), "a net needs at least one output")
        for i, o in enumerate(outputs):
            self.doc.name(o, path + ("outputs", i))
        return outputs

    def _top_source(self, ref, path, want):
        """A placeholder for the DSL and the call-time source of a top-level
        step input, static input or per-sequence initial memory."""
        match = _REF.match(ref) if isinstance(ref, str) else None
        if match is None:
            raise self.error(path, f"expected an input name or net.all.output / net.last.output, got {ref!r}")
        head, mode, output = match.groups()
        if head in self.model.inputs and mode is None:
            spec = self.model.inputs[head]
            source = _Source(input=head)
            dtype, features, levels = spec.dtype, spec.shape, spec.lod_level
        elif head in self.model.nets or head in self.model.layers:
            is_net = head in self.model.nets
            kind = "net" if is_net else "layer"
            producer = next(n for n in (self.model._nets if is_net else self.model._layers)
                            if n.name == head)
            if mode is None:
                raise self.error(path, f"{head!r} is a {kind}: use {head}.all or {head}.last "
                                 "(with .output when it has several)")
            names = producer.output_names if is_net else producer.outputs(mode)
            if output is None:
                if len(names) != 1:
                    raise self.error(path, f"{kind} {head!r} has outputs {names}; pick one: "
                                     f"{head}.{mode}.{names[0]}")
                index = 0
            elif output in names:
                index = names.index(output)
            else:
                which = "" if is_net else f"{mode}-step "
                raise self.error(path, f"{kind} {head!r} has no {which}output {output!r} (its "
                                 f"outputs: {', '.join(names)})" + document.did_you_mean(output, names))
            source = _Source(net=head, mode=mode, index=index)
            if is_net:
                producer.needed.setdefault(index, set()).add(mode)
                var = producer.rnn.program(mode == "all").eqn.outputs[index]
                dtype, features, levels = var.dtype, var.shape[1:], var.lod_depth
            elif mode == "all":
                dtype, features = producer.layer.dtype, (producer.width(),)
                levels = producer.input_levels
            elif want != "output":
                raise self.error(path, f"{ref!r} is [num_layers * num_directions, batch, hidden] "
                                 "(PyTorch's h_n); it can only be a network output")
            else:
                dtype, features, levels = producer.layer.dtype, (), 0
        else:
            choices = list(self.model.inputs) + list(self.model.nets) + list(self.model.layers)
            raise self.error(path, f"unknown input or net {head!r}" + document.did_you_mean(head, choices)
                             + (" (nets and layers read only those defined above them; layers run "
                                "before nets)" if head in (self.doc.data.get("nets") or {}) else ""))
        if want == "sequence" and levels < 1:
            raise self.error(path, f"{ref!r} has one row per sequence (lod_level 0); a step input "
                             "needs a LoD to step over (use it as a static input or an init)")
        if want == "init" and levels:
            raise self.error(path, f"{ref!r} is a sequence (lod_level {levels}); an initial memory "
                             "needs one row per sequence (lod_level 0)")
        rows = np.zeros((1,) + tuple(features), dtype)
        placeholder = LoDTensor.from_lengths(rows, [[1]] * levels) if levels else rows
        return placeholder, source

    def _memories(self, rnn, net_name, spec, path, scope, outer_scope, net):
        memories = {}
        for local, mspec in self.doc.mapping(spec.get("memories"), path + ("memories",)).items():
            p = path + ("memories", local)
            self._new_local(scope, local, p)
            mspec = self.doc.mapping(mspec, p, MEMORY_KEYS)
            shape = self.doc.shape(mspec["shape"], p + ("shape",)) if "shape" in mspec else None
            dtype = self._dtype(mspec["dtype"], p + ("dtype",)) if "dtype" in mspec else None
            init = mspec.get("init")
            binding = self._binding_name(rnn, net_name, local)
            if init is None:
                if shape is None:
                    raise self.error(p, "a memory needs shape: [...] (starts at zeros) or init:")
                handle = self._dsl(p, rnn.add_memory, shape=list(shape), name=binding, dtype=dtype)
            elif isinstance(init, bool):
                raise self.error(p + ("init",), "init must be a number, a name or an expression, "
                                 f"got {init!r}")
            elif isinstance(init, (int, float)):
                if shape is None:
                    raise self.error(p, "a number init needs shape: [...]")
                handle = self._dsl(p, rnn.add_memory, init=init, shape=list(shape), name=binding,
                                   dtype=dtype)
            elif isinstance(init, list):
                value = np.asarray(init, dtype=dtype or self.dtype)
                handle = self._dsl(p, rnn.add_memory, init=value, shape=None if shape is None
                                   else list(shape), name=binding, dtype=dtype)
            elif outer_scope is None:  # a top-level net: a parameter or a per-sequence source
                if isinstance(init, str) and init in self.model.parameters:
                    handle = self._dsl(p, rnn.add_memory, init=self.model.parameters[init],
                                       shape=None if shape is None else list(shape),
                                       name=binding, dtype=dtype)
                else:
                    placeholder, source = self._top_source(init, p + ("init",), want="init")
                    feature = placeholder.shape[1:]
                    if shape is not None and shape != feature:
                        raise self.error(p + ("init",), f"{init!r} has rows of shape {list(feature)} but "
                                         f"the memory is declared with shape {list(shape)}")
                    handle = self._dsl(p, rnn.add_memory, init=placeholder, shape=list(feature),
                                       name=binding, dtype=dtype)
                    net.sources[binding] = source
            else:  # a nested net: an expression of the enclosing step
                value = self._expression(outer_scope, init, p + ("init",))
                if isinstance(value, np.ndarray) and shape is None:
                    raise self.error(p, "an array init needs shape: [...]")
                handle = self._dsl(p, rnn.add_memory, init=value,
                                   shape=None if shape is None else list(shape),
                                   name=binding, dtype=dtype)
            scope.names[local] = handle
            memories[local] = (handle, p)
        return memories

    def _expression(self, scope, text, path):
        try:
            node = parse_expression(text)
            return Evaluator(scope, str(text)).eval(node)
        except ExpressionError as exc:
            raise self.error(path, str(exc)) from None

    # -- the step body -------------------------------------------------------

    def _body(self, rnn, spec, path, scope, memories):
        body = self.doc.sequence(spec["step"], path + ("step",))
        if not body:
            raise self.error(path + ("step",), "the step is empty; give a list of assignments")
        for i, item in enumerate(body):
            p = path + ("step", i)
            if isinstance(item, str):
                self._assignment(scope, item, p, memories)
            elif isinstance(item, dict) and "net" in item:
                self._nested_net(item, p, scope)
            elif isinstance(item, dict) and "op" in item:
                self._op_entry(scope, item, p, memories)
            else:
                raise self.error(p, "a step entry is an assignment 'h = tanh(x @ W)', an op "
                                 "{op: matmul, in: [x, W], out: xw}, or a nested net {net: name, ...}")
        for local, (handle, mpath) in memories.items():
            if handle.post is None:
                raise self.error(mpath, f"memory {local!r} is never updated in the step; assign it "
                                 f"once, e.g. '{local} = tanh(x @ W + {local}.pre @ U)'")
        values = []
        for i, name in enumerate(self._output_names(spec, path)):
            try:
                value = scope.names[name]
            except KeyError:
                raise self.error(path + ("outputs", i),
                                 f"output {name!r} is not a value of this step"
                                 + document.did_you_mean(name, scope.names)) from None
            if isinstance(value, NestedNet) or not isinstance(value, Value):
                raise self.error(path + ("outputs", i), f"output {name!r} is not a step value")
            values.append(value)
        self._dsl(path + ("outputs",), rnn.add_outputs, *values)

    def _assignment(self, scope, text, path, memories):
        try:
            names, node, unpack = parse_assignment(text)
            value = Evaluator(scope, text.strip()).eval(node)
        except ExpressionError as exc:
            raise self.error(path, str(exc)) from None
        self._assign(scope, names, value, unpack, path, memories)

    def _assign(self, scope, names, value, unpack, path, memories):
        if unpack:
            if not isinstance(value, (list, tuple)) or len(value) != len(names):
                got = len(value) if isinstance(value, (list, tuple)) else 1
                raise self.error(path, f"{len(names)} names on the left but {got} value(s) on the right")
            values = list(value)
        else:
            if isinstance(value, (list, tuple)):
                raise self.error(path, f"the right side gives {len(value)} values; unpack them: "
                                 f"{', '.join(f'v{i}' for i in range(len(value)))} = ...")
            values = [value]
        for name, v in zip(names, values):
            if name in memories:
                handle, _ = memories[name]
                if handle.post is not None:
                    raise self.error(path, f"memory {name!r} is updated twice in one step")
                if not isinstance(v, Value):
                    raise self.error(path, f"memory {name!r} must be updated with a step value, "
                                     f"not a constant")
                self._dsl(path, handle.update, v)
                continue
            try:
                existing = scope.lookup(name)
            except KeyError:
                existing = None
            if isinstance(existing, MemoryHandle):
                raise self.error(path, f"{name!r} is a memory of an enclosing net; a net updates "
                                 "only its own memories")
            if existing is not None or name in FUNCTIONS:
                raise self.error(path, f"name {name!r} is already defined; each name is assigned "
                                 "once (values are not variables)")
            scope.names[name] = v

    def _op_entry(self, scope, item, path, memories):
        op = item["op"]
        if not isinstance(op, str) or op not in FUNCTIONS:
            raise self.error(path + ("op",), f"unknown op {op!r}" + document.did_you_mean(op, FUNCTIONS))
        for key in ("in", "out"):
            if key not in item:
                raise self.error(path, f"op {op!r}: missing key {key!r}")
        ins = item["in"]
        ins = self.doc.sequence(ins if isinstance(ins, list) else [ins], path + ("in",))
        args = [self._expression(scope, x, path + ("in", i)) for i, x in enumerate(ins)]
        attrs = {}
        for key, value in item.items():
            if key in ("op", "in", "out"):
                continue
            if not isinstance(value, (int, float)):
                raise self.error(path + (key,), f"op attribute {key!r} must be a number or boolean, "
                                 f"got {value!r}")
            attrs[key] = value
        if op in LIST_FUNCTIONS:
            args = [args]

        def fail(message):
            raise self.error(path, message)

        value = call_function(op, args, attrs, fail)
        out = item["out"]
        names = out if isinstance(out, list) else [out]
        for i, n in enumerate(names):
            self.doc.name(n, path + ("out",) + ((i,) if isinstance(out, list) else ()))
        self._assign(scope, names, value, isinstance(out, list), path, memories)

    def _nested_net(self, item, path, scope):
        doc = self.doc
        spec = doc.mapping(item, path, NESTED_KEYS, required=("inputs", "step", "outputs"))
        name = doc.name(spec["net"], path + ("net",))
        self._new_local(scope, name, path + ("net",))
        outputs = self._output_names(spec, path)
        # the enclosing step's values are evaluated before the inner block opens
        sources = {}
        for key in ("inputs", "static_inputs"):
            for local, text in doc.mapping(spec.get(key), path + (key,)).items():
                sources[(key, local)] = self._expression(scope, text, path + (key, local))
        inner = create_rnn_op(output_num=len(outputs), reverse=self._reverse(spec, path), name=name)
        inner_scope = Scope(parent=scope)
        with self._wrap(path), inner.stepnet():
            for (key, local), value in sources.items():
                p = path + (key, local)
                self._new_local(inner_scope, local, p)
                binding = self._binding_name(inner, name, local)
                add = inner.add_input if key == "inputs" else inner.add_static_input
                inner_scope.names[local] = self._dsl(p, add, value, name=binding)
            memories = self._memories(inner, name, spec, path, inner_scope, scope, None)
            self._body(inner, spec, path, inner_scope, memories)
        scope.names[name] = NestedNet(inner, outputs)

    # -- network outputs -------------------------------------------------------

    def _outputs(self, outputs):
        doc = self.doc
        outputs = doc.mapping(outputs, ("outputs",))
        if not outputs:
            raise self.error(("outputs",), "a model needs at least one output: name: net.all.output")
        for name, ref in outputs.items():
            path = ("outputs", name)
            doc.name(name, path)
            if isinstance(ref, str) and ref in self.model.inputs:
                raise self.error(path, f"{ref!r} is an input; outputs are net.all.output or "
                                 "net.last.output")
            match = _REF.match(ref) if isinstance(ref, str) else None
            if match and match.group(1) in self.model.nets and match.group(2) is None:
                raise self.error(path, f"{ref!r} is a net: write {ref}.all (every step) or "
                                 f"{ref}.last (each sequence's last step)")
            _, source = self._top_source(ref, path, want="output")
            self.model._output_sources[name] = source
            self.model.outputs.append(name)


__all__ = ["InputSpec", "Model", "load_yaml"]
