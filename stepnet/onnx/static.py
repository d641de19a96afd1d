"""What a model's input shapes decide: the nodes a session computes once per
input shapes instead of on every run.

Exported models compute a lot from shapes: ``Shape``, ``Gather`` of a
dimension, ``Equal``, ``Cast``, an ``If`` on the batch size. Given the shapes
(and dtypes) of the fed inputs, and the values of small integer inputs such
as a sample rate, those values are always the same. A name's status is

- ``VALUE``: its value is decided by that key (constants included);
- ``SHAPE``: only its shape is;
- ``NONE``: neither.

A deterministic node whose inputs all have decided values has a decided
value; ``Shape`` and ``Size`` of a decided shape too. Shapes propagate through
the ops whose output shape follows from their inputs' shapes
(:data:`SHAPE_FROM_SHAPES`), and through those that also read the value of
their other inputs (:data:`SHAPE_FROM_VALUES`) when those values are decided.
An ``If`` whose condition is decided is analysed through both branches.
Anything else is ``NONE``: the analysis only ever leaves work to be done.
"""

from __future__ import annotations

import numpy as np

NONE, SHAPE, VALUE = 0, 1, 2

# integer or boolean inputs with at most this many elements are part of the key
SMALL = 4

SHAPE_FROM_SHAPES = {
    "Abs", "Acos", "Acosh", "Add", "And", "Asin", "Asinh", "Atan", "Atanh", "AveragePool",
    "BatchNormalization", "BitShift", "BitwiseAnd", "BitwiseNot", "BitwiseOr", "BitwiseXor", "Cast",
    "CastLike", "Ceil", "Celu", "Clip", "Concat", "Conv", "ConvTranspose", "Cos", "Cosh", "CumSum",
    "DepthToSpace", "Div", "Dropout", "Einsum", "Elu", "Equal", "Erf", "Exp", "Flatten", "Floor",
    "GRU", "Gather", "GatherElements", "Gelu", "Gemm", "GlobalAveragePool", "GlobalLpPool",
    "GlobalMaxPool", "Greater", "GreaterOrEqual", "HardSigmoid", "HardSwish", "Hardmax", "Identity",
    "InstanceNormalization", "IsInf", "IsNaN", "LRN", "LSTM", "LayerNormalization", "LeakyRelu",
    "Less", "LessOrEqual", "Log", "LogSoftmax", "LpNormalization", "LpPool", "MatMul", "Max",
    "MaxPool", "Mean", "Min", "Mish", "Mod", "Mul", "Neg", "Not", "Or", "PRelu", "Pow", "RNN",
    "Reciprocal", "Relu", "Round", "ScatterElements", "ScatterND", "Selu", "Shrink", "Sigmoid",
    "Sign", "Sin", "Sinh", "Softmax", "Softplus", "Softsign", "SpaceToDepth", "Sqrt", "Sub", "Sum",
    "Tan", "Tanh", "ThresholdedRelu", "Transpose", "Trilu", "Where", "Xor",
}
# (not ConstantOfShape nor Range: their output's shape is the value of their
# first input too, which is decided only where it is a VALUE)
SHAPE_FROM_VALUES = {
    "Expand", "OneHot", "Pad", "ReduceL1", "ReduceL2",
    "ReduceLogSum", "ReduceLogSumExp", "ReduceMax", "ReduceMean", "ReduceMin", "ReduceProd",
    "ReduceSum", "ReduceSumSquare", "Reshape", "Resize", "Slice", "Split", "Squeeze", "Tile",
    "TopK", "Unsqueeze",
}
RANDOM = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Bernoulli",
          "Multinomial", "Dropout"}


def feed_status(value) -> int:
    """A fed value's status: small integer and boolean inputs are part of the key."""
    value = np.asarray(value)
    return VALUE if value.dtype.kind in "biu" and value.size <= SMALL else SHAPE


def analyse(graph, status) -> tuple:
    """``(status, decided)``: ``status`` (name -> status for the graph's
    inputs and what it captures) completed with every name the graph's nodes
    define, and the nodes whose outputs all have decided values. The graph
    and the branches of its decided ``If`` nodes get ``graph.decide(decided)``."""
    status = dict(status)
    for name in list(graph.initializers) + list(graph.constants):
        status.setdefault(name, VALUE)
    decided = []
    for node in graph.plan:
        ins = [status.get(n, NONE) for n in node.inputs if n]
        out = NONE
        if node.kind == "op" and node.op not in RANDOM:
            if all(s == VALUE for s in ins):
                out = VALUE
            elif node.op in ("Shape", "Size") and ins and ins[0] >= SHAPE:
                out = VALUE
            elif node.op in SHAPE_FROM_SHAPES and all(s >= SHAPE for s in ins):
                out = SHAPE
            elif (node.op in SHAPE_FROM_VALUES and ins and ins[0] >= SHAPE
                  and all(s == VALUE for s in ins[1:])):
                out = SHAPE
        elif node.kind == "recurrent" and node.op != "Scan" and ins and ins[0] >= SHAPE:
            out = SHAPE  # Y and the states: from X's shape and hidden_size
        elif node.kind == "if" and ins and ins[0] == VALUE:
            out = _branches(node, status)
        for name in node.outputs:
            if name:
                status[name] = out
        if out == VALUE:
            decided.append(node)
    graph.decide(decided)
    return status, decided


def _branches(node, status) -> int:
    """The status of an If's outputs, the least over both branches."""
    found = VALUE
    for key in ("then_branch", "else_branch"):
        branch = node.subgraphs[key]
        inner, _ = analyse(branch, {n: status.get(n, NONE) for n in branch.captures})
        for name in branch.output_names:
            found = min(found, inner.get(name, NONE))
    return found
