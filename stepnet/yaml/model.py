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
from pathlib import Path

import numpy as np

from ..errors import Error, SizeError, YAMLError
from ..lod import LoDTensor
from ..nn import cells
from ..npz import open_npz
from ..tracing import Parameter
from . import document
from .expressions import FUNCTIONS
from .initializers import InitError, generator, initialize
from .network import InputSpec, LayerEntry, Model, Source
from .steps import NetBuilder

TOP_KEYS = ("name", "description", "dtype", "quantize", "inputs", "parameters", "layers", "cells",
            "nets", "outputs")
INPUT_KEYS = ("shape", "dtype", "lod_level", "random", "description")
PARAM_KEYS = ("shape", "dtype", "init", "from", "description", "mean", "std", "low", "high",
              "gain", "value")
RANDOM_KINDS = ("normal", "uniform", "onehot")
DTYPES = ("float16", "float32", "float64")
_COMMON_LAYER = ("type", "input", "description", "hidden_size", "num_layers", "direction",
                 "combine", "activations", "activation_alpha", "activation_beta", "clip", "dtype",
                 "bias")
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


class _Builder(NetBuilder):
    """Builds a :class:`Model` from a read document: its inputs, parameters,
    layers and cells here, its nets in :class:`NetBuilder`, then its
    outputs."""

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
        if "quantize" in data:
            return self._quantized(data["quantize"])
        return self.model

    def _quantized(self, mode):
        from ..quantize import MODES, quantize

        if mode not in MODES:
            raise self.error(("quantize",), f"quantize must be one of {list(MODES)}, got {mode!r}")
        try:
            return quantize(self.model, mode)
        except Error as e:
            raise self.error(("quantize",), str(e)) from None

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
            with open_npz(self.overrides) as npz:
                return {k: npz[k] for k in npz.files}
        except (OSError, ValueError) as exc:
            # the file given for the overrides is at fault, not a line of the model's
            err = YAMLError(f"{self.overrides}: cannot read the parameters to override: {exc}")
            err.file, err.line, err.key = str(self.overrides), None, None
            raise err from None

    def _from_file(self, ref, name, path):
        if not isinstance(ref, str):
            raise self.error(path, f"from: expects 'file.npz:key', got {ref!r}")
        file, _, key = ref.rpartition(":") if ":" in ref else (ref, "", name)
        key = key or name
        full = Path(file)
        if not full.is_absolute():
            full = self.doc.path.parent / full
        try:
            with open_npz(full) as npz:
                files = npz.files
                value = npz[key] if key in files else None
        except (OSError, ValueError) as exc:
            raise self.error(path, f"cannot read {str(full)!r}: {exc}") from None
        if value is None:
            raise self.error(path, f"{file} has no array {key!r} (it has {', '.join(files)})"
                             + document.did_you_mean(key, files))
        return value

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
            raise self.error(path + _option_named(options, exc), f"{kind} layer: {exc}") from None
        self._override_weights(name, layer)
        entry = LayerEntry(name, layer, source, placeholder.num_levels, attention)
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
            raise self.error(path + _option_named(options, exc), f"{kind} cell: {exc}") from None
        self._override_weights(name, cell)
        self.model.cells[name] = cell

    # -- references to the model's inputs, nets and layers ----------------------

    def _top_source(self, ref, path, want):
        """A placeholder for the DSL and the call-time source of a top-level
        step input, static input or per-sequence initial memory."""
        match = _REF.match(ref) if isinstance(ref, str) else None
        if match is None:
            raise self.error(path, f"expected an input name or net.all.output / net.last.output, got {ref!r}")
        head, mode, output = match.groups()
        if head in self.model.inputs and mode is not None:
            raise self.error(path, f"{head!r} is an input: give it by its name ({head}); .{mode} "
                             "follows a net or a layer")
        if head in self.model.inputs:
            spec = self.model.inputs[head]
            source = Source(input=head)
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
            source = Source(net=head, mode=mode, index=index)
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


def _option_named(options, exc) -> tuple:
    """``(key,)`` of the option an error's message names first (``proj_size
    must lie in [0, hidden_size)`` is about proj_size), or ``()``."""
    text = str(exc)
    named = [(text.index(k), k) for k in options if k in text]
    return (min(named)[1],) if named else ()


__all__ = ["InputSpec", "Model", "load_yaml"]
