"""The peers: one builder per (peer, workload).

A builder takes a :class:`workloads.Workload` and returns a zero-argument
callable that runs the forward on inputs built beforehand (each call is
given them, as a user's call on new data is: a stepnet step-net is called
with its input bound again, ``f(x=X)``) and returns
``(outputs, final_state)``: all steps' outputs in the peer's own layout, and
the final hidden state per sequence (W6: ``(paragraph_vectors,
chapter_last_states)``). ``final_state_numpy`` turns the latter into one
float array for the accuracy check (outside any timing).

A training workload (W8, W9) returns a third item: a zero-argument function
giving the gradients as a dict keyed by ``workloads.gradient_names(wl)`` (W8:
``GRADIENTS``, PyTorch's layout; W9: ``CUSTOM_GRADIENTS``, the layout of
``workloads.custom_weights``; ``"x"`` batch-major ``[B, T, I]``), called once,
outside any timing; ``None`` for a forward-only part. Such a callable may carry ``info`` (a dict: its
``role`` in the step, ``"step"``, ``"forward"``, ``"backward"`` or
``"inference"``, and what else it measured) for the report.

Families (each runs in its own process, see run.py): ``stepnet``, ``torch``,
``onnxruntime``, ``jax``, ``numpy``. ``PEERS[family][workload]`` lists
``(label, builder)``; a workload a family has no peer for maps to a string
saying why (shown as "n/a").

Frameworks are imported inside the builders, so that the worker controls the
import order (torch first in the torch worker) and a missing one fails only its
own items.
"""

from __future__ import annotations

import numpy as np

PEERS: dict = {}

FAMILIES = ("stepnet", "torch", "onnxruntime", "jax", "numpy")


def peer(family, keys, label):
    """Register ``fn`` as ``family``'s peer for the workloads ``keys``."""

    def register(fn):
        for key in keys:
            PEERS.setdefault(family, {}).setdefault(key, []).append((label, fn))
        return fn

    return register


def not_applicable(family, keys, reason):
    for key in keys:
        PEERS.setdefault(family, {})[key] = reason


def final_state_numpy(h) -> np.ndarray:
    """A peer's final state as a float64 array (a tuple is stacked by rows)."""
    if isinstance(h, (tuple, list)):
        return np.concatenate([final_state_numpy(v) for v in h], axis=0)
    if hasattr(h, "detach"):  # torch
        h = h.detach().cpu().numpy()
    return np.asarray(h, dtype=np.float64)


def gradients_numpy(grads) -> dict:
    """A peer's gradients as float64 arrays, keyed as given."""
    return {k: final_state_numpy(v) for k, v in grads.items()}


def _with_info(fn, **info):
    fn.info = info
    return fn


def _gate_slices(H, n):
    return [slice(k * H, (k + 1) * H) for k in range(n)]


# ============================================================================
# stepnet: the cells in the DSL, compiled with the Numba backend


def _sn_param(sn, array, name):
    return sn.Parameter(np.ascontiguousarray(array, dtype=np.float32), name=name)


def _sn_gru_params(sn, w, prefix):
    """PyTorch GRU weights as DSL Parameters: ``x @ W`` with ``W = w_ih[gate].T``.

    The r and z biases are pre-summed (``b_i + b_h``); the candidate keeps its
    recurrent bias inside ``r * (h @ U_n + b_hn)`` (linear_before_reset).
    """
    H = w["w_hh"].shape[1]
    r, z, n = _gate_slices(H, 3)
    p = {}
    for gate, sl in (("r", r), ("z", z), ("n", n)):
        p["W" + gate] = _sn_param(sn, w["w_ih"][sl].T, f"{prefix}W{gate}")
        p["U" + gate] = _sn_param(sn, w["w_hh"][sl].T, f"{prefix}U{gate}")
    p["br"] = _sn_param(sn, w["b_ih"][r] + w["b_hh"][r], f"{prefix}br")
    p["bz"] = _sn_param(sn, w["b_ih"][z] + w["b_hh"][z], f"{prefix}bz")
    p["bn"] = _sn_param(sn, w["b_ih"][n], f"{prefix}bin")
    p["bhn"] = _sn_param(sn, w["b_hh"][n], f"{prefix}bhn")
    return p


def _sn_gru_cell(sn, x, h, p):
    """One PyTorch GRU step in the DSL (linear_before_reset)."""
    r = sn.ops.sigmoid(x @ p["Wr"] + h @ p["Ur"] + p["br"])
    z = sn.ops.sigmoid(x @ p["Wz"] + h @ p["Uz"] + p["bz"])
    n = sn.ops.tanh(x @ p["Wn"] + p["bn"] + r * (h @ p["Un"] + p["bhn"]))
    return (1 - z) * n + z * h


def _sn_last_rows(lod_level):
    """Row index of each sequence's last step in an all-steps output."""
    off = np.asarray(lod_level, np.int64)
    if np.any(off[1:] == off[:-1]):
        raise ValueError("empty sequences have no last row")
    return off[1:] - 1


def _torch_to_onnx_gates(a, H, order):
    """PyTorch's gate blocks (rows) of ``a`` in ONNX's order."""
    return np.concatenate([a[j * H:(j + 1) * H] for j in order], axis=0)


def _onnx_layout(weights, H, order):
    """ONNX's ``W, R, B`` of one layer from PyTorch-layout weights, one dict
    per direction (``{"w_ih", "w_hh", "b_ih", "b_hh"}``)."""
    W, R, B = [], [], []
    for w in weights:
        W.append(_torch_to_onnx_gates(w["w_ih"], H, order))
        R.append(_torch_to_onnx_gates(w["w_hh"], H, order))
        B.append(np.concatenate([_torch_to_onnx_gates(w["b_ih"], H, order),
                                 _torch_to_onnx_gates(w["b_hh"], H, order)]))
    return np.stack(W), np.stack(R), np.stack(B)


_GRU_ORDER = (1, 0, 2)  # ONNX z, r, h from PyTorch r, z, n
_LSTM_ORDER = (0, 3, 1, 2)  # ONNX i, o, f, c from PyTorch i, f, g, o


def _sn_run_layer(layer, X, last_state, backend=None):
    def run():
        Y, state = layer(X, backend=backend)
        return Y, last_state(state)

    return run


def _sn_nn_gru(sn, wl):
    """``stepnet.nn.GRU`` with the workload's weights, and its input."""
    H = wl.dims["H"]
    W, R, B = _onnx_layout([wl.weights], H, _GRU_ORDER)
    layer = sn.nn.GRU.from_onnx(W, R, B, hidden_size=H, linear_before_reset=1)
    return layer, sn.LoDTensor.from_lengths(wl.x_packed(), [wl.lengths.tolist()])


@peer("stepnet", ["W1", "W3", "W4"], "stepnet nn.GRU (numba)")
def stepnet_nn_gru(wl):
    import stepnet as sn

    layer, X = _sn_nn_gru(sn, wl)
    return _sn_run_layer(layer, X, lambda h_n: h_n[0])


def sn_nn_lstm(sn, wl):
    """W2's ``stepnet.nn.LSTM`` (W7's 2-layer bidirectional one), its input,
    and the final state the report compares (W7: the top layer's last
    states, forward then reverse: [B, 2H])."""
    H, w = wl.dims["H"], wl.weights
    X = sn.LoDTensor.from_lengths(wl.x_packed(), [wl.lengths.tolist()])
    if wl.key != "W7":
        W, R, B = _onnx_layout([w], H, _LSTM_ORDER)
        return sn.nn.LSTM.from_onnx(W, R, B, hidden_size=H), X, lambda state: state[0][0]
    layer = sn.nn.LSTM(wl.dims["I"], H, num_layers=2, direction="bidirectional_concat")
    for l in range(2):
        W, R, B = _onnx_layout([w[f"l{l}"], w[f"l{l}_reverse"]], H, _LSTM_ORDER)
        layer.set_onnx_weights(l, W, R, B)
    return layer, X, lambda state: np.concatenate(state[0][2:], axis=1)


@peer("stepnet", ["W2"], "stepnet nn.LSTM (numba)")
def stepnet_nn_lstm(wl):
    import stepnet as sn

    return _sn_run_layer(*sn_nn_lstm(sn, wl))


@peer("stepnet", ["W7"], "stepnet nn.LSTM 2 layers bidirectional_concat (numba)")
def stepnet_nn_bilstm(wl):
    import stepnet as sn

    return _sn_run_layer(*sn_nn_lstm(sn, wl))


@peer("stepnet", ["W1", "W3", "W4"], "stepnet GRU cell in the DSL (numba)")
def stepnet_gru(wl):
    import stepnet as sn

    X = sn.LoDTensor.from_lengths(wl.x_packed(), [wl.lengths.tolist()])
    p = _sn_gru_params(sn, wl.weights, "")
    rnn = sn.create_rnn_op(output_num=1)
    with rnn.stepnet():
        x = rnn.add_input(X, name="x")
        h = rnn.add_memory(shape=[wl.dims["H"]], name="h")
        h.update(_sn_gru_cell(sn, x, h.pre_state(), p))
        rnn.add_outputs(h)
    f = rnn.compile("numba")
    last = _sn_last_rows(X.lod[-1])

    def run():
        out = f(x=X)
        return out, out.data[last]

    return run


@peer("stepnet", ["W4"], "stepnet GRU, batch padded to its longest sequence (work on padding)")
def stepnet_gru_padded(wl):
    """The same batch with every sequence padded to the longest: what the
    length-sorted active batch saves. Final states are read at each sequence's
    own last step, so they are exact."""
    import stepnet as sn

    B, T = wl.x.shape[:2]
    X = sn.LoDTensor.from_lengths(np.ascontiguousarray(wl.x.reshape(B * T, -1)), [[T] * B])
    p = _sn_gru_params(sn, wl.weights, "")
    rnn = sn.create_rnn_op(output_num=1)
    with rnn.stepnet():
        x = rnn.add_input(X, name="x")
        h = rnn.add_memory(shape=[wl.dims["H"]], name="h")
        h.update(_sn_gru_cell(sn, x, h.pre_state(), p))
        rnn.add_outputs(h)
    f = rnn.compile("numba")
    last = np.arange(B) * T + wl.lengths - 1

    def run():
        out = f(x=X)
        return out, out.data[last]

    return run


@peer("stepnet", ["W2"], "stepnet LSTM cell in the DSL (numba)")
def stepnet_lstm(wl):
    import stepnet as sn

    w, H = wl.weights, wl.dims["H"]
    X = sn.LoDTensor.from_lengths(wl.x_packed(), [wl.lengths.tolist()])
    gates = dict(zip("ifgo", _gate_slices(H, 4)))
    W = {g: _sn_param(sn, w["w_ih"][s].T, f"W{g}") for g, s in gates.items()}
    U = {g: _sn_param(sn, w["w_hh"][s].T, f"U{g}") for g, s in gates.items()}
    b = {g: _sn_param(sn, w["b_ih"][s] + w["b_hh"][s], f"b{g}") for g, s in gates.items()}
    rnn = sn.create_rnn_op(output_num=1)
    with rnn.stepnet():
        x = rnn.add_input(X, name="x")
        h = rnn.add_memory(shape=[H], name="h")
        c = rnn.add_memory(shape=[H], name="c")
        hp = h.pre_state()
        i = sn.ops.sigmoid(x @ W["i"] + hp @ U["i"] + b["i"])
        f_ = sn.ops.sigmoid(x @ W["f"] + hp @ U["f"] + b["f"])
        g = sn.ops.tanh(x @ W["g"] + hp @ U["g"] + b["g"])
        o = sn.ops.sigmoid(x @ W["o"] + hp @ U["o"] + b["o"])
        c.update(f_ * c.pre_state() + i * g)
        h.update(o * sn.ops.tanh(c))
        rnn.add_outputs(h)
    f = rnn.compile("numba")
    last = _sn_last_rows(X.lod[-1])

    def run():
        out = f(x=X)
        return out, out.data[last]

    return run


def sn_custom_rnn(sn, wl, last_too=False):
    """W5's cell as a step-net, and its input; ``last_too``: a second output,
    the same state (every step's and the last, from one run)."""
    X = sn.LoDTensor.from_lengths(wl.x_packed(), [wl.lengths.tolist()])
    p = {k: _sn_param(sn, v, k) for k, v in wl.weights.items()}
    rnn = sn.create_rnn_op()
    with rnn.stepnet():
        x = rnn.add_input(X, name="x")
        h = rnn.add_memory(shape=[wl.dims["H"]], name="h")
        hp = h.pre_state()
        z = sn.ops.sigmoid(x @ p["Wz"] + hp @ p["Uz"] + p["bz"])
        r = sn.ops.sigmoid(x @ p["Wr"] + hp @ p["Ur"] + p["br"])
        cand = p["s"] * sn.ops.tanh(x @ p["Wx"] + (r * hp) @ p["Wh"] + p["b"])
        h.update((1 - z) * hp + z * cand + 0.1 * (x @ p["P"]))
        rnn.add_outputs(*([h, h] if last_too else [h]))
    return rnn, X


def _sn_custom_run(sn, wl, backend):
    rnn, X = sn_custom_rnn(sn, wl)
    f = rnn.compile(backend)
    last = _sn_last_rows(X.lod[-1])

    def run():
        out = f(x=X)
        return out, out.data[last]

    return run


@peer("stepnet", ["W5"], "stepnet custom cell in the DSL (numba)")
def stepnet_custom(wl):
    import stepnet as sn

    return _sn_custom_run(sn, wl, "numba")


@peer("stepnet", ["W6"], "stepnet nested step-net (numba)")
def stepnet_nested(wl):
    import stepnet as sn

    H = wl.dims["H"]
    chapters = sn.LoDTensor.from_lengths(
        wl.words, [wl.paragraphs_per_chapter.tolist(), wl.words_per_paragraph.tolist()]
    )
    pw = _sn_gru_params(sn, wl.weights["word"], "word_")
    pp = _sn_gru_params(sn, wl.weights["para"], "para_")
    outer = sn.create_rnn_op(output_num=2)
    with outer.stepnet():
        paragraph = outer.add_input(chapters, name="chapters")
        ch = outer.add_memory(shape=[H], name="chapter")
        inner = sn.create_rnn_op(output_num=1)
        with inner.stepnet():
            word = inner.add_input(paragraph, name="words")
            h = inner.add_memory(shape=[H], name="h")  # h0 = 0 for every paragraph
            h.update(_sn_gru_cell(sn, word, h.pre_state(), pw))
            inner.add_outputs(h)
        pvec = inner(output_all_steps=False)  # [active chapters, H]: the paragraph vector
        ch.update(_sn_gru_cell(sn, pvec, ch.pre_state(), pp))
        outer.add_outputs(ch, pvec)
    f = outer.compile("numba")
    last = _sn_last_rows(chapters.lod[0])

    def run():
        chapter_states, pvecs = f(chapters=chapters)
        return (chapter_states, pvecs), (pvecs.data, chapter_states.data[last])

    return run


# ----------------------------------------------------------------------------
# stepnet W8: sn.vjp / keep_workspace + sn.gradients over nn.GRU


class _SnGruTraining:
    """W8 for ``stepnet.nn.GRU``: the layer, its input, the upstream
    gradients ``[dY rows, dh_n]`` and ``wrt`` (every parameter, then X)."""

    def __init__(self, wl):
        import stepnet as sn

        self.sn, self.wl = sn, wl
        self.layer, self.X = _sn_nn_gru(sn, wl)
        H = wl.dims["H"]
        self.grad_outputs = [np.ascontiguousarray(wl.extra["dY"].reshape(-1, H)),
                             np.ascontiguousarray(wl.extra["dh"][None])]
        self.wrt = self.layer.parameters() + ["X"]

    def forward(self):
        """``sn.vjp``: Y, h_n of the one layer, the pullback."""
        (Y, h_n), pullback = self.sn.vjp(self.layer, self.X)
        return Y, h_n[0], pullback

    def gradients(self, grads):
        """A function giving ``grads`` (one per ``wrt``) in PyTorch's layout:
        the weight gradients go through a second layer's ``onnx_weights``."""

        def convert():
            shadow, _ = _sn_nn_gru(self.sn, self.wl)
            for p, g in zip(shadow.parameters(), grads):
                p.value = np.asarray(g)
            onnx, H = shadow.onnx_weights(0), self.wl.dims["H"]
            b = onnx["B"][0]
            return {"weight_ih": _torch_to_onnx_gates(onnx["W"][0], H, _GRU_ORDER),
                    "weight_hh": _torch_to_onnx_gates(onnx["R"][0], H, _GRU_ORDER),
                    "bias_ih": _torch_to_onnx_gates(b[:3 * H], H, _GRU_ORDER),
                    "bias_hh": _torch_to_onnx_gates(b[3 * H:], H, _GRU_ORDER),
                    "x": np.asarray(grads[-1]).reshape(self.wl.x.shape)}

        return convert

    def backward(self, pullback):
        return self.gradients(pullback(self.grad_outputs, wrt=self.wrt))


@peer("stepnet", ["W8"], "stepnet nn.GRU: sn.vjp + pullback")
def stepnet_nn_gru_train(wl):
    t = _SnGruTraining(wl)

    def run():
        Y, h, pullback = t.forward()
        return Y, h, t.backward(pullback)

    return _with_info(run, role="step")


@peer("stepnet", ["W8"], "stepnet nn.GRU: layer(keep_workspace=True) + sn.gradients")
def stepnet_nn_gru_train_kept(wl):
    t = _SnGruTraining(wl)

    def run():
        Y, h_n = t.layer(t.X, keep_workspace=True)
        grads = t.sn.gradients(t.layer, wrt=t.wrt, grad_outputs=t.grad_outputs)
        return Y, h_n[0], t.gradients(grads)

    return _with_info(run, role="step")


@peer("stepnet", ["W8"], "stepnet nn.GRU: forward only (sn.vjp, workspace kept)")
def stepnet_nn_gru_train_forward(wl):
    t = _SnGruTraining(wl)

    def run():
        Y, h, _ = t.forward()
        return Y, h, None

    kept = getattr(t.forward()[2], "workspace_bytes", None)  # what the pullback keeps
    return _with_info(run, role="forward", workspace_bytes=kept)


@peer("stepnet", ["W8"], "stepnet nn.GRU: backward only (pullback of one kept sn.vjp)")
def stepnet_nn_gru_train_backward(wl):
    t = _SnGruTraining(wl)
    Y, h, pullback = t.forward()
    return _with_info(lambda: (Y, h, t.backward(pullback)), role="backward")


@peer("stepnet", ["W8"], "stepnet nn.GRU: forward only, no workspace (W1's call)")
def stepnet_nn_gru_train_inference(wl):
    t = _SnGruTraining(wl)
    return _with_info(_sn_run_layer(t.layer, t.X, lambda h_n: h_n[0]), role="inference")


# ----------------------------------------------------------------------------
# stepnet W9: sn.vjp / keep_workspace + sn.gradients over W5's DSL cell


class _SnCustomTraining:
    """W9 for W5's step-net (``sn_custom_rnn``): the step-net, its input, the
    upstream gradient of its all-steps output (rows in the input's order) and
    ``wrt`` (every Parameter, then the input ``"x"``).

    One per workload (``of``): the W9 stepnet peers share the step-net and so
    the kernels compiled for it, as one user's training loop would."""

    _shared: dict = {}

    @classmethod
    def of(cls, wl):
        found = cls._shared.get(id(wl))
        if found is None or found.wl is not wl:
            found = cls._shared[id(wl)] = cls(wl)
        return found

    def __init__(self, wl):
        import stepnet as sn

        self.sn, self.wl = sn, wl
        self.rnn, self.X = sn_custom_rnn(sn, wl)
        self.params = self.rnn.parameters()
        self.wrt = self.params + ["x"]
        self.grad_outputs = [np.ascontiguousarray(wl.extra["dY"].reshape(-1, wl.dims["H"]))]
        self.last = _sn_last_rows(self.X.lod[-1])

    def forward(self):
        """``sn.vjp``: Y (all steps), the final states, the pullback."""
        Y, pullback = self.sn.vjp(self.rnn, backend="numba")
        return Y, Y.data[self.last], pullback

    def gradients(self, grads):
        """A function giving ``grads`` (one per ``wrt``) keyed by the weights'
        names (``workloads.CUSTOM_GRADIENTS``), ``"x"`` as ``[B, T, I]``."""

        def convert():
            g = {p.name: np.asarray(v) for p, v in zip(self.params, grads)}
            g["x"] = np.asarray(grads[-1]).reshape(self.wl.x.shape)
            return g

        return convert

    def backward(self, pullback):
        return self.gradients(pullback(self.grad_outputs, wrt=self.wrt))


@peer("stepnet", ["W9"], "stepnet custom cell in the DSL: sn.vjp + pullback")
def stepnet_custom_train(wl):
    t = _SnCustomTraining.of(wl)

    def run():
        Y, h, pullback = t.forward()
        return Y, h, t.backward(pullback)

    return _with_info(run, role="step")


@peer("stepnet", ["W9"], "stepnet custom cell in the DSL: rnn(keep_workspace=True) + sn.gradients")
def stepnet_custom_train_kept(wl):
    t = _SnCustomTraining.of(wl)

    def run():
        Y = t.rnn(backend="numba", keep_workspace=True)
        grads = t.sn.gradients(t.rnn, wrt=t.wrt, grad_outputs=t.grad_outputs, backend="numba")
        return Y, Y.data[t.last], t.gradients(grads)

    return _with_info(run, role="step")


@peer("stepnet", ["W9"], "stepnet custom cell: forward only (sn.vjp, workspace kept)")
def stepnet_custom_train_forward(wl):
    t = _SnCustomTraining.of(wl)

    def run():
        Y, h, _ = t.forward()
        return Y, h, None

    kept = getattr(t.forward()[2], "workspace_bytes", None)  # what the pullback keeps
    return _with_info(run, role="forward", workspace_bytes=kept)


@peer("stepnet", ["W9"], "stepnet custom cell: backward only (pullback of one kept sn.vjp)")
def stepnet_custom_train_backward(wl):
    t = _SnCustomTraining.of(wl)
    Y, h, pullback = t.forward()
    return _with_info(lambda: (Y, h, t.backward(pullback)), role="backward")


@peer("stepnet", ["W9"], "stepnet custom cell: forward only, no workspace (W5's call)")
def stepnet_custom_train_inference(wl):
    t = _SnCustomTraining.of(wl)
    f = t.rnn.compile("numba")

    def run():
        out = f(x=t.X)
        return out, out.data[t.last]

    return _with_info(run, role="inference")


@peer("stepnet", ["W9"], "stepnet.jax: jax.jit(jax.grad) over the step-net")
def stepnet_custom_train_jax(wl):
    """W9 from JAX: the step-net as ``stepnet.jax.function``, ``loss = sum(Y *
    dY)`` under ``jax.jit(jax.grad)``: a forward callback keeping its
    workspace, then the backward's (the pullback)."""
    import jax

    import stepnet.jax

    t = _SnCustomTraining.of(wl)
    f = stepnet.jax.function(t.rnn, backend="numba")
    lengths = np.asarray(wl.lengths)
    dY = jax.numpy.asarray(wl.extra["dY"])

    def loss(p, x):
        Y = f(p, x=(x, lengths))
        return jax.numpy.sum(Y * dY), Y

    fn = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))
    args = (f.params, jax.numpy.asarray(wl.x))

    def run():
        (dp, dx), Y = jax.block_until_ready(fn(*args))
        Y = np.asarray(Y)
        return Y, Y[np.arange(len(lengths)), lengths - 1], lambda: {**dp, "x": np.asarray(dx)}

    return _with_info(run, role="step")


# ============================================================================
# torch


def _torch_loaded(torch, m, weights):
    """``m`` (a torch RNN module) with ``weights`` {suffix: {"w_ih", "w_hh",
    "b_ih", "b_hh"}} copied in (suffix "l0", "l0_reverse", ...), for inference."""
    with torch.no_grad():
        for suffix, w in weights.items():
            for key in ("w_ih", "w_hh", "b_ih", "b_hh"):
                name = key.replace("w_", "weight_").replace("b_", "bias_") + "_" + suffix
                getattr(m, name).copy_(torch.from_numpy(w[key]))
    m.eval()
    m.requires_grad_(False)
    return m


def _torch_gru_module(torch, w, batch_first=False):
    H, I = w["w_hh"].shape[1], w["w_ih"].shape[1]
    return _torch_loaded(torch, torch.nn.GRU(I, H, batch_first=batch_first), {"l0": w})


def torch_rnn(torch, wl):
    """The GRU of W1 and W3, the LSTM of W2 or the 2-layer bidirectional LSTM
    of W7 with the workload's weights, and ``last(state)``: the final state
    the report compares (W7: the top layer's, forward then reverse)."""
    if wl.kind == "gru":
        return _torch_gru_module(torch, wl.weights), lambda h: h[0]
    two = wl.key == "W7"
    m = _torch_loaded(torch, torch.nn.LSTM(wl.dims["I"], wl.dims["H"], num_layers=2 if two else 1,
                                           bidirectional=two), wl.weights if two else {"l0": wl.weights})
    if two:
        return m, lambda state: torch.cat([state[0][2], state[0][3]], dim=1)
    return m, lambda state: state[0][0]


def torch_run(torch, m, wl, last):
    """The peer's call of ``m`` on the workload's time-major input."""
    x = torch.from_numpy(wl.x_time_major())

    def run():
        with torch.inference_mode():
            y, state = m(x)
        return y, last(state)

    return run


@peer("torch", ["W1", "W3"], "torch nn.GRU")
@peer("torch", ["W2"], "torch nn.LSTM")
@peer("torch", ["W7"], "torch nn.LSTM 2 layers bidirectional")
def torch_layer(wl):
    import torch

    m, last = torch_rnn(torch, wl)
    return torch_run(torch, m, wl, last)


@peer("torch", ["W4"], "torch nn.GRU (PackedSequence, packed beforehand)")
def torch_gru_packed(wl):
    import torch
    from torch.nn.utils.rnn import pack_padded_sequence

    m = _torch_gru_module(torch, wl.weights)
    packed = pack_padded_sequence(torch.from_numpy(wl.x_time_major()),
                                  torch.from_numpy(wl.lengths), enforce_sorted=False)

    def run():
        with torch.inference_mode():
            y, h = m(packed)
        return y, h[0]

    return run


@peer("torch", ["W6"], "torch nn.GRU x2 (PackedSequence: words, then paragraphs)")
def torch_nested(wl):
    import torch
    from torch.nn.utils.rnn import pack_padded_sequence

    H = wl.dims["H"]
    word_gru = _torch_gru_module(torch, wl.weights["word"], batch_first=True)
    para_gru = _torch_gru_module(torch, wl.weights["para"], batch_first=True)
    words = pack_padded_sequence(torch.from_numpy(wl.words_padded()),
                                 torch.from_numpy(wl.words_per_paragraph),
                                 batch_first=True, enforce_sorted=False)
    index = torch.from_numpy(wl.chapter_gather_index())
    chapter_lengths = torch.from_numpy(wl.paragraphs_per_chapter)
    zero_row = torch.zeros(1, H)

    def run():
        with torch.inference_mode():
            _, hp = word_gru(words)
            pvec = hp[0]  # [P, H], the caller's paragraph order
            padded = torch.cat([pvec, zero_row])[index]  # [C, max_paragraphs, H]
            packed = pack_padded_sequence(padded, chapter_lengths, batch_first=True,
                                          enforce_sorted=False)
            y, hc = para_gru(packed)
        return (pvec, y), (pvec, hc[0])

    return run


class _TorchGruTraining:
    """W8 for ``torch.nn.GRU``: the module in training mode, X requiring its
    gradient, the upstream gradients (time-major, like Y)."""

    def __init__(self, torch, wl):
        self.torch = torch
        self.m = _torch_gru_module(torch, wl.weights).train().requires_grad_(True)
        self.x = torch.from_numpy(wl.x_time_major()).requires_grad_(True)
        self.grad_outputs = (torch.from_numpy(np.ascontiguousarray(wl.extra["dY"].transpose(1, 0, 2))),
                             torch.from_numpy(np.ascontiguousarray(wl.extra["dh"][None])))
        self.leaves = list(self.m.parameters()) + [self.x]

    def forward(self):
        for leaf in self.leaves:  # fresh gradients, as stepnet's (no accumulation)
            leaf.grad = None
        return self.m(self.x)

    def backward(self, y, h, retain_graph=False):
        self.torch.autograd.backward((y, h), self.grad_outputs, retain_graph=retain_graph)

    def grads(self):
        m = self.m
        g = {"weight_ih": m.weight_ih_l0.grad, "weight_hh": m.weight_hh_l0.grad,
             "bias_ih": m.bias_ih_l0.grad, "bias_hh": m.bias_hh_l0.grad,
             "x": self.x.grad.transpose(0, 1)}
        return lambda: g


@peer("torch", ["W8"], "torch nn.GRU: forward + backward()")
def torch_gru_train(wl):
    import torch

    t = _TorchGruTraining(torch, wl)

    def run():
        y, h = t.forward()
        t.backward(y, h)
        return y, h[0], t.grads()

    return _with_info(run, role="step")


@peer("torch", ["W8"], "torch nn.GRU: forward only (autograd recording)")
def torch_gru_train_forward(wl):
    import torch

    t = _TorchGruTraining(torch, wl)

    def run():
        y, h = t.forward()
        return y, h[0], None

    return _with_info(run, role="forward")


@peer("torch", ["W8"], "torch nn.GRU: backward only (backward(retain_graph=True) of one forward)")
def torch_gru_train_backward(wl):
    import torch

    t = _TorchGruTraining(torch, wl)
    y, h = t.forward()

    def run():
        for leaf in t.leaves:
            leaf.grad = None
        t.backward(y, h, retain_graph=True)
        return y, h[0], t.grads()

    return _with_info(run, role="backward")


def _custom_torch_weights(torch, w):
    t = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in w.items()}
    H = w["Uz"].shape[0]
    # hoisted input projection: x @ [Wz | Wr | Wx | P] + [bz | br | b | 0]
    wx = torch.cat([t["Wz"], t["Wr"], t["Wx"], t["P"]], dim=1)
    bx = torch.cat([t["bz"], t["br"], t["b"], torch.zeros(H)])
    u = torch.cat([t["Uz"], t["Ur"]], dim=1)  # h @ [Uz | Ur], one matmul
    return wx, bx, u, t["Wh"], t["s"]


def _custom_loop(xp, u, wh, s, h):
    """The W5 recurrence over a hoisted projection ``xp [T, B, 4H]``."""
    import torch

    H = h.shape[1]
    ys = []
    for t in range(xp.shape[0]):
        xt = xp[t]
        hu = h @ u
        z = torch.sigmoid(xt[:, :H] + hu[:, :H])
        r = torch.sigmoid(xt[:, H : 2 * H] + hu[:, H:])
        cand = s * torch.tanh(xt[:, 2 * H : 3 * H] + (r * h) @ wh)
        h = (1 - z) * h + z * cand + 0.1 * xt[:, 3 * H :]
        ys.append(h)
    return torch.stack(ys), h


@peer("torch", ["W5"], "torch eager Python loop (hoisted x-proj)")
def torch_custom_eager(wl):
    import torch

    T, B, H = wl.dims["T"], wl.dims["B"], wl.dims["H"]
    wx, bx, u, wh, s = _custom_torch_weights(torch, wl.weights)
    x = torch.from_numpy(wl.x_time_major())

    def run():
        with torch.inference_mode():
            xp = torch.addmm(bx, x.reshape(T * B, -1), wx).view(T, B, 4 * H)
            y, h = _custom_loop(xp, u, wh, s, torch.zeros(B, H))
        return y, h

    return run


_SCRIPTED = None


def _scripted_custom(torch):
    global _SCRIPTED
    if _SCRIPTED is None:

        def custom_forward(x, wx, bx, u, wh, s):
            # type: (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor) -> Tuple[Tensor, Tensor]
            T, B = x.shape[0], x.shape[1]
            H = u.shape[0]
            xp = torch.addmm(bx, x.reshape(T * B, -1), wx).view(T, B, 4 * H)
            h = torch.zeros(B, H)
            ys = []
            for t in range(T):
                xt = xp[t]
                hu = h @ u
                z = torch.sigmoid(xt[:, :H] + hu[:, :H])
                r = torch.sigmoid(xt[:, H : 2 * H] + hu[:, H:])
                cand = s * torch.tanh(xt[:, 2 * H : 3 * H] + (r * h) @ wh)
                h = (1 - z) * h + z * cand + 0.1 * xt[:, 3 * H :]
                ys.append(h)
            return torch.stack(ys), h

        _SCRIPTED = torch.jit.script(custom_forward)
    return _SCRIPTED


@peer("torch", ["W5"], "torch.jit.script (whole loop)")
def torch_custom_script(wl):
    import torch

    fn = _scripted_custom(torch)
    wx, bx, u, wh, s = _custom_torch_weights(torch, wl.weights)
    x = torch.from_numpy(wl.x_time_major())

    def run():
        with torch.inference_mode():
            y, h = fn(x, wx, bx, u, wh, s)
        return y, h

    return run


class _TorchCustomTraining:
    """W9 in PyTorch eager autograd: W5's cell as a Python loop over time
    (``_custom_loop``, the input projection hoisted into one ``addmm``, as the
    W5 eager peer), every weight a leaf of its own (concatenated inside the
    recorded graph, so each gets its gradient), X requiring its gradient, the
    upstream gradient of Y (time-major, like Y)."""

    def __init__(self, torch, wl):
        self.torch = torch
        self.T, self.B, self.H = wl.dims["T"], wl.dims["B"], wl.dims["H"]
        self.w = {k: torch.from_numpy(np.array(v, np.float32)).requires_grad_(True)
                  for k, v in wl.weights.items()}
        self.x = torch.from_numpy(wl.x_time_major()).requires_grad_(True)
        self.dY = torch.from_numpy(np.ascontiguousarray(wl.extra["dY"].transpose(1, 0, 2)))
        self.zero_bias = torch.zeros(self.H)
        self.leaves = list(self.w.values()) + [self.x]

    def forward(self):
        torch, w, T, B, H = self.torch, self.w, self.T, self.B, self.H
        for leaf in self.leaves:  # fresh gradients, as stepnet's (no accumulation)
            leaf.grad = None
        wx = torch.cat([w["Wz"], w["Wr"], w["Wx"], w["P"]], dim=1)
        bx = torch.cat([w["bz"], w["br"], w["b"], self.zero_bias])
        u = torch.cat([w["Uz"], w["Ur"]], dim=1)
        xp = torch.addmm(bx, self.x.reshape(T * B, -1), wx).view(T, B, 4 * H)
        return _custom_loop(xp, u, w["Wh"], w["s"], torch.zeros(B, H))

    def backward(self, y, retain_graph=False):
        self.torch.autograd.backward(y, self.dY, retain_graph=retain_graph)

    def grads(self):
        g = {k: v.grad for k, v in self.w.items()}
        g["x"] = self.x.grad.transpose(0, 1)
        return lambda: g


@peer("torch", ["W9"], "torch eager autograd: Python loop (hoisted x-proj) + backward()")
def torch_custom_train(wl):
    import torch

    t = _TorchCustomTraining(torch, wl)

    def run():
        y, h = t.forward()
        t.backward(y)
        return y, h, t.grads()

    return _with_info(run, role="step")


@peer("torch", ["W9"], "torch eager: forward only (autograd recording)")
def torch_custom_train_forward(wl):
    import torch

    t = _TorchCustomTraining(torch, wl)

    def run():
        y, h = t.forward()
        return y, h, None

    return _with_info(run, role="forward")


@peer("torch", ["W9"], "torch eager: backward only (backward(retain_graph=True) of one forward)")
def torch_custom_train_backward(wl):
    import torch

    t = _TorchCustomTraining(torch, wl)
    y, h = t.forward()

    def run():
        for leaf in t.leaves:
            leaf.grad = None
        t.backward(y, retain_graph=True)
        return y, h, t.grads()

    return _with_info(run, role="backward")


# ============================================================================
# onnxruntime: a single GRU / LSTM node

# PyTorch gate blocks in ONNX's order: GRU r,z,n -> z,r,h; LSTM i,f,g,o -> i,o,f,c
_ONNX_GRU_ORDER = (1, 0, 2)
_ONNX_LSTM_ORDER = (0, 3, 1, 2)


def _reorder(a, order, H):
    return np.concatenate([a[k * H : (k + 1) * H] for k in order], axis=0)


def _onnx_node_model(op, w, I, H, with_lengths):
    """A model of one ONNX GRU (linear_before_reset=1) or LSTM node with the
    workload's weights: X [T, N, I] (and L [N]) -> Y, Y_h."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    order = _ONNX_GRU_ORDER if op == "GRU" else _ONNX_LSTM_ORDER
    W = _reorder(w["w_ih"], order, H)[None]
    R = _reorder(w["w_hh"], order, H)[None]
    Bias = np.concatenate([_reorder(w["b_ih"], order, H), _reorder(w["b_hh"], order, H)])[None]
    inits = [numpy_helper.from_array(np.ascontiguousarray(a, np.float32), n)
             for a, n in ((W, "W"), (R, "R"), (Bias, "B"))]
    inputs = [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["T", "N", I])]
    node_inputs = ["X", "W", "R", "B"]
    if with_lengths:
        inputs.append(helper.make_tensor_value_info("L", TensorProto.INT32, ["N"]))
        node_inputs.append("L")
    attrs = {"hidden_size": H}
    if op == "GRU":
        attrs["linear_before_reset"] = 1
    node = helper.make_node(op, node_inputs, ["Y", "Y_h"], **attrs)
    outputs = [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["T", 1, "N", H]),
               helper.make_tensor_value_info("Y_h", TensorProto.FLOAT, [1, "N", H])]
    graph = helper.make_graph([node], f"single_{op.lower()}", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def _ort_options():
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    so.inter_op_num_threads = 1
    return so


def _ort_session(op, w, I, H, with_lengths):
    import onnxruntime as ort

    model = _onnx_node_model(op, w, I, H, with_lengths)
    return ort.InferenceSession(model.SerializeToString(), _ort_options(),
                                providers=["CPUExecutionProvider"])


@peer("onnxruntime", ["W1", "W3"], "onnxruntime GRU node")
def ort_gru(wl):
    sess = _ort_session("GRU", wl.weights, wl.dims["I"], wl.dims["H"], False)
    feeds = {"X": wl.x_time_major()}

    def run():
        y, h = sess.run(None, feeds)
        return y, h[0]

    return run


@peer("onnxruntime", ["W2"], "onnxruntime LSTM node")
def ort_lstm(wl):
    sess = _ort_session("LSTM", wl.weights, wl.dims["I"], wl.dims["H"], False)
    feeds = {"X": wl.x_time_major()}

    def run():
        y, h = sess.run(None, feeds)
        return y, h[0]

    return run


@peer("onnxruntime", ["W4"], "onnxruntime GRU node (sequence_lens)")
def ort_gru_varlen(wl):
    sess = _ort_session("GRU", wl.weights, wl.dims["I"], wl.dims["H"], True)
    feeds = {"X": wl.x_time_major(), "L": wl.lengths.astype(np.int32)}

    def run():
        y, h = sess.run(None, feeds)
        return y, h[0]

    return run


def _w5_scan_model(wl):
    """W5's cell exported by stepnet as an ONNX Scan model, and its feeds."""
    import stepnet as sn

    rnn, X = sn_custom_rnn(sn, wl)
    padded, lengths = X.to_padded()
    return sn.onnx.export(rnn, output_all_steps=False), {"x": padded, "lengths": lengths}


@peer("onnxruntime", ["W5"], "onnxruntime: the W5 cell exported by stepnet as ONNX Scan")
def ort_custom_scan(wl):
    import onnxruntime as ort

    model, feeds = _w5_scan_model(wl)
    sess = ort.InferenceSession(model.SerializeToString(), _ort_options(),
                                providers=["CPUExecutionProvider"])

    def run():
        h, = sess.run(None, feeds)
        return h, h

    return run


# ============================================================================
# stepnet.onnx.InferenceSession on the same ONNX models as onnxruntime


def _sn_session_node(op, with_lengths):
    def build(wl):
        import stepnet as sn

        model = _onnx_node_model(op, wl.weights, wl.dims["I"], wl.dims["H"], with_lengths)
        sess = sn.onnx.InferenceSession(model)
        feeds = {"X": wl.x_time_major()}
        if with_lengths:
            feeds["L"] = wl.lengths.astype(np.int32)

        def run():
            y, h = sess.run(None, feeds)
            return y, h[0]

        return run

    return build


peer("stepnet", ["W1", "W3"], "stepnet.onnx session: the onnxruntime GRU node model")(
    _sn_session_node("GRU", False))
peer("stepnet", ["W2"], "stepnet.onnx session: the onnxruntime LSTM node model")(
    _sn_session_node("LSTM", False))
peer("stepnet", ["W4"], "stepnet.onnx session: the onnxruntime GRU node model (sequence_lens)")(
    _sn_session_node("GRU", True))


@peer("stepnet", ["W5"], "stepnet.onnx session: the W5 cell exported as ONNX Scan")
def stepnet_session_custom_scan(wl):
    import stepnet as sn

    model, feeds = _w5_scan_model(wl)
    sess = sn.onnx.InferenceSession(model)

    def run():
        h, = sess.run(None, feeds)
        return h, h

    return run

not_applicable("onnxruntime", ["W6"], "no single ONNX op for a nested RNN")
not_applicable("onnxruntime", ["W7"], "one ONNX LSTM node is one layer; PyTorch is the W7 peer")
not_applicable("onnxruntime", ["W8", "W9"], "inference only: no gradients")


# ============================================================================
# jax: jit(lax.scan), the cell per step


def _jax_gru_params(jnp, w):
    return {k: jnp.asarray(v) for k, v in
            (("wih", w["w_ih"].T), ("whh", w["w_hh"].T), ("bih", w["b_ih"]), ("bhh", w["b_hh"]))}


def _jax_gru_cell(jax, p, h, x):
    H = h.shape[-1]
    gx = x @ p["wih"] + p["bih"]
    gh = h @ p["whh"] + p["bhh"]
    r = jax.nn.sigmoid(gx[:, :H] + gh[:, :H])
    z = jax.nn.sigmoid(gx[:, H : 2 * H] + gh[:, H : 2 * H])
    n = jax.numpy.tanh(gx[:, 2 * H :] + r * gh[:, 2 * H :])
    return (1 - z) * n + z * h


def _jax_gru_scan(jax, p, x, lengths=None):
    """GRU over time-major ``x [T, B, I]``; masked past ``lengths`` when given."""
    jnp = jax.numpy
    T, B = x.shape[0], x.shape[1]
    H = p["whh"].shape[0]
    h0 = jnp.zeros((B, H), x.dtype)
    if lengths is None:
        def step(h, xt):
            h = _jax_gru_cell(jax, p, h, xt)
            return h, h
        return jax.lax.scan(step, h0, x)[::-1]

    def masked(h, inp):
        xt, t = inp
        hn = _jax_gru_cell(jax, p, h, xt)
        m = (t < lengths)[:, None]
        return jnp.where(m, hn, h), jnp.where(m, hn, 0)

    hT, ys = jax.lax.scan(masked, h0, (x, jnp.arange(T)))
    return ys, hT


def _jax_ready(jax, fn, *args):
    def run():
        return jax.block_until_ready(fn(*args))
    return run


@peer("jax", ["W1", "W3"], "jax jit(lax.scan) (cell per step)")
def jax_gru(wl):
    import jax

    p = _jax_gru_params(jax.numpy, wl.weights)
    fn = jax.jit(lambda p, x: _jax_gru_scan(jax, p, x))
    return _jax_ready(jax, fn, p, jax.numpy.asarray(wl.x_time_major()))


@peer("jax", ["W4"], "jax jit(lax.scan) (cell per step, masked)")
def jax_gru_varlen(wl):
    import jax

    jnp = jax.numpy
    p = _jax_gru_params(jnp, wl.weights)
    fn = jax.jit(lambda p, x, L: _jax_gru_scan(jax, p, x, L))
    return _jax_ready(jax, fn, p, jnp.asarray(wl.x_time_major()),
                      jnp.asarray(wl.lengths.astype(np.int32)))


@peer("jax", ["W2"], "jax jit(lax.scan) (cell per step)")
def jax_lstm(wl):
    import jax

    jnp = jax.numpy
    w, H = wl.weights, wl.dims["H"]
    p = {"wih": jnp.asarray(w["w_ih"].T), "whh": jnp.asarray(w["w_hh"].T),
         "b": jnp.asarray(w["b_ih"] + w["b_hh"])}

    def forward(p, x):
        B = x.shape[1]

        def step(carry, xt):
            h, c = carry
            g = xt @ p["wih"] + h @ p["whh"] + p["b"]
            i = jax.nn.sigmoid(g[:, :H])
            f = jax.nn.sigmoid(g[:, H : 2 * H])
            gg = jnp.tanh(g[:, 2 * H : 3 * H])
            o = jax.nn.sigmoid(g[:, 3 * H :])
            c = f * c + i * gg
            h = o * jnp.tanh(c)
            return (h, c), h

        z = jnp.zeros((B, H), x.dtype)
        (h, _c), ys = jax.lax.scan(step, (z, z), x)
        return ys, h

    return _jax_ready(jax, jax.jit(forward), p, jnp.asarray(wl.x_time_major()))


@peer("jax", ["W5"], "jax jit(lax.scan) (cell per step)")
def jax_custom(wl):
    import jax

    jnp = jax.numpy
    w, H = wl.weights, wl.dims["H"]
    p = {"wx": jnp.asarray(np.concatenate([w["Wz"], w["Wr"], w["Wx"], w["P"]], axis=1)),
         "bx": jnp.asarray(np.concatenate([w["bz"], w["br"], w["b"], np.zeros(H, np.float32)])),
         "u": jnp.asarray(np.concatenate([w["Uz"], w["Ur"]], axis=1)),
         "wh": jnp.asarray(w["Wh"]), "s": jnp.asarray(w["s"])}

    def forward(p, x):
        B = x.shape[1]

        def step(h, xt):
            g = xt @ p["wx"] + p["bx"]
            hu = h @ p["u"]
            z = jax.nn.sigmoid(g[:, :H] + hu[:, :H])
            r = jax.nn.sigmoid(g[:, H : 2 * H] + hu[:, H:])
            cand = p["s"] * jnp.tanh(g[:, 2 * H : 3 * H] + (r * h) @ p["wh"])
            h = (1 - z) * h + z * cand + 0.1 * g[:, 3 * H :]
            return h, h

        h, ys = jax.lax.scan(step, jnp.zeros((B, H), x.dtype), x)
        return ys, h

    return _jax_ready(jax, jax.jit(forward), p, jnp.asarray(wl.x_time_major()))


@peer("jax", ["W8"], "jax jit(vjp(lax.scan)): forward + backward")
def jax_gru_train(wl):
    import jax

    jnp = jax.numpy

    def step(p, x, grad_outputs):
        outputs, pullback = jax.vjp(lambda p, x: _jax_gru_scan(jax, p, x), p, x)
        return outputs, pullback(grad_outputs)

    fn = jax.jit(step)
    args = (_jax_gru_params(jnp, wl.weights), jnp.asarray(wl.x_time_major()),
            (jnp.asarray(wl.extra["dY"].transpose(1, 0, 2)), jnp.asarray(wl.extra["dh"])))

    def run():
        (ys, h), (dp, dx) = jax.block_until_ready(fn(*args))
        return ys, h, lambda: {"weight_ih": np.asarray(dp["wih"]).T,
                               "weight_hh": np.asarray(dp["whh"]).T,
                               "bias_ih": dp["bih"], "bias_hh": dp["bhh"],
                               "x": np.asarray(dx).transpose(1, 0, 2)}

    return _with_info(run, role="step")


@peer("jax", ["W9"], "jax jit(grad(lax.scan)): forward + backward")
def jax_custom_train(wl):
    """``jax.jit(jax.grad(loss))``, ``loss = sum(Y * dY)`` over W5's cell in
    ``lax.scan`` (the jax W5 peer's step: input projections hoisted per step
    into one ``x @ [Wz|Wr|Wx|P]``, ``h @ [Uz|Ur]`` one matmul); every weight
    is an argument of its own (concatenated inside the traced function), X
    too. ``Y`` and ``h_n`` come back as ``grad``'s aux output."""
    import jax

    jnp = jax.numpy
    H = wl.dims["H"]

    def loss(p, x, dY):
        wx = jnp.concatenate([p["Wz"], p["Wr"], p["Wx"], p["P"]], axis=1)
        bx = jnp.concatenate([p["bz"], p["br"], p["b"], jnp.zeros(H, x.dtype)])
        u = jnp.concatenate([p["Uz"], p["Ur"]], axis=1)

        def step(h, xt):
            g = xt @ wx + bx
            hu = h @ u
            z = jax.nn.sigmoid(g[:, :H] + hu[:, :H])
            r = jax.nn.sigmoid(g[:, H : 2 * H] + hu[:, H:])
            cand = p["s"] * jnp.tanh(g[:, 2 * H : 3 * H] + (r * h) @ p["Wh"])
            h = (1 - z) * h + z * cand + 0.1 * g[:, 3 * H :]
            return h, h

        h, ys = jax.lax.scan(step, jnp.zeros((x.shape[1], H), x.dtype), x)
        return jnp.sum(ys * dY), (ys, h)

    fn = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))
    args = ({k: jnp.asarray(v) for k, v in wl.weights.items()}, jnp.asarray(wl.x_time_major()),
            jnp.asarray(wl.extra["dY"].transpose(1, 0, 2)))

    def run():
        (dp, dx), (ys, h) = jax.block_until_ready(fn(*args))
        return ys, h, lambda: {**dp, "x": np.asarray(dx).transpose(1, 0, 2)}

    return _with_info(run, role="step")


@peer("jax", ["W6"], "jax jit(lax.scan) x2 (masked: words, then paragraphs)")
def jax_nested(wl):
    import jax

    jnp = jax.numpy
    pw = _jax_gru_params(jnp, wl.weights["word"])
    pp = _jax_gru_params(jnp, wl.weights["para"])
    H = wl.dims["H"]

    def forward(pw, pp, words, wlen, index, clen):
        _, pvec = _jax_gru_scan(jax, pw, words, wlen)  # [P, H]
        padded = jnp.concatenate([pvec, jnp.zeros((1, H), pvec.dtype)])[index]  # [C, Tp, H]
        ys, hc = _jax_gru_scan(jax, pp, padded.transpose(1, 0, 2), clen)
        return (pvec, ys), (pvec, hc)

    args = (pw, pp, jnp.asarray(wl.words_padded().transpose(1, 0, 2)),
            jnp.asarray(wl.words_per_paragraph.astype(np.int32)),
            jnp.asarray(wl.chapter_gather_index().astype(np.int32)),
            jnp.asarray(wl.paragraphs_per_chapter.astype(np.int32)))
    return _jax_ready(jax, jax.jit(forward), *args)


# ============================================================================
# numpy: a Python loop over time, input projection hoisted


def _np_sigmoid(v):
    return 1.0 / (1.0 + np.exp(-v))


class _NumpyGRU:
    """GRU over padded time-major ``[T, B, I]`` with lengths: the sequences
    are sorted by length once, so step t runs on the active prefix only."""

    def __init__(self, w):
        self.wih = np.ascontiguousarray(w["w_ih"].T)
        self.whh = np.ascontiguousarray(w["w_hh"].T)
        self.bih, self.bhh = w["b_ih"], w["b_hh"]
        self.H = self.whh.shape[0]

    def __call__(self, x, lengths, order=None):
        """``order``: the permutation sorting ``lengths`` descending (or None)."""
        T, B, _ = x.shape
        H = self.H
        if order is not None:
            x, lengths = x[:, order], lengths[order]
        gx = (x.reshape(T * B, -1) @ self.wih + self.bih).reshape(T, B, 3 * H)
        h = np.zeros((B, H), np.float32)
        ys = np.zeros((T, B, H), np.float32)
        nb = B
        for t in range(int(lengths[0]) if B else 0):
            while nb > 0 and lengths[nb - 1] <= t:
                nb -= 1
            hb = h[:nb]
            gh = hb @ self.whh + self.bhh
            g = gx[t, :nb]
            r = _np_sigmoid(g[:, :H] + gh[:, :H])
            z = _np_sigmoid(g[:, H : 2 * H] + gh[:, H : 2 * H])
            n = np.tanh(g[:, 2 * H :] + r * gh[:, 2 * H :])
            h[:nb] = (1 - z) * n + z * hb
            ys[t, :nb] = h[:nb]
        if order is not None:
            inv = np.argsort(order)
            return ys[:, inv], h[inv]
        return ys, h


def _sort_order(lengths):
    lengths = np.asarray(lengths)
    if np.all(lengths == lengths[0]):
        return None
    return np.argsort(-lengths, kind="stable")


@peer("numpy", ["W1", "W3", "W4"], "numpy loop (hoisted x-proj)")
def numpy_gru(wl):
    gru = _NumpyGRU(wl.weights)
    x, lengths = wl.x_time_major(), wl.lengths
    order = _sort_order(lengths)

    def run():
        return gru(x, lengths, order)

    return run


@peer("numpy", ["W2"], "numpy loop (hoisted x-proj)")
def numpy_lstm(wl):
    w, H = wl.weights, wl.dims["H"]
    wih, whh = np.ascontiguousarray(w["w_ih"].T), np.ascontiguousarray(w["w_hh"].T)
    b = w["b_ih"] + w["b_hh"]
    x = wl.x_time_major()
    T, B, _ = x.shape

    def run():
        gx = (x.reshape(T * B, -1) @ wih + b).reshape(T, B, 4 * H)
        h = np.zeros((B, H), np.float32)
        c = np.zeros((B, H), np.float32)
        ys = np.empty((T, B, H), np.float32)
        for t in range(T):
            g = gx[t] + h @ whh
            i, f = _np_sigmoid(g[:, :H]), _np_sigmoid(g[:, H : 2 * H])
            gg, o = np.tanh(g[:, 2 * H : 3 * H]), _np_sigmoid(g[:, 3 * H :])
            c = f * c + i * gg
            h = o * np.tanh(c)
            ys[t] = h
        return ys, h

    return run


@peer("numpy", ["W5"], "numpy loop (hoisted x-proj)")
def numpy_custom(wl):
    w, H = wl.weights, wl.dims["H"]
    wx = np.concatenate([w["Wz"], w["Wr"], w["Wx"], w["P"]], axis=1)
    bx = np.concatenate([w["bz"], w["br"], w["b"], np.zeros(H, np.float32)])
    u = np.concatenate([w["Uz"], w["Ur"]], axis=1)
    wh, s = w["Wh"], w["s"]
    x = wl.x_time_major()
    T, B, _ = x.shape

    def run():
        xp = (x.reshape(T * B, -1) @ wx + bx).reshape(T, B, 4 * H)
        h = np.zeros((B, H), np.float32)
        ys = np.empty((T, B, H), np.float32)
        for t in range(T):
            xt = xp[t]
            hu = h @ u
            z = _np_sigmoid(xt[:, :H] + hu[:, :H])
            r = _np_sigmoid(xt[:, H : 2 * H] + hu[:, H:])
            cand = s * np.tanh(xt[:, 2 * H : 3 * H] + (r * h) @ wh)
            h = (1 - z) * h + z * cand + 0.1 * xt[:, 3 * H :]
            ys[t] = h
        return ys, h

    return run


@peer("numpy", ["W6"], "numpy loops x2 (words, then paragraphs)")
def numpy_nested(wl):
    word_gru, para_gru = _NumpyGRU(wl.weights["word"]), _NumpyGRU(wl.weights["para"])
    H = wl.dims["H"]
    words = np.ascontiguousarray(wl.words_padded().transpose(1, 0, 2))
    wlen, clen = wl.words_per_paragraph, wl.paragraphs_per_chapter
    word_order, para_order = _sort_order(wlen), _sort_order(clen)
    index_t = np.ascontiguousarray(wl.chapter_gather_index().T)  # [Tp, C]

    def run():
        _, pvec = word_gru(words, wlen, word_order)
        padded = np.concatenate([pvec, np.zeros((1, H), np.float32)])[index_t]
        ys, hc = para_gru(padded, clen, para_order)
        return (pvec, ys), (pvec, hc)

    return run


@peer("numpy", ["W8"], "numpy loops (forward, then backward through time)")
def numpy_gru_train(wl):
    import workloads

    x = wl.x_time_major()
    dY, dh = np.ascontiguousarray(wl.extra["dY"].transpose(1, 0, 2)), wl.extra["dh"]

    def run():
        ys, h, g = workloads.gru_train(x, wl.weights, dY, dh)
        return ys, h, lambda: {**g, "x": g["x"].transpose(1, 0, 2)}

    return _with_info(run, role="step")


not_applicable("jax", ["W7"], "the stacked bidirectional LSTM is measured against PyTorch's")
not_applicable("numpy", ["W7"], "the stacked bidirectional LSTM is measured against PyTorch's")
not_applicable("numpy", ["W9"], "the float64 reference is NumPy's BPTT (workloads.custom_train): "
               "a float32 run of it would be checked against itself")


# ============================================================================
# GPU (run.py --cuda): stepnet's CUDA backend against PyTorch on the GPU.
# Each call copies its result to the host, so GPU work is finished when it returns.


def _stepnet_cuda():
    import stepnet as sn

    if "cuda" not in sn.backends():
        raise RuntimeError("stepnet's cuda backend is not available (no GPU, no simulator)")
    return sn


@peer("stepnet-cuda", ["W1", "W3"], "stepnet nn.GRU (cuda)")
def stepnet_cuda_gru(wl):
    sn = _stepnet_cuda()
    layer, X = _sn_nn_gru(sn, wl)
    return _sn_run_layer(layer, X, lambda h_n: h_n[0], backend="cuda")


@peer("stepnet-cuda", ["W5"], "stepnet custom cell in the DSL (cuda)")
def stepnet_cuda_custom(wl):
    return _sn_custom_run(_stepnet_cuda(), wl, "cuda")


def _torch_cuda():
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError(f"torch {torch.__version__} sees no CUDA GPU")
    return torch


def _torch_cuda_gru(wl, tf32):
    torch = _torch_cuda()
    m = _torch_gru_module(torch, wl.weights).cuda()
    x = torch.from_numpy(wl.x_time_major()).cuda()

    def run():
        # cuDNN may use TF32 tensor cores (PyTorch's default); stepnet's
        # kernels are float32 on CUDA cores, so the like-for-like figure is
        # the one without
        before = torch.backends.cudnn.allow_tf32
        torch.backends.cudnn.allow_tf32 = tf32
        try:
            with torch.inference_mode():
                y, h = m(x)
            return y.cpu(), h[0].cpu()
        finally:
            torch.backends.cudnn.allow_tf32 = before

    return run


@peer("torch-cuda", ["W1", "W3"], "torch nn.GRU on the GPU (cuDNN, fp32 math)")
def torch_cuda_gru(wl):
    return _torch_cuda_gru(wl, tf32=False)


@peer("torch-cuda", ["W1", "W3"], "torch nn.GRU on the GPU (cuDNN, TF32 allowed: the default)")
def torch_cuda_gru_tf32(wl):
    return _torch_cuda_gru(wl, tf32=True)


def _torch_cuda_custom(wl):
    """W5's weights and input on the GPU, and a run of its recurrence that
    takes one step of the cell as ``step(xt, h)``."""
    torch = _torch_cuda()
    T, B, H = wl.dims["T"], wl.dims["B"], wl.dims["H"]
    wx, bx, u, wh, s = (t.cuda() for t in _custom_torch_weights(torch, wl.weights))
    x = torch.from_numpy(wl.x_time_major()).cuda()

    def run(step):
        with torch.inference_mode():
            xp = torch.addmm(bx, x.reshape(T * B, -1), wx).view(T, B, 4 * H)
            h, ys = torch.zeros(B, H, device="cuda"), []
            for t in range(T):
                h = step(xp[t], h)
                ys.append(h)
            return torch.stack(ys).cpu(), h.cpu()

    return torch, (u, wh, s), run


def _custom_step(torch, u, wh, s):
    """One step of the W5 cell (``_custom_loop``'s)."""
    H = u.shape[0]

    def step(xt, h):
        hu = h @ u
        z = torch.sigmoid(xt[:, :H] + hu[:, :H])
        r = torch.sigmoid(xt[:, H : 2 * H] + hu[:, H:])
        cand = s * torch.tanh(xt[:, 2 * H : 3 * H] + (r * h) @ wh)
        return (1 - z) * h + z * cand + 0.1 * xt[:, 3 * H :]

    return step


@peer("torch-cuda", ["W5"], "torch eager Python loop on the GPU")
def torch_cuda_custom_eager(wl):
    torch, weights, run = _torch_cuda_custom(wl)
    step = _custom_step(torch, *weights)
    return lambda: run(step)


@peer("torch-cuda", ["W5"], "torch.compile of the cell, Python loop on the GPU")
def torch_cuda_custom_compiled(wl):
    torch, weights, run = _torch_cuda_custom(wl)
    step = torch.compile(_custom_step(torch, *weights), dynamic=False)
    return lambda: run(step)
