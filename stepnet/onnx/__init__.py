"""ONNX for stepnet (the ``onnx`` extra).

- ``InferenceSession(model, backend=None)`` runs ONNX models whose recurrent
  nodes (GRU, LSTM, RNN, Scan) become step-nets, shaped like onnxruntime's.
- ``export(obj, path)`` writes a step-net or a ``stepnet.nn`` layer as an ONNX
  model that onnxruntime runs.

See docs/onnx.md.
"""

from .export import export
from .session import InferenceSession, NodeArg

__all__ = ["InferenceSession", "NodeArg", "export"]
