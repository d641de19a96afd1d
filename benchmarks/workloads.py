"""The benchmark workloads: deterministic data, weights and float64 references.

Every workload is built from fixed seeds (``numpy.random.default_rng``), in
float32. GRU math everywhere is PyTorch's (gates r, z, n;
``n = tanh(x@W_in + b_in + r*(h@W_hn + b_hn))``; ``h' = (1-z)*n + z*h``), i.e.
ONNX ``linear_before_reset=1``. GRU/LSTM weights are in PyTorch's layout
(``w_ih [G*H, I]``, ``w_hh [G*H, H]``, ``b_ih``, ``b_hh``; GRU gates r, z, n, LSTM
gates i, f, g, o), drawn like PyTorch's init, ``U(-1/sqrt(H), 1/sqrt(H))``;
inputs are ``N(0, 1)``.

- W1 gru-std: GRU T=100, B=64, I=128, H=256, every length T.
- W2 lstm-std: LSTM, same sizes.
- W3 gru-latency: GRU T=1000, B=1, I=64, H=128.
- W4 gru-varlen: GRU B=64, I=128, H=256, lengths ``default_rng(7).integers(10, 201, 64)``.
- W5 custom-cell: T=100, B=64, I=128, H=256,
  ``z = sigmoid(x@Wz + h@Uz + bz)``, ``r = sigmoid(x@Wr + h@Ur + br)``,
  ``h' = (1-z)*h + z*(s*tanh(x@Wx + (r*h)@Wh + b)) + 0.1*(x@P)``, ``s`` a learned
  per-unit scale ``[H]``.
- W7 lstm-bi2: a 2-layer bidirectional LSTM (PyTorch's stacking), T=100, B=64,
  I=128, H=256; the final state is the top layer's last states, forward then
  reverse (``[B, 2H]``).
- W6 nested: 64 chapters of 2-8 paragraphs of 5-40 words, I=64, H=128: a word-level
  GRU over each paragraph (h0 = 0) whose last state is the paragraph vector, then a
  paragraph-level GRU over each chapter's paragraph vectors. Outputs: every
  paragraph's vector and every chapter's last state.
- W8 gru-train: a training step of W1 without the optimizer: the forward, then
  the gradients of every parameter and of the input given upstream gradients
  ``dY [B, T, H]`` (every step's output) and ``dh [B, H]`` (the last state),
  both ``N(0, 1)``. Same x and weights as W1.
- W9 custom-train: a training step of W5's cell (a gated cell that is none of
  the built-in layers) without the optimizer: the forward, then the gradients
  of every weight (``CUSTOM_GRADIENTS``: the 11 of ``custom_weights``, in their
  ``x @ W`` layout) and of the input, given the upstream gradient ``dY [B, T, H]``
  of the all-steps output (``N(0, 1)``; no separate gradient of the last state:
  it is ``Y``'s last step). Same x and weights as W5.

``make(key, quick=False)`` builds one workload; ``quick`` gives tiny sizes for a
smoke run. ``reference(wl)`` is a plain float64 NumPy loop, one sequence at a
time, giving the final state that every peer's is compared with (W6: the
paragraph vectors stacked on the chapters' last states). For W8 and W9,
``gradient_reference(wl)`` gives the gradients in float64 (``gru_train``,
``custom_train``: the batched forward, then backpropagation through time,
written out by hand), keyed by ``gradient_names(wl)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

WORKLOADS = ("W1", "W2", "W3", "W4", "W5", "W6", "W7", "W8", "W9")
NAMES = {
    "W1": "gru-std",
    "W2": "lstm-std",
    "W3": "gru-latency",
    "W4": "gru-varlen",
    "W5": "custom-cell",
    "W6": "nested",
    "W7": "lstm-bi2",
    "W8": "gru-train",
    "W9": "custom-train",
}
KINDS = {"W1": "gru", "W2": "lstm", "W3": "gru", "W4": "gru", "W5": "custom", "W6": "nested",
         "W7": "bilstm", "W8": "gru-train", "W9": "custom-train"}
TRAINS = {"W8": "W1", "W9": "W5"}  # a training workload: the forward workload whose data it reuses
GRADIENTS = ("weight_ih", "weight_hh", "bias_ih", "bias_hh", "x")  # PyTorch's names
# W9: every weight of custom_weights (its own names and layout), then the input
CUSTOM_GRADIENTS = ("Wz", "Wr", "Wx", "P", "Uz", "Ur", "Wh", "bz", "br", "b", "s", "x")


@dataclass
class Workload:
    """One workload. Dense workloads (W1-W5) hold ``x`` padded batch-major
    ``[B, T, I]`` (zeros past each length) and ``lengths [B]``; W6 holds the
    words ``[num_words, I]`` and the per-level lengths."""

    key: str
    name: str
    kind: str  # "gru" | "lstm" | "custom" | "nested" | "bilstm" | "gru-train" | "custom-train"
    dims: dict
    weights: dict
    lengths: np.ndarray | None = None
    x: np.ndarray | None = None
    # W6 only
    words: np.ndarray | None = None
    paragraphs_per_chapter: np.ndarray | None = None
    words_per_paragraph: np.ndarray | None = None
    extra: dict = field(default_factory=dict)  # W8: the upstream gradients "dY", "dh"; W9: "dY"

    @property
    def title(self) -> str:
        return f"{self.key} {self.name}"

    # -- layouts of the same data (built once, outside any timing) ------------

    def x_packed(self) -> np.ndarray:
        """The valid tokens, sequence after sequence: ``[sum(lengths), I]``
        (the row order of a one-level LoDTensor)."""
        return np.ascontiguousarray(
            np.concatenate([self.x[b, :n] for b, n in enumerate(self.lengths)], axis=0)
        )

    def x_time_major(self) -> np.ndarray:
        """``[T, B, I]``, padded with zeros past each length."""
        return np.ascontiguousarray(self.x.transpose(1, 0, 2))

    def paragraph_offsets(self) -> np.ndarray:
        """Row offsets of each paragraph's words in ``words``."""
        return np.concatenate([[0], np.cumsum(self.words_per_paragraph)]).astype(np.int64)

    def chapter_offsets(self) -> np.ndarray:
        """Offsets of each chapter's paragraphs."""
        return np.concatenate([[0], np.cumsum(self.paragraphs_per_chapter)]).astype(np.int64)

    def words_padded(self) -> np.ndarray:
        """``[num_paragraphs, max_words, I]``, zeros past each paragraph's end."""
        P, Tw = len(self.words_per_paragraph), int(self.words_per_paragraph.max())
        out = np.zeros((P, Tw, self.dims["I"]), np.float32)
        off = self.paragraph_offsets()
        for p in range(P):
            out[p, : off[p + 1] - off[p]] = self.words[off[p] : off[p + 1]]
        return out

    def chapter_gather_index(self) -> np.ndarray:
        """``[num_chapters, max_paragraphs]`` indices into the paragraph vectors,
        ``num_paragraphs`` (one past the last) where a chapter has ended."""
        C, Tp = len(self.paragraphs_per_chapter), int(self.paragraphs_per_chapter.max())
        P = int(self.paragraphs_per_chapter.sum())
        idx = np.full((C, Tp), P, np.int64)
        off = self.chapter_offsets()
        for c in range(C):
            idx[c, : off[c + 1] - off[c]] = np.arange(off[c], off[c + 1])
        return idx


# ----------------------------------------------------------------------------
# weights


def _uniform(rng, shape, H):
    k = 1.0 / np.sqrt(H)
    return rng.uniform(-k, k, size=shape).astype(np.float32)


def gru_weights(rng, I, H) -> dict:
    return {
        "w_ih": _uniform(rng, (3 * H, I), H),
        "w_hh": _uniform(rng, (3 * H, H), H),
        "b_ih": _uniform(rng, (3 * H,), H),
        "b_hh": _uniform(rng, (3 * H,), H),
    }


def lstm_weights(rng, I, H) -> dict:
    return {
        "w_ih": _uniform(rng, (4 * H, I), H),
        "w_hh": _uniform(rng, (4 * H, H), H),
        "b_ih": _uniform(rng, (4 * H,), H),
        "b_hh": _uniform(rng, (4 * H,), H),
    }


def custom_weights(rng, I, H) -> dict:
    """W5: every matrix in ``x @ W`` orientation (``[in, out]``)."""
    w = {}
    for name in ("Wz", "Wr", "Wx", "P"):
        w[name] = _uniform(rng, (I, H), H)
    for name in ("Uz", "Ur", "Wh"):
        w[name] = _uniform(rng, (H, H), H)
    for name in ("bz", "br", "b"):
        w[name] = _uniform(rng, (H,), H)
    w["s"] = rng.uniform(0.5, 1.5, size=H).astype(np.float32)
    return w


# ----------------------------------------------------------------------------
# building


_FULL = {
    "W1": {"T": 100, "B": 64, "I": 128, "H": 256},
    "W2": {"T": 100, "B": 64, "I": 128, "H": 256},
    "W3": {"T": 1000, "B": 1, "I": 64, "H": 128},
    "W4": {"B": 64, "I": 128, "H": 256, "lo": 10, "hi": 200},
    "W5": {"T": 100, "B": 64, "I": 128, "H": 256},
    "W6": {"C": 64, "I": 64, "H": 128, "pmin": 2, "pmax": 8, "wmin": 5, "wmax": 40},
    "W7": {"T": 100, "B": 64, "I": 128, "H": 256},
}
_FULL["W8"] = _FULL["W1"]
_FULL["W9"] = _FULL["W5"]
_QUICK = {
    "W1": {"T": 5, "B": 4, "I": 8, "H": 16},
    "W2": {"T": 5, "B": 4, "I": 8, "H": 16},
    "W3": {"T": 20, "B": 1, "I": 8, "H": 16},
    "W4": {"B": 4, "I": 8, "H": 16, "lo": 2, "hi": 8},
    "W5": {"T": 5, "B": 4, "I": 8, "H": 16},
    "W6": {"C": 4, "I": 8, "H": 16, "pmin": 2, "pmax": 3, "wmin": 2, "wmax": 6},
    "W7": {"T": 5, "B": 4, "I": 8, "H": 16},
}
_QUICK["W8"] = _QUICK["W1"]
_QUICK["W9"] = _QUICK["W5"]


def make(key: str, quick: bool = False) -> Workload:
    """Build workload ``key`` ("W1".."W9"); the same seeds give the same arrays."""
    if key not in WORKLOADS:
        raise KeyError(f"unknown workload {key!r}; known: {', '.join(WORKLOADS)}")
    if key in TRAINS:
        wl = make(TRAINS[key], quick)
        B, T, H = wl.dims["B"], wl.dims["T"], wl.dims["H"]
        if np.any(wl.lengths != T):
            raise ValueError(f"{key}: {KINDS[key]} needs every sequence of length T")
        rng = np.random.default_rng(3000 + int(key[1]))
        extra = {"dY": rng.standard_normal((B, T, H)).astype(np.float32)}
        if KINDS[key] == "gru-train":  # W9 has no separate last-state gradient
            extra["dh"] = rng.standard_normal((B, H)).astype(np.float32)
        return Workload(key, NAMES[key], KINDS[key], wl.dims, wl.weights, lengths=wl.lengths,
                        x=wl.x, extra=extra)
    dims = dict((_QUICK if quick else _FULL)[key])
    kind = KINDS[key]
    n = int(key[1])
    data_rng = np.random.default_rng(1000 + n)
    weight_rng = np.random.default_rng(2000 + n)
    I, H = dims["I"], dims["H"]

    if kind == "nested":
        struct = np.random.default_rng(6)
        ppc = struct.integers(dims["pmin"], dims["pmax"] + 1, dims["C"]).astype(np.int64)
        wpp = struct.integers(dims["wmin"], dims["wmax"] + 1, int(ppc.sum())).astype(np.int64)
        words = data_rng.standard_normal((int(wpp.sum()), I)).astype(np.float32)
        weights = {"word": gru_weights(weight_rng, I, H), "para": gru_weights(weight_rng, H, H)}
        dims.update(P=int(ppc.sum()), words=int(wpp.sum()))
        return Workload(key, NAMES[key], kind, dims, weights, words=words,
                        paragraphs_per_chapter=ppc, words_per_paragraph=wpp)

    B = dims["B"]
    if key == "W4":
        lengths = np.random.default_rng(7).integers(dims["lo"], dims["hi"] + 1, B).astype(np.int64)
        dims["T"] = int(lengths.max())
    else:
        lengths = np.full(B, dims["T"], np.int64)
    T = dims["T"]
    x = data_rng.standard_normal((B, T, I)).astype(np.float32)
    for b, L in enumerate(lengths):
        x[b, L:] = 0.0
    if kind == "gru":
        weights = gru_weights(weight_rng, I, H)
    elif kind == "lstm":
        weights = lstm_weights(weight_rng, I, H)
    elif kind == "bilstm":  # layer 0 reads I features, layer 1 both directions' 2H
        weights = {f"l{layer}{sfx}": lstm_weights(weight_rng, I if layer == 0 else 2 * H, H)
                   for layer in range(2) for sfx in ("", "_reverse")}
    else:
        weights = custom_weights(weight_rng, I, H)
    return Workload(key, NAMES[key], kind, dims, weights, lengths=lengths, x=x)


def flops(wl: Workload, part: str = "step") -> float:
    """Sum of 2*M*N*K over every matmul of the workload, valid tokens only; of
    a training workload's ``part``: ``"step"`` (all), ``"forward"`` or
    ``"inference"`` (a third), ``"backward"`` (two thirds)."""
    I, H = wl.dims["I"], wl.dims["H"]
    if wl.kind == "nested":
        words, paras = wl.dims["words"], wl.dims["P"]
        return 2.0 * words * (I + H) * 3 * H + 2.0 * paras * (H + H) * 3 * H
    tokens = int(wl.lengths.sum())
    if wl.kind == "gru":
        return 2.0 * tokens * (I + H) * 3 * H
    if wl.kind == "gru-train":  # backward: dX, dW_ih, dh, dW_hh, each as large as its forward
        share = {"step": 3, "forward": 1, "inference": 1, "backward": 2}[part]
        return share * 2.0 * tokens * (I + H) * 3 * H
    if wl.kind == "custom-train":  # as gru-train: each matmul's two gradients, each as large
        share = {"step": 3, "forward": 1, "inference": 1, "backward": 2}[part]
        return share * 2.0 * tokens * (4 * I * H + 3 * H * H)
    if wl.kind == "lstm":
        return 2.0 * tokens * (I + H) * 4 * H
    if wl.kind == "bilstm":
        return 2 * (2.0 * tokens * (I + H) * 4 * H + 2.0 * tokens * (2 * H + H) * 4 * H)
    # custom: x@Wz, x@Wr, x@Wx, x@P and h@Uz, h@Ur, (r*h)@Wh
    return 2.0 * tokens * (4 * I * H + 3 * H * H)


# ----------------------------------------------------------------------------
# float64 references: one sequence at a time, a plain loop over its steps


def _sig(v):
    return 1.0 / (1.0 + np.exp(-v))


def _f64(weights):
    return {k: np.asarray(v, np.float64) for k, v in weights.items()}


def gru_sequence_ref(x, w, h=None):
    """PyTorch GRU over one sequence ``x [T, I]``; returns the last state."""
    H = w["w_hh"].shape[1]
    h = np.zeros(H) if h is None else h
    for t in range(x.shape[0]):
        gx = w["w_ih"] @ x[t] + w["b_ih"]
        gh = w["w_hh"] @ h + w["b_hh"]
        r = _sig(gx[:H] + gh[:H])
        z = _sig(gx[H : 2 * H] + gh[H : 2 * H])
        n = np.tanh(gx[2 * H :] + r * gh[2 * H :])
        h = (1.0 - z) * n + z * h
    return h


def lstm_sequence_ref(x, w):
    return lstm_sequence_all(x, w)[-1]


def lstm_sequence_all(x, w):
    """PyTorch LSTM over one sequence ``x [T, I]``: every step's h ``[T, H]``."""
    H = w["w_hh"].shape[1]
    h, c = np.zeros(H), np.zeros(H)
    out = np.zeros((x.shape[0], H))
    for t in range(x.shape[0]):
        g = w["w_ih"] @ x[t] + w["b_ih"] + w["w_hh"] @ h + w["b_hh"]
        i, f = _sig(g[:H]), _sig(g[H : 2 * H])
        gg, o = np.tanh(g[2 * H : 3 * H]), _sig(g[3 * H :])
        c = f * c + i * gg
        h = o * np.tanh(c)
        out[t] = h
    return out


def bilstm_sequence_ref(x, weights):
    """Two bidirectional LSTM layers over one sequence; the top layer's last
    states, forward (after the last step) then reverse (after the first)."""
    for layer in range(2):
        w, wr = _f64(weights[f"l{layer}"]), _f64(weights[f"l{layer}_reverse"])
        fwd, rev = lstm_sequence_all(x, w), lstm_sequence_all(x[::-1], wr)[::-1]
        x = np.concatenate([fwd, rev], axis=1)
    return np.concatenate([fwd[-1], rev[0]])


def custom_sequence_ref(x, w):
    H = w["Uz"].shape[0]
    h = np.zeros(H)
    for t in range(x.shape[0]):
        xt = x[t]
        z = _sig(xt @ w["Wz"] + h @ w["Uz"] + w["bz"])
        r = _sig(xt @ w["Wr"] + h @ w["Ur"] + w["br"])
        cand = w["s"] * np.tanh(xt @ w["Wx"] + (r * h) @ w["Wh"] + w["b"])
        h = (1.0 - z) * h + z * cand + 0.1 * (xt @ w["P"])
    return h


def reference(wl: Workload) -> np.ndarray:
    """The float64 final state: ``[B, H]`` (W6: ``[P + C, H]``, the paragraph
    vectors then each chapter's last state; W7: ``[B, 2H]``)."""
    if wl.kind == "nested":
        ww, wp = _f64(wl.weights["word"]), _f64(wl.weights["para"])
        words = wl.words.astype(np.float64)
        off = wl.paragraph_offsets()
        pv = np.stack([gru_sequence_ref(words[off[p] : off[p + 1]], ww)
                       for p in range(len(off) - 1)])
        coff = wl.chapter_offsets()
        ch = np.stack([gru_sequence_ref(pv[coff[c] : coff[c + 1]], wp)
                       for c in range(len(coff) - 1)])
        return np.concatenate([pv, ch], axis=0)
    x = wl.x.astype(np.float64)
    if wl.kind == "gru-train":  # the forward's final state; gradient_reference has the rest
        return gru_train(wl.x_time_major().astype(np.float64), _f64(wl.weights))[1]
    if wl.kind == "bilstm":
        return np.stack([bilstm_sequence_ref(x[b, :L], wl.weights) for b, L in enumerate(wl.lengths)])
    fn = {"gru": gru_sequence_ref, "lstm": lstm_sequence_ref, "custom": custom_sequence_ref,
          "custom-train": custom_sequence_ref}  # W9: the forward's final state, as W5's
    w = _f64(wl.weights)
    return np.stack([fn[wl.kind](x[b, :L], w) for b, L in enumerate(wl.lengths)])


# ----------------------------------------------------------------------------
# W8: a GRU's forward and backward through time, batched, time-major


def gru_train(x, w, dY=None, dh=None):
    """PyTorch's GRU over ``x [T, B, I]`` (every sequence T steps, h0 = 0) in
    ``x``'s dtype; with the upstream gradients ``dY [T, B, H]`` and ``dh [B, H]``
    also backpropagation through time. Returns ``(Y, h_n, grads)``, ``grads``
    (None without ``dY``) keyed by ``GRADIENTS`` in PyTorch's layout (gates r, z,
    n), ``grads["x"]`` shaped like ``x``."""
    T, B, _ = x.shape
    wih, whh = w["w_ih"], w["w_hh"]
    H = whh.shape[1]
    gx = (x.reshape(T * B, -1) @ wih.T + w["b_ih"]).reshape(T, B, 3 * H)
    h = np.zeros((B, H), x.dtype)
    Y = np.empty((T, B, H), x.dtype)
    saved = []  # per step: h_prev, r, z, n, h @ W_hn + b_hn
    for t in range(T):
        gh = h @ whh.T + w["b_hh"]
        r = _sig(gx[t, :, :H] + gh[:, :H])
        z = _sig(gx[t, :, H:2 * H] + gh[:, H:2 * H])
        n = np.tanh(gx[t, :, 2 * H:] + r * gh[:, 2 * H:])
        saved.append((h, r, z, n, gh[:, 2 * H:]))
        h = (1 - z) * n + z * h
        Y[t] = h
    if dY is None:
        return Y, h, None
    g = {"weight_hh": np.zeros_like(whh), "bias_hh": np.zeros_like(w["b_hh"])}
    dgx = np.empty((T, B, 3 * H), x.dtype)
    dh = np.array(dh, x.dtype)
    for t in reversed(range(T)):
        hp, r, z, n, ghn = saved[t]
        dh = dh + dY[t]
        dan = dh * (1 - z) * (1 - n * n)  # at n's pre-activation
        dar = dan * ghn * r * (1 - r)
        daz = dh * (hp - n) * z * (1 - z)
        dgh = np.concatenate([dar, daz, dan * r], axis=1)  # at h @ W_hh.T + b_hh
        dgx[t] = np.concatenate([dar, daz, dan], axis=1)  # at x @ W_ih.T + b_ih
        g["weight_hh"] += dgh.T @ hp
        g["bias_hh"] += dgh.sum(axis=0)
        dh = dh * z + dgh @ whh
    flat = dgx.reshape(T * B, 3 * H)
    g["weight_ih"] = flat.T @ x.reshape(T * B, -1)
    g["bias_ih"] = flat.sum(axis=0)
    g["x"] = (flat @ wih).reshape(x.shape)
    return Y, h, g


def gradient_reference(wl: Workload) -> dict:
    """W8's gradients in float64, keyed by ``GRADIENTS``; ``"x"`` batch-major
    ``[B, T, I]`` like ``wl.x``. (W9: ``custom_gradient_reference``.)"""
    if wl.kind == "custom-train":
        return custom_gradient_reference(wl)
    tm = (1, 0, 2)
    _, _, g = gru_train(wl.x_time_major().astype(np.float64), _f64(wl.weights),
                        wl.extra["dY"].transpose(tm).astype(np.float64),
                        wl.extra["dh"].astype(np.float64))
    g["x"] = g["x"].transpose(tm)
    return g


def gradient_names(wl: Workload) -> tuple:
    """The keys of a training workload's gradients: ``GRADIENTS`` (W8) or
    ``CUSTOM_GRADIENTS`` (W9)."""
    return CUSTOM_GRADIENTS if wl.kind == "custom-train" else GRADIENTS


# ----------------------------------------------------------------------------
# W9: W5's cell forward and backward through time, batched, time-major


def custom_train(x, w, dY=None):
    """W5's cell over ``x [T, B, I]`` (every sequence T steps, h0 = 0) in
    ``x``'s dtype; with the upstream gradient ``dY [T, B, H]`` of every step's
    output also backpropagation through time, written out by hand (no
    framework: the float64 oracle of W9). Returns ``(Y, h_n, grads)``,
    ``grads`` (None without ``dY``) keyed by ``CUSTOM_GRADIENTS``, each shaped
    like its weight in ``w`` (``x @ W`` layout), ``grads["x"]`` like ``x``.

    Forward: ``z = sig(x@Wz + h@Uz + bz)``, ``r = sig(x@Wr + h@Ur + br)``,
    ``c = tanh(x@Wx + (r*h)@Wh + b)``, ``h' = (1-z)*h + z*s*c + 0.1*x@P``.
    """
    T, B, I = x.shape
    H = w["Uz"].shape[0]
    xf = x.reshape(T * B, I)
    gz = (xf @ w["Wz"] + w["bz"]).reshape(T, B, H)
    gr = (xf @ w["Wr"] + w["br"]).reshape(T, B, H)
    gc = (xf @ w["Wx"] + w["b"]).reshape(T, B, H)
    px = 0.1 * (xf @ w["P"]).reshape(T, B, H)
    s = w["s"]
    h = np.zeros((B, H), x.dtype)
    Y = np.empty((T, B, H), x.dtype)
    saved = []  # per step: h_prev, z, r, c
    for t in range(T):
        z = _sig(gz[t] + h @ w["Uz"])
        r = _sig(gr[t] + h @ w["Ur"])
        c = np.tanh(gc[t] + (r * h) @ w["Wh"])
        saved.append((h, z, r, c))
        h = (1 - z) * h + z * (s * c) + px[t]
        Y[t] = h
    if dY is None:
        return Y, h, None
    g = {k: np.zeros_like(w[k]) for k in ("Uz", "Ur", "Wh", "s")}
    daz, dar, dac, dnew = (np.empty((T, B, H), x.dtype) for _ in range(4))
    dY = np.asarray(dY, x.dtype)
    dh = np.zeros((B, H), x.dtype)
    for t in reversed(range(T)):
        hp, z, r, c = saved[t]
        dh = dh + dY[t]  # at h' of step t: its output's and the next step's
        dnew[t] = dh  # x@P's term reads it, after the loop
        dcand = dh * z  # at s * c
        g["s"] += (dcand * c).sum(axis=0)
        dac[t] = dcand * s * (1 - c * c)  # at c's pre-activation
        daz[t] = dh * (s * c - hp) * z * (1 - z)
        dq = dac[t] @ w["Wh"].T  # at r * h
        dar[t] = dq * hp * r * (1 - r)
        g["Wh"] += (r * hp).T @ dac[t]
        g["Uz"] += hp.T @ daz[t]
        g["Ur"] += hp.T @ dar[t]
        dh = dh * (1 - z) + dq * r + daz[t] @ w["Uz"].T + dar[t] @ w["Ur"].T
    dnf = dnew.reshape(T * B, H)
    gx = 0.1 * (dnf @ w["P"].T)
    for name, bias, d in (("Wz", "bz", daz), ("Wr", "br", dar), ("Wx", "b", dac)):
        d = d.reshape(T * B, H)
        g[name] = xf.T @ d
        g[bias] = d.sum(axis=0)
        gx += d @ w[name].T
    g["P"] = 0.1 * (xf.T @ dnf)
    g["x"] = gx.reshape(x.shape)
    return Y, h, {k: g[k] for k in CUSTOM_GRADIENTS}


def custom_gradient_reference(wl: Workload) -> dict:
    """W9's gradients in float64 (``custom_train``), keyed by
    ``CUSTOM_GRADIENTS``; ``"x"`` batch-major ``[B, T, I]`` like ``wl.x``."""
    tm = (1, 0, 2)
    _, _, g = custom_train(wl.x_time_major().astype(np.float64), _f64(wl.weights),
                           wl.extra["dY"].transpose(tm).astype(np.float64))
    g["x"] = g["x"].transpose(tm)
    return g
