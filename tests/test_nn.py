"""stepnet.nn: the built-in RNN/LSTM/GRU/AUGRU layers against outside oracles.

* PyTorch (through PackedSequence) for what it has: RNN tanh/relu, LSTM
  (projection included), GRU (linear-before-reset), stacked, bidirectional,
  float32 and float64.
* onnxruntime (single-node and chained ONNX models) for what PyTorch lacks:
  GRU with linear_before_reset=0, ONNX activations with alpha/beta, clip,
  peephole, input_forget, reverse.
* The float64 NumPy oracle of ``nn_reference`` (oneDNN's and ONNX's equations)
  for AUGRU, bidirectional_sum and combine="final"; the oracle itself is
  checked against PyTorch and onnxruntime first.

Every stepnet run happens on the interpreter and on Numba; the two must also
agree with each other within ``conftest.assert_close``'s tolerance.
"""

import copy

import numpy as np
import pytest
from conftest import assert_close, available_backends

import nn_reference as ref
import stepnet as sn

BACKENDS = ["interpreter"] + [b for b in ("numba",) if b in sn.backends()]

# Against an outside oracle (another implementation, other rounding), per
# element relative to max(1, |expected|).  Gate-order or layout mistakes give
# errors of order 0.1.
ORACLE_TOL = {np.dtype(np.float32): 1e-5, np.dtype(np.float64): 1e-12}

LENGTHS = [5, 1, 7, 3, 2]

def nn():
    return pytest.importorskip("stepnet.nn")


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


def make_lod(rng, lengths, width, dtype):
    data = rng.standard_normal((sum(lengths), width)).astype(dtype)
    return sn.LoDTensor.from_lengths(data, [lengths])


def sequences(X):
    return [X.sequence(i) for i in range(X.num_sequences)]


def as_lod(ys, lengths, dtype, width):
    data = np.concatenate([np.asarray(y).reshape(len(y), width) for y in ys]) if ys else \
        np.zeros((0, width))
    return sn.LoDTensor.from_lengths(data.astype(dtype), [list(lengths)])


def call(layer, X, state=None, backend=None, attention=None):
    """Run a layer; returns (Y, h_n, c_n) with c_n None except for LSTM."""
    if attention is not None:
        out = layer(X, attention, state, backend=backend)
    else:
        out = layer(X, state, backend=backend)
    Y, hidden = out
    if isinstance(hidden, tuple):
        return Y, hidden[0], hidden[1]
    return Y, hidden, None


def assert_matches_oracle(actual, expected, dtype, what):
    """|a - e| <= ORACLE_TOL * max(1, |e|) elementwise (LoD checked exactly)."""
    if isinstance(expected, sn.LoDTensor):
        assert isinstance(actual, sn.LoDTensor), f"{what}: expected a LoDTensor, got {type(actual)}"
        assert actual.lod == expected.lod, f"{what}: LoD {actual.lod} != {expected.lod}"
        actual, expected = actual.data, expected.data
    actual = np.asarray(actual)
    expected = np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert actual.dtype == np.dtype(dtype), f"{what}: dtype {actual.dtype} != {np.dtype(dtype)}"
    tol = ORACLE_TOL[np.dtype(dtype)]
    err = np.abs(actual.astype(np.float64) - expected)
    bound = tol * np.maximum(1.0, np.abs(expected))
    worst = float(err.max()) if err.size else 0.0
    assert np.all(err <= bound), f"{what}: max error {worst:.3g} (tolerance {tol})"


def check_layer(layer, X, expected, state=None, attention=None, dtype=np.float32,
                backends=BACKENDS):
    """Run ``layer`` on ``backends`` (every one) against ``expected = (Y,
    h_n, c_n)``, and the others against the interpreter."""
    results = {}
    for backend in backends:
        got = call(layer, X, state, backend=backend, attention=attention)
        for name, a, e in zip(("Y", "h_n", "c_n"), got, expected):
            if e is None:
                continue
            assert_matches_oracle(a, e, dtype, f"{backend} {name}")
        results[backend] = got
    for backend in backends[1:]:
        for name, a, e in zip(("Y", "h_n", "c_n"), results[backend], results["interpreter"]):
            if e is not None:
                assert_close(a, e, what=f"{backend} {name} vs interpreter")
    return results["interpreter"]


def random_onnx_weights(rng, kind, input_size, hidden, D, peephole=False, dtype=np.float32,
                        scale=0.5):
    G = ref.GATES[kind]
    w = {"W": rng.standard_normal((D, G * hidden, input_size)) * scale,
         "R": rng.standard_normal((D, G * hidden, hidden)) * scale,
         "B": rng.standard_normal((D, 2 * G * hidden)) * scale}
    if peephole:
        w["P"] = rng.standard_normal((D, 3 * hidden)) * scale
    return {k: v.astype(dtype) for k, v in w.items()}


def layer_weights(layer, num_layers):
    return [layer.onnx_weights(i) for i in range(num_layers)]


# ---------------------------------------------------------------------------
# The oracles themselves, before stepnet is judged by them
# ---------------------------------------------------------------------------


TORCH_KINDS = {
    "rnn-tanh": ("RNN", "rnn", {"nonlinearity": "tanh"}),
    "rnn-relu": ("RNN", "rnn", {"nonlinearity": "relu"}),
    "gru": ("GRU", "gru", {}),
    "lstm": ("LSTM", "lstm", {}),
    "lstm-proj": ("LSTM", "lstm", {"proj_size": 3}),
}


def torch_module(name, num_layers, bidirectional, dtype, input_size=4, hidden=6, seed=0):
    torch = pytest.importorskip("torch")
    cls, _, kwargs = TORCH_KINDS[name]
    torch.manual_seed(seed)
    module = getattr(torch.nn, cls)(input_size, hidden, num_layers=num_layers,
                                    bidirectional=bidirectional, **kwargs)
    return module.to({np.float32: torch.float32, np.float64: torch.float64}[dtype])


@pytest.mark.parametrize("name", sorted(TORCH_KINDS))
def test_reference_matches_torch(rng, name):
    module = torch_module(name, num_layers=2, bidirectional=True, dtype=np.float64)
    kind = TORCH_KINDS[name][1]
    Hr = module.proj_size or module.hidden_size if kind == "lstm" else module.hidden_size
    xs = [rng.standard_normal((n, 4)) for n in LENGTHS]
    h0 = rng.standard_normal((4, len(xs), Hr))
    c0 = rng.standard_normal((4, len(xs), module.hidden_size)) if kind == "lstm" else None
    expected = ref.run_torch(module, xs, h0, c0)
    got = ref.run_stack(kind, xs, ref.torch_to_onnx_weights(module), "bidirectional_concat",
                        h0=h0, c0=c0, linear_before_reset=True,
                        activations=["Relu"] if name == "rnn-relu" else None)
    for y, e in zip(got[0], expected[0]):
        np.testing.assert_allclose(y, e, atol=1e-12)
    np.testing.assert_allclose(got[1], expected[1], atol=1e-12)
    if kind == "lstm":
        np.testing.assert_allclose(got[2], expected[2], atol=1e-12)


# Options onnxruntime runs (float32 only: its CPU GRU/LSTM reject double and
# its RNN has no double kernel).  Zero lengths are left out: onnxruntime gives
# zeros for Y_h of an empty sequence instead of its initial state.
ONNX_CASES = {
    "gru-lbr0": ("gru", 1, {}),
    "gru-lbr0-bidirectional": ("gru", 2, {}),
    "gru-lbr1-reverse-clip": ("gru", 1, {"linear_before_reset": 1, "direction": "reverse",
                                         "clip": 0.7}),
    "lstm-peephole": ("lstm", 1, {"P": True}),
    "lstm-peephole-input_forget-bidirectional": ("lstm", 2, {"P": True, "input_forget": 1}),
    "lstm-clip-reverse": ("lstm", 1, {"clip": 0.5, "direction": "reverse"}),
    "rnn-leakyrelu-softsign-bidirectional": ("rnn", 2, {
        "activations": ["LeakyRelu", "Softsign"], "activation_alpha": [0.2]}),
    "rnn-thresholdedrelu-softplus-bidirectional": ("rnn", 2, {
        "activations": ["ThresholdedRelu", "Softplus"], "activation_alpha": [0.3]}),
    "rnn-affine-elu-bidirectional": ("rnn", 2, {
        "activations": ["Affine", "Elu"], "activation_alpha": [0.5, 0.8],
        "activation_beta": [0.2]}),
    # Alpha/beta are consumed in order by the functions that take them.
    "gru-hardsigmoid-scaledtanh": ("gru", 1, {
        "activations": ["HardSigmoid", "ScaledTanh"], "activation_alpha": [0.3, 1.2],
        "activation_beta": [0.4, 0.8]}),
    "lstm-activations-bidirectional": ("lstm", 2, {
        "activations": ["Sigmoid", "ScaledTanh", "Affine", "HardSigmoid", "Elu", "Softsign"],
        "activation_alpha": [1.3, 0.5, 0.25, 0.9], "activation_beta": [0.7, 0.2, 0.45]}),
}


def onnx_case(rng, name, input_size=3, hidden=5, dtype=np.float32):
    """(kind, arrays dict W/R/B[/P], attrs dict) for one of ONNX_CASES."""
    kind, D, options = ONNX_CASES[name]
    options = dict(options)
    peephole = options.pop("P", False)
    arrays = random_onnx_weights(rng, kind, input_size, hidden, D, peephole, dtype)
    attrs = {"hidden_size": hidden,
             "direction": options.pop("direction", "bidirectional" if D == 2 else "forward")}
    attrs.update(options)
    return kind, arrays, attrs


def reference_options(attrs):
    direction = {"bidirectional": "bidirectional_concat"}.get(attrs["direction"], attrs["direction"])
    return direction, {k: attrs.get(k) for k in (
        "activations", "activation_alpha", "activation_beta", "clip")} | {
        "linear_before_reset": bool(attrs.get("linear_before_reset", 0)),
        "input_forget": bool(attrs.get("input_forget", 0))}


def initial_state(rng, kind, rows, batch, hidden, dtype, proj=None):
    h0 = rng.standard_normal((rows, batch, proj or hidden)).astype(dtype)
    c0 = rng.standard_normal((rows, batch, hidden)).astype(dtype) if kind == "lstm" else None
    return h0, c0


@pytest.mark.parametrize("name", sorted(ONNX_CASES))
def test_reference_matches_onnxruntime(rng, name):
    pytest.importorskip("onnxruntime")
    kind, arrays, attrs = onnx_case(rng, name)
    D = arrays["W"].shape[0]
    xs = [rng.standard_normal((n, 3)).astype(np.float32) for n in LENGTHS]
    h0, c0 = initial_state(rng, kind, D, len(xs), 5, np.float32)
    ys, h_n, c_n = ref.run_onnx_layers(kind, [arrays | attrs], xs, h0, c0)
    direction, options = reference_options(attrs)
    rys, rh, rc = ref.run_stack(kind, xs, [arrays], direction, h0=h0, c0=c0, **options)
    for y, e in zip(ys, rys):
        assert_matches_oracle(y, e, np.float32, "Y")
    assert_matches_oracle(h_n, rh, np.float32, "Y_h")
    if kind == "lstm":
        assert_matches_oracle(c_n, rc, np.float32, "Y_c")


def test_reference_alpha_beta_are_consumed_by_the_functions_that_take_them(rng):
    # ["HardSigmoid", "LeakyRelu"] with alpha [0.3, 0.1], beta [0.4]: LeakyRelu
    # gets alpha 0.1 (not 0.01, its default), HardSigmoid beta 0.4.
    f, g = ref.activation_functions("gru", 1, ["HardSigmoid", "LeakyRelu"], [0.3, 0.1], [0.4])[0]
    x = np.array([-2.0, 0.5])
    np.testing.assert_allclose(f(x), np.clip(0.3 * x + 0.4, 0, 1))
    np.testing.assert_allclose(g(x), [-0.2, 0.5])


def test_reference_augru_with_zero_attention_is_gru(rng):
    w = random_onnx_weights(rng, "gru", 3, 4, 2, dtype=np.float64)
    xs = [rng.standard_normal((n, 3)) for n in LENGTHS]
    for lbr in (False, True):
        gru = ref.run_stack("gru", xs, [w], "bidirectional_concat", linear_before_reset=lbr)
        augru = ref.run_stack("augru", xs, [w], "bidirectional_concat", linear_before_reset=lbr,
                              attention=[np.zeros(len(x)) for x in xs])
        for a, b in zip(augru[0], gru[0]):
            np.testing.assert_allclose(a, b, atol=1e-14)
    # Attention 1 turns the update gate off: with no recurrent weights h_t is
    # the candidate alone, whatever h0 was; with attention 0 it is not.
    w1 = {k: v[:1] for k, v in w.items()} | {"R": np.zeros((1, 12, 4))}
    h0 = rng.standard_normal((1, 1, 4))
    for scores, same in ((np.ones(1), True), (np.zeros(1), False)):
        a = ref.run_stack("augru", xs[1:2], [w1], attention=[scores], h0=h0)
        b = ref.run_stack("augru", xs[1:2], [w1], attention=[scores])
        assert np.allclose(a[1], b[1], atol=1e-14) == same


# ---------------------------------------------------------------------------
# PyTorch as oracle
# ---------------------------------------------------------------------------

# (torch kind, num_layers, bidirectional, dtype): one Numba kernel each.
TORCH_CASES = [
    ("rnn-tanh", 1, False, np.float32),
    ("rnn-relu", 2, True, np.float64),
    ("gru", 1, False, np.float32),
    ("gru", 3, True, np.float32),
    ("gru", 2, False, np.float64),
    ("lstm", 1, False, np.float32),
    ("lstm", 2, True, np.float64),
    ("lstm-proj", 1, False, np.float32),
    ("lstm-proj", 2, True, np.float32),
]


def torch_case_id(case):
    name, layers, bi, dtype = case
    return f"{name}-L{layers}-{'bi' if bi else 'fwd'}-{np.dtype(dtype).name}"


def stepnet_class(name):
    return getattr(nn(), TORCH_KINDS[name][0])


@pytest.mark.parametrize("case", TORCH_CASES, ids=torch_case_id)
def test_matches_torch_on_lod_input_with_initial_state(rng, case):
    name, num_layers, bi, dtype = case
    module = torch_module(name, num_layers, bi, dtype)
    layer = stepnet_class(name).from_torch(module)
    kind = TORCH_KINDS[name][1]
    D = 2 if bi else 1
    X = make_lod(rng, LENGTHS, 4, dtype)
    h0, c0 = initial_state(rng, kind, num_layers * D, len(LENGTHS), 6, dtype,
                           proj=module.proj_size if kind == "lstm" else None)
    ys, h_n, c_n = ref.run_torch(module, sequences(X), h0, c0)
    expected = (as_lod(ys, LENGTHS, dtype, ys[0].shape[1]), h_n, c_n)
    state = (h0, c0) if kind == "lstm" else h0
    check_layer(layer, X, expected, state=state, dtype=dtype)


@pytest.mark.parametrize("case", [TORCH_CASES[1], TORCH_CASES[2], TORCH_CASES[8]],
                         ids=torch_case_id)
def test_matches_torch_on_padded_input(rng, case):
    name, num_layers, bi, dtype = case
    module = torch_module(name, num_layers, bi, dtype)
    layer = stepnet_class(name).from_torch(module)
    lengths = np.array([4, 6, 1, 3])
    T = 8  # longer than every sequence: the padded output keeps T
    padded = np.zeros((4, T, 4), dtype)
    for b, n in enumerate(lengths):
        padded[b, :n] = rng.standard_normal((n, 4))
    xs = [padded[b, :n] for b, n in enumerate(lengths)]
    ys, h_n, c_n = ref.run_torch(module, xs)
    width = ys[0].shape[1]
    Y_expected = np.zeros((4, T, width))
    for b, n in enumerate(lengths):
        Y_expected[b, :n] = ys[b]
    results = {}
    for backend in BACKENDS:
        Y, h, c = call(layer, (padded, lengths), backend=backend)
        assert isinstance(Y, np.ndarray), f"{backend}: padded in, padded out (got {type(Y)})"
        assert_matches_oracle(Y, Y_expected, dtype, f"{backend} padded Y")
        assert_matches_oracle(h, h_n, dtype, f"{backend} h_n")
        if c_n is not None:
            assert_matches_oracle(c, c_n, dtype, f"{backend} c_n")
        results[backend] = (Y, h)
    assert_close(results[BACKENDS[-1]], results["interpreter"])


def test_empty_sequences_keep_their_initial_state(rng):
    module = torch_module("gru", 1, False, np.float32)
    layer = nn().GRU.from_torch(module)
    lengths = [3, 0, 4, 0, 1]
    X = make_lod(rng, lengths, 4, np.float32)
    h0 = rng.standard_normal((1, 5, 6)).astype(np.float32)
    keep = [b for b, n in enumerate(lengths) if n]
    ys, h_n, _ = ref.run_torch(module, [X.sequence(b) for b in keep], h0[:, keep])
    h_expected = h0.copy()
    h_expected[:, keep] = h_n
    expected = (as_lod(ys, lengths, np.float32, 6), h_expected, None)
    check_layer(layer, X, expected, state=h0)


def test_a_batch_of_empty_sequences_returns_the_initial_state(rng):
    layer = nn().GRU(4, 6, seed=0)
    h0 = rng.standard_normal((1, 3, 6)).astype(np.float32)
    X = sn.LoDTensor.from_lengths(np.zeros((0, 4), np.float32), [[0, 0, 0]])
    no_sequences = sn.LoDTensor.from_lengths(np.zeros((0, 4), np.float32), [[]])
    for backend in BACKENDS:
        Y, h, _ = call(layer, X, h0, backend=backend)
        assert Y.lod == X.lod and Y.data.shape == (0, 6) and Y.data.dtype == np.float32
        np.testing.assert_array_equal(h, h0)
        Y, h, _ = call(layer, no_sequences, backend=backend)
        assert Y.lod == [[0]] and Y.data.shape == (0, 6) and h.shape == (1, 0, 6)


def test_without_initial_state_and_default_backend(rng):
    module = torch_module("lstm-proj", 2, True, np.float32)
    layer = nn().LSTM.from_torch(module)
    X = make_lod(rng, LENGTHS, 4, np.float32)
    ys, h_n, c_n = ref.run_torch(module, sequences(X))
    Y, h, c = call(layer, X)  # the default backend
    assert_matches_oracle(Y, as_lod(ys, LENGTHS, np.float32, 6), np.float32, "Y")
    assert_matches_oracle(h, h_n, np.float32, "h_n")
    assert_matches_oracle(c, c_n, np.float32, "c_n")


@pytest.mark.parametrize("name", sorted(TORCH_KINDS))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_from_torch_reads_every_gate_and_to_torch_gives_it_back(name, dtype):
    torch = pytest.importorskip("torch")
    module = torch_module(name, 2, True, dtype)
    layer = stepnet_class(name).from_torch(module)
    # Gate orders: the layer's ONNX-layout weights equal an independent conversion.
    for i, expected in enumerate(ref.torch_to_onnx_weights(module)):
        got = layer.onnx_weights(i)
        for key, value in expected.items():
            assert got[key].dtype == np.dtype(dtype), f"layer {i} {key}: dtype {got[key].dtype}"
            np.testing.assert_array_equal(got[key], value, err_msg=f"layer {i} {key}")
    assert layer.parameters(), "a layer has parameters"
    for p in layer.parameters():
        assert isinstance(p, sn.Parameter)
        assert p.value.dtype == np.dtype(dtype)
    back = layer.to_torch()
    assert type(back) is type(module)
    for attr in ("input_size", "hidden_size", "num_layers", "bidirectional", "proj_size",
                 "nonlinearity", "bias", "batch_first"):
        if hasattr(module, attr):
            assert getattr(back, attr) == getattr(module, attr), attr
    expected, got = module.state_dict(), back.state_dict()
    assert sorted(got) == sorted(expected)
    for key in expected:
        assert got[key].dtype == expected[key].dtype, key
        assert torch.equal(got[key], expected[key]), key


def test_from_torch_refuses_modules_without_one_dtype_of_data_and_warns_of_dropout():
    torch = pytest.importorskip("torch")
    with pytest.raises(sn.StepNetError, match="parameter weight_ih_l0 is torch.float32 on meta"):
        nn().GRU.from_torch(torch.nn.GRU(4, 3, device="meta"))
    mixed = torch.nn.GRU(4, 3)
    mixed.weight_hh_l0.data = mixed.weight_hh_l0.data.double()
    with pytest.raises(sn.StepNetError, match="parameter weight_hh_l0 is torch.float64"):
        nn().GRU.from_torch(mixed)
    with pytest.warns(UserWarning, match="leaves out the module's dropout=0.5"):
        layer = nn().GRU.from_torch(torch.nn.GRU(4, 3, num_layers=2, dropout=0.5))
    assert layer.num_layers == 2


def test_to_torch_of_a_constructed_layer_runs_like_stepnet(rng):
    pytest.importorskip("torch")
    layer = nn().GRU(4, 6, num_layers=3, direction="bidirectional_concat",
                     linear_before_reset=True, seed=3)
    module = layer.to_torch()
    X = make_lod(rng, LENGTHS, 4, np.float32)
    ys, h_n, _ = ref.run_torch(module, sequences(X))
    # Same kernel as the gru-L3-bi-float32 case of the PyTorch tests.
    check_layer(layer, X, (as_lod(ys, LENGTHS, np.float32, 12), h_n, None))


def test_to_torch_refuses_what_torch_cannot_express():
    pytest.importorskip("torch")
    with pytest.raises(sn.Error):
        nn().GRU(4, 6, linear_before_reset=False, seed=0).to_torch()
    with pytest.raises(sn.Error):
        nn().LSTM(4, 6, peephole=True, seed=0).to_torch()


# ---------------------------------------------------------------------------
# onnxruntime as oracle
# ---------------------------------------------------------------------------

ONNX_CLASSES = {"rnn": "RNN", "gru": "GRU", "lstm": "LSTM"}


# the cases whose layer also runs compiled by default: one per cell kind (the
# compiled kernels of the other options are judged against the NumPy
# reference in test_matches_the_numpy_reference, each activation as an op in
# tests/test_ops.py; what is judged here is the layer read from ONNX's arrays
# and attributes, on the interpreter), every case compiled under -m slow
ONNX_COMPILED = ("gru-lbr1-reverse-clip", "lstm-peephole-input_forget-bidirectional",
                 "rnn-affine-elu-bidirectional")


@pytest.mark.parametrize("name, compiled", [
    *[(name, name in ONNX_COMPILED) for name in sorted(ONNX_CASES)],
    *[pytest.param(name, True, marks=pytest.mark.slow) for name in sorted(ONNX_CASES)
      if name not in ONNX_COMPILED]])
def test_matches_onnxruntime(rng, name, compiled):
    pytest.importorskip("onnxruntime")
    kind, arrays, attrs = onnx_case(rng, name)
    D = arrays["W"].shape[0]
    layer = getattr(nn(), ONNX_CLASSES[kind]).from_onnx(**arrays, **attrs)
    X = make_lod(rng, LENGTHS, 3, np.float32)
    h0, c0 = initial_state(rng, kind, D, len(LENGTHS), 5, np.float32)
    ys, h_n, c_n = ref.run_onnx_layers(kind, [arrays | attrs], sequences(X), h0, c0)
    expected = (as_lod(ys, LENGTHS, np.float32, D * 5), h_n, c_n)
    check_layer(layer, X, expected, state=(h0, c0) if kind == "lstm" else h0,
                backends=BACKENDS if compiled else BACKENDS[:1])


@pytest.mark.parametrize("name", ["gru-lbr0-bidirectional",
                                  "lstm-peephole-input_forget-bidirectional"])
def test_onnx_options_in_float64_match_the_reference(rng, name):
    kind, arrays, attrs = onnx_case(rng, name, dtype=np.float64)
    attrs["clip"] = 0.9
    D = arrays["W"].shape[0]
    layer = getattr(nn(), ONNX_CLASSES[kind]).from_onnx(**arrays, **attrs)
    lengths = [4, 0, 6, 1]
    X = make_lod(rng, lengths, 3, np.float64)
    h0, c0 = initial_state(rng, kind, D, len(lengths), 5, np.float64)
    direction, options = reference_options(attrs)
    ys, h_n, c_n = ref.run_stack(kind, sequences(X), [arrays], direction, h0=h0, c0=c0, **options)
    expected = (as_lod(ys, lengths, np.float64, D * 5), h_n, c_n)
    check_layer(layer, X, expected, state=(h0, c0) if kind == "lstm" else h0, dtype=np.float64)


def normalized_attrs(attrs, kind):
    """ONNX attributes with their defaults filled in, for comparing."""
    per_dir = len(ref.DEFAULT_ACTIVATIONS[kind])
    D = 2 if attrs.get("direction") == "bidirectional" else 1
    acts = attrs.get("activations") or ref.DEFAULT_ACTIVATIONS[kind] * D
    if len(acts) == per_dir and D == 2:
        acts = list(acts) * 2
    out = {
        "hidden_size": int(attrs["hidden_size"]),
        "direction": attrs.get("direction") or "forward",
        "activations": [a.lower() for a in acts],
        "activation_alpha": [float(a) for a in attrs.get("activation_alpha") or []],
        "activation_beta": [float(b) for b in attrs.get("activation_beta") or []],
        "clip": None if attrs.get("clip") is None else float(attrs["clip"]),
    }
    if kind == "gru":
        out["linear_before_reset"] = int(attrs.get("linear_before_reset") or 0)
    if kind == "lstm":
        out["input_forget"] = int(attrs.get("input_forget") or 0)
    return out


@pytest.mark.parametrize("name", sorted(ONNX_CASES))
def test_from_onnx_to_onnx_round_trip(rng, name):
    kind, arrays, attrs = onnx_case(rng, name)
    layer = getattr(nn(), ONNX_CLASSES[kind]).from_onnx(**arrays, **attrs)
    back = layer.to_onnx()
    assert isinstance(back, dict), f"one layer gives one dict (got {type(back)})"
    for key, value in arrays.items():
        assert key in back, f"to_onnx() lacks {key}"
        assert np.asarray(back[key]).dtype == value.dtype, key
        np.testing.assert_array_equal(back[key], value, err_msg=key)
    assert normalized_attrs(back, kind) == normalized_attrs(attrs, kind)
    weights = layer.onnx_weights(0)
    for key, value in arrays.items():
        np.testing.assert_array_equal(weights[key], value, err_msg=f"onnx_weights {key}")


def test_from_onnx_without_bias_means_zero_bias(rng):
    arrays = random_onnx_weights(rng, "gru", 3, 5, 1)
    layer = nn().GRU.from_onnx(arrays["W"], arrays["R"], hidden_size=5, linear_before_reset=1)
    np.testing.assert_array_equal(layer.onnx_weights(0)["B"], np.zeros((1, 30), np.float32))
    back = layer.to_onnx()
    np.testing.assert_array_equal(back["W"], arrays["W"])
    np.testing.assert_array_equal(back["R"], arrays["R"])


def test_stacked_to_onnx_runs_on_onnxruntime(rng):
    pytest.importorskip("onnxruntime")
    layer = nn().GRU(3, 5, num_layers=2, direction="bidirectional_concat",
                     linear_before_reset=False, seed=7)
    dicts = layer.to_onnx()
    assert isinstance(dicts, list) and len(dicts) == 2
    assert [np.asarray(d["W"]).shape for d in dicts] == [(2, 15, 3), (2, 15, 10)]
    assert all(d["direction"] == "bidirectional" for d in dicts)
    X = make_lod(rng, LENGTHS, 3, np.float32)
    h0 = rng.standard_normal((4, len(LENGTHS), 5)).astype(np.float32)
    ys, h_n, _ = ref.run_onnx_layers("gru", dicts, sequences(X), h0)
    check_layer(layer, X, (as_lod(ys, LENGTHS, np.float32, 10), h_n, None), state=h0)


# ---------------------------------------------------------------------------
# The NumPy oracle: AUGRU, bidirectional_sum, combine="final", stacked reverse
# ---------------------------------------------------------------------------

# (class, kwargs, num_layers, dtype): one Numba kernel each.
REFERENCE_CASES = {
    "augru-forward": ("AUGRU", {}, 1, np.float32),
    "augru-reverse": ("AUGRU", {"direction": "reverse"}, 1, np.float32),
    "augru-lbr-bidirectional_concat-L2": (
        "AUGRU", {"direction": "bidirectional_concat", "linear_before_reset": True}, 2,
        np.float64),
    "gru-bidirectional_sum-L2": ("GRU", {"direction": "bidirectional_sum"}, 2, np.float32),
    "lstm-peephole-bidirectional_sum": (
        "LSTM", {"direction": "bidirectional_sum", "peephole": True}, 1, np.float64),
    "gru-bidirectional_concat-final-L2": (
        "GRU", {"direction": "bidirectional_concat", "combine": "final"}, 2, np.float32),
    "lstm-proj-bidirectional_sum-final-L2": (
        "LSTM", {"direction": "bidirectional_sum", "combine": "final", "proj_size": 3}, 2,
        np.float32),
    "rnn-relu-bidirectional_concat-final-L3": (
        "RNN", {"direction": "bidirectional_concat", "combine": "final", "nonlinearity": "relu"},
        3, np.float64),
    "rnn-sigmoid-reverse-L2": ("RNN", {"direction": "reverse", "nonlinearity": "sigmoid"}, 2,
                               np.float32),
    # ONNX activations, alpha/beta and clip given to the constructor.
    "gru-activations-clip-bidirectional_concat-L2": (
        "GRU", {"direction": "bidirectional_concat",
                "activations": ["HardSigmoid", "Softsign", "Sigmoid", "ScaledTanh"],
                "activation_alpha": [0.3, 1.1], "activation_beta": [0.45, 0.9], "clip": 2.0}, 2,
        np.float32),
    "mgu-bidirectional_concat-L2": ("MGU", {"direction": "bidirectional_concat"}, 2,
                                    np.float32),
    "mgu-activations-clip-reverse": (
        "MGU", {"direction": "reverse", "activations": ["HardSigmoid", "Softsign"],
                "activation_alpha": [0.3], "activation_beta": [0.45], "clip": 1.5}, 1, np.float64),
    "lstm-activations-input_forget-clip": (
        "LSTM", {"activations": ["HardSigmoid", "Elu", "Softplus"], "activation_alpha": [0.25, 0.7],
                 "activation_beta": [0.5], "clip": 1.5, "input_forget": True}, 1, np.float64),
}

REFERENCE_KIND = {"RNN": "rnn", "GRU": "gru", "LSTM": "lstm", "AUGRU": "augru", "MGU": "mgu"}


def reference_run(layer_kind, kwargs, weights, X, h0, c0, attention=None):
    kind = REFERENCE_KIND[layer_kind]
    acts = kwargs.get("activations")
    if layer_kind == "RNN" and acts is None:
        acts = [kwargs.get("nonlinearity", "tanh").capitalize()]
    return ref.run_stack(
        kind, sequences(X), weights, kwargs.get("direction", "forward"),
        kwargs.get("combine", "per_layer"), h0=h0, c0=c0, activations=acts,
        activation_alpha=kwargs.get("activation_alpha"),
        activation_beta=kwargs.get("activation_beta"), clip=kwargs.get("clip"),
        linear_before_reset=kwargs.get("linear_before_reset", False),
        input_forget=kwargs.get("input_forget", False), attention=attention)


def run_reference_case(rng, layer_kind, kwargs, num_layers, dtype, lengths, input_size=4,
                       hidden=6, with_state=True):
    layer = getattr(nn(), layer_kind)(input_size, hidden, num_layers=num_layers, dtype=dtype,
                                      seed=11, **kwargs)
    direction = kwargs.get("direction", "forward")
    D = 2 if direction.startswith("bidirectional") else 1
    X = make_lod(rng, lengths, input_size, dtype)
    attention = None
    if layer_kind == "AUGRU":
        attention = sn.LoDTensor.from_lengths(
            rng.uniform(0, 1, (sum(lengths), 1)).astype(dtype), [lengths])
    h0 = c0 = None
    if with_state:
        h0, c0 = initial_state(rng, REFERENCE_KIND[layer_kind], num_layers * D, len(lengths),
                               hidden, dtype, proj=kwargs.get("proj_size"))
    ys, h_n, c_n = reference_run(
        layer_kind, kwargs, layer_weights(layer, num_layers), X, h0, c0,
        attention=None if attention is None else [a[:, 0] for a in sequences(attention)])
    width = ys[0].shape[1] if ys else 0
    expected = (as_lod(ys, lengths, dtype, width), h_n, c_n)
    state = (h0, c0) if layer_kind == "LSTM" and with_state else h0
    return check_layer(layer, X, expected, state=state, attention=attention, dtype=dtype)


@pytest.mark.parametrize("case", sorted(REFERENCE_CASES))
def test_matches_the_numpy_reference(rng, case):
    layer_kind, kwargs, num_layers, dtype = REFERENCE_CASES[case]
    run_reference_case(rng, layer_kind, kwargs, num_layers, dtype, [5, 0, 7, 3, 1])


def test_mgu_is_the_gru_whose_update_gate_is_one_minus_its_reset_gate(rng):
    """An outside check of the MGU (no library has one): sigmoid(-v) is
    1 - sigmoid(v), so a GRU whose z weights are minus the MGU's f weights,
    whose r weights are f's and whose candidate is the MGU's computes the
    MGU; the GRU is checked against PyTorch and onnxruntime above."""
    mgu = nn().MGU(4, 6, direction="bidirectional_concat", seed=3)
    w = mgu.onnx_weights(0)

    def as_gru(a):  # gate blocks (f, h) -> (z, r, h) along axis 1
        f, h = np.split(a, 2, axis=1)
        return np.concatenate([-f, f, h], axis=1)

    Wb, Rb = np.split(w["B"], 2, axis=1)
    gru = nn().GRU.from_onnx(as_gru(w["W"]), as_gru(w["R"]),
                             np.concatenate([as_gru(Wb), as_gru(Rb)], axis=1),
                             direction="bidirectional")
    X = make_lod(rng, [4, 0, 3], 4, np.float32)
    Y, h_n = gru(X, backend="interpreter")
    for backend in BACKENDS:
        got = mgu(X, backend=backend)
        assert_close(got[0].data, Y.data, what=f"{backend} Y")
        assert_close(got[1], h_n, what=f"{backend} h_n")


def test_augru_output_width_and_dtype(rng):
    Y, h_n, _ = run_reference_case(rng, "AUGRU", {}, 1, np.float32, [2, 3], with_state=False)
    assert Y.data.shape == (5, 6) and Y.data.dtype == np.float32
    assert h_n.shape == (1, 2, 6)


@pytest.mark.parametrize("lengths", [[0, 0], []], ids=["no-steps", "no-sequences"])
def test_augru_of_no_token(lengths):
    layer = sn.nn.AUGRU(3, 4, seed=0)
    X = sn.LoDTensor.from_lengths(np.zeros((0, 3), np.float32), [lengths])
    scores = sn.LoDTensor.from_lengths(np.zeros((0, 1), np.float32), [lengths])
    for backend in ["interpreter"] + available_backends():
        Y, h_n = layer(X, scores, backend=backend)
        assert Y.lod == X.lod and h_n.shape == (1, len(lengths), 4) and not h_n.any()


def test_augru_with_zero_attention_is_the_gru(rng):
    # The same weights in a GRU and an AUGRU (through ONNX layout).
    augru = nn().AUGRU(4, 6, seed=5)
    w = augru.onnx_weights(0)
    gru = nn().GRU.from_onnx(w["W"], w["R"], w["B"], hidden_size=6)
    X = make_lod(rng, LENGTHS, 4, np.float32)
    zeros = sn.LoDTensor.from_lengths(np.zeros((sum(LENGTHS), 1), np.float32), [LENGTHS])
    for backend in BACKENDS:
        a = call(augru, X, backend=backend, attention=zeros)
        g = call(gru, X, backend=backend)
        assert_close(a[:2], g[:2], what=f"{backend} AUGRU(a=0) vs GRU")


# ---------------------------------------------------------------------------
# Layer objects: printing, parameters, shapes
# ---------------------------------------------------------------------------


def test_print_shows_the_step_net():
    text = str(nn().GRU(4, 6, seed=0))
    assert text.strip() and "rnn" in text.lower()


def test_repr_names_the_options_that_change_the_maths():
    assert repr(nn().LSTM(4, 6)) == "LSTM(4, 6, dtype=float32)"
    assert repr(nn().LSTM(4, 6, activations=["sigmoid", "tanh", "tanh"])) == "LSTM(4, 6, dtype=float32)"
    gru = nn().GRU(4, 6, direction="reverse", activations=["HardSigmoid", "Softsign"],
                   activation_alpha=[0.3, 1.0], activation_beta=[0.2, 0.0])
    assert repr(gru) == ("GRU(4, 6, direction='reverse', activations=['HardSigmoid', 'Softsign'], "
                         "activation_alpha=[0.3, 1.0], activation_beta=[0.2, 0.0], dtype=float32)")
    assert repr(nn().RNN(4, 6, nonlinearity="relu")) == "RNN(4, 6, nonlinearity='relu', dtype=float32)"


@pytest.mark.parametrize("layer_kind", ["RNN", "GRU", "LSTM", "AUGRU", "MGU"])
def test_a_layer_without_biases_has_none_among_its_parameters(rng, layer_kind):
    kind = getattr(nn(), layer_kind)
    plain, bare = kind(3, 4, num_layers=2, seed=0), kind(3, 4, num_layers=2, seed=0, bias=False)
    names = {p.name for p in plain.parameters()} - {p.name for p in bare.parameters()}
    assert names and all("_Wb_" in n or "_Rb_" in n for n in names)
    assert all(not np.any(w["B"]) for w in (bare.onnx_weights(layer) for layer in range(2)))
    assert repr(bare).endswith("bias=False, dtype=float32)")
    with pytest.raises(sn.StepNetError, match="bias=False"):
        bare.set_onnx_weights(0, **{**plain.onnx_weights(0), "P": None, "proj": None})
    with pytest.raises(sn.StepNetError, match="bias must be True or False, got 'false'"):
        kind(3, 4, bias="false")


@pytest.mark.parametrize("layer_kind", ["RNN", "GRU", "LSTM", "MGU"])
def test_a_layer_pickles_with_its_activations(rng, layer_kind):
    import pickle

    kind = getattr(nn(), layer_kind)
    count = len(kind(3, 4).activations)
    layer = kind(3, 4, direction="bidirectional_concat", seed=0,
                 activations=(["HardSigmoid", "LeakyRelu", "Softsign"] * 2)[:count],
                 activation_alpha=[0.3, 0.2][:count - (count == 1)], activation_beta=[0.4])
    copy = pickle.loads(pickle.dumps(layer))
    assert repr(copy) == repr(layer)
    x = (rng.standard_normal((2, 5, 3)).astype(np.float32), np.array([5, 2]))
    np.testing.assert_array_equal(copy(x, backend="interpreter")[0], layer(x, backend="interpreter")[0])


@pytest.mark.parametrize("layer_kind", ["RNN", "GRU", "LSTM", "AUGRU"])
def test_parameters_are_stepnet_parameters_of_the_layer_dtype(layer_kind):
    layer = getattr(nn(), layer_kind)(4, 6, num_layers=2, direction="bidirectional_concat",
                                      dtype=np.float64, seed=0)
    params = layer.parameters()
    assert params and all(isinstance(p, sn.Parameter) for p in params)
    assert all(p.dtype == np.float64 for p in params)
    # Every weight matrix's values are held by the parameters (biases may be fused).
    held = sum(p.value.size for p in params)
    matrices = sum(w[k].size for w in layer_weights(layer, 2) for k in ("W", "R"))
    assert held >= matrices


@pytest.mark.parametrize("layer_kind, options", [
    ("GRU", {"linear_before_reset": True}), ("GRU", {}), ("LSTM", {}),
    ("LSTM", {"input_forget": True}),
    ("LSTM", {"num_layers": 2, "direction": "bidirectional_concat"})])
@pytest.mark.parametrize("copied", [False, True], ids=["layer", "deepcopy"])
def test_a_layers_joined_weights_are_its_parameters_memory(rng, layer_kind, options, copied):
    """The Numba kernel's products join the gates' weights by columns; a
    layer keeps them so joined (a deep copy too), and the join is its
    Parameters' memory: no copy a call, and a change made in place (an
    optimizer's) is seen."""
    from stepnet.backends import compiled

    layer = getattr(nn(), layer_kind)(4, 6, seed=0, **options)
    if copied:
        layer = copy.deepcopy(layer)
    joins = 0
    for key in layer._params:
        rnn = layer.step_net(*key)
        flags = (True,) + (False,) * len(layer.state_widths())
        run = compiled(rnn, "numba")._runner(flags)
        run = getattr(run, "numba_program", run)
        consts = rnn.const_values()
        prepared = run.prepare(consts)[len(run.consts):-1]  # (then the small-products rows)
        for gates, joined in zip(run.concatenated.values(), prepared, strict=True):
            parts = [consts[v] for v in gates]
            np.testing.assert_array_equal(joined, np.concatenate(parts, axis=1))
            assert joined.flags.c_contiguous and all(np.shares_memory(joined, p) for p in parts)
            joins += 1
    assert joins == 2 * len(layer._params)  # x @ W and h @ R, in every step-net
    X = make_lod(rng, LENGTHS, 4, np.float32)
    before = call(layer, X, backend="numba")[0].data
    for p in layer.parameters():
        p.value[...] = p.value * 0.5  # in place, as stepnet.optim
    twin = getattr(nn(), layer_kind)(4, 6, seed=0, **options)
    for p, q in zip(twin.parameters(), layer.parameters()):
        p.value[...] = q.value
    after = call(layer, X, backend="numba")[0].data
    expected = call(twin, X, backend="numba")[0].data
    assert not np.allclose(after, before)
    np.testing.assert_array_equal(after, expected)
    # a Parameter given a new array: its join is a copy of the new values
    first, twin_first = layer.parameters()[0], twin.parameters()[0]
    first.value = np.array(first.value) * 2
    twin_first.value[...] = first.value
    renewed = call(layer, X, backend="numba")[0].data
    assert not np.allclose(renewed, after)
    np.testing.assert_array_equal(renewed, call(twin, X, backend="numba")[0].data)


def test_seed_makes_weights_reproducible():
    a = nn().LSTM(4, 6, seed=1).onnx_weights(0)
    b = nn().LSTM(4, 6, seed=1).onnx_weights(0)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key])


# ---------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_wrong_input_width_is_a_shape_error(rng, backend):
    layer = nn().GRU(4, 6, seed=0)
    with pytest.raises(sn.ShapeError):
        layer(make_lod(rng, [2, 3], 5, np.float32), backend=backend)
    with pytest.raises(sn.ShapeError):
        layer((np.zeros((2, 3, 5), np.float32), [2, 3]), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_wrong_initial_state_shape_is_a_shape_error(rng, backend):
    X = make_lod(rng, [2, 3], 4, np.float32)
    gru = nn().GRU(4, 6, num_layers=2, seed=0)
    for shape in [(1, 2, 6), (2, 3, 6), (2, 2, 5), (2, 6)]:
        with pytest.raises(sn.ShapeError):
            gru(X, np.zeros(shape, np.float32), backend=backend)
    lstm = nn().LSTM(4, 6, proj_size=3, seed=0)
    good_h, good_c = np.zeros((1, 2, 3), np.float32), np.zeros((1, 2, 6), np.float32)
    with pytest.raises(sn.ShapeError):
        lstm(X, (np.zeros((1, 2, 6), np.float32), good_c), backend=backend)
    with pytest.raises(sn.ShapeError):
        lstm(X, (good_h, np.zeros((1, 2, 3), np.float32)), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_lstm_state_must_be_a_pair(rng, backend):
    layer = nn().LSTM(4, 6, seed=0)
    with pytest.raises(sn.Error):
        layer(make_lod(rng, [2, 3], 4, np.float32), np.zeros((1, 2, 6), np.float32),
              backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_with_another_lod_is_refused(rng, backend):
    layer = nn().AUGRU(4, 6, seed=0)
    X = make_lod(rng, [2, 3], 4, np.float32)
    for lengths in ([3, 2], [5], [2, 3, 0]):
        attention = sn.LoDTensor.from_lengths(np.zeros((5, 1), np.float32), [lengths])
        with pytest.raises(sn.Error, match="(?i)attention"):
            layer(X, attention, backend=backend)


def test_a_layer_or_direction_index_out_of_range_is_refused(rng):
    gru = nn().GRU(4, 4, seed=0)
    X = make_lod(rng, [2, 3], 4, np.float32)
    before = gru(X, backend="interpreter")
    w = gru.onnx_weights(0)
    with pytest.raises(sn.StepNetError, match=r"GRU.set_onnx_weights: layer 4 is out of range "
                                              r"\[0, 1\) \(num_layers=1\)"):
        gru.set_onnx_weights(4, 2 * w["W"], w["R"], w["B"])
    with pytest.raises(sn.StepNetError, match=r"GRU.set_onnx_weights: layer -1 is out of range"):
        gru.set_onnx_weights(-1, 2 * w["W"], w["R"], w["B"])
    assert len(gru.parameters()) == len(nn().GRU(4, 4).parameters())  # nothing was added
    assert_close(gru(X, backend="interpreter"), before)
    with pytest.raises(sn.StepNetError, match=r"GRU.step_net: layer 7 is out of range \[0, 1\)"):
        gru.step_net(7, 0)
    with pytest.raises(sn.StepNetError, match=r"GRU.step_net: direction 1 is out of range "
                                              r"\[0, 1\) \(direction='forward'\)"):
        gru.step_net(0, 1)
    with pytest.raises(sn.StepNetError, match=r"GRU.step_net: layer must be an int, got 0.5"):
        gru.step_net(0.5, 0)
    lstm = nn().LSTM(4, 6, num_layers=2, direction="bidirectional_concat", seed=0)
    with pytest.raises(sn.StepNetError, match=r"LSTM.onnx_weights: layer 2 is out of range "
                                              r"\[0, 2\) \(num_layers=2\)"):
        lstm.onnx_weights(2)
    with pytest.raises(sn.StepNetError, match=r"LSTM.layer_input_size: layer 2 is out of range"):
        lstm.layer_input_size(2)
    assert lstm.step_net(np.int64(1), 1) is lstm.step_net(1, 1)


def test_unknown_options_are_refused():
    with pytest.raises(sn.Error, match="sideways"):
        nn().GRU(4, 6, direction="sideways")
    with pytest.raises(sn.Error, match="sideways"):
        nn().LSTM(4, 6, direction="sideways")
    with pytest.raises(sn.Error, match="middle"):
        nn().GRU(4, 6, num_layers=2, direction="bidirectional_concat", combine="middle")
    with pytest.raises(sn.Error, match="gelu"):
        nn().RNN(4, 6, nonlinearity="gelu")
    w = np.zeros((1, 18, 4), np.float32)
    r = np.zeros((1, 18, 6), np.float32)
    with pytest.raises(sn.Error, match="sideways"):
        nn().GRU.from_onnx(w, r, hidden_size=6, direction="sideways")
    with pytest.raises(sn.Error, match="Swish"):
        nn().GRU.from_onnx(w, r, hidden_size=6, activations=["Swish", "Tanh"])


# ---------------------------------------------------------------------------
# Slow: the whole cross product against the NumPy reference
# ---------------------------------------------------------------------------

SLOW_KINDS = {
    "RNN": [{}, {"nonlinearity": "relu"}],
    "GRU": [{}, {"linear_before_reset": True}],
    "LSTM": [{}, {"peephole": True}, {"proj_size": 3}, {"input_forget": True}],
    "AUGRU": [{}, {"linear_before_reset": True}],
}
SLOW_CASES = [
    (kind, dict(options, direction=direction, combine=combine), layers, dtype)
    for kind, option_list in SLOW_KINDS.items()
    for options in option_list
    for direction in ("forward", "reverse", "bidirectional_concat", "bidirectional_sum")
    for combine in (("per_layer", "final") if direction.startswith("bidirectional")
                    else ("per_layer",))
    for layers in (1, 2)
    for dtype in (np.float32, np.float64)
    if not (combine == "final" and layers == 1)
]


@pytest.mark.slow
@pytest.mark.parametrize("case", [
    pytest.param(c, id="-".join(
        [c[0]] + [f"{k}={v}" for k, v in c[1].items()] + [f"L{c[2]}", np.dtype(c[3]).name]))
    for c in SLOW_CASES])
def test_cross_product_matches_the_numpy_reference(rng, case):
    layer_kind, kwargs, num_layers, dtype = case
    run_reference_case(rng, layer_kind, kwargs, num_layers, dtype, [4, 0, 6, 2, 1])


def test_float16_input_is_computed_in_float32_and_given_back_as_float16(rng):
    sn_nn = nn()
    gru = sn_nn.GRU(3, 4, seed=1)
    data = rng.standard_normal((6, 3)).astype(np.float16)
    X16 = sn.LoDTensor.from_lengths(data, [[4, 2]])
    X32 = sn.LoDTensor.from_lengths(data.astype(np.float32), [[4, 2]])
    Y16, h16 = gru(X16, backend="interpreter")
    Y32, h32 = gru(X32, backend="interpreter")
    assert Y16.data.dtype == np.float16 and h16.dtype == np.float16
    np.testing.assert_array_equal(Y16.data, Y32.data.astype(np.float16))
    np.testing.assert_array_equal(h16, h32.astype(np.float16))


def test_a_nested_lod_input_runs_over_its_finest_sequences(rng):
    sn_nn = nn()
    lstm = sn_nn.LSTM(3, 4, seed=2)
    data = rng.standard_normal((9, 3)).astype(np.float32)
    nested = sn.LoDTensor.from_lengths(data, [[2, 1], [4, 0, 5]])  # 2 chapters, 3 paragraphs
    flat = sn.LoDTensor.from_lengths(data, [[4, 0, 5]])
    for backend in ("interpreter", "numba"):
        Y, (h_n, c_n) = lstm(nested, backend=backend)
        Yf, (hf, cf) = lstm(flat, backend=backend)
        assert Y.lod == nested.lod
        np.testing.assert_array_equal(Y.data, Yf.data)
        np.testing.assert_array_equal(h_n, hf)
        assert h_n.shape == (1, 3, 4)


def test_torch_converters_without_torch_say_what_is_missing(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_torch(name, *args, **kwargs):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("no torch here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torch)
    layer = nn().GRU(2, 3, linear_before_reset=True)
    with pytest.raises(sn.UnsupportedError, match=r"GRU.to_torch needs torch: pip install torch"):
        layer.to_torch()
    with pytest.raises(sn.UnsupportedError, match=r"LSTM.from_torch needs torch"):
        nn().LSTM.from_torch(object())


def test_augru_takes_padded_scores_alone_beside_a_padded_input():
    rng = np.random.default_rng(0)
    layer = sn.nn.AUGRU(3, 4, seed=0)
    X, lengths = rng.standard_normal((2, 5, 3)).astype(np.float32), np.array([5, 2])
    scores = rng.random((2, 5)).astype(np.float32)
    want, _ = layer((X, lengths), (scores, lengths), backend="interpreter")
    for given in (scores, scores[..., None]):
        got, _ = layer((X, lengths), given, backend="interpreter")
        np.testing.assert_array_equal(got, want)
    with pytest.raises(sn.ShapeError, match=r"a padded attention must be \[B, T\] or \[B, T, 1\]"):
        layer((X, lengths), scores[:, :4], backend="interpreter")
