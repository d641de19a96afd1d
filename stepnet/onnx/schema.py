"""What a session checks of a model before any data is seen, and how it
names the model's values.

- Each node against its operator's schema at the model's opset (``node_schema``,
  ``check_node``): its inputs, outputs and attributes; ``attributes`` reads
  the attributes as Python values.
- The graph's inputs and outputs as onnxruntime describes them (``NodeArg``,
  ``value_info``), and whether a graph can hold float16 at all
  (``mentions_float16``: where not, no node looks for float16 inputs).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import Error, UnsupportedError, optional_import
from . import tensors


_TYPE_NAMES = {
    np.dtype(np.float32): "float", np.dtype(np.float16): "float16", np.dtype(np.float64): "double",
    np.dtype(np.int8): "int8", np.dtype(np.int16): "int16", np.dtype(np.int32): "int32",
    np.dtype(np.int64): "int64", np.dtype(np.uint8): "uint8", np.dtype(np.uint16): "uint16",
    np.dtype(np.uint32): "uint32", np.dtype(np.uint64): "uint64", np.dtype(np.bool_): "bool",
}


def _onnx():
    return optional_import("onnx", "stepnet.onnx", "pip install 'stepnet[onnx]'")


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


def type_string(type_proto, what="") -> tuple:
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
        return f"seq({type_string(type_proto.sequence_type.elem_type, what)[0]})", None, None
    if kind == "optional_type":
        return f"optional({type_string(type_proto.optional_type.elem_type, what)[0]})", None, None
    return "unknown", None, None


def value_info(info, where):
    name, dtype, shape = type_string(info.type, f"ONNX {where}: {info.name!r}")
    return NodeArg(info.name, name, shape), dtype


def node_schema(proto, ctx):
    """The node's operator schema at the model's opset; raises naming the node."""
    onnx = _onnx()
    try:
        schema = onnx.defs.get_schema(ctx.op, ctx.opset, "")
    except (onnx.defs.SchemaError, TypeError):  # (TypeError: a name that is not text)
        raise ctx.unsupported(f"{ctx.op} is not an operator of the default ONNX domain at "
                              f"opset {ctx.opset}") from None
    if schema.deprecated and ctx.op not in _RUN_DEPRECATED:
        raise ctx.unsupported(f"{ctx.op} is deprecated at opset {ctx.opset} (since "
                              f"{schema.since_version})")
    return schema


# deprecated versions that models still use and onnxruntime runs (docs/onnx.md)
_RUN_DEPRECATED = {"GroupNormalization"}


def check_node(proto, schema, ctx):
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


def type_params(schema):
    """The type parameter (``"T"``, ``"T1"``, ...) of each formal input and
    output: an output typed like a float16 input is given back as float16."""
    return [f.type_str for f in schema.inputs], [f.type_str for f in schema.outputs]


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


def mentions_float16(graph) -> bool:
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
            if attr.type == onnx.AttributeProto.GRAPH and mentions_float16(attr.g):
                return True
            if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type == half:
                return True
            if node.op_type == "Cast" and attr.name == "to" and attr.i == half:
                return True
            if attr.type == onnx.AttributeProto.TYPE_PROTO and _type_is_float16(attr.tp):
                return True
    return False


def tensor_type_name(dtype) -> str:
    return f"tensor({_TYPE_NAMES.get(np.dtype(dtype), str(dtype))})"
