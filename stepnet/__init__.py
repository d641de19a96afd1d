"""stepnet: recurrent step-nets over nested variable-length (LoD) sequences.

Write what happens in one time step; stepnet runs it over every step of every
sequence of a batch. See docs/design.md and README.md.
"""

from . import errors, nn, onnx, ops, optim
from .pullback import gradients, vjp
from .config import config
from .backends import backends, compile_ahead, default_backend, set_default_backend
from .dsl import MemoryHandle, RNNOp, create_rnn_op
from .errors import (
    BackendError,
    Error,
    LoDError,
    ShapeError,
    SizeError,
    StepNetError,
    UnsupportedError,
    YAMLError,
)
from .lod import LoDTensor
from .quantize import quantize
from .tracing import Parameter, Value
from .yaml import load_yaml

__version__ = "0.1.0"

__all__ = [
    "BackendError",
    "Error",
    "LoDError",
    "LoDTensor",
    "MemoryHandle",
    "Parameter",
    "RNNOp",
    "ShapeError",
    "SizeError",
    "StepNetError",
    "UnsupportedError",
    "Value",
    "YAMLError",
    "backends",
    "compile_ahead",
    "config",
    "create_rnn_op",
    "default_backend",
    "errors",
    "gradients",
    "load_yaml",
    "nn",
    "onnx",
    "ops",
    "optim",
    "quantize",
    "set_default_backend",
    "vjp",
]
