"""A two-level RNN over chapters -> paragraphs -> sentences.

The model of Paddle's RNNOp design doc (see paddle_design_doc.py), taken
further: the lower RNN reads each paragraph's sentences starting from the
chapter state so far, its last state feeds the chapter state, and the step-net
returns three outputs:

* ``chapter_state``: the chapter's state after each paragraph (all steps: one
  row per paragraph, LoD [chapters]; last step: one row per chapter);
* ``sentence_states``: the lower RNN's state after each sentence, a ragged
  output that carries the LoD of both levels it went through;
* ``paragraph_summary``: the lower RNN's last state for each paragraph.

LoD levels are coarsest first: level 0 groups paragraphs into chapters, level 1
sentences into paragraphs. Empty chapters and paragraphs are legal.

Run it: ``python examples/nested_chapters.py``.
"""

import numpy as np

import stepnet as sn

SENTENCE_DIM, HIDDEN = 16, 8
rng = np.random.default_rng(7)


def random_chapters(paragraphs_per_chapter, max_sentences=5):
    """Random sentence vectors: chapters of the given paragraph counts."""
    sentences = rng.integers(0, max_sentences + 1, size=sum(paragraphs_per_chapter)).tolist()
    data = rng.standard_normal((sum(sentences), SENTENCE_DIM)).astype(np.float32)
    return sn.LoDTensor.from_lengths(data, [paragraphs_per_chapter, sentences])


def weight(*shape):
    return sn.Parameter((rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32))


chapter_data = random_chapters([2, 0, 3, 1])  # chapter 1 has no paragraphs
chapter_init = rng.standard_normal((chapter_data.num_sequences, HIDDEN)).astype(np.float32)
W, U = weight(SENTENCE_DIM, HIDDEN), weight(HIDDEN, HIDDEN)  # lower level
W0, U0 = weight(HIDDEN, HIDDEN), weight(HIDDEN, HIDDEN)  # top level
b0 = sn.Parameter(np.zeros(HIDDEN, np.float32), name="b0")

top_level_rnn = sn.create_rnn_op(output_num=3)
with top_level_rnn.stepnet():
    paragraph = top_level_rnn.add_input(chapter_data, name="chapters")
    chapter = top_level_rnn.add_memory(init=chapter_init, name="chapter")

    low_rnn = sn.create_rnn_op(output_num=1)
    with low_rnn.stepnet():
        sentence = low_rnn.add_input(paragraph, name="sentence")
        # each paragraph starts from the chapter's state before it
        h = low_rnn.add_memory(init=chapter.pre_state(), name="h")
        h.update(sn.ops.tanh(sentence @ W + h.pre_state() @ U))
        low_rnn.add_outputs(h)

    paragraph_summary = low_rnn(output_all_steps=False)  # [paragraphs, HIDDEN]
    sentence_states = low_rnn()  # ragged: every sentence of each paragraph
    chapter.update(sn.ops.tanh(paragraph_summary @ W0 + chapter.pre_state() @ U0 + b0))
    top_level_rnn.add_outputs(chapter, sentence_states, paragraph_summary)


def show(title, outputs):
    print(title)
    for name, value in zip(["chapter_state", "sentence_states", "paragraph_summary"], outputs):
        if isinstance(value, sn.LoDTensor):
            print(f"  {name}: shape {value.data.shape}, lod {value.lod}")
        else:
            print(f"  {name}: shape {value.shape}")


print(f"chapter_data: shape {chapter_data.data.shape}, lod {chapter_data.lod}")
all_steps = top_level_rnn()
show("all steps:", all_steps)
# the sentence states carry the input's whole LoD
assert all_steps[1].lod == chapter_data.lod

last = top_level_rnn(output_all_steps=False)
show("last step (output_all_steps=False):", last)
# an empty chapter keeps its initial state; its paragraph summary is zeros
assert np.array_equal(last[0][1], chapter_init[1]) and not last[2][1].any()

# New data, a different number of chapters: rebind by name, no re-tracing.
more_chapters = random_chapters([1, 4, 0, 2, 2])
more_init = np.zeros((more_chapters.num_sequences, HIDDEN), np.float32)
print(f"rebound chapters: shape {more_chapters.data.shape}, lod {more_chapters.lod}")
show("rebound, last step:",
     top_level_rnn(chapters=more_chapters, chapter=more_init, output_all_steps=False))
