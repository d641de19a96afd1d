"""Reading an ONNX model: a path, bytes or an ``onnx.ModelProto``; a file
that is missing or cannot be parsed is a stepnet error naming it."""

from __future__ import annotations

import os

from ..errors import Error, StepNetError, optional_import


def _onnx():
    return optional_import("onnx", "stepnet.onnx", "pip install 'stepnet[onnx]'")


def load_model(model):
    """A ModelProto from a path, bytes or a ModelProto, its local functions inlined."""
    onnx = _onnx()
    if isinstance(model, (bytes, bytearray, str, os.PathLike)):
        path = None if isinstance(model, (bytes, bytearray)) else os.fspath(model)
        if path is not None and not os.path.exists(path):
            raise StepNetError(f"ONNX model {path!r} does not exist")
        try:
            model = onnx.load_from_string(bytes(model)) if path is None else onnx.load(path)
        except Exception as exc:  # noqa: BLE001  (protobuf's and onnx's own errors, named here)
            raise Error(f"ONNX model {path or 'given as bytes'!r} cannot be read: {exc!r} (a "
                        "truncated or damaged file, or not an ONNX model)") from None
    elif not isinstance(model, onnx.ModelProto):
        raise StepNetError(f"InferenceSession: expects a path, bytes or an onnx.ModelProto, got "
                           f"{type(model).__name__}")
    if len(model.functions):
        from onnx.inliner import inline_local_functions

        model = inline_local_functions(model)
    return model
