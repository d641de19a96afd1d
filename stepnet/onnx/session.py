"""``stepnet.onnx.InferenceSession``: ONNX models on stepnet's kernels.

The session checks every node when it is made, against its operator's schema
(inputs, outputs, attributes) and against what runs it: an op outside the
default domain, one the model's opset does not have, or a malformed node
raises :class:`stepnet.errors.UnsupportedError` or :class:`~stepnet.errors.Error`
naming the node, before any data is seen. Nodes that compute only from
constants (initializers, ``Constant``) are computed then, once.

``run`` evaluates the other nodes in order:

- GRU, LSTM, RNN and Scan nodes as step-nets on the chosen backend
  (:mod:`stepnet.onnx.recurrent`);
- ``If`` and ``Loop`` here, their branches and bodies being graphs of this
  module (so recurrent nodes inside them are step-nets too);
- the ONNX Gradient operator with stepnet's reverse mode
  (:mod:`stepnet.onnx.gradient`);
- every other op with stepnet's NumPy version where it has one
  (:mod:`stepnet.onnx.ops`, :mod:`stepnet.onnx.conv`), else with the ONNX
  project's reference implementation (:mod:`stepnet.onnx.reference`); on
  the Numba backend, once a call with the same input shapes has run them
  node by node, runs of elementwise nodes as one compiled loop each
  (:mod:`stepnet.onnx.fusion`).

float16 is computed in float32 and given back as float16 (docs/design.md §4): per
node, the outputs typed like a float16 input are rounded to float16.
"""

from __future__ import annotations

import contextlib
import operator
import os
from dataclasses import dataclass

import numpy as np

from ..backends import backend as backend_info, default_backend, get_backend
from ..errors import Error, ShapeError, StepNetError, UnsupportedError, optional_import
from ..nn.cells import ONNX_LAYERS
from . import tensors
from .reading import load_model
from . import conv  # noqa: F401  (registers Conv and the pools in OPS)
from .fusion import fuse
from .gradient import GradientNode
from .ops import OPS, UNKNOWN, NodeContext, OnnxOp, is_step
from .recurrent import RecurrentNode, ScanNode
from .reference import ReferenceOp
from .static import RANDOM, SMALL, VALUE, analyse

TRAINING_DOMAIN = "ai.onnx.preview.training"
# exact in any float type: float16 is not widened for them
_MOVES = {"Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose", "Concat",
          "Split", "Slice", "Gather", "Shape", "Size", "Expand", "Tile", "Pad", "Cast",
          "CastLike", "Constant", "ConstantOfShape"}

_F16 = np.dtype(np.float16)

_TYPE_NAMES = {
    np.dtype(np.float32): "float", np.dtype(np.float16): "float16", np.dtype(np.float64): "double",
    np.dtype(np.int8): "int8", np.dtype(np.int16): "int16", np.dtype(np.int32): "int32",
    np.dtype(np.int64): "int64", np.dtype(np.uint8): "uint8", np.dtype(np.uint16): "uint16",
    np.dtype(np.uint32): "uint32", np.dtype(np.uint64): "uint64", np.dtype(np.bool_): "bool",
}


def _onnx():
    return optional_import("onnx", "stepnet.onnx", "pip install 'stepnet[onnx]'")


def _numpy_blas_threads():
    """``set(n) -> previous``: the number of threads NumPy's own OpenBLAS uses
    for calls from this thread, or None where it cannot be set.

    A run keeps it at one: the GEMMs the session leaves to NumPy (Conv,
    MatMul) are small, and OpenBLAS's pool spinning after them takes the
    cores Numba's threads need, which slows a many-stream model down
    severalfold where cores are few."""
    import ctypes
    import glob

    libs = os.path.join(os.path.dirname(np.__file__), os.pardir, "numpy.libs")
    for path in sorted(glob.glob(os.path.join(libs, "*openblas*.so*"))):
        try:
            set_local = ctypes.CDLL(path).openblas_set_num_threads_local
        except (OSError, AttributeError):
            continue
        set_local.argtypes, set_local.restype = [ctypes.c_int], ctypes.c_int
        return set_local
    return None


_BLAS_THREADS = []  # [set_local or None], found on the first session


@dataclass(frozen=True)
class NodeArg:
    """A graph input or output as onnxruntime describes it.

    What ``InferenceSession.get_inputs()`` and ``get_outputs()`` list.

    Parameters
    ----------
    name : str
        The input's or output's name in the graph.
    type : str
        Its type as onnxruntime writes it, e.g. ``"tensor(float)"`` or
        ``"seq(tensor(int64))"``.
    shape : list or None
        Its declared shape: per axis an int, a dimension name (str) or None
        (unknown).
    """

    name: str
    type: str  # e.g. "tensor(float)", "seq(tensor(int64))"
    shape: list  # ints, dimension names (str) or None


def attributes(node) -> dict:
    """A node's attributes as Python values (strings decoded, tensors as arrays)."""
    onnx = _onnx()
    out = {}
    for attr in node.attribute:
        value = onnx.helper.get_attribute_value(attr)
        if isinstance(value, bytes):
            value = value.decode()
        elif isinstance(value, list) and value and isinstance(value[0], bytes):
            value = [v.decode() for v in value]
        elif isinstance(value, onnx.TensorProto):
            value = tensors.to_array(value, f"ONNX node {node.name or node.op_type!r} attribute "
                                     f"{attr.name!r}")
        out[attr.name] = value
    return out


def _type_string(type_proto, what="") -> tuple:
    """(onnxruntime's name of a type, its NumPy dtype for a tensor, its shape)."""
    kind = type_proto.WhichOneof("value")
    if kind == "tensor_type":
        t = type_proto.tensor_type
        dtype = tensors.dtype_of(t.elem_type, what) if t.elem_type else None
        shape = None
        if t.HasField("shape"):
            shape = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                     for d in t.shape.dim]
        name = _TYPE_NAMES.get(np.dtype(dtype), str(dtype)) if dtype is not None else "unknown"
        return f"tensor({name})", dtype, shape
    if kind == "sequence_type":
        return f"seq({_type_string(type_proto.sequence_type.elem_type, what)[0]})", None, None
    if kind == "optional_type":
        return f"optional({_type_string(type_proto.optional_type.elem_type, what)[0]})", None, None
    return "unknown", None, None


def _value_info(info, where):
    name, dtype, shape = _type_string(info.type, f"ONNX {where}: {info.name!r}")
    return NodeArg(info.name, name, shape), dtype


def _schema(proto, ctx):
    """The node's operator schema at the model's opset; raises naming the node."""
    onnx = _onnx()
    try:
        schema = onnx.defs.get_schema(ctx.op, ctx.opset, "")
    except (onnx.defs.SchemaError, TypeError):  # (TypeError: a name that is not text)
        raise ctx.unsupported(f"{ctx.op} is not an operator of the default ONNX domain at "
                              f"opset {ctx.opset}") from None
    if schema.deprecated:
        raise ctx.unsupported(f"{ctx.op} is deprecated at opset {ctx.opset} (since "
                              f"{schema.since_version})")
    return schema


def _check_node(proto, schema, ctx):
    """Inputs, outputs and attributes against the schema: Error naming the node."""
    onnx = _onnx()
    where = f"ONNX node {ctx.node!r} ({ctx.op})"
    op = f"{ctx.op}-{schema.since_version}"
    n_in, n_out = len(proto.input), len(proto.output)
    if not schema.min_input <= n_in <= schema.max_input:
        raise Error(f"{where}: has {n_in} inputs, {op} takes {schema.min_input} to "
                    f"{schema.max_input}")
    if not schema.min_output <= n_out <= schema.max_output:
        raise Error(f"{where}: has {n_out} outputs, {op} gives {schema.min_output} to "
                    f"{schema.max_output}")
    single = onnx.defs.OpSchema.FormalParameterOption.Single
    for i, (name, formal) in enumerate(zip(proto.input, schema.inputs)):
        if not name and formal.option == single:
            raise Error(f"{where}: input {i} ({formal.name}) is required, the node leaves it out")
    for attr in proto.attribute:
        known = schema.attributes.get(attr.name)
        if known is None:
            raise UnsupportedError(f"{where}: attribute {attr.name!r} is not supported ({op} "
                                   f"has no such attribute)")
        if attr.ref_attr_name:
            raise UnsupportedError(f"{where}: attribute {attr.name!r} refers to a function's "
                                   "attribute outside a function")
        if known.type.value != attr.type:
            given = onnx.AttributeProto.AttributeType.Name(attr.type)
            raise Error(f"{where}: attribute {attr.name!r} is {given}, {op} expects "
                        f"{known.type.name}")
    given = {a.name for a in proto.attribute}
    for name, known in schema.attributes.items():
        if known.required and name not in given:
            raise Error(f"{where}: attribute {name!r} is required")


def _type_params(schema):
    """The type parameter (``"T"``, ``"T1"``, ...) of each formal input and
    output: an output typed like a float16 input is given back as float16."""
    return [f.type_str for f in schema.inputs], [f.type_str for f in schema.outputs]


class Node:
    """One node, checked and ready to run. ``kind`` is "op", "recurrent"
    (GRU, LSTM, RNN, Scan; ``impl``), "if", "loop" or "gradient"."""

    def __init__(self, proto, opsets, index, constants=None):
        self.proto = proto
        self.op = proto.op_type
        self.domain = proto.domain or ""
        self.inputs = list(proto.input)
        self.outputs = list(proto.output)
        self.args = list(self.inputs)  # without the omitted inputs at the end
        while self.args and not self.args[-1]:
            self.args.pop()
        self.fast = None  # the table entry bound to this node (prepare)
        self.widen = False  # float16 inputs are computed in float32
        name = proto.name or f"{self.op}_{index}"
        domain = "" if self.domain in ("", "ai.onnx") else self.domain
        if domain not in opsets:
            raise UnsupportedError(f"ONNX node {name!r} ({self.op}): domain {self.domain!r} is not "
                                   "imported by the model")
        self.ctx = NodeContext(name, self.op, opsets[domain], num_outputs=len(self.outputs))
        self.attrs = attributes(proto)
        self.impl = None  # RecurrentNode, ScanNode or GradientNode
        self.entry = OPS.get(self.op) or OnnxOp(self.op, None, in_step=False)
        self.table = None  # the OPS entry that runs the node, if any
        self.reference = None
        self.captures = []  # outer-scope names read by its subgraphs
        self.dynamic_captures = []  # ... those that are not constants of the enclosing graph
        self.subgraphs = {}
        self.types = None
        if domain == TRAINING_DOMAIN and self.op == "Gradient":
            self.kind = "gradient"
            self.impl = GradientNode(self.ctx, self.attrs, self.inputs)
            return
        if domain != "":
            raise self.ctx.unsupported(f"domain {self.domain!r} is not supported (stepnet runs "
                                       "the default ONNX domain)")
        schema = _schema(proto, self.ctx)
        _check_node(proto, schema, self.ctx)
        tensors.check_constant_types(proto, schema, constants or {}, f"ONNX node {name!r} ({self.op})")
        self.types = _type_params(schema)
        self.widen = self.op not in _MOVES
        for key in ("body", "then_branch", "else_branch"):
            if key in self.attrs:
                graph = Graph(self.attrs[key], opsets, where=f"the {key} of {name!r}", outer=True,
                              outer_constants=constants)
                self.subgraphs[key] = graph
                self.captures += [c for c in graph.captures if c not in self.captures]
                self.dynamic_captures += [c for c in graph.dynamic_captures
                                          if c not in self.dynamic_captures]
        if self.op in ONNX_LAYERS:
            self.kind = "recurrent"
            self.impl = RecurrentNode(self.ctx, self.attrs)
        elif self.op == "Scan":
            self.kind = "recurrent"
            self.impl = ScanNode(self.ctx, self.attrs, self.subgraphs["body"])
        elif self.op == "If":
            self.kind = "if"
            self.then_branch, self.else_branch = (self.subgraphs["then_branch"],
                                                  self.subgraphs["else_branch"])
            for branch in (self.then_branch, self.else_branch):
                if len(branch.output_names) != len(self.outputs):
                    raise Error(f"ONNX node {name!r} (If): a branch gives "
                                f"{len(branch.output_names)} outputs, the node has "
                                f"{len(self.outputs)}")
        elif self.op == "Loop":
            self.kind = "loop"
            self._check_loop()
        else:
            self.kind = "op"
            entry = OPS.get(self.op)
            if entry is not None and entry.run is not None and set(self.attrs) <= entry.attrs:
                self.table = entry
            self.reference = ReferenceOp(proto, self.ctx, opsets)

    @property
    def recurrent(self) -> bool:
        return self.kind == "recurrent"

    def prepare(self, known):
        """Bind the table entry to what is known before any run (``known``:
        the constants by name): what the attributes and constant inputs
        decide is worked out once."""
        if self.kind == "op" and self.table is not None and self.table.bind is not None:
            values = [known.get(n, UNKNOWN) if n else None for n in self.args]
            self.fast = self.table.bind(self.ctx, values, **self.attrs)
        if self.fast is not None:
            if not self.args or not self.outputs or not self.outputs[0]:
                self.fast = None
            else:  # what Graph.run reads: the inputs (an omitted one is env[""])
                self.get = operator.itemgetter(*self.args)
                self.single, self.out = len(self.args) == 1, self.outputs[0]

    # -- running -----------------------------------------------------------------

    def run(self, graph, env, backend, step=False, rows=False, float16_as_float32=False,
            use_fast=True, key=None):
        """Compute the node from ``env`` into ``env`` (``Graph._run`` inlines
        the common case, an op bound to its table entry)."""
        if self.kind == "gradient":
            outs = self.impl.run(graph, env, backend)
        elif self.kind == "if" and not step:
            outs = self._run_if(env, backend, key)
        else:
            inputs = [env[n] if n else None for n in self.args]
            if self.kind == "op":
                outs = None
                if use_fast and self.fast is not None and not step:
                    outs = self._run_bound(inputs)
                if outs is None:
                    outs = graph.run_op(self, inputs, step, rows, float16_as_float32)
            else:
                if step and (any(is_step(x) for x in inputs)
                             or any(is_step(env[n]) for n in self.dynamic_captures)):
                    raise self.ctx.unsupported("a recurrent or control-flow node on a Scan state "
                                               "or scan input (the body runs node by node)")
                if self.op == "Scan":
                    outs = self.impl.run(inputs, backend,
                                         {n: env[n] for n in self.dynamic_captures})
                elif self.kind == "recurrent":
                    outs = self.impl.run(inputs, backend)
                elif self.kind == "if":
                    outs = self._run_if(env, backend)
                else:
                    outs = self._run_loop(inputs, {n: env[n] for n in self.dynamic_captures},
                                          backend)
        for name, value in zip(self.outputs, outs):
            if name:
                env[name] = value

    def _run_bound(self, inputs):
        """The outputs by the bound table entry, or None where it declines (or
        a float16 input must be widened first: ``Graph.run_op``)."""
        if self.widen and any(type(x) is np.ndarray and x.dtype == _F16 for x in inputs):
            return None
        try:
            out = self.fast(*inputs)
        except (TypeError, ValueError, IndexError) as e:  # NumPy's own complaints
            if isinstance(e, Error):
                raise
            raise ShapeError(f"ONNX node {self.ctx.node!r} ({self.op}): {e}") from e
        if out is NotImplemented:
            return None
        return [out if type(out) is np.ndarray or isinstance(out, list) or out is None
                else np.asarray(out)]

    def _run_if(self, env, backend, key=None):
        cond = env[self.inputs[0]]
        if cond.size != 1:
            raise ShapeError(f"ONNX node {self.ctx.node!r} (If): cond has shape "
                             f"{list(np.shape(cond))}, not one element")
        branch = self.then_branch if cond.item() else self.else_branch
        inner = {n: env[n] for n in branch.dynamic_captures}
        branch.run(inner, backend, key=key)
        return [inner[n] for n in branch.output_names]

    def _check_loop(self):
        body = self.subgraphs["body"]
        carried = len(self.inputs) - 2
        if len(body.input_names) != carried + 2 or len(body.output_names) < carried + 1:
            raise Error(f"ONNX node {self.ctx.node!r} (Loop): its body has "
                        f"{len(body.input_names)} inputs and {len(body.output_names)} outputs "
                        f"for {carried} loop-carried values")
        if len(self.outputs) != len(body.output_names) - 1:
            raise Error(f"ONNX node {self.ctx.node!r} (Loop): has {len(self.outputs)} outputs, "
                        f"its body gives {len(body.output_names) - 1}")

    def _run_loop(self, inputs, captures, backend):
        """``for i in range(M) while cond: cond, v..., scan... = body(i, cond, v...)``;
        scan outputs stacked on a new first axis."""
        body = self.subgraphs["body"]
        inputs = list(inputs) + [None] * (len(self.inputs) - len(inputs))
        trips, cond, values = inputs[0], inputs[1], list(inputs[2:])
        trips = None if trips is None else int(np.asarray(trips).reshape(-1)[0])
        cond = True if cond is None else bool(np.asarray(cond).reshape(-1)[0])
        N = len(values)
        scans = [[] for _ in range(len(body.output_names) - 1 - N)]
        i = 0
        while cond and (trips is None or i < trips):
            env = {n: captures[n] for n in body.dynamic_captures}
            env[body.input_names[0]] = np.array(i, np.int64)
            env[body.input_names[1]] = np.array(cond)
            env.update(zip(body.input_names[2:], values))
            body.run(env, backend)
            outs = [env[n] for n in body.output_names]
            cond = bool(np.asarray(outs[0]).reshape(-1)[0])
            values = outs[1:1 + N]
            for k, y in enumerate(outs[1 + N:]):
                scans[k].append(np.asarray(y))
            i += 1
        stacked = []
        for k, ys in enumerate(scans):
            if ys:
                stacked.append(np.stack(ys))
            else:
                dtype = body.output_dtypes[1 + N + k] or np.float32
                stacked.append(np.zeros((0,), dtype))
        return values + stacked


class Graph:
    """An ONNX graph (a model's, a branch or a body) ready to run.

    ``outer=True`` marks a subgraph: names it reads but does not define are
    taken from the enclosing graph (``captures``)."""

    def __init__(self, proto, opsets, where="graph", outer=False, outer_constants=None):
        self.where = where
        self.initializers = {t.name: tensors.to_array(t, f"ONNX {where}: initializer")
                             for t in proto.initializer}
        for sparse in proto.sparse_initializer:
            self.initializers[sparse.values.name] = tensors.dense(sparse, f"ONNX {where}: sparse "
                                                                  "initializer")
        self.input_args, self.input_dtypes = [], {}
        for info in proto.input:
            arg, dtype = _value_info(info, f"{where} input")
            self.input_args.append(arg)
            self.input_dtypes[info.name] = dtype
        self.input_names = [i.name for i in proto.input]
        outputs = [_value_info(o, f"{where} output") for o in proto.output]
        self.output_args = [a for a, _ in outputs]
        self.output_dtypes = [d for _, d in outputs]
        self.output_names = [o.name for o in proto.output]
        defined = set(self.input_names) | set(self.initializers)
        # what is known before any run: initializers that cannot be fed, the
        # enclosing graph's constants, and what nodes compute from them alone
        known = {k: v for k, v in (outer_constants or {}).items() if k not in defined}
        known.update((k, v) for k, v in self.initializers.items() if k not in self.input_names)
        folding = not any(p.domain == TRAINING_DOMAIN for p in proto.node)
        self.nodes, self.captures, self.plan, self.constants = [], [], [], {}
        for i, p in enumerate(proto.node):
            for name in p.input:
                if name and name not in defined and name not in self.captures:
                    if not outer:
                        raise StepNetError(f"ONNX {where}: node {p.name or p.op_type!r} reads "
                                           f"{name!r}, which nothing before it defines")
                    self.captures.append(name)
            node = Node(p, opsets, i, constants=known if folding else {})
            self.nodes.append(node)
            for name in node.captures:
                if name not in defined and name not in self.captures:
                    if not outer:
                        raise StepNetError(f"ONNX {where}: a subgraph of node {node.ctx.node!r} "
                                           f"reads {name!r}, which nothing before it defines")
                    self.captures.append(name)
            for name in p.output:
                if name and name in defined:
                    raise Error(f"ONNX {where}: node {node.ctx.node!r} ({node.op}) defines "
                                f"{name!r}, which is already defined")
            defined.update(n for n in p.output if n)
            if folding and node.kind == "op" and node.op not in RANDOM and all(
                    n in known for n in node.inputs if n):
                self._fold(node, known)
            else:
                node.prepare(known)
                self.plan.append(node)
        for name in self.output_names:
            if name not in defined and name not in self.captures:
                if not outer:
                    raise StepNetError(f"ONNX {where}: output {name!r} is computed by no node")
                self.captures.append(name)
        # what a run puts into its environment: the constants the nodes left
        # to run (and their subgraphs) read, the enclosing graph's constants
        # it captures (bound here, not copied in on each run), and
        # initializers a feed may replace
        read = set(self.output_names)
        for node in self.plan:
            read.update(node.inputs)
            read.update(node.captures)
        outer = {n: known[n] for n in self.captures if n in known}
        self.dynamic_captures = [n for n in self.captures if n not in outer]
        self.run_constants = {k: v for k, v in {**self.initializers, **self.constants,
                                                **outer}.items()
                              if k in read and k not in self.input_names}
        self.defaults = {k: v for k, v in self.initializers.items() if k in self.input_names}
        self.constants32 = {k: v.astype(np.float32)
                            if isinstance(v, np.ndarray) and v.dtype == np.float16 else v
                            for k, v in {**self.run_constants, **self.defaults}.items()}
        for value in [*self.initializers.values(), *self.constants.values(),
                      *self.constants32.values()]:
            _read_only(value)  # shared by every run
        self.widen = True  # a node may meet float16 (_no_widening clears it)
        self.decided, self.rest, self.memo = [], self.plan, {}
        self.fused = {}  # key -> its plan with runs of elementwise nodes fused (_fuse)

    def _fold(self, node, known):
        """Compute a node that reads only constants, once, now."""
        inputs = [known[n] if n else None for n in node.inputs]
        while inputs and inputs[-1] is None:
            inputs.pop()
        for name, value in zip(node.outputs, self.run_op(node, inputs, False, False, False)):
            if name:
                known[name] = self.constants[name] = value

    def decide(self, decided):
        """Remember the nodes whose values a run's key decides
        (:mod:`stepnet.onnx.static`): run once per key, then taken from a memo."""
        chosen = {id(n) for n in decided}
        self.decided = [name for n in decided for name in n.outputs if name]
        self.rest = [n for n in self.plan if id(n) not in chosen]
        self.memo, self.fused = {}, {}

    def run(self, env, backend, step=False, rows=False, float16_as_float32=False, key=None):
        """Evaluate every node into ``env`` (name -> value), which holds the
        graph's inputs (and, for a subgraph, what it captures). ``key``: the
        fed shapes and small integer values (see ``decide``). Inside a Scan
        body being traced (``step``) values may be step values, in the layout
        ``rows`` says (:mod:`stepnet.onnx.ops`). On the Numba backend a key's
        later runs take its plan with runs of elementwise nodes fused
        (``_fuse``)."""
        plain = not (step or float16_as_float32 or self.widen)
        memo = self.memo.get(key) if key is not None and self.decided else None
        if key is None or not self.decided or memo is not None:
            plan, node_key, constants = self.plan, None, True
            if memo is not None:  # (a plain run's memo needs no constants: they are in it)
                (known, plan, constants), node_key = memo, key
                env.update(known)
            fusing = key is not None and backend_info(backend).host_code and plain
            fused = self.fused.get(key) if fusing else None
            self._run(env, backend, step, rows, float16_as_float32, fused or plan, node_key,
                      constants)
            if fusing and fused is None:
                self._fuse(key, plan, env)
            return env
        self._run(env, backend, step, rows, float16_as_float32, self.plan, key)
        if len(self.memo) >= 16:
            self.memo.clear()
        known = {n: _read_only(env[n].copy() if isinstance(env[n], np.ndarray) else env[n])
                 for n in self.decided}
        plan, constants = self.rest, True
        if plain:
            plan = self._key_plan(known)
            # the memoized values and constants that the plan and the outputs read
            read = {n for node in plan for n in (*node.inputs, *node.captures) if n}
            read.update(self.output_names)
            known = {n: v for n, v in {**self.run_constants, **known}.items() if n in read}
            constants = False
        self.memo[key] = (known, plan, constants)
        return env

    def _fuse(self, key, plan, env):
        """Remember ``plan`` with its runs of elementwise nodes fused
        (:mod:`stepnet.onnx.fusion`) for the runs of ``key``, from the values
        of a run of it (``env``)."""
        if len(self.fused) >= 16:
            self.fused.clear()
        self.fused[key] = fuse(plan, env, self.output_names)

    def _key_plan(self, known):
        """The nodes a run with the memoized values ``known`` computes: each
        ``If`` whose condition is among them replaced by its branch for
        these values (the branch's nodes, then its outputs copied to the
        If's; the branch's constants added to ``known``), and only the
        nodes that the graph's outputs need."""
        taken = set(self.input_names) | set(self.initializers) | set(self.constants) | set(
            self.captures) | {n for node in self.nodes for n in node.outputs}
        plan = self._inline(self.rest, known, taken)
        needed, kept = set(self.output_names), []
        for node in reversed(plan):
            if any(n in needed for n in node.outputs if n):
                kept.append(node)
                needed.update(n for n in node.inputs if n)
                needed.update(node.captures)
        return kept[::-1]

    def _inline(self, nodes, known, taken):
        plan = []
        for node in nodes:
            branch = None
            if node.kind == "if" and node.inputs[0] in known:
                cond = known[node.inputs[0]]
                if isinstance(cond, np.ndarray) and cond.size == 1:
                    branch = node.then_branch if cond.item() else node.else_branch
            if branch is not None:
                defined = ({n for inner in branch.nodes for n in inner.outputs if n}
                           | set(branch.initializers) | set(branch.constants))
                if (branch.decided or branch.widen or defined & taken
                        or any(inner.kind == "gradient" for inner in branch.nodes)):
                    branch = None  # run by the If node itself
                else:
                    taken |= defined
            if branch is None:
                plan.append(node)
                continue
            for name, value in branch.run_constants.items():
                known.setdefault(name, value)
            plan += self._inline(branch.plan, known, taken)
            plan += [_Copy(node, source, name)
                     for source, name in zip(branch.output_names, node.outputs) if name]
        return plan

    def _run(self, env, backend, step, rows, float16_as_float32, plan, key, constants=True):
        """``plan`` run into ``env``; ``constants``: whether ``env`` needs
        the graph's constants (a key's plan has them among its memoized
        values)."""
        if float16_as_float32:
            for name, value in self.constants32.items():
                env.setdefault(name, value)
        else:
            if constants:
                env.update(self.run_constants)
            for name, value in self.defaults.items():  # inputs that were not fed
                env.setdefault(name, value)
        if step or float16_as_float32 or self.widen:
            for node in plan:
                node.run(self, env, backend, step, rows, float16_as_float32, key=key)
            return env
        # the common case, inlined: a node bound to its table entry (Node.run)
        env[""] = None  # an omitted input
        node = None
        try:
            for node in plan:
                fast = node.fast
                if fast is None:
                    node.run(self, env, backend, key=key)
                    continue
                out = fast(node.get(env)) if node.single else fast(*node.get(env))
                if type(out) is np.ndarray:
                    env[node.out] = out
                elif out is NotImplemented:
                    node.run(self, env, backend, use_fast=False)
                else:
                    env[node.out] = out if isinstance(out, list) else np.asarray(out)
        except (TypeError, ValueError, IndexError) as e:  # NumPy's own complaints
            if isinstance(e, Error) or node is None:
                raise
            raise ShapeError(f"ONNX node {node.ctx.node!r} ({node.op}): {e}") from e
        return env

    def run_op(self, node, inputs, step, rows, float16_as_float32):
        """One op node on its inputs: its outputs, as a list. Inside a Scan body
        being traced, step values go to the node's table entry; an op it cannot
        trace raises UnsupportedError (the Scan then runs node by node)."""
        ctx = node.ctx
        if node.kind != "op":  # the Gradient operator re-running If or Loop
            raise ctx.unsupported("If and Loop inside the graph a Gradient node differentiates")
        if step and any(is_step(x) for x in inputs):
            ctx = NodeContext(ctx.node, node.op, ctx.opset, step=True, rows=rows,
                              num_outputs=len(node.outputs))
            if node.table is None or not node.table.in_step:
                raise ctx.unsupported("this op on a Scan state or scan input inside a Scan body "
                                      "is not traced")
            out = self._call(node.table, ctx, inputs, node.attrs)
            if out is NotImplemented:
                raise ctx.unsupported("this case on a Scan state or scan input is not traced")
            return self._outputs(node, out)
        half = None
        if node.types is not None and node.op not in _MOVES:
            half = {j for j, x in enumerate(inputs)
                    if isinstance(x, np.ndarray) and x.dtype == np.float16}
            if half:  # float16 is computed in float32 (docs/design.md §4)
                inputs = [x.astype(np.float32) if j in half else x for j, x in enumerate(inputs)]
        out = NotImplemented
        if node.table is not None:
            out = self._call(node.table, ctx, inputs, node.attrs)
        outs = self._outputs(node, out) if out is not NotImplemented else node.reference(*inputs)
        if half:
            ins, outs_t = node.types
            types = {ins[min(j, len(ins) - 1)] for j in half}
            outs = [y.astype(np.float16) if isinstance(y, np.ndarray) and y.dtype == np.float32
                    and outs_t[min(k, len(outs_t) - 1)] in types else y
                    for k, y in enumerate(outs)]
        return outs

    @staticmethod
    def _call(entry, ctx, inputs, attrs):
        try:
            return entry.run(ctx, *inputs, **attrs)
        except Error as e:
            if str(e).startswith("ONNX node"):
                raise
            raise type(e)(f"ONNX node {ctx.node!r} ({ctx.op}): {e}") from e
        except (TypeError, ValueError, IndexError) as e:  # NumPy's own complaints
            raise ShapeError(f"ONNX node {ctx.node!r} ({ctx.op}): {e}") from e

    @staticmethod
    def _outputs(node, out):
        outs = list(out) if isinstance(out, tuple) else [out]
        if len(outs) < len([n for n in node.outputs if n]):
            raise node.ctx.unsupported(f"gives {len(outs)} output(s), the node asks for "
                                       f"{len(node.outputs)}")
        return [o if is_step(o) or isinstance(o, (np.ndarray, list)) or o is None
                else np.asarray(o) for o in outs]


class _Copy:
    """An ``If``'s output taken from the output of its branch inlined in a
    plan (``Graph._key_plan``): run like a node bound to its table entry."""

    def __init__(self, node, source, name):
        self.ctx, self.op, self.kind = node.ctx, node.op, "copy"
        self.inputs, self.captures, self.outputs = [source], [], [name]
        self.get, self.single, self.out = operator.itemgetter(source), True, name

    @staticmethod
    def fast(value):
        return value if type(value) is np.ndarray else NotImplemented

    def run(self, graph, env, backend, *args, **kwargs):
        env[self.out] = env[self.inputs[0]]


def _type_is_float16(type_proto) -> bool:
    onnx = _onnx()
    kind = type_proto.WhichOneof("value")
    if kind == "tensor_type":
        return type_proto.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    if kind in ("sequence_type", "optional_type"):
        return _type_is_float16(getattr(type_proto, kind).elem_type)
    if kind == "map_type":
        return _type_is_float16(type_proto.map_type.value_type)
    return False


def _mentions_float16(graph) -> bool:
    """Whether a graph (or a subgraph of it) can hold a float16 value: a
    float16 input, initializer, constant or cast."""
    onnx = _onnx()
    half = onnx.TensorProto.FLOAT16
    for info in list(graph.input) + list(graph.output):
        if _type_is_float16(info.type):
            return True
    if any(t.data_type == half for t in graph.initializer):
        return True
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH and _mentions_float16(attr.g):
                return True
            if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type == half:
                return True
            if node.op_type == "Cast" and attr.name == "to" and attr.i == half:
                return True
            if attr.type == onnx.AttributeProto.TYPE_PROTO and _type_is_float16(attr.tp):
                return True
    return False


def _read_only(value):
    if isinstance(value, np.ndarray):
        value.flags.writeable = False
    return value


def _has_decided(graph) -> bool:
    """Whether a graph or a subgraph of it has nodes its key decides."""
    return bool(graph.decided) or any(_has_decided(sub) for node in graph.nodes
                                      for sub in node.subgraphs.values())


def _no_widening(graph):
    """No node of a graph without float16 needs to look for float16 inputs."""
    graph.widen = False
    for node in graph.nodes:
        node.widen = False
        for sub in node.subgraphs.values():
            _no_widening(sub)


class InferenceSession:
    """Run an ONNX model with stepnet, shaped like ``onnxruntime.InferenceSession``.

    Every node is checked when the session is made, before any data is
    seen; nodes that compute only from constants are computed then, once.

    Parameters
    ----------
    model : str, os.PathLike, bytes or onnx.ModelProto
        The model: a file's path, its serialized bytes, or the proto. Local
        functions are inlined.
    backend : str, optional
        Where recurrent nodes run as step-nets: any of ``stepnet.backends()``.
        None: ``default_backend()`` at each run.

    Raises
    ------
    BackendError
        ``backend`` is unknown or not available on this machine (checked
        first, before the model is read).
    UnsupportedError
        ONNX is not installed; the model imports no version of the default
        domain, or has an op outside it or one its opset lacks.
    StepNetError
        ``model`` is a path that does not exist, or of another type.
    Error
        A node is malformed (its inputs, outputs or attributes do not fit
        its operator's schema); the message names the node.

    Examples
    --------
    >>> import numpy as np, stepnet as sn
    >>> model = sn.onnx.export(sn.nn.GRU(3, 4, seed=0))
    >>> session = sn.onnx.InferenceSession(model, backend="interpreter")
    >>> [arg.name for arg in session.get_inputs()]
    ['X', 'lengths']
    >>> X, lengths = np.ones((2, 5, 3), np.float32), np.array([5, 2])
    >>> Y, h_n = session.run(None, {"X": X, "lengths": lengths})
    >>> Y.shape, h_n.shape
    ((2, 5, 4), (1, 2, 4))
    """

    def __init__(self, model, backend=None):
        if backend is not None:
            get_backend(backend)  # an unknown or unavailable name: BackendError, now
        self.backend = backend
        self._path = os.fspath(model) if isinstance(model, (str, os.PathLike)) else None
        model = load_model(model)
        with self._naming():
            opsets = {}
            for imp in model.opset_import:
                if not 1 <= imp.version < 2**31:
                    raise Error(f"ONNX model imports version {imp.version} of domain "
                                f"{imp.domain or 'ai.onnx'!r}, which is no opset version")
                opsets["" if imp.domain in ("", "ai.onnx") else imp.domain] = imp.version
            if "" not in opsets:
                raise UnsupportedError("ONNX model imports no version of the default (ai.onnx) "
                                       "domain")
            self.graph = Graph(model.graph, opsets)
        if not _mentions_float16(model.graph):
            _no_widening(self.graph)
        self._inputs = [a for a in self.graph.input_args if a.name not in self.graph.initializers]
        # (name, dtype, declared shape, its fixed axes [(axis, size)]) per tensor input
        self._checks = [(a.name, self.graph.input_dtypes[a.name], a.shape,
                         None if a.shape is None else
                         [(k, d) for k, d in enumerate(a.shape) if isinstance(d, int) and d > 0])
                        for a in self.graph.input_args if a.type.startswith("tensor(")]
        self._plan_memo()

    def _plan_memo(self):
        """Which inputs make the key of the memos (:mod:`stepnet.onnx.static`):
        the shapes of all, and the values of small integer inputs."""
        graph = self.graph
        self._by_value, self._memoized = [], False
        # a run's key also picks its plan with elementwise nodes fused, but
        # not where a Gradient node reads the values of the nodes it follows
        self._keyed = not any(n.kind == "gradient" for n in graph.nodes)
        if not self._keyed:
            return
        status = {}
        for arg in graph.input_args:
            dtype, shape = graph.input_dtypes[arg.name], arg.shape
            small = (dtype is not None and np.dtype(dtype).kind in "biu" and shape is not None
                     and all(isinstance(d, int) and d > 0 for d in shape)
                     and int(np.prod(shape)) <= SMALL)
            status[arg.name] = VALUE if small else 1
            if small:
                self._by_value.append(arg.name)
        _, decided = analyse(graph, status)
        self._memoized = _has_decided(graph)

    def get_inputs(self) -> list:
        """The model's inputs, as onnxruntime lists them.

        Returns
        -------
        list of NodeArg
            The graph's inputs in order, without those that an initializer
            gives a value to.
        """
        return list(self._inputs)

    def get_outputs(self) -> list:
        """The model's outputs, as onnxruntime lists them.

        Returns
        -------
        list of NodeArg
            The graph's outputs in order.
        """
        return list(self.graph.output_args)

    def run(self, output_names, input_feed, run_options=None):
        """The outputs named (all when ``output_names`` is None or empty), in order.

        Parameters
        ----------
        output_names : sequence of str or None
            Names of graph outputs; None or empty: every output.
        input_feed : dict
            A value for every input of ``get_inputs()`` by name: arrays (or
            anything ``np.asarray`` takes) of the declared dtype and rank, and
            of the declared size on each fixed axis. float16 inputs are
            computed in float32 and the outputs typed like them given back as
            float16.
        run_options : object, optional
            Accepted for onnxruntime's signature; not read.

        Returns
        -------
        list
            One value per name, in order: ndarrays (the caller's own, never
            a view of the session's constants), or lists for sequence
            outputs.

        Raises
        ------
        StepNetError
            An unknown output or input name, an input without a value, or an
            ``input_feed`` that is not a dict.
        ShapeError
            An input of another dtype or shape than the model declares.
        """
        with self._naming():
            graph = self.graph
            names = list(output_names) if output_names else graph.output_names
            for name in names:
                if name not in graph.output_names:
                    raise StepNetError(f"InferenceSession.run: {name!r} is not an output of the "
                                       f"model (outputs: {graph.output_names})")
            env = self._check_feeds(input_feed)
            backend = self.backend or default_backend()
            if not _BLAS_THREADS:
                _BLAS_THREADS.append(_numpy_blas_threads())
            set_threads = _BLAS_THREADS[0]
            previous = set_threads(1) if set_threads is not None else None
            try:
                self._run(env, backend)
            finally:
                if set_threads is not None:
                    set_threads(previous)
        return [self._output(env[n]) for n in names]

    @contextlib.contextmanager
    def _naming(self):
        """A stepnet error of the model's own, raised with its file named."""
        try:
            yield
        except Error as exc:
            if self._path is None or str(exc).startswith(self._path):
                raise
            raise type(exc)(f"{self._path}: {exc}") from None

    @staticmethod
    def _output(value):
        """An output as the caller gets it: a copy where it is (a view of) one
        of the session's constants or memoized values (read-only: the next
        run reuses them)."""
        if isinstance(value, np.ndarray):
            return value if value.flags.writeable else value.copy()
        return value if isinstance(value, list) or value is None else np.asarray(value)

    def _run(self, env, backend):
        key = None
        if self._keyed:  # the fed shapes (and small integer values, where they decide)
            key = tuple((n, v.shape, v.dtype) if type(v) is np.ndarray else (n, id(v))
                        for n, v in env.items())
            if self._memoized:
                key += tuple(env[n].tobytes() for n in self._by_value if n in env)
        self.graph.run(env, backend, key=key)

    def _check_feeds(self, feeds) -> dict:
        graph = self.graph
        if not isinstance(feeds, dict):
            raise StepNetError(f"InferenceSession.run: input_feed must be a dict, got "
                               f"{type(feeds).__name__}")
        env = {}
        for name, value in feeds.items():
            if name not in graph.input_dtypes:
                raise StepNetError(f"InferenceSession.run: {name!r} is not an input of the model "
                                   f"(inputs: {[a.name for a in self._inputs]})")
            env[name] = value
        for name, dtype, shape, fixed in self._checks:
            value = env.get(name)
            if value is None:
                continue
            if type(value) is not np.ndarray:
                value = env[name] = np.asarray(value)
            if dtype is not None and value.dtype != dtype and value.dtype != object:
                raise ShapeError(f"InferenceSession.run: input {name!r} has dtype {value.dtype}, "
                                 f"the model declares {_type_string_of(dtype)}")
            if shape is not None:
                ok = value.ndim == len(shape)
                for k, d in fixed:
                    ok = ok and value.shape[k] == d
                if not ok:
                    raise ShapeError(f"InferenceSession.run: input {name!r} has shape "
                                     f"{list(value.shape)}, the model declares {shape}")
        missing = [a.name for a in self._inputs if a.name not in env]
        if missing:
            raise StepNetError(f"InferenceSession.run: no value fed for input(s) {missing}")
        return env


def _type_string_of(dtype) -> str:
    return f"tensor({_TYPE_NAMES.get(np.dtype(dtype), str(dtype))})"
