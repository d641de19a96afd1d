"""YAML networks: each example equals the same network written in the Python
DSL (same IR, bit-identical outputs), the expression language, initializers,
and every error class (file, line and key in the message)."""

import textwrap
from pathlib import Path

import numpy as np
import pytest

import stepnet as sn
from conftest import assert_close, available_backends
from stepnet.yaml.expressions import FUNCTIONS

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def _data(x):
    return x.data if isinstance(x, sn.LoDTensor) else x


def assert_identical(actual, expected, what):
    if isinstance(expected, sn.LoDTensor):
        assert isinstance(actual, sn.LoDTensor), what
        assert actual.lod == expected.lod, what
    a, e = _data(actual), _data(expected)
    assert a.dtype == e.dtype and a.shape == e.shape, what
    assert np.array_equal(a, e), f"{what}: max difference {np.abs(a - e).max()}"


def write(tmp_path, text, name="model.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return path


# ----------------------------------------------------------------------------
# the examples against the same networks in the Python DSL


def char_gru_dsl(P, chars):
    rnn = sn.create_rnn_op(output_num=2, name="gru")
    with rnn.stepnet():
        x = rnn.add_input(chars, name="x")
        h = rnn.add_memory(shape=[64], name="h")
        hp = h.pre_state()
        r = sn.ops.sigmoid(x @ P["W_r"] + hp @ P["U_r"] + P["b_r"])
        z = sn.ops.sigmoid(x @ P["W_z"] + hp @ P["U_z"] + P["b_z"])
        n = sn.ops.tanh(x @ P["W_n"] + P["b_n"] + r * (hp @ P["U_n"] + P["b_hn"]))
        h.update((1 - z) * n + z * hp)
        logits = h @ P["W_out"] + P["b_out"]
        log_probs = logits - sn.ops.log(sn.ops.sum(sn.ops.exp(logits), axis=-1, keepdims=True))
        rnn.add_outputs(log_probs, h)
    return rnn


def hierarchical_dsl(P, chapters, chapter_init):
    top = sn.create_rnn_op(output_num=3, name="top")
    with top.stepnet():
        paragraph = top.add_input(chapters, name="paragraph")
        chapter = top.add_memory(init=chapter_init, shape=[8], name="chapter")
        low = sn.create_rnn_op(output_num=1, name="low")
        with low.stepnet():
            sentence = low.add_input(paragraph, name="sentence")
            h = low.add_memory(init=chapter.pre_state(), name="h")
            h.update(sn.ops.tanh(sentence @ P["W"] + h.pre_state() @ P["U"]))
            low.add_outputs(h)
        summary = low(output_all_steps=False)
        sentence_states = low()
        chapter.update(sn.ops.tanh(summary @ P["W0"] + chapter.pre_state() @ P["U0"] + P["b0"]))
        top.add_outputs(chapter, sentence_states, summary)
    return top


def custom_cell_dsl(P, x):
    rnn = sn.create_rnn_op(output_num=1, name="mgu")
    with rnn.stepnet():
        xt = rnn.add_input(x, name="xt")
        h = rnn.add_memory(shape=[32], name="h")
        f = sn.ops.sigmoid(sn.ops.add(sn.ops.add(sn.ops.matmul(xt, P["W_f"]),
                                                 sn.ops.matmul(h.pre_state(), P["U_f"])), P["b_f"]))
        c = sn.ops.tanh(xt @ P["W_c"] + (f * h.pre_state()) @ P["U_c"] + P["b_c"])
        m = (1 - f) * h.pre_state() + f * c
        h.update(sn.ops.sigmoid(P["d"]) * m)
        rnn.add_outputs(h)
    return rnn


def test_char_gru_equals_dsl_on_interpreter_and_numba():
    model = sn.load_yaml(EXAMPLES / "char_gru.yaml")
    feeds = model.random_feeds(seed=3, num_sequences=3, max_length=5)
    rnn = char_gru_dsl(model.parameters, feeds["chars"])
    assert rnn.ir() == model.nets["gru"].ir()
    for backend in ("interpreter", "numba"):
        out = model(feeds, backend=backend)
        all_steps = rnn(backend=backend)
        last = rnn(output_all_steps=False, backend=backend)
        assert_identical(out["log_probs"], all_steps[0], f"{backend} log_probs")
        assert_identical(out["final_state"], last[1], f"{backend} final_state")
    # one-hot random characters; log-probabilities sum to one
    assert np.array_equal(feeds["chars"].data.sum(axis=1), np.ones(feeds["chars"].shape[0]))
    np.testing.assert_allclose(np.exp(out["log_probs"].data).sum(axis=1), 1.0, rtol=1e-5)


def test_hierarchical_equals_dsl():
    model = sn.load_yaml(EXAMPLES / "hierarchical.yaml")
    feeds = model.random_feeds(seed=5)
    top = hierarchical_dsl(model.parameters, feeds["chapters"], feeds["chapter_init"])
    assert top.ir() == model.nets["top"].ir()
    out = model(feeds, backend="interpreter")
    all_steps = top(backend="interpreter")
    last = top(output_all_steps=False, backend="interpreter")
    assert_identical(out["chapter_state"], all_steps[0], "chapter_state")
    assert_identical(out["final_chapter_state"], last[0], "final_chapter_state")
    assert_identical(out["sentence_states"], all_steps[1], "sentence_states")
    assert_identical(out["paragraph_summary"], all_steps[2], "paragraph_summary")
    assert out["sentence_states"].lod == feeds["chapters"].lod


def test_hierarchical_attention_on_every_cpu_backend():
    """The word attention over a nested net's every step: the numba kernel
    as the interpreter, each sentence's word weights summing to one, and
    the gradients of the document states on both."""
    model = sn.load_yaml(EXAMPLES / "hierarchical_attention.yaml")
    feeds = model.random_feeds(seed=6, num_sequences=4, max_length=5)
    expected = model(feeds, backend="interpreter")
    weights = expected["word_weights"]
    assert weights.lod == feeds["documents"].lod
    words = weights.lod[1]
    sums = [weights.data[a:b, 0].sum() for a, b in zip(words[:-1], words[1:]) if b > a]
    assert len(sums) > 3
    np.testing.assert_allclose(sums, 1.0, rtol=1e-5)
    for backend in available_backends():
        found = model(feeds, backend=backend)
        for name, value in expected.items():
            assert_close(found[name], value, what=f"{name}, {backend}")
    top = model.nets["top"]
    grads = {}
    for backend in ["interpreter"] + available_backends():
        last = top(output_all_steps=[False, True], backend=backend, sentence=feeds["documents"])[0]
        grads[backend] = sn.gradients(top, wrt=top.parameters(), grad_outputs=[np.ones_like(last), None],
                                      output_all_steps=[False, True], backend=backend,
                                      sentence=feeds["documents"])
    for backend in available_backends():
        assert_close(grads[backend], grads["interpreter"], what=f"gradients, {backend}")


def test_custom_cell_equals_dsl():
    model = sn.load_yaml(EXAMPLES / "custom_cell.yaml")
    feeds = model.random_feeds(seed=2)
    rnn = custom_cell_dsl(model.parameters, feeds["x"])
    assert rnn.ir() == model.nets["mgu"].ir()
    out = model(feeds, backend="interpreter")
    assert_identical(out["states"], rnn(backend="interpreter"), "states")
    assert_identical(out["final"], rnn(output_all_steps=False, backend="interpreter"), "final")
    decay = 1 / (1 + np.exp(-model.parameters["d"].value))
    assert np.all((decay > 0.88) & (decay < 0.99))


def test_attention_decoder_equals_dsl_on_interpreter_and_numba():
    """A ragged memory (a layer's all-steps output as a static input), the
    attention op and a built-in cell called in the step."""
    model = sn.load_yaml(EXAMPLES / "attention_decoder.yaml")
    feeds = model.random_feeds(seed=4, num_sequences=3, max_length=6)
    P, cell, encoder = model.parameters, model.cells["step_cell"], model.layers["encoder"]
    memory = encoder(feeds["source"], backend="interpreter")[0]
    rnn = sn.create_rnn_op(name="decoder_net")
    with rnn.stepnet():
        prev = rnn.add_input(feeds["decoder"], name="prev")
        mem = rnn.add_static_input(memory, name="memory")
        h = rnn.add_memory(shape=[32], name="h")
        context = sn.ops.attention(h.pre_state() @ P["Wq"], mem)
        cell(sn.ops.concat([prev, context], axis=-1), h)
        rnn.add_outputs(sn.ops.concat([h, context], axis=-1) @ P["Wo"] + P["bo"])
    assert rnn.ir() == model.nets["decoder_net"].ir()
    for backend in ("interpreter", "numba"):
        memory = encoder(feeds["source"], backend=backend)[0]
        assert_identical(model(feeds, backend=backend)["logits"],
                         rnn(backend=backend, memory=memory), backend)


def test_cells_are_checked(tmp_path):
    decoder = (EXAMPLES / "attention_decoder.yaml").read_text()
    for text, old, new, message in [
        (decoder, "step_cell(concat([prev, context], axis=-1), h.pre)", "step_cell(prev)",
         r"step_cell is a gru cell, called as step_cell\(x, h\)"),
        (decoder, "    linear_before_reset: true\n\nparameters", "    peephole: true\n\nparameters",
         r"cells.step_cell.peephole.*a gru cell has no option 'peephole'"),
        (decoder, "    input_size: 75", "    input_size: 74",
         r"step_cell.*contracted dimensions differ"),
        (AUGRU_CELL, "interest(x, h.pre, a)", "interest(x, h.pre)",
         r"interest is a augru cell, called as interest\(x, h, a\)"),
        (AUGRU_CELL, "    hidden_size: 6\nparameters", "    hidden_size: 6\n    attention: x\nparameters",
         r"cells.interest.attention: a cell takes no 'attention' key.*interest\(x, h.pre, a\)"),
        (AUGRU_CELL, "sigmoid(h.pre @ q)", "sigmoid(h.pre)",
         r"attention must be one score per sequence"),
    ]:
        assert old in text, old
        with pytest.raises(sn.YAMLError, match=message):
            sn.load_yaml(write(tmp_path, text.replace(old, new)))


def test_model_reruns_on_new_data_and_sizes():
    model = sn.load_yaml(EXAMPLES / "hierarchical.yaml")
    for seed, n in ((1, 1), (2, 6)):
        feeds = model.random_feeds(seed=seed, num_sequences=n)
        out = model(feeds, backend="interpreter")
        assert out["final_chapter_state"].shape == (n, 8)
        top = hierarchical_dsl(model.parameters, feeds["chapters"], feeds["chapter_init"])
        assert_identical(out["final_chapter_state"],
                         top(output_all_steps=False, backend="interpreter")[0], "rerun")


# ----------------------------------------------------------------------------
# the format: nets fed by nets, statics, inits, reverse, expressions


STACKED = """
inputs:
  tokens: {shape: [5], lod_level: 1}
  context: {shape: [3], lod_level: 0}
parameters:
  Wa: {shape: [5, 4], init: normal, std: 0.5}
  Ua: {shape: [4, 4], init: orthogonal, gain: 0.9}
  Wb: {shape: [4, 4], init: uniform}
  Cb: {shape: [3, 4], init: xavier}
  h0: {shape: [4], init: constant, value: 0.25}
nets:
  enc:
    inputs: {x: tokens}
    memories:
      h: {init: h0}
    step:
      - h = tanh(x @ Wa + h.pre @ Ua)
    outputs: [h]
  dec:
    reverse: true
    inputs: {y: enc.all}
    static_inputs: {ctx: context}
    memories:
      s: {init: enc.last}
    step:
      - gate = sigmoid(ctx @ Cb)
      - both = concat([y, s.pre], axis=-1)
      - left, right = split(both, 2)
      - s = where(left > 0, gate * tanh(left @ Wb), clip(right, lo=-0.5, hi=0.5))
      - part = s[:, 1:3]
    outputs: [s, part]
outputs:
  states: dec.all.s
  part: dec.last.part
  encoded: enc.last
"""


def stacked_dsl(P, tokens, context):
    enc = sn.create_rnn_op(output_num=1, name="enc")
    with enc.stepnet():
        x = enc.add_input(tokens, name="x")
        h = enc.add_memory(init=P["h0"], name="h")
        h.update(sn.ops.tanh(x @ P["Wa"] + h.pre_state() @ P["Ua"]))
        enc.add_outputs(h)
    encoded_all, encoded_last = enc(backend="interpreter"), enc(output_all_steps=False,
                                                                backend="interpreter")
    dec = sn.create_rnn_op(output_num=2, reverse=True, name="dec")
    with dec.stepnet():
        y = dec.add_input(encoded_all, name="y")
        ctx = dec.add_static_input(context, name="ctx")
        s = dec.add_memory(init=encoded_last, shape=[4], name="s")
        gate = sn.ops.sigmoid(ctx @ P["Cb"])
        both = sn.ops.concat([y, s.pre_state()], axis=-1)
        left, right = sn.ops.split(both, 2)
        s.update(sn.ops.where(left > 0, gate * sn.ops.tanh(left @ P["Wb"]),
                              sn.ops.clip(right, lo=-0.5, hi=0.5)))
        part = s[:, 1:3]
        dec.add_outputs(s, part)
    return enc, encoded_last, dec


def test_nets_fed_by_nets_statics_inits_reverse(tmp_path):
    model = sn.load_yaml(write(tmp_path, STACKED))
    feeds = model.random_feeds(seed=4, num_sequences=5)
    enc, encoded_last, dec = stacked_dsl(model.parameters, feeds["tokens"], feeds["context"])
    assert enc.ir() == model.nets["enc"].ir() and dec.ir() == model.nets["dec"].ir()
    out = model(feeds, backend="interpreter")
    assert_identical(out["encoded"], encoded_last, "encoded")
    assert_identical(out["states"], dec(backend="interpreter")[0], "states")
    assert_identical(out["part"], dec(output_all_steps=False, backend="interpreter")[1], "part")
    assert list(out) == ["states", "part", "encoded"]
    assert out["part"].shape == (5, 2)


def test_parameters_initializers_and_files(tmp_path):
    np.savez(tmp_path / "w.npz", emb=np.arange(6.0).reshape(2, 3), V=np.ones((3, 3)))
    path = write(tmp_path, """
        dtype: float64
        inputs:
          x: {shape: [2]}
        parameters:
          E: {from: "w.npz:emb"}
          V: {from: w.npz, shape: [3, 3]}
          Q: {shape: [6, 3], init: orthogonal}
          G: {shape: [40, 50], init: xavier, gain: 2.0}
          N: {shape: [400], init: normal, mean: 3.0, std: 0.5}
          Z: {shape: [3]}
        nets:
          n:
            inputs: {xt: x}
            memories: {h: {shape: [3]}}
            step:
              - h = xt @ E + h.pre @ V + Z
            outputs: [h]
        outputs:
          h: n.all
    """)
    model = sn.load_yaml(path, seed=1)
    P = {k: p.value for k, p in model.parameters.items()}
    assert P["E"].dtype == np.float64 and np.array_equal(P["E"], np.arange(6.0).reshape(2, 3))
    assert np.array_equal(P["V"], np.ones((3, 3))) and not P["Z"].any()
    np.testing.assert_allclose(P["Q"].T @ P["Q"], np.eye(3), atol=1e-12)
    assert np.abs(P["G"]).max() <= 2.0 * np.sqrt(6 / 90) and np.abs(P["G"]).max() > 0.5
    assert abs(P["N"].mean() - 3.0) < 0.1 and abs(P["N"].std() - 0.5) < 0.1
    # the same seed gives the same values; another seed others; each parameter has
    # its own generator, so removing one does not change the rest
    again = sn.load_yaml(path, seed=1)
    assert np.array_equal(again.parameters["Q"].value, P["Q"])
    assert not np.array_equal(sn.load_yaml(path, seed=2).parameters["Q"].value, P["Q"])
    fewer = path.read_text().replace("      G: {shape: [40, 50], init: xavier, gain: 2.0}\n", "")
    assert np.array_equal(sn.load_yaml(write(tmp_path, fewer, "fewer.yaml"), seed=1)
                          .parameters["N"].value, P["N"])
    # overrides by name, from a dict or an .npz file
    np.savez(tmp_path / "override.npz", Z=np.full(3, 7.0))
    for params in ({"Z": np.full(3, 7.0)}, tmp_path / "override.npz"):
        assert np.array_equal(sn.load_yaml(path, params=params).parameters["Z"].value, np.full(3, 7.0))


def test_expressions_never_run_python(tmp_path):
    marker = tmp_path / "ran"
    for body in (f"__import__('pathlib').Path('{marker}').touch()",
                 "x.__class__", "(lambda: 1)()", "[c for c in x]", "x if x else x"):
        path = write(tmp_path, MINIMAL.replace("h = tanh(x @ W + h.pre @ U)", f"y = {body}"))
        with pytest.raises(sn.YAMLError):
            sn.load_yaml(path)
    assert not marker.exists()


def test_every_stepnet_op_is_callable_from_yaml():
    assert {"tanh", "sigmoid", "matmul", "concat", "split", "where", "clip", "mean",
            "hard_sigmoid", "leaky_relu", "softplus"} <= set(FUNCTIONS)
    assert "registry" not in FUNCTIONS


def test_model_call_errors():
    model = sn.load_yaml(EXAMPLES / "hierarchical.yaml")
    feeds = model.random_feeds(seed=0)
    with pytest.raises(sn.StepNetError, match=r"missing input\(s\) \['chapter_init'\]"):
        model({"chapters": feeds["chapters"]})
    with pytest.raises(sn.StepNetError, match="unknown input"):
        model(dict(feeds, extra=1))
    bad = sn.LoDTensor(np.zeros((feeds["chapters"].shape[0], 5), np.float32), feeds["chapters"].lod)
    with pytest.raises(sn.ShapeError, match="input chapters: shape"):
        model(dict(feeds, chapters=bad))
    with pytest.raises(sn.ShapeError, match="has 1 LoD level.*declared lod_level 2"):
        model(dict(feeds, chapters=sn.LoDTensor.from_lengths(np.zeros((2, 16)), [[2]])))
    with pytest.raises(sn.ShapeError,
                       match=r"net top: memory chapter: init of shape \[3, 8\].*chapter <- chapter_init"):
        model(dict(feeds, chapter_init=np.zeros((3, 8), np.float32)))


# ----------------------------------------------------------------------------
# errors: file, line and key


MINIMAL = """
inputs:
  x: {shape: [3]}
parameters:
  W: {shape: [3, 4], init: xavier}
  U: {shape: [4, 4], init: orthogonal}
nets:
  rnn:
    inputs: {x: x}
    memories:
      h: {shape: [4]}
    step:
      - h = tanh(x @ W + h.pre @ U)
    outputs: [h]
outputs:
  out: rnn.all
"""

# (name, text to replace in MINIMAL, replacement, line, key, message fragment)
ERRORS = [
    ("unknown name", "x @ W +", "x @ Wx +", 12, "nets.rnn.step[0]",
     "unknown name 'Wx'"),
    ("unknown function", "tanh(", "tanhh(", 12, "nets.rnn.step[0]",
     "unknown function 'tanhh'; did you mean 'tanh'?"),
    ("unknown op", "- h = tanh(x @ W + h.pre @ U)",
     "- {op: matmull, in: [x, W], out: xw}\n      - h = tanh(xw + h.pre @ U)", 12,
     "nets.rnn.step[0].op", "unknown op 'matmull'; did you mean 'matmul'?"),
    ("shape mismatch", "x @ W +", "x @ U +", 12, "nets.rnn.step[0]", "matmul"),
    ("memory with no update", "h = tanh(x @ W + h.pre @ U)", "y = tanh(x @ W + h.pre @ U)", 10,
     "nets.rnn.memories.h", "memory 'h' is never updated"),
    ("memory updated twice", "    outputs: [h]", "      - h = tanh(h)\n    outputs: [h]", 13,
     "nets.rnn.step[1]", "memory 'h' is updated twice"),
    ("memory read before update", "x @ W + h.pre", "x @ W + h", 12, "nets.rnn.step[0]",
     "use h.pre"),
    ("bad initializer", "init: xavier", "init: glorot", 4, "parameters.W.init",
     "unknown initializer 'glorot'"),
    ("initializer shape", "U: {shape: [4, 4], init: orthogonal}",
     "U: {shape: [4], init: orthogonal}", 5, "parameters.U.init", "orthogonal needs a 2-D shape"),
    ("initializer option", "init: xavier}", "init: xavier, std: 2}", 4, "parameters.W.std",
     "has no option 'std'"),
    ("negative std", "init: xavier}", "init: normal, std: -0.4}", 4, "parameters.W.std",
     "normal needs std >= 0, got std=-0.4"),
    ("infinite option", "init: xavier}", "init: normal, mean: .inf}", 4, "parameters.W.mean",
     "option 'mean' of 'normal' must be a finite number, got inf"),
    ("missing parameter file", "W: {shape: [3, 4], init: xavier}",
     "W: {from: 'nothere.npz:W'}", 4, "parameters.W.from", "cannot read"),
    ("bad YAML", "    memories:\n      h: {shape: [4]}", "    memories:\n      h: {shape: [4]",
     11, "nets.rnn.step", "bad YAML: expected ',' or '}'"),
    ("bad YAML indentation", "    outputs: [h]", "   outputs: [h]", 13, "nets.rnn.outputs",
     "bad YAML"),
    ("duplicate key", "  U: {shape: [4, 4], init: orthogonal}",
     "  U: {shape: [4, 4], init: orthogonal}\n  U: {shape: [4, 4]}", 6, "parameters.U",
     "appears twice"),
    ("boolean key", "  U: {shape: [4, 4], init: orthogonal}",
     "  U: {shape: [4, 4], init: orthogonal}\n  on: {shape: [4]}", 3, "parameters",
     "key True must be a string (YAML reads an unquoted yes, no, on, off"),
    ("unknown key", "    outputs: [h]", "    output: [h]", 13, "nets.rnn.output",
     "did you mean 'outputs'?"),
    ("not allowed", "x @ W +", "x ** W +", 12, "nets.rnn.step[0]", "operator '**' is not allowed"),
    ("unknown step input source", "inputs: {x: x}", "inputs: {x: y}", 8, "nets.rnn.inputs.x",
     "unknown input or net 'y'"),
    ("unknown output", "outputs: [h]", "outputs: [g]", 13, "nets.rnn.outputs[0]",
     "output 'g' is not a value of this step"),
    ("unknown network output", "out: rnn.all", "out: rnn.last.c", 15, "outputs.out",
     "net 'rnn' has no output 'c'"),
    ("bad dtype", "x: {shape: [3]}", "x: {shape: [3], dtype: int32}", 2, "inputs.x.dtype",
     "dtype 'int32' is not supported"),
    ("bad shape", "x: {shape: [3]}", "x: {shape: [three]}", 2, "inputs.x.shape",
     "list of positive integers"),
    ("syntax", "x @ W +", "x @@ W +", 12, "nets.rnn.step[0]", "syntax error"),
    ("wrong arguments", "tanh(x @ W + h.pre @ U)", "tanh(x @ W + h.pre @ U, 2)", 12,
     "nets.rnn.step[0]", "tanh()"),
    ("slice of more axes than the value has", "x @ W +", "x[:, 0:3, 0:1] @ W +", 12,
     "nets.rnn.step[0]", "3 indices for a step value of 2 axes ([B, 3], the batch axis B first)"),
    ("keyword as a name", "  U: {shape: [4, 4], init: orthogonal}",
     "  U: {shape: [4, 4], init: orthogonal}\n  if: {shape: [4]}", 6, "parameters.if",
     "'if' is a Python keyword, which an expression cannot name; choose another name"),
    ("reassigned name", "- h = tanh(x @ W + h.pre @ U)",
     "- a = x @ W\n      - a = a + 1\n      - h = tanh(a + h.pre @ U)", 13, "nets.rnn.step[1]",
     "already defined"),
]


@pytest.mark.parametrize("case", ERRORS, ids=[c[0] for c in ERRORS])
def test_errors_name_file_line_and_key(tmp_path, case):
    _, old, new, line, key, fragment = case
    assert old in MINIMAL
    path = write(tmp_path, MINIMAL.replace(old, new, 1))
    with pytest.raises(sn.YAMLError) as info:
        sn.load_yaml(path)
    message = str(info.value)
    assert message.startswith(f"{path}:{line}: {key}: "), message
    assert fragment in message, message
    assert (info.value.file, info.value.line, info.value.key) == (str(path), line, key)


def test_a_function_of_numbers_alone_is_a_weakly_typed_number(tmp_path):
    """``exp(1)`` in a float32 step is a number, as ``2.718...`` is: the
    values it scales stay float32 (a float64 constant would make them
    float64, and a memory updated so would be refused)."""
    step = "h = tanh(x @ W + h.pre @ U) * tanh(1)\n      - e = h * exp(1) + sum(1)"
    model = sn.load_yaml(write(tmp_path, MINIMAL.replace("h = tanh(x @ W + h.pre @ U)", step)
                               .replace("outputs: [h]", "outputs: [e]")))
    out = model(model.random_feeds(seed=0), backend="interpreter")["out"]
    assert out.data.dtype == np.float32


def test_minimal_model_loads(tmp_path):
    model = sn.load_yaml(write(tmp_path, MINIMAL))
    out = model(model.random_feeds(), backend="interpreter")
    assert out["out"].shape[1:] == (4,)


def test_error_in_nested_net_names_its_key(tmp_path):
    text = (EXAMPLES / "hierarchical.yaml").read_text()
    bad = text.replace("h = tanh(sentence @ W + h.pre @ U)", "h = tanh(sentence @ W0 + h.pre @ U)")
    path = write(tmp_path, bad)
    line = next(i for i, s in enumerate(bad.splitlines(), 1) if "sentence @ W0" in s)
    with pytest.raises(sn.YAMLError) as info:
        sn.load_yaml(path)
    assert str(info.value).startswith(f"{path}:{line}: nets.top.step[0].step[0]: ")
    assert "f32[B,16]" in str(info.value) and "[8,8]" in str(info.value)


def test_parameter_files_at_fault_are_named(tmp_path):
    path = write(tmp_path, MINIMAL)
    with pytest.raises(sn.YAMLError) as info:
        sn.load_yaml(path, params=tmp_path / "nothere.npz")
    assert str(info.value).startswith(f"{tmp_path / 'nothere.npz'}: cannot read"), str(info.value)
    assert (info.value.file, info.value.line) == (str(tmp_path / "nothere.npz"), None)
    np.savez(tmp_path / "w.npz", X=np.zeros((3, 4), np.float32))
    path = write(tmp_path, MINIMAL.replace("W: {shape: [3, 4], init: xavier}", "W: {from: 'w.npz:W'}"))
    with pytest.raises(sn.YAMLError) as info:
        sn.load_yaml(path)
    assert str(info.value) == f"{path}:4: parameters.W.from: w.npz has no array 'W' (it has X)"


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(sn.YAMLError, match=r"nothere.yaml:1: \(document\): cannot read"):
        sn.load_yaml(tmp_path / "nothere.yaml")
    with pytest.raises(sn.YAMLError, match="empty"):
        sn.load_yaml(write(tmp_path, "# nothing\n"))
    with pytest.raises(sn.YAMLError, match="nets: a model needs at least one net or layer"):
        sn.load_yaml(write(tmp_path, "inputs: {x: {shape: [2]}}\noutputs: {}\n"))


# ----------------------------------------------------------------------------
# built-in layers (stepnet.nn)


LAYERS = """
inputs:
  x: {shape: [5]}
parameters:
  V: {shape: [12, 3], init: xavier}
layers:
  enc:
    type: gru
    input: x
    hidden_size: 6
    direction: bidirectional_concat
    linear_before_reset: true
  top:
    type: lstm
    input: enc.all
    hidden_size: 4
    num_layers: 2
nets:
  head:
    inputs: {y: enc.all}
    memories: {s: {shape: [3]}}
    step:
      - s = s.pre + y @ V
    outputs: [s]
outputs:
  y: enc.all
  h_n: enc.last
  c_n: top.last.c_n
  s: head.last
"""


def copy_of(layer, cls, **options):
    other = cls(layer.input_size, layer.hidden_size, **options)
    for i in range(layer.num_layers):
        other.set_onnx_weights(i, **layer.onnx_weights(i))
    return other


def test_a_layer_without_biases(tmp_path):
    model = sn.load_yaml(write(tmp_path, LAYERS.replace("num_layers: 2", "num_layers: 2\n    bias: false")))
    lstm = model.layers["top"]
    assert not lstm.bias and not any("b_" in p.name for p in lstm.parameters())


def test_layers_equal_stepnet_nn_and_feed_nets(tmp_path):
    model = sn.load_yaml(write(tmp_path, LAYERS), seed=4)
    feeds = model.random_feeds(seed=1)
    out = model(feeds, backend="interpreter")
    gru = copy_of(model.layers["enc"], sn.nn.GRU, direction="bidirectional_concat",
                  linear_before_reset=True)
    Y, h_n = gru(feeds["x"], backend="interpreter")
    assert_identical(out["y"], Y, "y")
    assert_identical(out["h_n"], h_n, "h_n")
    lstm = copy_of(model.layers["top"], sn.nn.LSTM, num_layers=2)
    _, (_, c_n) = lstm(Y, backend="interpreter")
    assert_identical(out["c_n"], c_n, "c_n")
    head = sn.create_rnn_op(name="head")
    with head.stepnet():
        y = head.add_input(Y, name="y")
        s = head.add_memory(shape=[3], name="s")
        s.update(s.pre_state() + y @ model.parameters["V"])
        head.add_outputs(s)
    assert head.ir() == model.nets["head"].ir()
    assert_identical(out["s"], head(output_all_steps=False, backend="interpreter"), "s")
    assert "layer enc: GRU(5, 6" in model.ir()
    # layer weights can be given by name, like parameters
    name = model.layers["enc"].parameters()[0].name
    value = np.full(model.layers["enc"].parameters()[0].shape, 0.5, np.float32)
    again = sn.load_yaml(write(tmp_path, LAYERS), params={f"enc.{name}": value})
    assert np.array_equal(again.layers["enc"].parameters()[0].value, value)


MGU = """
inputs:
  x: {shape: [5]}
cells:
  step_cell:
    type: mgu
    input_size: 5
    hidden_size: 4
layers:
  enc:
    type: mgu
    input: x
    hidden_size: 4
    direction: reverse
nets:
  stepper:
    inputs: {x: x}
    memories:
      h: {shape: [4]}
    step:
      - h = step_cell(x, h.pre)
    outputs: [h]
outputs:
  y: enc.all
  h_n: enc.last
  stepped: stepper.all
"""


def test_an_mgu_layer_and_cell_are_stepnet_nn_s(tmp_path):
    model = sn.load_yaml(write(tmp_path, MGU), seed=5)
    feeds = model.random_feeds(seed=6)
    out = model(feeds, backend="interpreter")
    layer = copy_of(model.layers["enc"], sn.nn.MGU, direction="reverse")
    Y, h_n = layer(feeds["x"], backend="interpreter")
    assert_identical(out["y"], Y, "y")
    assert_identical(out["h_n"], h_n, "h_n")
    cell = model.cells["step_cell"]
    assert isinstance(cell, sn.nn.MGUCell)
    forward = copy_of(cell, sn.nn.MGU)  # the cell stepped over x is the layer
    assert_identical(out["stepped"], forward(feeds["x"], backend="interpreter")[0], "stepped")
    with pytest.raises(sn.YAMLError, match="a mgu layer has no option 'linear_before_reset'"):
        sn.load_yaml(write(tmp_path, MGU.replace("direction: reverse",
                                                 "linear_before_reset: true")))


AUGRU_LAYER = """
inputs:
  x: {shape: [5]}
  score: {shape: [1], random: uniform}
layers:
  interest:
    type: augru
    input: x
    attention: score
    hidden_size: 6
    linear_before_reset: true
outputs:
  y: interest.all
  h_n: interest.last
"""


AUGRU_CELL = """
inputs:
  x: {shape: [5]}
cells:
  interest:
    type: augru
    input_size: 5
    hidden_size: 6
parameters:
  q: {shape: [6, 1], init: xavier}
nets:
  evolve:
    inputs: {x: x}
    memories:
      h: {shape: [6]}
    step:
      - a = sigmoid(h.pre @ q)
      - h = interest(x, h.pre, a)
    outputs: [h]
outputs:
  states: evolve.all
"""


def test_an_augru_cell_takes_the_score_its_step_computes(tmp_path):
    """``cell(x, h.pre, a)``: the step's own attention score scales the update
    gate, as ``sn.nn.AUGRUCell`` in the DSL (interpreter, bit for bit; Numba)."""
    model = sn.load_yaml(write(tmp_path, AUGRU_CELL), seed=2)
    feeds = model.random_feeds(seed=3, num_sequences=4, max_length=7)
    cell, q = model.cells["interest"], model.parameters["q"]
    assert isinstance(cell, sn.nn.AUGRUCell)
    rnn = sn.create_rnn_op(name="evolve")
    with rnn.stepnet():
        x = rnn.add_input(feeds["x"], name="x")
        h = rnn.add_memory(shape=[6], name="h")
        a = sn.ops.sigmoid(h.pre_state() @ q)
        h.update(cell(x, h.pre_state(), a))
        rnn.add_outputs(h)
    assert rnn.ir() == model.nets["evolve"].ir()
    expected = rnn(backend="interpreter")
    assert_identical(model(feeds, backend="interpreter")["states"], expected, "states")
    got = model(feeds, backend="numba")["states"]
    np.testing.assert_allclose(got.data, expected.data, rtol=1e-5, atol=1e-6)


def test_an_augru_layer_reads_one_attention_score_per_token(tmp_path):
    model = sn.load_yaml(write(tmp_path, AUGRU_LAYER), seed=2)
    feeds = model.random_feeds(seed=3)
    layer = copy_of(model.layers["interest"], sn.nn.AUGRU, linear_before_reset=True)
    Y, h_n = layer(feeds["x"], feeds["score"], backend="interpreter")
    out = model(feeds, backend="interpreter")
    assert_identical(out["y"], Y, "y")
    assert_identical(out["h_n"], h_n, "h_n")
    out = model(feeds, backend="numba")
    assert out["y"].lod == Y.lod
    np.testing.assert_allclose(out["y"].data, Y.data, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out["h_n"], h_n, rtol=1e-5, atol=1e-6)
    # the scores matter: other scores, other states
    other = dict(feeds, score=sn.LoDTensor(1 - feeds["score"].data, feeds["score"].lod))
    assert not np.allclose(model(other, backend="interpreter")["h_n"], h_n)
    # scores of one element per token may also be declared as scalars
    scalar = sn.load_yaml(write(tmp_path, AUGRU_LAYER.replace("{shape: [1], random: uniform}",
                                                              "{shape: [], random: uniform}")),
                          seed=2)
    flat = dict(feeds, score=sn.LoDTensor(feeds["score"].data[:, 0], feeds["score"].lod))
    np.testing.assert_array_equal(scalar(flat, backend="interpreter")["h_n"],
                                  model(feeds, backend="interpreter")["h_n"])


@pytest.mark.parametrize("old, new, key, fragment", [
    ("    attention: score\n", "", "layers.interest", "an augru layer needs 'attention'"),
    ("score: {shape: [1], random: uniform}", "score: {shape: [2]}", "layers.interest.attention",
     "has rows of [2]"),
    ("score: {shape: [1], random: uniform}", "score: {shape: [1], lod_level: 2}",
     "layers.interest.attention", "has 2 LoD level(s), the layer's input 1"),
    ("type: augru", "type: gru", "layers.interest.attention", "a gru layer has no option 'attention'"),
    ("layers:\n  interest:\n    type: augru\n    input: x\n    attention: score\n",
     "layers:\n  first: {type: gru, input: x, hidden_size: 1}\n  interest:\n    type: augru\n"
     "    input: x\n    attention: first.all\n", "layers.interest.attention", "is a layer's output"),
])
def test_augru_layer_errors(tmp_path, old, new, key, fragment):
    assert old in AUGRU_LAYER
    path = write(tmp_path, AUGRU_LAYER.replace(old, new, 1))
    with pytest.raises(sn.YAMLError) as info:
        sn.load_yaml(path)
    assert f": {key}: " in str(info.value) and fragment in str(info.value), str(info.value)
    assert str(info.value).startswith(f"{path}:")


@pytest.mark.parametrize("old, new, line, key, fragment", [
    ("type: gru", "type: gruu", 7, "layers.enc.type", "did you mean 'gru'?"),
    ("linear_before_reset: true", "peephole: true", 11, "layers.enc.peephole",
     "a gru layer has no option 'peephole'"),
    ("inputs: {y: enc.all}", "inputs: {y: enc.last}", 19, "nets.head.inputs.y",
     "it can only be a network output"),
    ("direction: bidirectional_concat", "direction: sideways", 10, "layers.enc.direction",
     "direction 'sideways'"),
    ("input: enc.all", "input: head.all", 14, "layers.top.input", "layers run before nets"),
    ("num_layers: 2", "num_layers: 2\n    bias: nope", 17, "layers.top.bias",
     "bias must be True or False, got 'nope'"),
    ("linear_before_reset: true", 'linear_before_reset: "false"', 11, "layers.enc.linear_before_reset",
     "linear_before_reset must be True or False, got 'false'"),
    ("num_layers: 2", "num_layers: 2\n    proj_size: 4", 17, "layers.top.proj_size",
     "proj_size must lie in [0, hidden_size), got 4"),
    ("num_layers: 2", "num_layers: 2\n    proj_size: 1.5", 17, "layers.top.proj_size",
     "proj_size must be a positive integer, got 1.5"),
    ("num_layers: 2", "num_layers: 2\n    clip: abc", 17, "layers.top.clip",
     "clip must be a number, got 'abc'"),
    ("num_layers: 2", "num_layers: 2\n    activations: tanh", 17, "layers.top.activations",
     "activations must be a list of names, got 'tanh'"),
    ("input: enc.all", "input: x.last", 14, "layers.top.input",
     "'x' is an input: give it by its name (x); .last follows a net or a layer"),
])
def test_layer_errors(tmp_path, old, new, line, key, fragment):
    assert old in LAYERS
    path = write(tmp_path, LAYERS.replace(old, new, 1))
    with pytest.raises(sn.YAMLError) as info:
        sn.load_yaml(path)
    assert str(info.value).startswith(f"{path}:{line}: {key}: "), str(info.value)
    assert fragment in str(info.value)


@pytest.mark.parametrize("terms", [290, 500, 3000])
def test_a_step_expression_nested_too_deep_is_a_yaml_error(tmp_path, terms):
    """A long chain of operators nests one level each: up to
    ``expressions.MAX_DEPTH`` it loads, past it a YAMLError names the file,
    the line and the step (not Python's RecursionError)."""
    text = f"""
inputs:
  x: {{shape: [4], lod_level: 1}}
nets:
  net:
    inputs: {{xt: x}}
    memories:
      h: {{shape: [4]}}
    step:
      - h = tanh({" + ".join(["xt"] * terms)} + h.pre)
    outputs: [h]
outputs:
  states: net.all
"""
    path = write(tmp_path, text)
    if terms < 300:
        sn.load_yaml(path)
        return
    with pytest.raises(sn.YAMLError, match=r"model.yaml:9: nets.net.step\[0\]: .* is nested more "
                       r"than 300 deep"):
        sn.load_yaml(path)
