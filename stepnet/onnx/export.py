"""``stepnet.onnx.export``: step-nets, built-in layers and YAML networks as
ONNX models (opset 17) that onnxruntime runs to stepnet's numbers.

>>> import numpy as np, stepnet as sn
>>> gru = sn.nn.GRU(3, 4, seed=0)
>>> model = sn.onnx.export(gru, "gru.onnx")             # doctest: +SKIP
>>> [i.name for i in model.graph.input]                  # doctest: +SKIP
['X', 'lengths']

Layout (docs/onnx-export.md has the whole of it): sequences come batch-first
and right-padded, ``X [B, T, ...]``, with ``lengths`` (int64 ``[B]``); a
nested (k-level) input is ``[B, T0, ..., T(k-1), ...]`` with one more lengths
input per deeper level. Static inputs and per-sequence initial memories are
``[B, ...]`` inputs named as in the step-net. Parameters are initializers.
All-steps outputs are ``[B, T, ...]``, zero past each length; last-step
outputs ``[B, ...]``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..dsl import RNNOp
from ..errors import Error, StepNetError, UnsupportedError
from ..ir import rnn_parts
from ..lod import LoDTensor
from .export_graph import (
    IR_VERSION,
    OPSET,
    Graph,
    ModelBuilder,
    Ragged,
    StepNet,
    _onnx,
    check_supported,
    emit_rnn,
    tensor_type,
)

def export(obj, path=None, *, output_all_steps=True, output_names=None, initial_states=False,
           as_scan=False):
    """Write ``obj`` as an ONNX model to ``path`` (if given) and return it
    (an ``onnx.ModelProto``, checked with ``onnx.checker.check_model(...,
    full_check=True)``).

    ``obj`` is a top-level step-net (``RNNOp``), a built-in layer
    (``stepnet.nn.RNN``, ``LSTM``, ``GRU``, ``AUGRU``, ``MGU``) or a YAML network
    (``stepnet.load_yaml(...)``): its layers, then its nets, in one graph.

    Options that do not apply to ``obj``'s kind are refused, not ignored.
    The model's layout (batch-first, right-padded inputs with ``lengths``) is
    described in docs/onnx-export.md.

    Parameters
    ----------
    obj : RNNOp, stepnet.nn layer or stepnet.yaml.Model
        A top-level step-net, a built-in layer (``stepnet.nn.RNN``,
        ``LSTM``, ``GRU``, ``AUGRU``, ``MGU``) or a YAML network
        (``stepnet.load_yaml(...)``): its layers, then its nets, in one graph.
    path : str or os.PathLike, optional
        Where to write the model; its folder must exist. None: nothing is
        written.
    output_all_steps : bool or sequence of bool, default True
        Step-nets only: one bool, or one per output, as in
        ``rnn(output_all_steps=...)``.
    output_names : sequence of str, optional
        Step-nets only: the graph outputs' names. None: the memory's name,
        or ``output<i>``, plus ``_all`` or ``_last``.
    initial_states : bool, default False
        Layers only: add ``h0`` (LSTM also ``c0``) inputs,
        ``[num_layers * num_directions, B, H]``; without them states start
        at 0.
    as_scan : bool, default False
        Layers and YAML networks: ``Scan`` nodes even where ONNX has a GRU,
        LSTM or RNN operator. Layers ONNX has no operator for (AUGRU, MGU,
        ``bidirectional_sum``, ``combine="final"`` stacks, ``proj_size``)
        are always exported as ``Scan``.

    Returns
    -------
    onnx.ModelProto
        Opset 17, checked with ``onnx.checker.check_model(...,
        full_check=True)``.

    Raises
    ------
    UnsupportedError
        ``obj`` is of another kind, uses what the export does not support,
        or ONNX is not installed; the message names what.
    StepNetError
        An option given that does not apply to ``obj``'s kind.
    Error
        ``path`` cannot be written.
    """
    from ..nn.base import _RecurrentLayer
    from ..yaml.model import Model

    _not_quantized(obj)
    if isinstance(obj, RNNOp):
        _only_for("a step-net", initial_states=initial_states, as_scan=as_scan)
        model = _step_net_model(obj, output_all_steps, output_names)
    elif isinstance(obj, _RecurrentLayer):
        _only_for("a built-in layer", output_all_steps=output_all_steps is not True,
                  output_names=output_names)
        model = _layer_model(obj, initial_states, as_scan)
    elif isinstance(obj, Model):
        _only_for("a YAML network", output_all_steps=output_all_steps is not True,
                  output_names=output_names, initial_states=initial_states)
        model = _yaml_model(obj, as_scan)
    else:
        raise UnsupportedError(
            f"export: expected a step-net (sn.create_rnn_op), a stepnet.nn layer or a YAML "
            f"network (sn.load_yaml), got {type(obj).__name__}")
    onnx = _onnx()
    onnx.checker.check_model(model, full_check=True)
    if path is not None:
        _save(model, path)
    return model


def to_nested_padded(X: LoDTensor):
    """``(padded, lengths)``: a k-level LoDTensor as the exported models take
    it, ``padded [B, T0, ..., T(k-1), *features]`` (zeros past the lengths)
    and per level the int64 lengths ``[B]``, ``[B, T0]``, ... (0 where a
    sequence does not exist).

    >>> X = LoDTensor.from_lengths(np.arange(5.0)[:, None], [[2, 1], [1, 0, 4]])
    >>> padded, (top, inner) = to_nested_padded(X)
    >>> padded.shape, top.tolist(), inner.tolist()
    ((2, 2, 4, 1), [2, 1], [[1, 0], [4, 0]])
    """
    levels = [np.asarray(level, np.int64) for level in X.levels]
    num_sequences = len(levels[0]) - 1
    coords = np.arange(num_sequences)[:, None]  # per sequence of the level: its position
    shape, lengths = [num_sequences], []
    for offsets in levels:
        counts = np.diff(offsets)
        per_position = np.zeros(shape, np.int64)
        per_position[tuple(coords.T)] = counts
        lengths.append(per_position)
        shape.append(int(counts.max()) if counts.size else 0)
        owner = np.repeat(np.arange(len(counts)), counts)
        position = np.arange(offsets[-1]) - offsets[owner]
        coords = np.concatenate([coords[owner], position[:, None]], axis=1)
    padded = np.zeros(tuple(shape) + tuple(X.data.shape[1:]), X.data.dtype)
    padded[tuple(coords.T)] = X.data
    return padded, lengths


# ----------------------------------------------------------------------------
# step-nets


class _TopGraph:
    """The main graph: its inputs by name (one input may feed several
    bindings), its constants and outputs."""

    def __init__(self, name, taken):
        self.builder = ModelBuilder(taken)
        self.graph = Graph(self.builder, name)
        self.declared = {}
        self.lengths = {}  # a group of inputs sharing their LoD (None: the first) -> its lengths
        self.lengths_name = None  # (reserved before the Parameters are named: top_lengths)
        self.groups = {}  # of a YAML network: each LoD input -> its group (_lod_groups)

    def input(self, name, dtype, shape) -> str:
        if name not in self.declared:
            self.builder.names.add(name)
            self.graph.inputs.append(self.graph.value_info(name, dtype, shape))
            self.declared[name] = name
        return name

    def top_lengths(self, group=None) -> str:
        """The ``[B]`` lengths of the top level, shared by every sequence input
        of a step-net; of a YAML network, by each ``group`` of its inputs
        (``lengths`` the first's, ``<input>_lengths`` another's)."""
        if group not in self.lengths:
            name = (self.lengths_name or self.builder.fresh("lengths") if group is None
                    else self.builder.fresh(f"{group}_lengths"))
            self.lengths[group] = self.input(name, np.int64, ["batch"])
        return self.lengths[group]

    @staticmethod
    def steps(group) -> str:
        """The name of the top-level time axis of a ``group`` of inputs."""
        return "steps" if group is None else f"{group}_steps"

    def ragged_input(self, name, var, shared_top) -> Ragged:
        """Input ``name`` of a ``lod_depth``-level value: padded, plus lengths
        per level (the top level's shared, by its group's inputs, when
        ``shared_top``)."""
        group = self.groups.get(name)
        steps = [f"{name}_steps_{j}" if not shared_top else
                 (self.steps(group) if j == 0 else f"{self.steps(group)}_{j}")
                 for j in range(var.lod_depth)]
        padded = self.input(name, var.dtype, ["batch"] + steps + list(var.shape[1:]))
        lengths = []
        for level in range(var.lod_depth):
            if level == 0 and shared_top:
                lengths.append(self.top_lengths(group))
            else:
                lengths.append(self.input(self.builder.fresh(f"{name}_lengths_{level}"), np.int64,
                                          ["batch"] + steps[:level]))
        return Ragged(padded, tuple(lengths))

    def constants(self, rnn, env):
        for var in rnn.program(True).consts:
            env[id(var)] = self.builder.initializer(self.builder.fresh(var.name),
                                                    rnn.const_values()[var])

    def output(self, value, name, dtype, shape):
        value = value.padded if isinstance(value, Ragged) else value
        self.graph.add("Identity", [value], names=[name])
        self.graph.add_output(name, dtype, shape)

    def model(self, doc):
        onnx = _onnx()
        graph = self.graph.make(self.builder.initializers)
        model = onnx.helper.make_model(graph, producer_name="stepnet", doc_string=doc,
                                       opset_imports=[onnx.helper.make_opsetid("", OPSET)])
        model.ir_version = IR_VERSION
        return model


def _step_net_model(rnn, output_all_steps, output_names):
    program = rnn.program(True)
    body = program.eqn.attrs["body"]
    check_supported(body, f"step-net {rnn.name}")
    modes = [("all",) if flag else ("last",) for flag in rnn.all_steps_flags(output_all_steps)]
    names = _default_output_names(body, modes)
    if output_names is not None:
        output_names = list(output_names)
        if len(output_names) != len(names):
            raise StepNetError(f"export: output_names has {len(output_names)} names for the "
                               f"{len(names)} outputs of step-net {rnn.name}")
        odd = [n for n in output_names if not isinstance(n, str) or not n]
        if odd:
            raise StepNetError(f"export: output_names must be non-empty strings, got {odd}")
        names = output_names
    inputs = [name for name, b in rnn.bindings.items() if b.kind != "init" or b.per_sequence]
    top = _TopGraph(rnn.name, taken=inputs)
    # the documented ``lengths`` input keeps its name (a Parameter called so gets a suffix)
    top.lengths_name = top.builder.fresh("lengths")
    inputs.append(top.lengths_name)
    clash = sorted(set(names) & set(inputs)) or sorted(n for n in set(names) if names.count(n) > 1)
    if clash:
        raise StepNetError(f"export: output name(s) {clash} are used twice (the inputs are "
                           f"{inputs})")
    top.builder.names.update(names)
    outputs = {(i, mode[0]): [name] for i, (mode, name) in enumerate(zip(modes, names))}
    _emit_step_net(top, rnn, {name: name for name in rnn.bindings}, outputs)
    return top.model(f"stepnet step-net {rnn.name}")


def _default_output_names(body, modes):
    names = []
    for i, (out, mode) in enumerate(zip(body.outputs, modes)):
        base = f"output{i}"
        for mem in body.memories:
            if out is mem.post:
                base = mem.name
                break
            if out is mem.pre:
                base = f"{mem.name}_prev"
        name = f"{base}_{mode[0]}"
        names.append(name if name not in names else f"{name}_{i}")
    return names


def _emit_step_net(top, rnn, input_names, outputs, produced=None):
    """The Scan of top-level step-net ``rnn`` in ``top``'s graph; its
    results, per output index a dict mode -> value (``emit_rnn``).

    ``input_names`` maps each binding to its graph input's name, or
    ``produced`` to a value computed before it in the graph (a Ragged for
    a sequence, a name for a per-sequence value); ``outputs`` maps (output
    index, "all" | "last") to graph output names.
    """
    g = top.graph
    produced = produced or {}
    eqn = rnn.program(True).eqn
    body = eqn.attrs["body"]
    seq_vars, static_vars, init_vars = rnn_parts(eqn)
    env = {}
    top.constants(rnn, env)
    seqs = [produced[v.name] if v.name in produced else
            top.ragged_input(input_names[v.name], v, shared_top=True) for v in seq_vars]
    statics = []
    for var in static_vars:
        if var.name in produced:
            statics.append(produced[var.name])
            continue
        name = input_names[var.name]
        statics.append(top.ragged_input(name, var, shared_top=False) if var.lod_depth else
                       top.input(name, var.dtype, ["batch"] + list(var.shape[1:])))
    inits = []
    for var in init_vars:
        binding = rnn.bindings[var.name]
        if var.name in produced:
            inits.append(produced[var.name])
        elif binding.per_sequence:
            inits.append(top.input(input_names[var.name], var.dtype, ["batch"] + list(var.shape[1:])))
        else:  # one value for every sequence (zeros for a shape-only memory)
            value = np.asarray(binding.value, var.dtype)
            const = top.builder.initializer(top.builder.fresh(f"{var.name}_init"), value)
            inits.append(g.batch_of(const, var.shape[1:], seqs[0].lengths[0]))
    modes = [tuple(mode for (index, mode) in outputs if index == i) for i in range(len(body.outputs))]
    net = StepNet(rnn.name, body, rnn.reverse, eqn.attrs["output_memory"])
    results = emit_rnn(g, env, net, seqs, statics, inits, modes)
    for (i, mode), names in outputs.items():
        out = body.outputs[i]
        steps = ["batch", "steps"] if mode == "all" else ["batch"]
        shape = steps + [None] * out.lod_depth + list(out.shape[1:])
        for name in names:
            top.output(results[i][mode], name, out.dtype, shape)
    return results


# ----------------------------------------------------------------------------
# built-in layers


def _layer_model(layer, initial_states, as_scan):
    top = _TopGraph(type(layer).__name__, taken=["X", "lengths", "attention", "h0", "c0",
                                                 "Y", "h_n", "c_n"])
    X = top.input("X", layer.dtype, ["batch", "steps", layer.input_size])
    lengths = top.input("lengths", np.int64, ["batch"])
    attention = None
    if layer.kind.attention:
        attention = top.input("attention", layer.dtype, ["batch", "steps"])
    initial = [top.input(name, layer.dtype, [layer.num_layers * layer.num_directions, "batch", w])
               for name, w in zip(("h0", "c0"), layer.state_widths())] if initial_states else None
    names = ["Y", "h_n", "c_n"][:1 + len(layer.state_widths())]
    _emit_layer(top, layer, X, lengths, attention, initial, as_scan,
                {name: [name] for name in names})
    return top.model(f"stepnet {layer!r}")


def _emit_layer(top, layer, X, lengths, attention, initial, as_scan, outputs):
    """Y ``[B, T, D*H]`` and the final states ``[L*D, B, H]`` of ``layer``;
    ``outputs`` maps "Y", "h_n", "c_n" to graph output names."""
    native = not as_scan
    if native:
        try:
            nodes = layer.to_onnx()
        except UnsupportedError:
            native = False  # no ONNX operator computes it: Scan
    if native:
        Y, states = _layer_nodes(top, layer, nodes if isinstance(nodes, list) else [nodes],
                                 X, lengths, initial)
    else:
        Y, states = _layer_scans(top, layer, X, lengths, attention, initial)
    L, D = layer.num_layers, layer.num_directions
    width = layer.output_size * (2 if layer.direction == "bidirectional_concat" else 1)
    shapes = {"Y": ["batch", "steps", width]}
    for name, w in zip(("h_n", "c_n"), layer.state_widths()):
        shapes[name] = [L * D, "batch", w]
    values = dict(zip(("Y", "h_n", "c_n"), [Y] + states))
    for key, names in outputs.items():
        for name in names:
            top.output(values[key], name, layer.dtype, shapes[key])
    return Y, states


def _layer_input(top, model, entry, produced):
    """The padded ``[B, T, I]`` input of YAML layer ``entry``, and its
    lengths where it is an earlier layer's Y (None for a model input of one
    LoD level: its group's, ``_TopGraph.top_lengths``)."""
    source = entry.source
    if source.input is None:
        value = produced[source.net, source.mode, source.index]
        return value.padded, value.lengths[0]
    spec = model.inputs[source.input]
    if spec.lod_level != 1:
        raise UnsupportedError(
            f"{model.path}: layer {entry.name} reads {spec.name!r} with lod_level "
            f"{spec.lod_level}; export takes a layer over a one-level input")
    group = top.groups.get(spec.name)
    X = top.input(spec.name, spec.dtype, ["batch", top.steps(group), entry.layer.input_size])
    if np.dtype(spec.dtype) != np.dtype(entry.layer.dtype):  # (the layer casts it, as when it runs)
        X = top.graph.add("Cast", [X], f"{spec.name}_{np.dtype(entry.layer.dtype).name}",
                          to=tensor_type(entry.layer.dtype))
    return X, None


def _layer_nodes(top, layer, nodes, X, lengths, initial):
    """One ONNX GRU / LSTM / RNN node per layer, time-major between them."""
    g, builder = top.graph, top.builder
    op = layer.kind.onnx
    D = layer.num_directions
    x = g.add("Transpose", [X], "x_time_major", perm=[1, 0, 2])  # [T, B, I]
    sequence_lens = g.add("Cast", [lengths], "sequence_lens", to=tensor_type(np.int32))
    finals = [[] for _ in layer.state_widths()]
    for index, node in enumerate(nodes):
        def weight(key, index=index, node=node):
            return builder.initializer(builder.fresh(f"l{index}_{key}"), node[key])

        states = [""] * 2
        for s in range(len(finals)):
            if initial is not None:
                states[s] = g.add("Slice", [initial[s], g.ints([index * D]), g.ints([(index + 1) * D]),
                                            g.ints([0])], f"l{index}_initial")
        inputs = [x, weight("W"), weight("R"), weight("B"), sequence_lens, states[0]]
        if op == "LSTM":
            inputs += [states[1], weight("P") if "P" in node else ""]
        while inputs[-1] == "":
            inputs.pop()
        attrs = {key: node[key] for key in ("hidden_size", "direction", "activations",
                                            "activation_alpha", "activation_beta", "clip",
                                            "linear_before_reset", "input_forget")
                 if node.get(key) not in (None, [])}
        results = g.add(op, inputs, f"l{index}_{op}", num_outputs=1 + len(finals), **attrs)
        for s, final in enumerate(results[1:]):
            if initial is not None:
                # onnxruntime gives zeros for an empty sequence; its state is the initial one
                started = g.add("Unsqueeze", [g.add("Greater", [lengths, g.const(0, np.int64)]),
                                              g.ints([0, 2])], "started")
                final = g.add("Where", [started, final, states[s]], "final_state")
            finals[s].append(final)
        # Y [T, D, B, H] -> [T, B, D*H], the next layer's input (D*H given: with T = 0
        # there is nothing to infer it from)
        y = g.add("Transpose", [results[0]], perm=[0, 2, 1, 3])
        x = g.add("Reshape", [y, g.ints([0, 0, D * int(node["hidden_size"])])], f"l{index}_y")
    Y = g.add("Transpose", [x], "Y_batch_first", perm=[1, 0, 2])
    return Y, [g.add("Concat", parts, "final_state", axis=0) for parts in finals]


def _layer_scans(top, layer, X, lengths, attention, initial):
    """The layer's own step-nets, one Scan each, stacked and combined as the
    layer runs them."""
    g = top.graph
    L, D = layer.num_layers, layer.num_directions
    widths = layer.state_widths()
    finals = [[None] * (L * D) for _ in widths]
    if attention is not None:
        attention = g.add("Unsqueeze", [attention, g.ints([2])], "attention_rows")

    def run(index, d, inp):
        rnn = layer.step_net(index, d)  # the layer's step-net for (layer, direction)
        eqn = rnn.program(True).eqn
        env = {}
        top.constants(rnn, env)
        seqs = [Ragged(inp, (lengths,))] + ([Ragged(attention, (lengths,))] if attention else [])
        inits = []
        for s, w in enumerate(widths):
            if initial is not None:
                inits.append(g.add("Gather", [initial[s], g.const(index * D + d, np.int64)],
                                   "initial_state", axis=0))
            else:
                inits.append(g.batch_of(g.const(0, layer.dtype), [w], lengths))
        modes = [("all",)] + [("last",)] * len(widths)
        net = StepNet(rnn.name, eqn.attrs["body"], rnn.reverse, eqn.attrs["output_memory"])
        results = emit_rnn(g, env, net, seqs, [], inits, modes)
        for s in range(len(widths)):
            finals[s][index * D + d] = results[1 + s]["last"]
        return results[0]["all"].padded

    def combined(ys, _layer):
        if len(ys) == 1:
            return ys[0]
        if layer.direction == "bidirectional_sum":
            return g.add("Add", ys, "y")
        return g.add("Concat", ys, "y", axis=-1)

    Y = layer.stack(X, run, combined)
    states = [g.add("Concat", [g.add("Unsqueeze", [v, g.ints([0])]) for v in parts],
                    "final_state", axis=0) for parts in finals]
    return Y, states


# ----------------------------------------------------------------------------
# YAML networks


# a YAML layer's results by (mode, index), as _emit_layer names them
_LAYER_VALUES = {("all", 0): "Y", ("last", 0): "h_n", ("last", 1): "c_n"}


def _lod_groups(model) -> dict:
    """Each LoD input of YAML network ``model`` -> its group, the first of
    the inputs whose top-level LoD is one (the step inputs of one net, what
    its layers and earlier nets read included), or None for the first
    group's. A net's ragged static input (an encoder's output over the
    sources, read by a decoder over the targets) keeps its own."""
    layers = {entry.name: entry for entry in model._layers}
    nets = {net.name: net for net in model._nets}
    order = [name for name, spec in model.inputs.items() if spec.lod_level]
    parent = {name: name for name in order}

    def find(name):
        while parent[name] != name:
            name = parent[name]
        return name

    def steps(net):
        return [net.sources[b] for b, binding in net.rnn.bindings.items()
                if binding.kind == "sequence" and b in net.sources]

    def root(source):
        if source.input is not None:
            return find(source.input)
        if source.net in layers:
            return root(layers[source.net].source)
        return root(steps(nets[source.net])[0])

    for net in model._nets:
        roots = sorted({root(s) for s in steps(net)}, key=order.index)
        for other in roots[1:]:
            parent[other] = roots[0]
    return {name: None if find(name) == find(order[0]) else find(name) for name in order}


def _yaml_model(model, as_scan):
    """A YAML network: its layers, then its nets, in run order, each reading
    the model's inputs or what an earlier one gives (``Ragged`` values over
    the top-level lengths of their group of inputs: ``_lod_groups``)."""
    top = _TopGraph(model.name, taken=list(model.inputs) + list(model.outputs))
    top.groups = _lod_groups(model)
    produced = {}  # (layer or net, "all" | "last", index) -> its value in the graph
    wanted = {}  # the same key -> the graph outputs that name it
    for name, src in model._output_sources.items():  # (never a model input: load_yaml)
        wanted.setdefault((src.net, src.mode, src.index), []).append(name)
    needed = {(src.net, src.mode, src.index) for net in model._nets
              for src in net.sources.values() if src.input is None}
    for entry in model._layers:
        layer = entry.layer
        X, lengths = _layer_input(top, model, entry, produced)
        attention = None
        if entry.attention is not None:  # an AUGRU's scores: padded as X is
            scores = model.inputs[entry.attention.input]
            attention = top.input(scores.name, layer.dtype, ["batch", top.steps(top.groups.get(
                entry.source.input))] + list(scores.shape))
            if scores.shape:  # rows of [1]
                attention = top.graph.add("Squeeze", [attention, top.graph.ints([2])],
                                          "attention")
        outputs = {}
        for (producer, mode, index), names in wanted.items():
            if producer == entry.name:
                outputs.setdefault(_LAYER_VALUES[mode, index], []).extend(names)
        lengths = lengths or top.top_lengths(top.groups.get(entry.source.input))
        Y, states = _emit_layer(top, layer, X, lengths, attention, None, as_scan, outputs)
        produced[entry.name, "all", 0] = Ragged(Y, (lengths,))
        for index, state in enumerate(states):
            produced[entry.name, "last", index] = state
    for net in model._nets:
        check_supported(net.rnn.program(True).eqn.attrs["body"], f"{model.path}: net {net.name}")
        input_names, earlier = {}, {}
        for binding in net.rnn.bindings:
            source = net.sources.get(binding)
            if source is not None and source.input is None:
                earlier[binding] = produced[source.net, source.mode, source.index]
            else:
                input_names[binding] = source.input if source is not None else binding
        outputs = {(index, mode): wanted.get((producer, mode, index), [])
                   for producer, mode, index in set(wanted) | needed if producer == net.name}
        results = _emit_step_net(top, net.rnn, input_names, outputs, earlier)
        for index, modes in enumerate(results):
            for mode, value in modes.items():
                produced[net.name, mode, index] = value
    top.graph.outputs.sort(key=lambda info: model.outputs.index(info.name))  # the YAML's order
    return top.model(f"stepnet YAML network {model.name} ({model.path.name})")


# ----------------------------------------------------------------------------
# checks


def _not_quantized(obj):
    if getattr(obj, "quantized", None):
        raise UnsupportedError(f"onnx.export: the model is quantized ({obj.quantized}), and its "
                               "quantized products have no ONNX form yet; export the float model "
                               "it was made from")


def _only_for(what, **given):
    """Options that do not apply to ``what`` are refused, not ignored."""
    wrong = [name for name, value in given.items() if value]
    if wrong:
        raise StepNetError(f"export: {', '.join(wrong)} does not apply to {what}")


def _save(model, path):
    path = Path(path)
    if not path.parent.is_dir():
        raise Error(f"export: cannot write {str(path)!r}: the folder {str(path.parent)!r} "
                    "does not exist")
    try:
        _onnx().save(model, str(path))
    except OSError as exc:
        raise Error(f"export: cannot write {str(path)!r}: {exc.strerror or exc}") from None
