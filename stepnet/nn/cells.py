"""The built-in cells: one :class:`Cell` record each in ``CELLS``, its step
written in the step-net DSL.

The equations are the ONNX RNN, GRU and LSTM operators' (the oneDNN RNN
primitive's; AUGRU is oneDNN's, MGU the minimal gated unit's), in ONNX's gate
orders: RNN ``i``; GRU ``z, r, h``; LSTM ``i, o, f, c`` with peepholes ``i, o,
f``; MGU ``f, h``. Weights are per gate, in the DSL's
orientation (``x @ W``: ``W[g]`` is ``[input, hidden]``); the Numba backend
merges the gates' matmuls into one GEMM over all tokens for the input and one
per step for the recurrence.

A step ``step(x, states, p, acts, layer, attention)`` updates its memory
handles ``states``; ``acts`` holds the cell's activations (ONNX's f, g, h) as
one-argument callables; it reads its options from ``layer`` (``clip`` bounds
every activation's input to ``[-clip, clip]``, ONNX's cell clip).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from .. import ops

# ONNX's activation functions: name -> (callable(x, alpha, beta), default alpha,
# default beta); a default of None means the function takes no such argument.
ACTIVATIONS = {
    "Relu": (lambda x, a, b: ops.relu(x), None, None),
    "Tanh": (lambda x, a, b: ops.tanh(x), None, None),
    "Sigmoid": (lambda x, a, b: ops.sigmoid(x), None, None),
    "Affine": (lambda x, a, b: ops.affine(x, a, b), 1.0, 0.0),
    "LeakyRelu": (lambda x, a, b: ops.leaky_relu(x, a), 0.01, None),
    "ThresholdedRelu": (lambda x, a, b: ops.thresholded_relu(x, a), 1.0, None),
    "ScaledTanh": (lambda x, a, b: ops.scaled_tanh(x, a, b), 1.0, 1.0),
    "HardSigmoid": (lambda x, a, b: ops.hard_sigmoid(x, a, b), 0.2, 0.5),
    "Elu": (lambda x, a, b: ops.elu(x, a), 1.0, None),
    "Softsign": (lambda x, a, b: ops.softsign(x), None, None),
    "Softplus": (lambda x, a, b: ops.softplus(x), None, None),
}
ACTIVATION_NAMES = {name.lower(): name for name in ACTIVATIONS}


def _clipped(v, clip):
    return v if clip is None else ops.clip(v, -clip, clip)


def _gate_input(x, hp, p, g, peephole=None):
    """``x @ W[g] + (Wb[g] + Rb[g]) + h_prev @ R[g] (+ peephole)``: the two
    biases summed once per call (a value of constants alone), so a step adds
    one bias as a cell written by hand does."""
    v = x @ p["W"][g] + ops.add(p["Wb"][g], p["Rb"][g]) + hp @ p["R"][g]
    return v if peephole is None else v + peephole


def rnn_step(x, states, p, acts, layer, attention=None):
    """``h = f(x Wi + Wbi + Rbi + h_prev Ri)``."""
    (h,), (f,) = states, acts
    h.update(f(_clipped(_gate_input(x, h.pre_state(), p, "i"), layer.clip)))


def gru_step(x, states, p, acts, layer, attention=None):
    """ONNX GRU; with ``attention`` oneDNN's AUGRU (``z' = (1 - a) * z``)."""
    (h,), (f, g), clip = states, acts, layer.clip
    hp = h.pre_state()
    z = f(_clipped(_gate_input(x, hp, p, "z"), clip))
    r = f(_clipped(_gate_input(x, hp, p, "r"), clip))
    if layer.linear_before_reset:
        pre = x @ p["W"]["h"] + p["Wb"]["h"] + r * (hp @ p["R"]["h"] + p["Rb"]["h"])
    else:
        pre = x @ p["W"]["h"] + p["Wb"]["h"] + p["Rb"]["h"] + (r * hp) @ p["R"]["h"]
    candidate = g(_clipped(pre, clip))
    if attention is not None:
        z = (1.0 - attention) * z
    h.update((1.0 - z) * candidate + z * hp)


def mgu_step(x, states, p, acts, layer, attention=None):
    """The minimal gated unit (Zhou et al., 2016): one forget gate ``f``
    serves as both of a GRU's gates, ``h~ = g(x Wh + (f * h_prev) Rh + b)``,
    ``h = (1 - f) * h_prev + f * h~``."""
    (h,), (fa, g), clip = states, acts, layer.clip
    hp = h.pre_state()
    forget = fa(_clipped(_gate_input(x, hp, p, "f"), clip))
    pre = x @ p["W"]["h"] + p["Wb"]["h"] + p["Rb"]["h"] + (forget * hp) @ p["R"]["h"]
    h.update((1.0 - forget) * hp + forget * g(_clipped(pre, clip)))


def lstm_step(x, states, p, acts, layer, attention=None):
    """ONNX LSTM (peepholes, coupled input-forget gate) with PyTorch's
    projection of the hidden state (``h = (o * h(c)) @ proj``)."""
    (h, c), (f, g, hact), clip = states, acts, layer.clip
    hp, cp = h.pre_state(), c.pre_state()

    def peep(gate, state):
        return state * p["P"][gate] if layer.peephole else None

    i = f(_clipped(_gate_input(x, hp, p, "i", peep("i", cp)), clip))
    if layer.input_forget:
        forget = 1.0 - i
    else:
        forget = f(_clipped(_gate_input(x, hp, p, "f", peep("f", cp)), clip))
    cell = g(_clipped(_gate_input(x, hp, p, "c"), clip))
    c_new = forget * cp + i * cell
    c.update(c_new)
    o = f(_clipped(_gate_input(x, hp, p, "o", peep("o", c_new)), clip))
    h_new = o * hact(c_new)
    if layer.proj_size:
        h_new = h_new @ p["proj"]
    h.update(h_new)


class Cell(NamedTuple):
    """One built-in recurrent cell: everything the front ends read of it.

    The layer classes (``stepnet.nn.<title>`` and ``<title>Cell``), YAML's
    ``type: <name>``, ONNX import and export and the PyTorch and JAX bridges
    all work from this record; docs/adding-a-layer.md is the recipe."""

    name: str  # YAML's type, and the prefix of the layer's step-nets' names
    title: str  # the classes stepnet.nn.<title> and stepnet.nn.<title>Cell
    gates: tuple  # its gates in ONNX's order: the blocks of ONNX's W, R and B
    # the order a step reads its gates' x @ W and h @ R: the Numba backend
    # joins a step's products with one left operand by columns in this
    # order, and a layer keeps the gate weights it joins as one array so
    # ordered (the join is then a view, not a copy a call)
    read_order: tuple
    # the gates whose h @ R a step reads on a gated state ((r * h) @ R_h),
    # apart from the others' joined product (unless linear_before_reset)
    gated_state: tuple
    activations: tuple  # ONNX's default activations (f, g, h)
    states: tuple  # its memories: the output state first
    attention: bool  # its step also reads a score per sequence (AUGRU)
    options: tuple  # the layer's own keyword options (and YAML keys)
    onnx: str | None  # ONNX's operator; None: a layer exports as a Scan of its step
    onnx_attrs: tuple  # the operator's attributes that are layer options
    torch: str | None  # torch.nn.<torch> and <torch>Cell; None: PyTorch has none
    torch_gates: tuple  # PyTorch's gate order
    step: Callable  # step(x, states, p, acts, layer, attention): the equations


CELLS = {c.name: c for c in (
    Cell(name="rnn", title="RNN", gates=("i",), read_order=("i",), gated_state=(),
         activations=("Tanh",), states=("h",), attention=False, options=("nonlinearity",),
         onnx="RNN", onnx_attrs=(), torch="RNN", torch_gates=("i",), step=rnn_step),
    Cell(name="gru", title="GRU", gates=("z", "r", "h"), read_order=("z", "r", "h"),
         gated_state=("h",), activations=("Sigmoid", "Tanh"), states=("h",), attention=False,
         options=("linear_before_reset",), onnx="GRU", onnx_attrs=("linear_before_reset",),
         torch="GRU", torch_gates=("r", "z", "h"), step=gru_step),
    Cell(name="augru", title="AUGRU", gates=("z", "r", "h"), read_order=("z", "r", "h"),
         gated_state=("h",), activations=("Sigmoid", "Tanh"), states=("h",), attention=True,
         options=("linear_before_reset",), onnx=None, onnx_attrs=(), torch=None, torch_gates=(),
         step=gru_step),
    Cell(name="lstm", title="LSTM", gates=("i", "o", "f", "c"), read_order=("i", "f", "c", "o"),
         gated_state=(), activations=("Sigmoid", "Tanh", "Tanh"), states=("h", "c"),
         attention=False, options=("peephole", "proj_size", "input_forget"), onnx="LSTM",
         onnx_attrs=("input_forget",), torch="LSTM", torch_gates=("i", "f", "c", "o"),
         step=lstm_step),
    Cell(name="mgu", title="MGU", gates=("f", "h"), read_order=("f", "h"), gated_state=("h",),
         activations=("Sigmoid", "Tanh"), states=("h",), attention=False, options=(), onnx=None,
         onnx_attrs=(), torch=None, torch_gates=(), step=mgu_step),
)}
PEEPHOLES = ("i", "o", "f")  # an LSTM's peephole weights, in ONNX's order
ONNX_LAYERS = {c.onnx: c for c in CELLS.values() if c.onnx}


def joined_gates(cell, kind, linear_before_reset=False, input_forget=False):
    """The gates whose weights of ``kind`` (``"W"``: ``x @ W``, ``"R"``:
    ``h @ R``) a step of ``cell`` reads as one product, in the order it
    reads them: every gate but those it reads apart (a GRU's ``(r * h) @
    R_h`` without ``linear_before_reset``) or not at all (an LSTM's forget
    gate with ``input_forget``)."""
    apart = set(CELLS[cell].gated_state) if kind == "R" and not linear_before_reset else set()
    if input_forget:
        apart.add("f")
    return tuple(g for g in CELLS[cell].read_order if g not in apart)


def resolve_activations(names, alphas, betas):
    """ONNX's ``activations``/``activation_alpha``/``activation_beta`` as
    one-argument callables: each alpha (beta) is consumed, in order, by the
    next function that takes one; missing ones take ONNX's defaults."""
    alphas, betas = list(alphas or ()), list(betas or ())
    funcs, specs = [], []
    for name in names:
        _, default_alpha, default_beta = ACTIVATIONS[name]
        alpha = alphas.pop(0) if default_alpha is not None and alphas else default_alpha
        beta = betas.pop(0) if default_beta is not None and betas else default_beta
        funcs.append(Activation(name, alpha, beta))
        specs.append((name, alpha, beta))
    return funcs, specs


class Activation(NamedTuple):
    """An activation of ``ACTIVATIONS`` with its alpha and beta, called on a
    value (a record, not a closure: a layer holding it pickles)."""

    name: str
    alpha: float | None
    beta: float | None

    def __call__(self, x):
        return ACTIVATIONS[self.name][0](x, self.alpha, self.beta)


def canonical_activation(name, where):
    from ..errors import StepNetError

    key = str(name).lower()
    if key not in ACTIVATION_NAMES:
        raise StepNetError(
            f"{where}: unknown activation {name!r}; expected one of {sorted(ACTIVATIONS)}"
        )
    return ACTIVATION_NAMES[key]
