"""stepnet's ops: the primitives (``registry``, one entry each) and the
composites built from them. Use them as ``sn.ops.tanh(x)`` and so on."""

from . import primitives as _primitives  # noqa: F401 - fills the registry
from . import registry
from .api import (
    abs,
    add,
    clip,
    concat,
    div,
    equal,
    exp,
    greater,
    greater_equal,
    less,
    less_equal,
    log,
    matmul,
    maximum,
    minimum,
    mul,
    neg,
    relu,
    sigmoid,
    slice,
    softplus,
    sub,
    sum,
    tanh,
    where,
)
from .composites import (
    affine,
    elu,
    hard_sigmoid,
    leaky_relu,
    mean,
    scaled_tanh,
    softsign,
    split,
    thresholded_relu,
)

__all__ = [
    "registry", "abs", "add", "clip", "concat", "div", "equal", "exp", "greater",
    "greater_equal", "less", "less_equal", "log", "matmul", "maximum", "minimum", "mul",
    "neg", "relu", "sigmoid", "slice", "softplus", "sub", "sum", "tanh", "where", "affine",
    "elu", "hard_sigmoid", "leaky_relu", "mean", "scaled_tanh", "softsign", "split",
    "thresholded_relu",
]
