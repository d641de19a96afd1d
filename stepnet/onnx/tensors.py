"""The arrays an ONNX file holds (initializers, sparse initializers, tensor
attributes) and the element types it declares, read so that a damaged or
hostile file is a stepnet error naming the tensor: an unknown element type,
dims that do not fit the data, or a size that cannot fit in memory
(:mod:`stepnet.sizes`, checked before the array is made)."""

from __future__ import annotations

import numpy as np

from .. import sizes
from ..errors import Error


def dtype_of(elem_type, what):
    """The NumPy dtype of ONNX element type ``elem_type`` (an int of
    ``TensorProto.DataType``); ``what`` names its owner in the error."""
    from onnx import TensorProto, helper

    if elem_type not in TensorProto.DataType.values() or elem_type == TensorProto.UNDEFINED:
        raise Error(f"{what}: element type {elem_type} is not an ONNX tensor type")
    return helper.tensor_dtype_to_np_dtype(elem_type)


def to_array(tensor, what):
    """``numpy_helper.to_array(tensor)``, its dims and element type checked
    and its size checked before it is made."""
    from onnx import numpy_helper

    what = f"{what} {tensor.name!r}" if tensor.name else what
    dtype = dtype_of(tensor.data_type, what)
    if any(d < 0 for d in tensor.dims):
        raise Error(f"{what}: dims {list(tensor.dims)} has a negative size")
    sizes.check(what, tensor.dims, dtype)
    try:
        return numpy_helper.to_array(tensor)
    except Error:
        raise
    except Exception as exc:  # noqa: BLE001  (onnx's and NumPy's own complaints, named here)
        raise Error(f"{what}: its data does not fit dims {list(tensor.dims)} of "
                    f"{np.dtype(dtype)}: {type(exc).__name__}: {exc}") from None


def dense(sparse, what):
    """A SparseTensorProto as a dense array (indices: flat, or one row per
    value), its size checked before it is made."""
    what = f"{what} {sparse.values.name!r}"
    values = to_array(sparse.values, what + " values")
    indices = to_array(sparse.indices, what + " indices")
    if indices.dtype.kind not in "iu" or (indices < 0).any() or any(d < 0 for d in sparse.dims):
        raise Error(f"{what}: indices of {indices.dtype}, a negative index or dims "
                    f"{list(sparse.dims)} with a negative size")
    sizes.check(what, sparse.dims, values.dtype)
    dense = np.zeros(tuple(sparse.dims), values.dtype)
    try:
        if indices.ndim == 1:
            dense.reshape(-1)[indices.astype(np.int64)] = values
        else:
            dense[tuple(indices.astype(np.int64).T)] = values
    except (IndexError, ValueError) as exc:
        raise Error(f"{what}: its indices do not fit dims {list(sparse.dims)}: {exc}") from None
    return dense


def check_constant_types(proto, schema, known, where):
    """A constant input (an initializer, what constants compute) of a type
    the node's operator does not take: Error naming the node and the input,
    before anything reads it (a damaged file may give a float shape)."""
    from onnx import TensorProto, helper

    allowed = {c.type_param_str: set(c.allowed_type_strs) for c in schema.type_constraints}
    formals = list(schema.inputs)
    bound = {}  # a type parameter -> the first constant input of it: (its type, index, formal, name)
    for i, name in enumerate(proto.input):
        value = known.get(name) if name else None
        if not isinstance(value, np.ndarray) or not formals:
            continue
        formal = formals[min(i, len(formals) - 1)]  # (the last one may repeat)
        try:
            elem_type = helper.np_dtype_to_tensor_dtype(value.dtype)
            given = f"tensor({TensorProto.DataType.Name(elem_type).lower()})"
        except (KeyError, TypeError, ValueError):  # a dtype with no ONNX name: left to the op
            continue
        takes = allowed.get(formal.type_str, {formal.type_str})
        if given not in takes:
            raise Error(f"{where}: input {i} ({formal.name}) {name!r} is a {given}, it takes "
                        f"{', '.join(sorted(takes))}")
        first = bound.setdefault(formal.type_str, (given, i, formal.name, name)) \
            if formal.type_str in allowed else None
        if first is not None and first[0] != given:
            raise Error(f"{where}: input {i} ({formal.name}) {name!r} is a {given} and input "
                        f"{first[1]} ({first[2]}) {first[3]!r} a {first[0]}; the operator takes "
                        f"both as one type ({formal.type_str})")
