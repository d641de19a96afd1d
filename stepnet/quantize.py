"""``sn.quantize(model, "int8" | "bf16")``: a model whose products by weights
run in fewer bits (docs/quantization.md).

A step-net's ``x @ W`` (``x`` a step's rows in float32, ``W`` a constant
matrix: a Parameter or an array the step reads) becomes ``matmul_int8(x,
Wq, scale)`` or ``matmul_bf16(x, Wb)`` (:mod:`stepnet.ops.quantized`), the
weights quantized once, here; every other op stays as it was. The result
is a model like any other: called the same way, on any backend that runs
the ops, its IR and kernel source showing the quantized products. Its
weights are a snapshot: a later change of the float Parameters does not
reach it (quantize again); it has no gradient.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import warnings

import numpy as np

from . import ir
from .errors import StepNetError, UnsupportedError
from .ops import quantized as q
from .tracing import Parameter

MODES = ("int8", "bf16")


def quantize(model, mode="int8"):
    """A copy of ``model`` whose products by weights run in ``mode``.

    Parameters
    ----------
    model : RNNOp, stepnet.nn layer or stepnet.yaml.Model
        A float32 step-net, a built-in layer (``GRU``, ``LSTM``, ...) or a
        YAML model (its nets and layers).
    mode : {"int8", "bf16"}
        ``"int8"``: int8 weights with a scale per output column, each row of
        the product's input quantized to int8 as it is made (its own scale),
        sums in int32, dequantized to float32. ``"bf16"``: bfloat16 weights
        and inputs, sums in float32.

    Returns
    -------
    The same kind of model; ``model`` itself is not changed. States, gates
    and outputs stay float32.

    Raises
    ------
    StepNetError
        An unknown mode, a model that is not float32 or is quantized already,
        or a step-net with no product by a constant matrix.
    UnsupportedError
        A model of another kind (an ONNX session: not done yet).

    Examples
    --------
    >>> import numpy as np, stepnet as sn
    >>> gru = sn.nn.GRU(8, 16, seed=0)
    >>> x = (np.ones((2, 5, 8), np.float32), np.array([5, 3]))
    >>> y, h = sn.quantize(gru, "int8")(x, backend="interpreter")
    >>> float(np.abs(h - gru(x, backend="interpreter")[1]).max()) < 1e-2
    True
    """
    if mode not in MODES:
        raise StepNetError(f"quantize: mode {mode!r} is not one of {list(MODES)}")
    if getattr(model, "quantized", None):
        raise StepNetError(f"quantize: the model is quantized already ({model.quantized}); quantize "
                           "the float model it was made from")
    if mode == "bf16":
        _say_bf16_speed()
    from .dsl import RNNOp
    from .nn.base import _RecurrentLayer
    from .yaml.network import Model

    if isinstance(model, RNNOp):
        return quantize_step_net(model, mode)
    if isinstance(model, _RecurrentLayer):
        return _quantize_layer(model, mode)
    if isinstance(model, Model):
        return _quantize_yaml(model, mode)
    raise UnsupportedError(f"quantize: a {type(model).__name__} is not a step-net, a stepnet.nn "
                           "layer or a YAML model (ONNX sessions are not quantized yet)")


@functools.cache
def _say_bf16_speed():
    """bf16 without instructions of its own (the kernels are compiled for a
    CPU without AVX512_BF16): said, not hidden (once a process)."""
    import llvmlite.binding as llvm

    from .jit import int8_gemm

    if int8_gemm.BF16:
        return
    features = llvm.get_host_cpu_features()
    has = [f for f in ("avx512bf16", "amx-bf16") if features.get(f)]
    warnings.warn("stepnet runs bf16 products as float32 products of bf16-rounded values: bf16's "
                  "results at float32's speed" + (f" (this CPU's {' and '.join(has)} are not used)"
                                                 if has else " (this CPU has no bf16 instructions)"),
                  stacklevel=3)


def quantize_step_net(rnn, mode, required=True):
    """A copy of the top-level step-net ``rnn`` with each ``x @ W`` by a
    constant ``W`` in ``mode`` (see :func:`quantize`); ``rnn`` itself where
    it has none and not ``required``."""
    if rnn.block is None or not rnn._top:
        raise StepNetError("quantize: a step-net is quantized once defined, at the top level")
    program = rnn.program(True)
    values = rnn.const_values()
    state = copy.copy(rnn.frame.state)
    state.names = set(state.names)
    # constants of the copy's own, snapshots of the float model's (its biases
    # too): a later change of the float Parameters does not reach it
    state.consts = {key: (var, _snapshot(source)) for key, (var, source) in state.consts.items()}
    made = {}  # id(W's Var) -> the operands standing for it

    def weights(w):
        if id(w) not in made:
            array = values[w]
            if mode == "int8":
                wq, scale = q.int8_weights(array, f"the weights {w.name} of step-net {rnn.name!r}")
                arrays = [(f"{w.name}_int8", wq), (f"{w.name}_scale", scale)]
            else:
                arrays = [(f"{w.name}_bf16", q.to_bf16(array))]
            made[id(w)] = tuple(ir.Var(state.fresh(name), a.dtype, a.shape) for name, a in arrays)
            for var, (_, a) in zip(made[id(w)], arrays):
                state.consts[("quantized", id(var))] = (var, a)
        return made[id(w)]

    consts = set(program.consts)
    body = _rewrite(rnn.block, consts, "matmul_" + mode, weights)
    other = sorted({str(np.dtype(e.inputs[1].dtype)) for e in _eqns(rnn.block) if e.op == "matmul"
                    and e.inputs[1] in consts and np.dtype(e.inputs[1].dtype) != np.float32})
    if other:
        raise StepNetError(f"quantize: step-net {rnn.name!r} computes products by constant matrices "
                           f"in {' and '.join(other)}; quantized products take float32 models")
    if not made and not required:
        return rnn
    if not made:
        raise StepNetError(f"quantize: step-net {rnn.name!r} has no product of a float32 step value "
                           "by a constant matrix (x @ W) to quantize")
    # (a float weight every product of which is quantized is no constant of the copy)
    read = _read(body) | {v for part in rnn._eqn_operands() for v in part if isinstance(v, ir.Var)}
    state.consts = {key: (var, source) for key, (var, source) in state.consts.items()
                    if var in read or id(var) not in made}
    out = copy.copy(rnn)
    out.frame = copy.copy(rnn.frame)
    out.frame.state = state
    out.block = body
    out._programs, out._workspace, out.step_scopes = {}, None, None
    out.quantized = mode
    return out


def _eqns(block):
    """The equations of ``block`` and of the blocks nested in it."""
    for e in block.eqns:
        yield e
        if e.op == "rnn":
            yield from _eqns(e.attrs["body"])


def _read(block) -> set:
    """The Vars ``block`` and the blocks nested in it read: operands,
    outputs and memories' new values."""
    found = {*block.outputs, *(m.post for m in block.memories)}
    for e in block.eqns:
        found.update(v for v in e.inputs if isinstance(v, ir.Var))
        if e.op == "rnn":
            found |= _read(e.attrs["body"])
    return found


def _quantizable(e, consts) -> bool:
    """``x @ W``: ``x`` a step's dense rows in float32, ``W`` a constant
    float32 matrix of the program."""
    if e.op != "matmul":
        return False
    a, w = e.inputs
    return (isinstance(a, ir.Var) and isinstance(w, ir.Var) and w in consts
            and a.batched and not a.lod_depth and len(a.shape) == 2 and len(w.shape) == 2
            and np.dtype(a.dtype) == np.float32 and np.dtype(w.dtype) == np.float32)


def _rewrite(block, consts, op, weights):
    eqns = []
    for e in block.eqns:
        if e.op == "rnn":
            body = _rewrite(e.attrs["body"], consts, op, weights)
            e = ir.Eqn("rnn", e.inputs, e.outputs, dict(e.attrs, body=body))
        elif _quantizable(e, consts):
            e = ir.Eqn(op, (e.inputs[0], *weights(e.inputs[1])), e.outputs, {})
        eqns.append(e)
    return dataclasses.replace(block, eqns=tuple(eqns))


def _snapshot(source):
    """A constant's source as the copy's own: a Parameter of a copy of its
    value (its name kept), an array copied."""
    if isinstance(source, Parameter):
        return Parameter(np.array(source.value), name=source.name)
    return np.array(source)


def _quantize_layer(layer, mode):
    name = type(layer).__name__
    if layer._one_step:
        raise StepNetError(f"quantize: {name} is one step of a recurrence, called in a step-net; "
                           "quantize that step-net (or the layer sn.nn."
                           f"{name.removesuffix('Cell')}(...))")
    if np.dtype(layer.dtype) != np.float32:
        raise StepNetError(f"quantize: {name} computes in {np.dtype(layer.dtype)}; "
                           "quantized products take float32 models")
    # weights of its own (a copy, the gate weights joined again): a later
    # change of the float layer's Parameters does not reach it
    state = copy.deepcopy({k: v for k, v in layer.__dict__.items() if k not in ("_nets", "_workspace")})
    out = object.__new__(type(layer))
    out.__setstate__(dict(state, _nets={}, _workspace=None, quantized=mode))
    for index in range(out.num_layers):  # quantized now: bad weights are refused here
        for d in range(out.num_directions):
            out.step_net(index, d)
    return out


def _quantize_yaml(model, mode):
    if not (model._layers or model._nets):
        raise StepNetError(f"quantize: {model.name} has no layer or net to quantize")
    out = copy.copy(model)
    out.quantized = mode
    out.layers, out._layers, out.nets, out._nets = {}, [], {}, []
    for entry in model._layers:
        entry = copy.copy(entry)
        entry.layer = _quantize_layer(entry.layer, mode)
        out.layers[entry.name] = entry.layer
        out._layers.append(entry)
    for net in model._nets:
        net = copy.copy(net)
        net.rnn = quantize_step_net(net.rnn, mode, required=False)
        out.nets[net.name] = net.rnn
        out._nets.append(net)
    if not out._layers and all(a.rnn is b.rnn for a, b in zip(out._nets, model._nets)):
        raise StepNetError(f"quantize: no net of {model.name} has a product of a float32 step value "
                           "by a constant matrix (x @ W) to quantize")
    return out
