"""One time step of each built-in cell, written in the step-net DSL.

The equations are the ONNX RNN, GRU and LSTM operators' (the oneDNN RNN
primitive's), in ONNX's gate orders: RNN ``i``; GRU ``z, r, h``; LSTM
``i, o, f, c`` with peepholes ``i, o, f``. Weights are per gate, in the DSL's
orientation (``x @ W``: ``W[g]`` is ``[input, hidden]``); the Numba backend
merges the gates' matmuls into one GEMM over all tokens for the input and one
per step for the recurrence.

``acts`` holds the cell's activations (ONNX's f, g, h) as one-argument
callables; ``clip`` bounds every activation's input to ``[-clip, clip]``
(ONNX's cell clip).
"""

from __future__ import annotations

import numpy as np

from .. import ops

GATES = {
    "rnn": ("i",),
    "gru": ("z", "r", "h"),
    "augru": ("z", "r", "h"),
    "lstm": ("i", "o", "f", "c"),
}
PEEPHOLES = ("i", "o", "f")
# the order in which a step reads each gate's ``x @ W`` and ``h @ R``: the
# Numba backend joins a step's products with one left operand by columns in
# this order, and a layer keeps the gate weights it joins as one array so
# ordered (``stepnet.nn``: the join is then a view, not a copy a call)
READ_ORDER = {
    "rnn": ("i",),
    "gru": ("z", "r", "h"),
    "augru": ("z", "r", "h"),
    "lstm": ("i", "f", "c", "o"),
}


def joined_gates(cell, kind, linear_before_reset=False, input_forget=False):
    """The gates whose weights of ``kind`` (``"W"``: ``x @ W``, ``"R"``:
    ``h @ R``) a step of ``cell`` reads as one product, in the order it
    reads them: every gate but those it reads apart (a GRU's ``(r * h) @
    R_h`` without ``linear_before_reset``) or not at all (an LSTM's forget
    gate with ``input_forget``)."""
    apart = set()
    if cell in ("gru", "augru") and kind == "R" and not linear_before_reset:
        apart.add("h")
    if cell == "lstm" and input_forget:
        apart.add("f")
    return tuple(g for g in READ_ORDER[cell] if g not in apart)


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


def rnn_step(x, h, p, acts, clip):
    """``h = f(x Wi + Wbi + Rbi + h_prev Ri)``."""
    (f,) = acts
    hp = h.pre_state()
    h.update(f(_clipped(_gate_input(x, hp, p, "i"), clip)))


def gru_step(x, h, p, acts, clip, linear_before_reset, attention=None):
    """ONNX GRU; with ``attention`` oneDNN's AUGRU (``z' = (1 - a) * z``)."""
    f, g = acts
    hp = h.pre_state()
    z = f(_clipped(_gate_input(x, hp, p, "z"), clip))
    r = f(_clipped(_gate_input(x, hp, p, "r"), clip))
    if linear_before_reset:
        pre = x @ p["W"]["h"] + p["Wb"]["h"] + r * (hp @ p["R"]["h"] + p["Rb"]["h"])
    else:
        pre = x @ p["W"]["h"] + p["Wb"]["h"] + p["Rb"]["h"] + (r * hp) @ p["R"]["h"]
    candidate = g(_clipped(pre, clip))
    if attention is not None:
        z = (1.0 - attention) * z
    h.update((1.0 - z) * candidate + z * hp)


def lstm_step(x, h, c, p, acts, clip, peephole, input_forget, proj):
    """ONNX LSTM (peepholes, coupled input-forget gate) with PyTorch's
    projection of the hidden state (``h = (o * h(c)) @ proj``)."""
    f, g, hact = acts
    hp, cp = h.pre_state(), c.pre_state()
    def peep(gate, state):
        return state * p["P"][gate] if peephole else None

    i = f(_clipped(_gate_input(x, hp, p, "i", peep("i", cp)), clip))
    if input_forget:
        forget = 1.0 - i
    else:
        forget = f(_clipped(_gate_input(x, hp, p, "f", peep("f", cp)), clip))
    cell = g(_clipped(_gate_input(x, hp, p, "c"), clip))
    c_new = forget * cp + i * cell
    c.update(c_new)
    o = f(_clipped(_gate_input(x, hp, p, "o", peep("o", c_new)), clip))
    h_new = o * hact(c_new)
    if proj is not None:
        h_new = h_new @ proj
    h.update(h_new)


def resolve_activations(names, alphas, betas):
    """ONNX's ``activations``/``activation_alpha``/``activation_beta`` as
    one-argument callables: each alpha (beta) is consumed, in order, by the
    next function that takes one; missing ones take ONNX's defaults."""
    alphas, betas = list(alphas or ()), list(betas or ())
    funcs, specs = [], []
    for name in names:
        fn, default_alpha, default_beta = ACTIVATIONS[name]
        alpha = alphas.pop(0) if default_alpha is not None and alphas else default_alpha
        beta = betas.pop(0) if default_beta is not None and betas else default_beta
        funcs.append(lambda x, fn=fn, a=alpha, b=beta: fn(x, a, b))
        specs.append((name, alpha, beta))
    return funcs, specs


def canonical_activation(name, where):
    from ..errors import StepNetError

    key = str(name).lower()
    if key not in ACTIVATION_NAMES:
        raise StepNetError(
            f"{where}: unknown activation {name!r}; expected one of {sorted(ACTIVATIONS)}"
        )
    return ACTIVATION_NAMES[key]


def float_or_none(v):
    return None if v is None else float(np.asarray(v))
