"""The step-net IR as ONNX nodes: each op as its registry entry says
(``OpDef.onnx``) and one ``Scan`` per ``rnn`` equation.

A step-net over a padded batch is one ``Scan`` (opset 17) whose body is the
step. Sequences are right-padded, so the batch never shrinks; a mask says
which rows are inside their sequence at each step instead::

    mask[b, t] = t < lengths[b]
    for t in (range(T) if not reverse else reversed(range(T))):   # the Scan
        run the step's ops on every row
        h[b] = h_new[b] if mask[b, t] else h_prev[b]                # memories
        all_steps[b, t] = out[b] if mask[b, t] else 0                # all-steps outputs
        last[b] = out[b] if mask[b, t] else last[b]                  # last-step outputs

Scanning a right-padded sequence backwards skips its padding first (masked
steps change nothing), so ``reverse`` gives each sequence's reverse over its
own length. A ragged value (a sequence of sequences, nested any depth) is a
:class:`Ragged`: one padded tensor ``[B, T1, ..., Tk, *features]`` and its
lengths per level. A nested step-net is a ``Scan`` inside the body of its
enclosing one, stepping over the inner level; its batch is the enclosing
batch (each row's sub-sequence at this step).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import UnsupportedError
from ..ir import Literal, Var, rnn_parts
from .. import registry

OPSET = 17
IR_VERSION = 8  # the IR version of opset 17


def _onnx():
    try:
        import onnx
    except ImportError as exc:
        raise UnsupportedError("stepnet.onnx.export needs the onnx package: "
                               "pip install 'stepnet[onnx]'") from exc
    return onnx


def tensor_type(dtype) -> int:
    """The ONNX element type of a NumPy dtype."""
    onnx = _onnx()
    return onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))


@dataclass(frozen=True)
class Ragged:
    """A ragged value in ONNX form: ``padded`` is ``[B, T1, ..., Tk, *features]``
    (zeros past the lengths where it comes from a Scan), ``lengths[j]`` the
    int64 lengths of level j, shaped ``[B, T1, ..., Tj]``."""

    padded: str
    lengths: tuple

    @property
    def depth(self) -> int:
        return len(self.lengths)


@dataclass(frozen=True)
class Rows:
    """A ragged value of one level read by ops in ONNX form (an attention
    memory, a value computed from one, a nested net's every step): ``data``
    ``[R, *features]`` its rows, every batch row's one after another;
    ``segment`` ``[R]`` the batch row of each; ``place`` ``[R, 2]`` each
    row's (batch row, position) in ``source``, the Ragged it was read from
    (its padding: ``[B, M, ...]``). Row-wise ops run on ``data`` as on a
    step value's ``[B, ...]``; a step value meeting it is gathered by
    ``segment``; a segment op scatters it back to ``[B, M, ...]``."""

    data: str
    segment: str
    place: str
    source: Ragged
    per_step: bool = True  # its rows are the active rows' alone (not a static input's, all)


@dataclass(frozen=True)
class StepNet:
    """What the ONNX translation needs of one ``rnn`` equation."""

    name: str
    body: object  # ir.Block
    reverse: bool
    output_memory: tuple


class ModelBuilder:
    """Names and initializers shared by a model's main graph and its Scan bodies
    (ONNX wants each name once across them all)."""

    def __init__(self, taken=()):
        self.names = set(taken)
        self.initializers = []
        self._constants = {}

    def fresh(self, base) -> str:
        base = str(base).replace(" ", "_")
        name, n = base, 0
        while name in self.names:
            n += 1
            name = f"{base}_{n}"
        self.names.add(name)
        return name

    def initializer(self, name, array) -> str:
        """A named initializer (parameters keep their names)."""
        onnx = _onnx()
        self.names.add(name)
        self.initializers.append(onnx.numpy_helper.from_array(np.array(array, order="C"), name))
        return name

    def constant(self, value, dtype) -> str:
        """An initializer holding ``value`` as ``dtype``; equal ones are shared."""
        array = np.asarray(value, dtype=dtype)
        key = (array.dtype.str, array.shape, array.tobytes())
        if key not in self._constants:
            base = f"const_{array.item():g}" if array.size == 1 and array.dtype.kind == "f" \
                else "const"
            self._constants[key] = self.initializer(self.fresh(base), array)
        return self._constants[key]


class Graph:
    """The nodes of one ONNX graph (the main graph or a Scan body)."""

    def __init__(self, model: ModelBuilder, name):
        self.model = model
        self.name = name
        self.nodes = []
        self.inputs = []  # ValueInfoProto
        self.outputs = []
        self._expanded_masks = {}

    def fresh(self, base) -> str:
        return self.model.fresh(base)

    def const(self, value, dtype) -> str:
        return self.model.constant(value, dtype)

    def ints(self, values) -> str:
        return self.model.constant(np.asarray(values, np.int64).reshape(-1), np.int64)

    def add(self, op, inputs, base=None, num_outputs=1, names=None, **attrs):
        """Append one node; returns its output name (a list when several).
        Outputs are named after ``base`` unless ``names`` gives them."""
        onnx = _onnx()
        outputs = names or [self.fresh(base or op.lower()) for _ in range(num_outputs)]
        attrs = {k: v for k, v in attrs.items() if v is not None and not (isinstance(v, list) and not v)}
        self.nodes.append(onnx.helper.make_node(op, list(inputs), outputs,
                                                name=self.fresh(f"{self.name}/{op}"), **attrs))
        return outputs[0] if num_outputs == 1 else outputs

    def value_info(self, name, dtype, shape=None):
        return _onnx().helper.make_tensor_value_info(name, tensor_type(dtype), shape)

    def add_input(self, base, dtype, shape=None) -> str:
        name = self.fresh(base)
        self.inputs.append(self.value_info(name, dtype, shape))
        return name

    def add_output(self, name, dtype, shape=None):
        self.outputs.append(self.value_info(name, dtype, shape))

    def make(self, initializers=()):
        return _onnx().helper.make_graph(self.nodes, self.name, self.inputs, self.outputs,
                                         initializer=list(initializers))

    # -- helpers on batches -------------------------------------------------------

    def cast(self, name, from_dtype, to_dtype) -> str:
        if np.dtype(from_dtype) == np.dtype(to_dtype):
            return name
        return self.add("Cast", [name], to=tensor_type(to_dtype))

    def batch_of(self, value, row_shape, like) -> str:
        """``value`` (broadcasting to ``row_shape``) repeated for every row of
        ``like`` (any tensor whose first axis is the batch)."""
        batch = self.add("Shape", [like], "batch", start=0, end=1)
        shape = self.add("Concat", [batch, self.ints(row_shape)], "batch_shape", axis=0)
        return self.add("Expand", [value, shape], "per_row")

    def sequence_mask(self, padded, lengths, axis) -> str:
        """``mask[..., t] = t < lengths[...]`` for the time axis ``axis`` of
        ``padded``; ``lengths`` holds the axes before it."""
        steps = self.add("Shape", [padded], "steps", start=axis, end=axis + 1)
        steps = self.add("Squeeze", [steps, self.ints([0])], "steps")
        positions = self.add("Range", [self.const(0, np.int64), steps, self.const(1, np.int64)],
                             "positions")
        limits = self.add("Unsqueeze", [lengths, self.ints([-1])], "limits")
        return self.add("Less", [positions, limits], "mask")

    def ragged_mask(self, value: Ragged) -> str:
        """``[B, T1, ..., Tk]``: which entries of a ragged value exist."""
        mask = None
        for level, lengths in enumerate(value.lengths):
            level_mask = self.sequence_mask(value.padded, lengths, level + 1)
            if mask is not None:
                mask = self.add("And", [self.add("Unsqueeze", [mask, self.ints([-1])]),
                                        level_mask], "mask")
            else:
                mask = level_mask
        return mask

    def expand_mask(self, mask, mask_rank, rank) -> str:
        """``mask`` with axes of size 1 appended up to ``rank`` (for Where)."""
        if rank <= mask_rank:
            return mask
        key = (mask, rank)
        if key not in self._expanded_masks:
            self._expanded_masks[key] = self.add(
                "Unsqueeze", [mask, self.ints(range(mask_rank, rank))], "mask")
        return self._expanded_masks[key]

    def nonempty(self, value, axes, rank) -> str:
        """``value`` (of ``rank`` axes) padded with zeros to one entry on
        each of ``axes`` that has none: onnxruntime's Scan fails on a step's
        input or output with no elements (every sub-sequence empty)."""
        if not axes:
            return value
        short = self.add("Sub", [self.ints([1] * rank), self.add("Shape", [value])], "short")
        axes = self.ints([1 if a in axes else 0 for a in range(rank)])
        need = self.add("Mul", [self.add("Max", [short, self.ints([0] * rank)]), axes], "need")
        pads = self.add("Concat", [self.ints([0] * rank), need], "pads", axis=0)
        return self.add("Pad", [value, pads], "nonempty")

    def where(self, cond, a, b, dtype, base=None) -> str:
        """``Where(cond, a, b)`` for values of ``dtype``; of booleans as
        ``Or(And(cond, a), And(Not(cond), b))`` (onnxruntime has no boolean
        ``Where``)."""
        if np.dtype(dtype) != np.bool_:
            return self.add("Where", [cond, a, b], base)
        return self.add("Or", [self.add("And", [cond, a]),
                               self.add("And", [self.add("Not", [cond]), b])], base)

    def masked(self, mask, mask_rank, value, rank, dtype, otherwise=None) -> str:
        """``Where(mask, value, otherwise)``; ``otherwise`` defaults to 0."""
        if otherwise is None:
            otherwise = self.const(0, dtype)
        return self.where(self.expand_mask(mask, mask_rank, rank), value, otherwise, dtype, "masked")


# ----------------------------------------------------------------------------
# ops: each primitive's entry says how it exports (registry.OpDef.onnx)


def _operand(g, env, v, dtype=None):
    """The ONNX name of operand ``v``, cast to ``dtype`` if given (a Literal
    is a constant of that dtype: Python scalars are weak)."""
    if isinstance(v, Literal):
        return g.const(v.value, dtype)
    return env[id(v)] if dtype is None else g.cast(env[id(v)], v.dtype, dtype)


def check_supported(block, where) -> None:
    """Raise UnsupportedError naming the first op of ``block`` (or of a block
    nested in it) that has no ONNX translation."""
    for eqn in block.eqns:
        if eqn.op == "rnn":
            check_supported(eqn.attrs["body"], f"{where} > {eqn.attrs['name']}")
        elif registry.get(eqn.op).onnx is None and eqn.op not in SEGMENT_OPS:
            raise UnsupportedError(f"{where}: op {eqn.op!r} has no ONNX export")


def rows_of(g, value: Ragged, per_step=True) -> Rows:
    """A one-level ragged value's rows (``Rows``), read from its padding."""
    place = g.add("Transpose", [g.add("NonZero", [g.ragged_mask(value)])], "place")
    segment = g.add("Squeeze", [g.add("Slice", [place, g.ints([0]), g.ints([1]), g.ints([1])]),
                                g.ints([1])], "segment")
    return Rows(g.add("GatherND", [value.padded, place], "rows"), segment, place, value, per_step)


def _scattered(g, rows: Rows, fill, dtype) -> str:
    """``rows``' data in its source's padding ``[B, M, *features]``, ``fill``
    where no row is."""
    shape = g.add("Concat", [g.add("Shape", [rows.source.padded], start=0, end=2),
                             g.add("Shape", [rows.data], start=1)], "padded_shape", axis=0)
    base = g.add("Expand", [g.const(fill, dtype), shape], "padding")
    return g.add("ScatterND", [base, rows.place, rows.data], "padded")


def as_ragged(g, value, dtype):
    """A ragged value as a Ragged (``Rows`` back in their padding, zeros
    past each length), for a nested net or an output."""
    if not isinstance(value, Rows):
        return value
    return Ragged(_scattered(g, value, 0, dtype), value.source.lengths)


# the segment ops (no ``OpDef.onnx``): read over a ragged value's Rows (``_emit_over_rows``)
SEGMENT_OPS = ("seq_sum", "seq_max", "seq_expand")


def _emit_over_rows(g, env, eqn):
    """Op ``eqn`` reading ragged values (of the same LoD, as every backend
    checks), at the rows of a step's value where one is read (a step's
    rows are its active rows' alone: a static input's are read there too),
    else of the first: ``seq_sum`` and ``seq_max`` reduce its padding (zeros
    or -inf where no row is) back to ``[B, ...]``, ``seq_expand`` gathers a
    step value to the rows, any other op runs on the rows with each step
    value it reads gathered to them."""
    out = eqn.outputs[0]
    ragged = {id(v): _rows(g, env, v) for v in eqn.inputs if isinstance(v, Var) and v.lod_depth}
    rows = next((r for r in ragged.values() if r.per_step), next(iter(ragged.values())))
    if eqn.op == "seq_sum":
        env[id(out)] = g.add("ReduceSum", [_scattered(g, rows, 0, out.dtype), g.ints([1])],
                             "seq_sum", keepdims=0)
        return
    if eqn.op == "seq_max":
        env[id(out)] = g.add("ReduceMax", [_scattered(g, rows, -np.inf, out.dtype)], "seq_max",
                             axes=[1], keepdims=0)
        return
    local = dict(env)
    for v in eqn.inputs:
        if isinstance(v, Var) and v.lod_depth:
            r = ragged[id(v)]
            local[id(v)] = r.data if r.place == rows.place else g.add(
                "GatherND", [_scattered(g, r, 0, v.dtype), rows.place], "at_rows")
        elif isinstance(v, Var) and v.batched:
            local[id(v)] = g.add("Gather", [env[id(v)], rows.segment], "per_row", axis=0)
    if eqn.op == "seq_expand":
        data = local[id(eqn.inputs[0])]
    else:
        _emit_op(g, local, eqn)
        data = local[id(out)]
    env[id(out)] = Rows(data, rows.segment, rows.place, rows.source,
                        any(r.per_step for r in ragged.values()))


def _rows(g, env, v) -> Rows:
    """The Rows of ragged ``v`` (read from its padding once: kept in ``env``
    beside it, under ``("rows", id(v))``)."""
    value = env[id(v)]
    if isinstance(value, Rows):
        return value
    if value.depth != 1:
        raise UnsupportedError(f"onnx.export: {v.name}, a value of {value.depth} LoD levels, is "
                               "read by an op (only a nested net reads it in an export)")
    if ("rows", id(v)) not in env:
        env[("rows", id(v))] = rows_of(g, value)
    return env[("rows", id(v))]


def emit_eqn(g, env, eqn):
    """Translate one equation of a step into ``g``; its results go to ``env``."""
    if eqn.op == "rnn":
        _emit_nested_rnn(g, env, eqn)
        return
    if any(isinstance(v, Var) and v.lod_depth for v in eqn.inputs):
        _emit_over_rows(g, env, eqn)
    else:
        _emit_op(g, env, eqn)


def _emit_op(g, env, eqn):
    """One op as its registry entry says (``OpDef.onnx``)."""
    form = registry.get(eqn.op).onnx

    def operand(v, dtype=None):
        return _operand(g, env, v, dtype)

    if isinstance(form, str):  # one ONNX node, its operands of the result's type
        dtype = registry.result_dtype(eqn.inputs)
        env[id(eqn.outputs[0])] = g.add(form, [operand(v, dtype) for v in eqn.inputs])
    else:
        env[id(eqn.outputs[0])] = form(g, eqn, operand)


def _emit_nested_rnn(g, env, eqn):
    seq_vars, static_vars, init_operands = rnn_parts(eqn)
    body = eqn.attrs["body"]
    seqs = [as_ragged(g, env[id(v)], v.dtype) for v in seq_vars]
    statics = [as_ragged(g, env[id(v)], v.dtype) for v in static_vars]
    inits = []
    for mem, operand in zip(body.memories, init_operands):
        row_shape = mem.pre.shape[1:]
        if isinstance(operand, Var) and operand.batched:
            inits.append(g.cast(env[id(operand)], operand.dtype, mem.pre.dtype))
        else:  # one value for every sequence: a constant or a Literal
            value = _operand(g, env, operand, mem.pre.dtype)
            inits.append(g.batch_of(value, row_shape, seqs[0].lengths[0]))
    net = StepNet(eqn.attrs["name"], body, eqn.attrs["reverse"], eqn.attrs["output_memory"])
    modes = [("all",) if flag else ("last",) for flag in eqn.attrs["all_steps"]]
    results = emit_rnn(g, env, net, seqs, statics, inits, modes)
    for out, flag, result in zip(eqn.outputs, eqn.attrs["all_steps"], results):
        env[id(out)] = result["all" if flag else "last"]


# ----------------------------------------------------------------------------
# the Scan of one step-net


def emit_rnn(g, env, net: StepNet, seqs, statics, inits, modes):
    """One ``Scan`` node in ``g`` running ``net`` over ``seqs`` (Ragged values
    of one batch, equal lengths at their first level).

    ``env`` maps id(Var) to ONNX values of the enclosing scope (constants,
    and the enclosing step's values for a nested net); ``statics`` and
    ``inits`` (``[B, *shape]`` names) are in the body's order; ``modes``
    holds, per output, the forms wanted ("all", "last"). Returns per output
    a dict mode -> value: "all" a Ragged one level deeper than the output,
    "last" the output's own form.
    """
    body = net.body
    lengths = seqs[0].lengths[0]
    # (one step at least, and each deeper level's axis of one entry at least)
    seqs = [Ragged(g.nonempty(v.padded, range(1, v.depth + 1), len(var.shape) + v.depth),
                   v.lengths[:1] + tuple(g.nonempty(n, range(1, k + 2), k + 2)
                                         for k, n in enumerate(v.lengths[1:])))
            for v, var in zip(seqs, body.step_inputs)]
    mask = g.sequence_mask(seqs[0].padded, lengths, 1)  # [B, T]
    scan = Graph(g.model, f"{g.name}/{net.name}")
    inner = dict(env)
    read = {id(v) for e in body.eqns if e.op != "rnn" for v in e.inputs}
    for var, value in zip(body.static_inputs, statics):
        inner[id(var)] = value
        if var.lod_depth == 1 and id(var) in read:  # (its rows read once, before the Scan)
            inner[("rows", id(var))] = rows_of(g, value, per_step=False)
    state_inits, state_vars, trackers = _scan_states(g, scan, inner, net, inits, modes, lengths)

    # scan inputs: the mask, then each sequence's next element and lengths
    step_mask = scan.add_input("step_mask", np.bool_)
    scan_inputs = [mask]
    for var, value in zip(body.step_inputs, seqs):
        scan_inputs.append(value.padded)
        element = scan.add_input(var.name, var.dtype)
        deeper = []
        for level in value.lengths[1:]:
            scan_inputs.append(level)
            deeper.append(scan.add_input(f"{var.name}_lengths", np.int64))
        inner[id(var)] = Ragged(element, tuple(deeper)) if deeper else element

    for eqn in body.eqns:
        emit_eqn(scan, inner, eqn)
    state_outputs, scan_output_names, scan_outputs = _scan_body_outputs(scan, inner, body, modes,
                                                                        step_mask, trackers)
    for name, var in zip(state_outputs, state_vars):
        scan.add_output(name, var.dtype)
    for name, (i, level) in zip(scan_output_names, scan_outputs):
        scan.add_output(name, np.int64 if level is not None else body.outputs[i].dtype)

    direction = int(net.reverse)
    num_scan_inputs = len(scan_inputs)
    results = g.add("Scan", state_inits + scan_inputs, net.name,
                    num_outputs=len(state_outputs) + len(scan_output_names),
                    body=scan.make(), num_scan_inputs=num_scan_inputs,
                    scan_input_axes=[1] * num_scan_inputs,
                    scan_input_directions=[direction] * num_scan_inputs,
                    scan_output_axes=[1] * len(scan_output_names),
                    scan_output_directions=[direction] * len(scan_output_names))
    results = results if isinstance(results, list) else [results]
    finals, stacked = results[:len(state_outputs)], results[len(state_outputs):]
    return _per_output(g, net, modes, lengths, finals, dict(zip(scan_outputs, stacked)), trackers)


def _scan_states(g, scan, inner, net, inits, modes, lengths):
    """The Scan's state variables, added as inputs of its body ``scan``:
    the memories, then each last-step output that is not a memory's new
    value. Returns their initial values, their variables, and per such
    output its state's index (``{output index: state index}``)."""
    body = net.body
    state_inits, state_vars = [], []
    for mem, init in zip(body.memories, inits):
        inner[id(mem.pre)] = scan.add_input(f"{mem.name}_prev", mem.pre.dtype)
        state_inits.append(init)
        state_vars.append(mem.pre)
    memory_posts = {id(mem.post) for mem in body.memories}
    trackers = {}  # output index -> state index
    for i, (out, wanted) in enumerate(zip(body.outputs, modes)):
        if "last" not in wanted or out.lod_depth or id(out) in memory_posts:
            continue
        mem_index = net.output_memory[i]
        start = inits[mem_index] if mem_index >= 0 else \
            g.batch_of(g.const(0, out.dtype), out.shape[1:], lengths)
        trackers[i] = len(state_inits)
        scan.add_input(f"last_{out.name}", out.dtype)
        state_inits.append(start)
        state_vars.append(out)
    return state_inits, state_vars, trackers


def _scan_body_outputs(scan, inner, body, modes, step_mask, trackers):
    """The body's outputs, each masked by ``step_mask`` (a step past a
    sequence's end keeps a state, and gives zeros): the states' new values,
    then the values of every step wanted ("all", and every output with a
    LoD) with their lengths at each level. Returns the states' names, the
    scan outputs' names, and per scan output ``(output index, level or
    None for the values)``."""

    def rank(var):
        return len(var.shape)

    state_outputs = []
    for mem in body.memories:
        state_outputs.append(scan.masked(step_mask, 1, inner[id(mem.post)], rank(mem.pre),
                                         mem.pre.dtype, otherwise=inner[id(mem.pre)]))
    for i, index in trackers.items():
        out = body.outputs[i]
        previous = scan.inputs[index].name
        state_outputs.append(scan.masked(step_mask, 1, inner[id(out)], rank(out), out.dtype,
                                         otherwise=previous))
    scan_outputs = []  # (output index, level or None for the values)
    scan_output_names = []
    for i, (out, wanted) in enumerate(zip(body.outputs, modes)):
        value = as_ragged(scan, inner[id(out)], out.dtype)
        if out.lod_depth:
            exists = scan.add("And", [scan.expand_mask(step_mask, 1, value.depth + 1),
                                      scan.ragged_mask(value)], "mask")
            values = scan.masked(exists, value.depth + 1, value.padded, rank(out) + out.lod_depth,
                                 out.dtype)
            scan_output_names.append(scan.nonempty(values, range(1, value.depth + 1),
                                                   rank(out) + out.lod_depth))
            scan_outputs.append((i, None))
            for level, level_lengths in enumerate(value.lengths):
                lengths = scan.masked(step_mask, 1, level_lengths, level + 1, np.int64)
                scan_output_names.append(scan.nonempty(lengths, range(1, level + 1), level + 1))
                scan_outputs.append((i, level))
        elif "all" in wanted:
            scan_output_names.append(scan.masked(step_mask, 1, value, rank(out), out.dtype))
            scan_outputs.append((i, None))
    return state_outputs, scan_output_names, scan_outputs


def _per_output(g, net, modes, lengths, finals, stacked_of, trackers):
    """``emit_rnn``'s result from the Scan's final states (``finals``) and
    stacked outputs (``stacked_of``: by ``(output index, level or None)``)."""
    body = net.body
    memory_posts = {id(mem.post): i for i, mem in enumerate(body.memories)}
    per_output = [{} for _ in body.outputs]
    for i, (out, wanted) in enumerate(zip(body.outputs, modes)):
        if out.lod_depth:
            levels = tuple(stacked_of[(i, level)] for level in range(out.lod_depth))
            every_step = Ragged(stacked_of[(i, None)], (lengths,) + levels)
            if "all" in wanted:
                per_output[i]["all"] = every_step
            if "last" in wanted:
                per_output[i]["last"] = _last_of_ragged(g, every_step, lengths, net.reverse)
            continue
        if "all" in wanted:
            per_output[i]["all"] = Ragged(stacked_of[(i, None)], (lengths,))
        if "last" in wanted:
            index = memory_posts.get(id(out))
            per_output[i]["last"] = finals[index] if index is not None else finals[trackers[i]]
    return per_output


def _last_of_ragged(g, every_step: Ragged, lengths, reverse) -> Ragged:
    """Each sequence's value at its last step processed, from all of them
    (zeros for an empty sequence: its steps are all masked)."""
    if reverse:
        position = g.add("Mul", [lengths, g.const(0, np.int64)], "last_position")
    else:
        position = g.add("Max", [g.add("Sub", [lengths, g.const(1, np.int64)]),
                                 g.const(0, np.int64)], "last_position")
    index = g.add("Unsqueeze", [position, g.ints([1])], "last_index")

    def pick(name):
        return g.add("GatherND", [name, index], "last", batch_dims=1)

    return Ragged(pick(every_step.padded), tuple(pick(n) for n in every_step.lengths[1:]))
