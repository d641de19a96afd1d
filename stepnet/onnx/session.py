"""``stepnet.onnx.InferenceSession``: ONNX models on stepnet's kernels.

The session checks every node when it is made: an op, attribute or domain
stepnet does not run raises :class:`stepnet.errors.UnsupportedError` naming the
node, before any data is seen. ``run`` then evaluates the nodes in order:
GRU, LSTM, RNN and Scan nodes as step-nets on the chosen backend
(:mod:`stepnet.onnx.recurrent`), the other ops with NumPy
(:mod:`stepnet.onnx.ops`), and the ONNX Gradient operator with stepnet's reverse
mode (:mod:`stepnet.onnx.gradient`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from ..backends import default_backend
from ..errors import Error, ShapeError, StepNetError, UnsupportedError, optional_import
from .gradient import GradientNode
from .ops import OPS, NodeContext, is_step
from .recurrent import RecurrentNode, ScanNode

TRAINING_DOMAIN = "ai.onnx.preview.training"

_TYPE_NAMES = {
    np.dtype(np.float32): "float", np.dtype(np.float16): "float16", np.dtype(np.float64): "double",
    np.dtype(np.int8): "int8", np.dtype(np.int16): "int16", np.dtype(np.int32): "int32",
    np.dtype(np.int64): "int64", np.dtype(np.uint8): "uint8", np.dtype(np.bool_): "bool",
}
# ops whose output type is not their float input's: float16 is not computed in float32 for them
_TYPE_OPS = {"Cast", "Shape", "ConstantOfShape", "Constant"}


def _onnx():
    return optional_import("onnx", "stepnet.onnx", "pip install 'stepnet[onnx]'")


@dataclass(frozen=True)
class NodeArg:
    """A graph input or output as onnxruntime describes it."""

    name: str
    type: str  # e.g. "tensor(float)"
    shape: list  # ints, dimension names (str) or None


def load_model(model):
    """A ModelProto from a path, bytes or a ModelProto."""
    onnx = _onnx()
    if isinstance(model, onnx.ModelProto):
        return model
    if isinstance(model, (bytes, bytearray)):
        return onnx.load_from_string(bytes(model))
    if isinstance(model, (str, os.PathLike)):
        if not os.path.exists(model):
            raise StepNetError(f"ONNX model {os.fspath(model)!r} does not exist")
        return onnx.load(os.fspath(model))
    raise StepNetError(f"InferenceSession: expects a path, bytes or an onnx.ModelProto, got "
                       f"{type(model).__name__}")


def attributes(node) -> dict:
    """A node's attributes as Python values (strings decoded, tensors as arrays)."""
    onnx = _onnx()
    from onnx import numpy_helper

    out = {}
    for attr in node.attribute:
        value = onnx.helper.get_attribute_value(attr)
        if isinstance(value, bytes):
            value = value.decode()
        elif isinstance(value, list) and value and isinstance(value[0], bytes):
            value = [v.decode() for v in value]
        elif isinstance(value, onnx.TensorProto):
            value = numpy_helper.to_array(value)
        out[attr.name] = value
    return out


def _value_info(info) -> NodeArg:
    onnx = _onnx()
    t = info.type.tensor_type
    dtype = onnx.helper.tensor_dtype_to_np_dtype(t.elem_type) if t.elem_type else None
    shape = None
    if t.HasField("shape"):
        shape = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                 for d in t.shape.dim]
    name = _TYPE_NAMES.get(np.dtype(dtype), str(dtype)) if dtype is not None else "unknown"
    return NodeArg(info.name, f"tensor({name})", shape), dtype


class Node:
    """One node, checked and ready to run."""

    def __init__(self, proto, opsets, index):
        self.proto = proto
        self.op = proto.op_type
        self.domain = proto.domain or ""
        self.inputs = list(proto.input)
        self.outputs = list(proto.output)
        name = proto.name or f"{self.op}_{index}"
        domain = "" if self.domain in ("", "ai.onnx") else self.domain
        if domain not in opsets:
            raise UnsupportedError(f"ONNX node {name!r} ({self.op}): domain {self.domain!r} is not "
                                   "imported by the model")
        self.ctx = NodeContext(name, self.op, opsets[domain], num_outputs=len(self.outputs))
        attrs = attributes(proto)
        self.impl = None  # a RecurrentNode, ScanNode or GradientNode; None for an OPS entry
        if domain == TRAINING_DOMAIN and self.op == "Gradient":
            self.impl = GradientNode(self.ctx, attrs, self.inputs)
        elif domain != "":
            raise self.ctx.unsupported(f"domain {self.domain!r} is not supported")
        elif self.op in ("GRU", "LSTM", "RNN"):
            self.impl = RecurrentNode(self.ctx, attrs)
        elif self.op == "Scan":
            body = Graph(attrs["body"], opsets, where=f"the body of {name!r}", outer=True)
            self.impl = ScanNode(self.ctx, attrs, body)
            self.captures = body.captures
        elif self.op in OPS:
            entry = OPS[self.op]
            unknown = sorted(set(attrs) - entry.attrs)
            if unknown:
                raise self.ctx.unsupported(f"attribute {unknown[0]!r} is not supported")
            self.entry = entry
        else:
            raise self.ctx.unsupported("the op is not supported by stepnet")
        self.attrs = attrs

    @property
    def recurrent(self) -> bool:
        return self.op in ("GRU", "LSTM", "RNN", "Scan")


class Graph:
    """An ONNX graph (a model's, or a Scan body) ready to run.

    ``outer=True`` marks a subgraph: names it reads but does not define are
    taken from the enclosing graph (``captures``)."""

    def __init__(self, proto, opsets, where="graph", outer=False):
        from onnx import numpy_helper

        self.where = where
        self.initializers = {t.name: numpy_helper.to_array(t) for t in proto.initializer}
        # what a float16 model's Scan body reads: float16 is computed in float32
        self.initializers32 = {k: v.astype(np.float32) if v.dtype == np.float16 else v
                               for k, v in self.initializers.items()}
        self.input_args, self.input_dtypes = [], {}
        for info in proto.input:
            arg, dtype = _value_info(info)
            self.input_args.append(arg)
            self.input_dtypes[info.name] = dtype
        self.input_names = [i.name for i in proto.input]
        self.output_args = [_value_info(o)[0] for o in proto.output]
        self.output_names = [o.name for o in proto.output]
        defined = set(self.input_names) | set(self.initializers)
        self.nodes, self.captures = [], []
        for i, p in enumerate(proto.node):
            for name in p.input:
                if name and name not in defined and name not in self.captures:
                    if not outer:
                        raise StepNetError(f"ONNX {where}: node {p.name or p.op_type!r} reads "
                                           f"{name!r}, which nothing before it defines")
                    self.captures.append(name)
            node = Node(p, opsets, i)
            if outer and node.recurrent:
                raise node.ctx.unsupported(
                    f"a recurrent node inside a Scan body ({where}): stepnet's nested step-nets "
                    "step over ragged values, not over a body's tensors")
            self.nodes.append(node)
            if node.op == "Scan":
                for name in node.captures:
                    if name not in defined and name not in self.captures:
                        self.captures.append(name)
            defined.update(n for n in p.output if n)
        for name in self.output_names:
            if name not in defined and name not in self.captures:
                if not outer:
                    raise StepNetError(f"ONNX {where}: output {name!r} is computed by no node")
                self.captures.append(name)

    def run(self, env, backend, step=False, rows=False, float16_as_float32=False):
        """Evaluate every node into ``env`` (name -> value), which holds the
        graph's inputs (and, for a subgraph, what it captures). Inside a Scan
        body (``step``) values may be step values, in the layout ``rows``
        says (:mod:`stepnet.onnx.ops`)."""
        initializers = self.initializers32 if float16_as_float32 else self.initializers
        for name, value in initializers.items():
            env.setdefault(name, value)
        for node in self.nodes:
            if node.op == "Gradient":
                outs = node.impl.run(self, env, backend)
            else:
                inputs = [env[n] if n else None for n in node.inputs]
                while inputs and inputs[-1] is None:
                    inputs.pop()
                if node.op == "Scan":
                    outs = node.impl.run(inputs, backend, {n: env[n] for n in node.captures})
                elif node.recurrent:
                    outs = node.impl.run(inputs, backend)
                else:
                    outs = self.run_op(node, inputs, step, rows, float16_as_float32)
            for name, value in zip(node.outputs, outs):
                if name:
                    env[name] = value
        return env

    def run_op(self, node, inputs, step, rows, float16_as_float32):
        """One node of the op table on its inputs: its outputs, as a list."""
        ctx = NodeContext(node.ctx.node, node.op, node.ctx.opset, step=step, rows=rows,
                          num_outputs=len(node.outputs))
        entry = node.entry
        if any(is_step(x) for x in inputs) and not entry.in_step:
            raise ctx.unsupported("this op on a Scan state or scan input inside a Scan body")
        half = not step and node.op not in _TYPE_OPS and any(
            isinstance(x, np.ndarray) and x.dtype == np.float16 for x in inputs)
        if half or float16_as_float32:  # float16 is computed in float32 (DESIGN.md §4)
            inputs = [x.astype(np.float32) if isinstance(x, np.ndarray) and x.dtype == np.float16
                      else x for x in inputs]
        try:
            out = entry.run(ctx, *inputs, **node.attrs)
        except Error as e:
            if str(e).startswith("ONNX node"):
                raise
            raise type(e)(f"ONNX node {ctx.node!r} ({ctx.op}): {e}") from e
        except (TypeError, ValueError, IndexError) as e:  # NumPy's own complaints
            raise ShapeError(f"ONNX node {ctx.node!r} ({ctx.op}): {e}") from e
        outs = list(out) if isinstance(out, tuple) else [out]
        if len(outs) < len([n for n in node.outputs if n]):
            raise ctx.unsupported(f"gives {len(outs)} output(s), the node asks for "
                                  f"{len(node.outputs)}")
        outs = [o if is_step(o) else np.asarray(o) for o in outs]
        if half:
            outs = [o.astype(np.float16) if o.dtype == np.float32 else o for o in outs]
        return outs


class InferenceSession:
    """Run an ONNX model with stepnet, shaped like ``onnxruntime.InferenceSession``.

    ``model`` is a path, bytes or an ``onnx.ModelProto``; ``backend`` is any of
    ``stepnet.backends()`` (default: the default backend)."""

    def __init__(self, model, backend=None):
        model = load_model(model)
        opsets = {}
        for imp in model.opset_import:
            opsets["" if imp.domain in ("", "ai.onnx") else imp.domain] = imp.version
        if "" not in opsets:
            raise UnsupportedError("ONNX model imports no version of the default (ai.onnx) domain")
        self.backend = backend
        self.graph = Graph(model.graph, opsets)
        self._inputs = [a for a in self.graph.input_args if a.name not in self.graph.initializers]

    def get_inputs(self) -> list:
        return list(self._inputs)

    def get_outputs(self) -> list:
        return list(self.graph.output_args)

    def run(self, output_names, input_feed, run_options=None):
        """The outputs named (all when ``output_names`` is None or empty), in order."""
        graph = self.graph
        names = list(output_names) if output_names else list(graph.output_names)
        for name in names:
            if name not in graph.output_names:
                raise StepNetError(f"InferenceSession.run: {name!r} is not an output of the model "
                                   f"(outputs: {graph.output_names})")
        env = self._check_feeds(input_feed)
        backend = self.backend or default_backend()
        graph.run(env, backend)
        return [np.asarray(env[n]) for n in names]

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
            value = np.asarray(value)
            arg = next(a for a in graph.input_args if a.name == name)
            dtype = graph.input_dtypes[name]
            if dtype is not None and value.dtype != dtype:
                raise ShapeError(f"InferenceSession.run: input {name!r} has dtype {value.dtype}, "
                                 f"the model declares {arg.type}")
            if arg.shape is not None:
                if value.ndim != len(arg.shape) or any(
                        isinstance(d, int) and d > 0 and d != v for d, v in zip(arg.shape, value.shape)):
                    raise ShapeError(f"InferenceSession.run: input {name!r} has shape "
                                     f"{list(value.shape)}, the model declares {arg.shape}")
            env[name] = value
        missing = [a.name for a in self._inputs if a.name not in env]
        if missing:
            raise StepNetError(f"InferenceSession.run: no value fed for input(s) {missing}")
        return env
