"""ONNX for stepnet (the ``onnx`` extra).

- ``InferenceSession(model, backend=None)`` runs ONNX models, shaped like
  onnxruntime's: recurrent nodes (GRU, LSTM, RNN, Scan) as compiled
  step-nets, ``If`` and ``Loop`` around them, every other op of the default
  domain with stepnet's NumPy or the ONNX reference implementation.
- ``export(obj, path)`` writes a step-net or a ``stepnet.nn`` layer as an ONNX
  model that onnxruntime runs.

See docs/onnx.md.
"""

from .export import export
from .session import InferenceSession, NodeArg

__all__ = ["InferenceSession", "NodeArg", "export"]
