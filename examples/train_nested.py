"""Train a hierarchical encoder, words -> sentences -> document, on a task that
needs both levels.

Data. A document is 3 or 5 sentences (equally likely); a sentence is 2 to 6
words (uniformly); a word is one of two symbols, ``a`` or ``b``, drawn
uniformly and independently of everything else. Its label is 1 when **most of
its sentences begin and end with the same word**, e.g. ``[a b a] [b b] [a a b]``
has 2 of 3 such sentences: label 1. The input is a two-level LoDTensor: level 0
groups sentences into documents, level 1 words into sentences; each row is a
word's one-hot vector.

Why one level is not enough.

* The words without the sentence structure (what a flat model over each
  document's word sequence sees) do not say where a sentence begins or ends.
  Whatever model reads them, its accuracy is at most that of the Bayes
  classifier ``P(label | words)``, which this script computes exactly on the
  test set by summing over every way of cutting the words into sentences (a
  small dynamic program; the words are independent of the cuts): about 0.66.
* The sentence structure without the words (how many sentences, how long)
  says nothing: each sentence begins and ends with the same word with
  probability 1/2 whatever its length, so every model scores 0.5.

The model is two GRU cells written in the step-net DSL, one nested in the
other as in README's example: the inner step-net reads a sentence's words, its
last state is the sentence's vector; the outer one reads the sentence vectors,
and a linear readout of its last state gives the label's logit. The loss is
binary cross-entropy, in NumPy with its gradient written out. The step-nets'
gradients come from ``sn.gradients(rnn, wrt=params, grad_outputs=[dlast],
output_all_steps=False)`` on the workspace the forward kept
(``rnn(..., keep_workspace=True)``); Adam updates the Parameters in place.

The script prints the training loss every ``--log-every`` steps, then the test
accuracy next to the word-only bound, and exits with status 1 unless the
accuracy is at least 0.9 and 0.1 above that bound.

Run it: ``python examples/train_nested.py`` (``--help`` lists the flags).
"""

import argparse
import sys
import time

import numpy as np

import stepnet as sn
from stepnet.optim import Adam, train

SENTENCES = (3, 5)  # sentences per document, equally likely (odd: no ties)
WORDS = (2, 6)  # words per sentence, uniform over this closed range
VOCAB = 2
TARGET_ACCURACY, MARGIN = 0.9, 0.1
TEST_SEED, TEST_SIZE = 20_231_125, 1000


def documents(rng, count):
    """``count`` random documents: the LoDTensor of one-hot words and the labels."""
    sentences = rng.choice(SENTENCES, count)
    lengths = rng.integers(WORDS[0], WORDS[1] + 1, sentences.sum())
    words = rng.integers(0, VOCAB, lengths.sum())
    ends = np.cumsum(lengths)
    same = words[ends - lengths] == words[ends - 1]  # per sentence: first word == last word
    doc_of_sentence = np.repeat(np.arange(count), sentences)
    matching = np.bincount(doc_of_sentence, weights=same, minlength=count)
    labels = (2 * matching > sentences).astype(np.float32)
    X = sn.LoDTensor.from_lengths(np.eye(VOCAB, dtype=np.float32)[words],
                                  [sentences.tolist(), lengths.tolist()])
    return X, labels


def word_only_bayes_accuracy(X, labels):
    """The accuracy of the best classifier that sees each document's words but
    not where its sentences begin and end.

    For one document of ``n`` words, ``f[pos][k, m]`` is the probability of
    the cuts of its first ``pos`` words into ``k`` sentences of which ``m``
    begin and end with the same word; the Bayes classifier answers whichever
    label has the larger posterior mass at ``pos = n``."""
    kmax = max(SENTENCES)
    lengths = range(WORDS[0], WORDS[1] + 1)
    p_length = 1.0 / len(lengths)
    words = X.data.argmax(axis=1)
    sentence_offsets, word_offsets = X.lod
    correct = 0
    for d in range(X.num_sequences):
        w = words[word_offsets[sentence_offsets[d]]:word_offsets[sentence_offsets[d + 1]]]
        n = len(w)
        f = np.zeros((n + 1, kmax + 1, kmax + 1))
        f[0, 0, 0] = 1.0
        for pos in range(n):
            if not f[pos].any():
                continue
            for length in lengths:
                end = pos + length
                if end > n:
                    break
                match = int(w[pos] == w[end - 1])
                f[end, 1:, match:] += p_length * f[pos, :-1, :kmax + 1 - match]
        mass = np.zeros(2)  # posterior mass of label 0 and label 1
        for s in SENTENCES:  # each count equally likely a priori
            m = np.arange(kmax + 1)
            mass[1] += f[n, s, 2 * m > s].sum()
            mass[0] += f[n, s, 2 * m < s].sum()
        correct += float(mass.argmax()) == labels[d]
    return correct / X.num_sequences


def gru_cell(x, h, p):
    """PyTorch's GRU equations, written in the DSL."""
    r = sn.ops.sigmoid(x @ p["Wr"] + h @ p["Ur"] + p["br"])
    z = sn.ops.sigmoid(x @ p["Wz"] + h @ p["Uz"] + p["bz"])
    n = sn.ops.tanh(x @ p["Wn"] + p["bn"] + r * (h @ p["Un"] + p["bhn"]))
    return (1 - z) * n + z * h


def gru_parameters(rng, inputs, hidden, prefix):
    k = 1.0 / np.sqrt(hidden)  # PyTorch's initialization

    def draw(*shape):
        return rng.uniform(-k, k, shape).astype(np.float32)

    shapes = {"W": (inputs, hidden), "U": (hidden, hidden), "b": (hidden,)}
    p = {f"{kind}{g}": sn.Parameter(draw(*shape), name=f"{prefix}_{kind}{g}")
         for kind, shape in shapes.items() for g in "rzn"}
    p["bhn"] = sn.Parameter(draw(hidden), name=f"{prefix}_bhn")
    return p


class HierarchicalEncoder:
    """Words -> sentence vectors (inner step-net) -> document vector (outer
    step-net) -> one logit."""

    def __init__(self, hidden, seed, backend, X):
        rng = np.random.default_rng(seed)
        self.word_cell = gru_parameters(rng, VOCAB, hidden, "word")
        self.sentence_cell = gru_parameters(rng, hidden, hidden, "sentence")
        k = 1.0 / np.sqrt(hidden)
        self.v = sn.Parameter(rng.uniform(-k, k, (hidden, 1)).astype(np.float32), name="readout_v")
        self.c = sn.Parameter(np.zeros(1, np.float32), name="readout_c")
        self.backend = backend

        self.rnn = sn.create_rnn_op(output_num=1)
        with self.rnn.stepnet():
            sentence = self.rnn.add_input(X, name="docs")  # one step: a sentence's words
            doc = self.rnn.add_memory(shape=[hidden], name="doc")
            inner = sn.create_rnn_op(output_num=1)
            with inner.stepnet():
                word = inner.add_input(sentence, name="words")
                h = inner.add_memory(shape=[hidden], name="h")
                h.update(gru_cell(word, h.pre_state(), self.word_cell))
                inner.add_outputs(h)
            doc.update(gru_cell(inner(output_all_steps=False), doc.pre_state(), self.sentence_cell))
            self.rnn.add_outputs(doc)

    def rnn_parameters(self):
        return list(self.word_cell.values()) + list(self.sentence_cell.values())

    def parameters(self):
        return self.rnn_parameters() + [self.v, self.c]

    def logits(self, X, keep_workspace=False):
        last = self.rnn(docs=X, output_all_steps=False, backend=self.backend,
                        keep_workspace=keep_workspace)
        return last, (last @ self.v.value + self.c.value)[:, 0]

    def loss_and_grads(self, batch):
        """Binary cross-entropy of a batch and the gradients of every parameter."""
        X, y = batch
        last, logit = self.logits(X, keep_workspace=True)
        loss = float(np.mean(np.logaddexp(0.0, logit) - y * logit))
        dlogit = ((1.0 / (1.0 + np.exp(-logit)) - y) / len(y))[:, None]  # [B, 1]
        dlast = dlogit @ self.v.value.T
        grads = sn.gradients(self.rnn, wrt=self.rnn_parameters(), grad_outputs=[dlast],
                             output_all_steps=False, backend=self.backend)
        return loss, list(grads) + [last.T @ dlogit, dlogit.sum(axis=0)]

    def accuracy(self, X, labels):
        _, logit = self.logits(X)
        return float(np.mean((logit > 0) == (labels > 0.5)))


FLAGS = {  # flag: (default, meaning)
    "steps": (300, "training steps"),
    "batch": (64, "documents per step"),
    "hidden": (16, "hidden size of both cells"),
    "lr": (0.01, "Adam learning rate"),
    "seed": (0, "seed of the weights and training data"),
    "log-every": (25, "print the loss every N steps"),
}


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for flag, (default, meaning) in FLAGS.items():
        parser.add_argument(f"--{flag}", type=type(default), default=default,
                            help=f"{meaning} (default {default})")
    parser.add_argument("--backend", default=None, help="stepnet backend (default: numba)")
    return parser.parse_args(argv)


def main(argv=None):
    """Train as the flags say; returns ``(test accuracy, word-only bound)``."""
    args = parse_args(argv)
    rng = np.random.default_rng(args.seed)
    X_test, y_test = documents(np.random.default_rng(TEST_SEED), TEST_SIZE)
    bound = word_only_bayes_accuracy(X_test, y_test)
    model = HierarchicalEncoder(args.hidden, args.seed, args.backend, X_test)
    optimizer = Adam(model.parameters(), lr=args.lr)
    batches = (documents(rng, args.batch) for _ in range(args.steps))
    print(f"nested encoder: hidden {args.hidden}, batch {args.batch}, {args.steps} Adam steps "
          f"(lr {args.lr}); label balance on the test set {y_test.mean():.3f}")
    start = time.perf_counter()
    train(model.loss_and_grads, optimizer, batches, log_every=args.log_every)
    seconds = time.perf_counter() - start
    accuracy = model.accuracy(X_test, y_test)
    passed = accuracy >= max(TARGET_ACCURACY, bound + MARGIN)
    print(f"trained in {seconds:.1f} s; test accuracy {accuracy:.3f} on {TEST_SIZE} documents; "
          f"best possible from the words alone {bound:.3f}, from the sentence structure alone 0.5 "
          f"({'beaten' if passed else 'NOT beaten clearly'})")
    return accuracy, bound


if __name__ == "__main__":
    accuracy, bound = main()
    sys.exit(0 if accuracy >= max(TARGET_ACCURACY, bound + MARGIN) else 1)
