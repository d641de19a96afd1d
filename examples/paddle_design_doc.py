"""PaddlePaddle's "RNNOp design" doc (doc/design/ops/rnn.md), in stepnet's DSL.

The doc's two examples, keeping its structure and its names:

1. "Usage in Python": the step-net of ``h_t = U h_{t-1} + W x_t`` with a
   memory that starts at ``a``.
2. "Nested RNN and LoDTensor": a two-level RNN over chapters -> paragraphs ->
   sentences, whose top level returns only its last step.

The doc's code never ran (its ``some_op()`` and ``pd.Variable`` are
placeholders); where it slips, the fix is marked ``DOC FIX`` below.

Run it: ``python examples/paddle_design_doc.py``.
"""

import numpy as np

import stepnet as sn

rng = np.random.default_rng(2017)

# ---------------------------------------------------------------------------
# 1. h_t = U h_{t-1} + W x_t
# ---------------------------------------------------------------------------

# X = some_op()  # x is some operator's output, and is a LoDTensor
# Here: 3 sequences of 4, 0 and 2 steps of 30-dim inputs.
X = sn.LoDTensor.from_lengths(rng.standard_normal((6, 30)).astype(np.float32), [[4, 0, 2]])
# a = some_op()  # the initial memory: one 20-dim row per sequence
a = rng.standard_normal((X.num_sequences, 20)).astype(np.float32)

# declare parameters
# DOC FIX: the doc declares W and U both of shape [20, 30]. U maps the state
# onto itself, so it is square; and we multiply row vectors (`x @ W`, a batch
# of rows at a time), so W is [input, hidden] = [30, 20].
W = sn.Parameter(rng.standard_normal((30, 20)).astype(np.float32) * 0.2, name="W")
U = sn.Parameter(rng.standard_normal((20, 20)).astype(np.float32) * 0.2, name="U")

rnn = sn.create_rnn_op(output_num=1)
with rnn.stepnet():
    x = rnn.add_input(X)
    # declare a memory (rnn's step)
    h = rnn.add_memory(init=a)
    # h.pre_state() means previous memory of rnn
    # DOC FIX: the doc writes `pd.add_two(pd.matmul(W, x) + pd.matmul(U, h.pre_state()))`:
    # add_two of a single argument, and column-vector products. Ours: rows, `x @ W`.
    new_state = x @ W + h.pre_state() @ U
    # update current memory
    h.update(new_state)
    # indicate that h variables in all step scopes should be merged
    rnn.add_outputs(h)

out = rnn()
print(f"out: shape {out.data.shape}, lod {out.lod}")
last = rnn(output_all_steps=False)
print(f"out (last step): shape {last.shape}")
# The empty sequence 1 never steps: its last state is its initial memory.
assert np.array_equal(last[1], a[1])

# ---------------------------------------------------------------------------
# 2. Nested RNN: chapters -> paragraphs -> sentences
# ---------------------------------------------------------------------------

# DOC FIX: W and U above take 30-dim inputs; here the sentences are 128-dim,
# so the lower level gets its own W and U of fitting shapes (the doc reuses
# its [20, 30] ones). W0 and U0 take 20-dim states.
W = sn.Parameter(rng.standard_normal((128, 20)).astype(np.float32) * 0.1, name="W")
U = sn.Parameter(rng.standard_normal((20, 20)).astype(np.float32) * 0.2, name="U")
W0 = sn.Parameter(rng.standard_normal((20, 20)).astype(np.float32) * 0.2, name="W0")
U0 = sn.Parameter(rng.standard_normal((20, 20)).astype(np.float32) * 0.2, name="U0")

# chapter_data is a set of 128-dim vectors, one per sentence.
# DOC FIX: the doc numbers LoD levels finest first ("the first level of LoD is
# sentence, the second level of LoD is chapter"); ours are coarsest first:
# level 0 groups paragraphs into chapters, level 1 sentences into paragraphs.
# 3 chapters of 2, 1 and 3 paragraphs; 6 paragraphs of 3, 1, 2, 0, 4, 2 sentences.
chapter_lengths = [[2, 1, 3], [3, 1, 2, 0, 4, 2]]
chapter_data = sn.LoDTensor.from_lengths(
    rng.standard_normal((12, 128)).astype(np.float32), chapter_lengths
)
# a is output of some op: the top memory's initial value, one row per chapter
a = rng.standard_normal((chapter_data.num_sequences, 20)).astype(np.float32)


def lower_level_rnn(paragraph):
    """An RNN over the sentences of each paragraph."""
    rnn = sn.create_rnn_op(output_num=1)
    with rnn.stepnet():
        # DOC FIX: no `level=0`; add_input steps over the coarsest level of what
        # it is given, here the sentences of one paragraph.
        sentence = rnn.add_input(paragraph)
        # DOC FIX: the doc's memory shape [20, 30] is a weight's shape; the
        # state of one paragraph is a 20-dim row.
        h = rnn.add_memory(shape=[20])
        h.update(sentence @ W + h.pre_state() @ U)
        # get the last state as sentence's info
        rnn.add_outputs(h)
    return rnn


top_level_rnn = sn.create_rnn_op(output_num=1)
with top_level_rnn.stepnet():
    # DOC FIX: the doc writes `rnn.add_input(chapter_data, level=1)` here: `rnn`
    # is a typo for top_level_rnn, and `level=` is not needed (the top level
    # steps over paragraphs, the coarsest level below the chapters).
    paragraph_data = top_level_rnn.add_input(chapter_data)
    low_rnn = lower_level_rnn(paragraph_data)
    # DOC FIX: the doc computes paragraph_out and never uses it, then
    # multiplies W0 with the ragged paragraph_data. The paragraph's summary is
    # the lower RNN's last state, and that is what feeds the top memory.
    paragraph_out = low_rnn(output_all_steps=False)

    h = top_level_rnn.add_memory(init=a)
    h.update(paragraph_out @ W0 + h.pre_state() @ U0)
    top_level_rnn.add_outputs(h)

# just output the last step
chapter_out = top_level_rnn(output_all_steps=False)
print(f"chapter_out: shape {chapter_out.shape}")
all_paragraphs = top_level_rnn()
print(f"chapter_out (all steps): shape {all_paragraphs.data.shape}, lod {all_paragraphs.lod}")
