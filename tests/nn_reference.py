"""Independent float64 oracles for ``stepnet.nn``.

Written from the ONNX RNN/GRU/LSTM operator specs and oneDNN's RNN primitive
docs, not from stepnet: one Python loop per sequence, per direction, per
layer, so that none of stepnet's batching, masking or reordering is shared.

Weights are in ONNX operator layout, one dict per layer as
``layer.onnx_weights(l)`` gives them:

* ``W`` ``[D, G*H, I]``, ``R`` ``[D, G*H, Hr]``, ``B`` ``[D, 2*G*H]``
  (``Wb`` then ``Rb``), gate orders RNN: i; GRU: z, r, h; LSTM: i, o, f, c;
* ``P`` ``[D, 3*H]`` (LSTM peephole, i, o, f);
* ``proj`` ``[D, P, H]`` (LSTM projection, PyTorch's ``weight_hr`` layout:
  ``h_t = proj @ (o_t * h(C_t))``), so ``Hr`` is ``P`` then.

Sequences are lists of ``[T_b, features]`` arrays.  The ONNX Runtime helpers
at the end build single-node (or chained) ONNX models for the same layers.

>>> import numpy as np
>>> rng = np.random.default_rng(0)
>>> w = {"W": rng.normal(size=(1, 6, 2)), "R": rng.normal(size=(1, 6, 2)),
...      "B": rng.normal(size=(1, 12))}
>>> ys, h_n, _ = run_stack("gru", [rng.normal(size=(3, 2))], [w])
>>> ys[0].shape, h_n.shape
((3, 2), (1, 1, 2))
"""

import numpy as np

GATES = {"rnn": 1, "gru": 3, "augru": 3, "lstm": 4, "mgu": 2}
DEFAULT_ACTIVATIONS = {
    "rnn": ["Tanh"],
    "gru": ["Sigmoid", "Tanh"],
    "augru": ["Sigmoid", "Tanh"],
    "lstm": ["Sigmoid", "Tanh", "Tanh"],
    "mgu": ["Sigmoid", "Tanh"],
}


# ---------------------------------------------------------------------------
# ONNX activations (the RNN operators' list, with alpha/beta as defined there)
# ---------------------------------------------------------------------------


def _sigmoid(x):
    # Split by sign so that exp never overflows.
    out = np.empty_like(x)
    pos = x >= 0
    out[pos] = 1.0 / (1.0 + np.exp(-x[pos]))
    e = np.exp(x[~pos])
    out[~pos] = e / (1.0 + e)
    return out


# name -> (function(x, alpha, beta), default alpha or None if unused,
#          default beta or None if unused)
ACTIVATIONS = {
    "relu": (lambda x, a, b: np.maximum(x, 0.0), None, None),
    "tanh": (lambda x, a, b: np.tanh(x), None, None),
    "sigmoid": (lambda x, a, b: _sigmoid(x), None, None),
    "affine": (lambda x, a, b: a * x + b, 1.0, 0.0),
    "leakyrelu": (lambda x, a, b: np.where(x >= 0, x, a * x), 0.01, None),
    "thresholdedrelu": (lambda x, a, b: np.where(x >= a, x, 0.0), 1.0, None),
    "scaledtanh": (lambda x, a, b: a * np.tanh(b * x), 1.0, 1.0),
    "hardsigmoid": (lambda x, a, b: np.clip(a * x + b, 0.0, 1.0), 0.2, 0.5),
    "elu": (lambda x, a, b: np.where(x >= 0, x, a * np.expm1(np.minimum(x, 0.0))), 1.0, None),
    "softsign": (lambda x, a, b: x / (1.0 + np.abs(x)), None, None),
    "softplus": (lambda x, a, b: np.logaddexp(0.0, x), None, None),
}


def activation_functions(kind, num_directions, activations=None, alpha=None, beta=None):
    """Per direction, the list of activation callables (f, g[, h]).

    ``activations`` lists ONNX names for every direction in turn (a list for
    one direction is reused for both).  ``alpha``/``beta`` values are consumed
    in order by the functions that take one, as ONNX Runtime reads them; a
    function left without a value gets its ONNX default.
    """
    per_dir = len(DEFAULT_ACTIVATIONS[kind])
    names = list(activations) if activations else DEFAULT_ACTIVATIONS[kind] * num_directions
    if len(names) == per_dir and num_directions == 2:
        names = names * 2
    if len(names) != per_dir * num_directions:
        raise ValueError(f"{kind}: {len(names)} activations for {num_directions} directions")
    alphas, betas = list(alpha or []), list(beta or [])
    funcs = []
    for name in names:
        fn, a_default, b_default = ACTIVATIONS[name.lower()]
        a = alphas.pop(0) if a_default is not None and alphas else a_default
        b = betas.pop(0) if b_default is not None and betas else b_default
        funcs.append(lambda x, fn=fn, a=a, b=b: fn(x, a, b))
    return [funcs[d * per_dir:(d + 1) * per_dir] for d in range(num_directions)]


# ---------------------------------------------------------------------------
# One direction of one layer over one sequence
# ---------------------------------------------------------------------------


def run_direction(kind, x, W, R, B, h0, c0=None, P=None, proj=None, acts=None, clip=None,
                  reverse=False, linear_before_reset=False, input_forget=False, attention=None):
    """Run one direction (weights without the D axis) over ``x [T, I]``.

    Returns ``(y [T, Hr], h_last, c_last)``; ``h_last`` is the state after the
    last processed step (position 0 when ``reverse``), ``h0`` for ``T == 0``.
    ``attention`` (AUGRU) is ``[T]``, one score per position of ``x``.
    """
    x = np.asarray(x, np.float64)
    W, R = np.asarray(W, np.float64), np.asarray(R, np.float64)
    G = GATES[kind]
    H = W.shape[0] // G
    B = np.zeros(2 * G * H) if B is None else np.asarray(B, np.float64)
    Wb, Rb = B[:G * H], B[G * H:]
    acts = acts or activation_functions(kind, 1)[0]
    f = acts[0]

    def cl(v):
        return v if clip is None else np.clip(v, -clip, clip)

    def gate(k, x_t, h):
        s = slice(k * H, (k + 1) * H)
        return x_t @ W[s].T + h @ R[s].T + Wb[s] + Rb[s]

    h = np.asarray(h0, np.float64).copy()
    c = None if c0 is None else np.asarray(c0, np.float64).copy()
    T = x.shape[0]
    y = np.zeros((T, h.shape[0]))
    for t in (range(T - 1, -1, -1) if reverse else range(T)):
        x_t = x[t]
        if kind == "rnn":
            h = f(cl(gate(0, x_t, h)))
        elif kind in ("gru", "augru"):
            g = acts[1]
            z = f(cl(gate(0, x_t, h)))
            r = f(cl(gate(1, x_t, h)))
            s = slice(2 * H, 3 * H)
            if linear_before_reset:
                pre = x_t @ W[s].T + Wb[s] + r * (h @ R[s].T + Rb[s])
            else:
                pre = x_t @ W[s].T + Wb[s] + (r * h) @ R[s].T + Rb[s]
            cand = g(cl(pre))
            if kind == "augru":
                z = (1.0 - attention[t]) * z
            h = (1.0 - z) * cand + z * h
        elif kind == "mgu":  # the minimal gated unit: gates f, h
            fg = f(cl(gate(0, x_t, h)))
            s = slice(H, 2 * H)
            cand = acts[1](cl(x_t @ W[s].T + Wb[s] + (fg * h) @ R[s].T + Rb[s]))
            h = (1.0 - fg) * h + fg * cand
        else:
            g, hact = acts[1], acts[2]
            Pi, Po, Pf = (np.zeros(H),) * 3 if P is None else np.split(np.asarray(P, np.float64), 3)
            i = f(cl(gate(0, x_t, h) + Pi * c))
            if input_forget:
                fg = 1.0 - i
            else:
                fg = f(cl(gate(2, x_t, h) + Pf * c))
            cand = g(cl(gate(3, x_t, h)))
            c = fg * c + i * cand
            o = f(cl(gate(1, x_t, h) + Po * c))
            h = o * hact(c)
            if proj is not None:
                h = np.asarray(proj, np.float64) @ h
        y[t] = h
    return y, h, c


# ---------------------------------------------------------------------------
# Layers, directions and stacking
# ---------------------------------------------------------------------------


def _state_width(kind, weights):
    if "proj" in weights and weights["proj"] is not None:
        return weights["proj"].shape[1]
    return weights["W"].shape[1] // GATES[kind]


def run_stack(kind, seqs, layers, direction="forward", combine="per_layer", h0=None, c0=None,
              activations=None, activation_alpha=None, activation_beta=None, clip=None,
              linear_before_reset=False, input_forget=False, attention=None):
    """A stack of layers over a batch of sequences, stepnet.nn's semantics.

    ``seqs``: list of ``[T_b, I]``; ``layers``: one ONNX-layout dict per layer;
    ``direction`` in forward, reverse, bidirectional_concat, bidirectional_sum;
    ``combine`` per_layer (each layer reads both directions' combined output)
    or final (each direction's stack runs alone, combined at the end);
    ``h0``/``c0``: ``[L*D, B, *]`` indexed ``layer * D + direction``;
    ``attention``: list of ``[T_b]`` scores (AUGRU).
    Returns ``(ys, h_n, c_n)``: ys a list of ``[T_b, out]``, h_n ``[L*D, B, Hr]``,
    c_n ``[L*D, B, H]`` (LSTM) or None.
    """
    if direction not in ("forward", "reverse", "bidirectional_concat", "bidirectional_sum"):
        raise ValueError(direction)
    D = 2 if direction.startswith("bidirectional") else 1
    L = len(layers)
    nb = len(seqs)
    G = GATES[kind]
    H = layers[0]["W"].shape[1] // G
    Hr = _state_width(kind, layers[0])
    acts = activation_functions(kind, D, activations, activation_alpha, activation_beta)
    h_n = np.zeros((L * D, nb, Hr)) if h0 is None else np.array(h0, np.float64)
    c_n = None
    if kind == "lstm":
        c_n = np.zeros((L * D, nb, H)) if c0 is None else np.array(c0, np.float64)
    h_init, c_init = h_n.copy(), None if c_n is None else c_n.copy()

    def one(layer, d, b, x):
        w = layers[layer]
        P = w.get("P")
        proj = w.get("proj")
        y, h, c = run_direction(
            kind, x, w["W"][d], w["R"][d], None if w.get("B") is None else w["B"][d],
            h_init[layer * D + d, b], None if c_init is None else c_init[layer * D + d, b],
            P=None if P is None else P[d], proj=None if proj is None else proj[d],
            acts=acts[d], clip=clip, reverse=(direction == "reverse" or d == 1),
            linear_before_reset=linear_before_reset, input_forget=input_forget,
            attention=None if attention is None else np.asarray(attention[b], np.float64))
        h_n[layer * D + d, b] = h
        if c_n is not None:
            c_n[layer * D + d, b] = c
        return y

    def combined(outs):
        if D == 1:
            return outs[0]
        if direction == "bidirectional_sum":
            return outs[0] + outs[1]
        return np.concatenate(outs, axis=-1)

    xs = [np.asarray(s, np.float64) for s in seqs]
    ys = []
    for b in range(nb):
        if combine == "per_layer":
            x = xs[b]
            for layer in range(L):
                x = combined([one(layer, d, b, x) for d in range(D)])
            ys.append(x)
        elif combine == "final":
            outs = []
            for d in range(D):
                x = xs[b]
                for layer in range(L):
                    x = one(layer, d, b, x)
                outs.append(x)
            ys.append(combined(outs))
        else:
            raise ValueError(combine)
    return ys, h_n, c_n


# ---------------------------------------------------------------------------
# PyTorch layouts -> ONNX layout
# ---------------------------------------------------------------------------

# Row blocks of a PyTorch weight in ONNX gate order.
TORCH_TO_ONNX_GATES = {"rnn": [0], "gru": [1, 0, 2], "lstm": [0, 3, 1, 2]}


def _reorder(a, kind):
    blocks = np.split(np.asarray(a), len(TORCH_TO_ONNX_GATES[kind]), axis=0)
    return np.concatenate([blocks[k] for k in TORCH_TO_ONNX_GATES[kind]], axis=0)


def torch_to_onnx_weights(module):
    """One ONNX-layout dict per layer from a torch.nn.RNN/GRU/LSTM (as NumPy)."""
    kind = {"RNN": "rnn", "GRU": "gru", "LSTM": "lstm"}[type(module).__name__]
    D = 2 if module.bidirectional else 1
    params = {k: v.detach().cpu().numpy() for k, v in module.named_parameters()}
    layers = []
    for layer in range(module.num_layers):
        W, R, B, proj = [], [], [], []
        for d in range(D):
            sfx = f"_l{layer}" + ("_reverse" if d else "")
            wih, whh = params["weight_ih" + sfx], params["weight_hh" + sfx]
            zeros = np.zeros(wih.shape[0], wih.dtype)
            bih, bhh = params.get("bias_ih" + sfx, zeros), params.get("bias_hh" + sfx, zeros)
            W.append(_reorder(wih, kind))
            R.append(_reorder(whh, kind))
            B.append(np.concatenate([_reorder(bih, kind), _reorder(bhh, kind)]))
            if "weight_hr" + sfx in params:
                proj.append(params["weight_hr" + sfx])
        w = {"W": np.stack(W), "R": np.stack(R), "B": np.stack(B)}
        if proj:
            w["proj"] = np.stack(proj)
        layers.append(w)
    return layers


# ---------------------------------------------------------------------------
# ONNX Runtime: single-node and chained models in ONNX operator layout
# ---------------------------------------------------------------------------

ONNX_OPS = {"rnn": "RNN", "gru": "GRU", "lstm": "LSTM"}


def onnx_layer_model(kind, layers, input_size, dtype=np.float32, opset=14):
    """An ONNX model running ``layers`` (ONNX-operator dicts: arrays W, R, B,
    optional P, and attributes) one after another, each layer reading the
    previous one's Y reshaped to ``[T, B, D*H]`` (PyTorch/ONNX stacking).

    Graph inputs: X ``[T, B, I]``, sequence_lens ``[B]`` int32, and per layer
    ``initial_h_{l}`` (``initial_c_{l}`` for LSTM) ``[D, B, H]``.  Outputs:
    Y (last layer, ``[T, D, B, H]``), and ``Y_h_{l}`` (``Y_c_{l}``) per layer.
    """
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    elem = {np.dtype(np.float32): TensorProto.FLOAT,
            np.dtype(np.float64): TensorProto.DOUBLE}[np.dtype(dtype)]
    attr_names = ("hidden_size", "direction", "activations", "activation_alpha",
                  "activation_beta", "clip", "linear_before_reset", "input_forget")
    inputs = [helper.make_tensor_value_info("X", elem, ["T", "B", input_size]),
              helper.make_tensor_value_info("sequence_lens", TensorProto.INT32, ["B"])]
    outputs, nodes, inits = [], [], []
    x_name = "X"
    for l, layer in enumerate(layers):
        D = layer["W"].shape[0]
        H = int(layer["hidden_size"])
        names = {}
        for key in ("W", "R", "B", "P"):
            if layer.get(key) is not None:
                names[key] = f"{key}_{l}"
                inits.append(numpy_helper.from_array(np.asarray(layer[key], dtype), names[key]))
        inputs.append(helper.make_tensor_value_info(f"initial_h_{l}", elem, [D, "B", H]))
        node_inputs = [x_name, names["W"], names["R"], names.get("B", ""), "sequence_lens",
                       f"initial_h_{l}"]
        node_outputs = [f"Y_{l}", f"Y_h_{l}"]
        if kind == "lstm":
            inputs.append(helper.make_tensor_value_info(f"initial_c_{l}", elem, [D, "B", H]))
            node_inputs += [f"initial_c_{l}", names.get("P", "")]
            node_outputs.append(f"Y_c_{l}")
        attrs = {k: layer[k] for k in attr_names
                 if layer.get(k) is not None and not (isinstance(layer[k], (list, tuple))
                                                      and len(layer[k]) == 0)}
        if kind != "gru":
            attrs.pop("linear_before_reset", None)
        if kind != "lstm":
            attrs.pop("input_forget", None)
        if "direction" in attrs and attrs["direction"] not in ("forward", "reverse"):
            attrs["direction"] = "bidirectional"
        for key in ("activation_alpha", "activation_beta"):
            if key in attrs:
                attrs[key] = [float(v) for v in attrs[key]]
        if "clip" in attrs:
            attrs["clip"] = float(attrs["clip"])
        for key in ("linear_before_reset", "input_forget", "hidden_size"):
            if key in attrs:
                attrs[key] = int(attrs[key])
        if "activations" in attrs:
            attrs["activations"] = list(attrs["activations"])
        nodes.append(helper.make_node(ONNX_OPS[kind], node_inputs, node_outputs, **attrs))
        outputs += [helper.make_tensor_value_info(n, elem, [D, "B", None]) for n in node_outputs[1:]]
        if l + 1 < len(layers):
            # [T, D, B, H] -> [T, B, D, H] -> [T, B, D*H]
            nodes.append(helper.make_node("Transpose", [f"Y_{l}"], [f"Yt_{l}"], perm=[0, 2, 1, 3]))
            shape = f"shape_{l}"
            inits.append(numpy_helper.from_array(np.array([0, 0, -1], np.int64), shape))
            nodes.append(helper.make_node("Reshape", [f"Yt_{l}", shape], [f"X_{l + 1}"]))
            x_name = f"X_{l + 1}"
    outputs.insert(0, helper.make_tensor_value_info(f"Y_{len(layers) - 1}", elem,
                                                    ["T", None, "B", None]))
    graph = helper.make_graph(nodes, "stepnet_nn_oracle", inputs, outputs, initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    onnx.checker.check_model(model)
    return model


def run_onnx_layers(kind, layers, seqs, h0=None, c0=None, dtype=np.float32):
    """Run :func:`onnx_layer_model` on onnxruntime over ``seqs``.

    ``h0``/``c0`` are ``[L*D, B, H]`` (stepnet's indexing).  Returns
    ``(ys, h_n, c_n)`` like :func:`run_stack` (Y of the last layer, per
    sequence ``[T_b, D*H]`` with directions concatenated).
    """
    import onnxruntime as ort

    dtype = np.dtype(dtype)
    nb = len(seqs)
    lens = np.array([len(s) for s in seqs], np.int32)
    T = int(lens.max()) if nb else 0
    I = seqs[0].shape[1]
    X = np.zeros((T, nb, I), dtype)
    for b, s in enumerate(seqs):
        X[:len(s), b] = s
    model = onnx_layer_model(kind, layers, I, dtype)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {"X": X, "sequence_lens": lens}
    row = 0
    for l, layer in enumerate(layers):
        D, H = layer["W"].shape[0], int(layer["hidden_size"])
        zeros = np.zeros((D, nb, H), dtype)
        feeds[f"initial_h_{l}"] = zeros if h0 is None else np.asarray(h0[row:row + D], dtype)
        if kind == "lstm":
            feeds[f"initial_c_{l}"] = zeros if c0 is None else np.asarray(c0[row:row + D], dtype)
        row += D
    out = sess.run(None, feeds)
    Y = out[0]  # [T, D, B, H]
    ys = [Y[:lens[b], :, b, :].reshape(lens[b], Y.shape[1] * Y.shape[3]) for b in range(nb)]
    per_layer = 2 if kind == "lstm" else 1
    h_n = np.concatenate([out[1 + per_layer * l] for l in range(len(layers))])
    c_n = None
    if kind == "lstm":
        c_n = np.concatenate([out[2 + 2 * l] for l in range(len(layers))])
    return ys, h_n, c_n


# ---------------------------------------------------------------------------
# PyTorch through PackedSequence
# ---------------------------------------------------------------------------


def run_torch(module, seqs, h0=None, c0=None):
    """Run a torch.nn.RNN/GRU/LSTM over ``seqs`` (all non-empty) packed.

    Returns ``(ys, h_n, c_n)`` like :func:`run_stack`, as NumPy arrays in the
    module's dtype; ``c_n`` is None except for LSTM.
    """
    import torch
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

    dtype = next(module.parameters()).dtype
    lens = [len(s) for s in seqs]
    padded = torch.nn.utils.rnn.pad_sequence(
        [torch.as_tensor(np.asarray(s)).to(dtype) for s in seqs], batch_first=True)
    packed = pack_padded_sequence(padded, torch.tensor(lens), batch_first=True,
                                  enforce_sorted=False)
    state = None
    if h0 is not None:
        h = torch.as_tensor(np.asarray(h0)).to(dtype)
        state = (h, torch.as_tensor(np.asarray(c0)).to(dtype)) if c0 is not None else h
    with torch.no_grad():
        out, hidden = module(packed, state)
    Y, _ = pad_packed_sequence(out, batch_first=True)
    Y = Y.numpy()
    ys = [Y[b, :n] for b, n in enumerate(lens)]
    if isinstance(hidden, tuple):
        return ys, hidden[0].numpy(), hidden[1].numpy()
    return ys, hidden.numpy(), None
