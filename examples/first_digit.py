"""The task and the cell of the examples that train a custom stepnet cell
inside another framework (``torch_custom_cell.py``, ``jax_custom_cell.py``).

The task: sequences of 4 to ``max_length`` tokens over a vocabulary of 12:
four "digit" tokens 0-3 and eight noise tokens. Every sequence begins and
ends with a digit, with noise between; the label is the first digit, which
must be carried across the whole, variable-length sequence while the last
digit, the most recent input, is a decoy. Guessing scores 0.25, and so does
answering the last digit.

The cell: a gated recurrent unit written in stepnet's DSL (a minimal gated
unit with a learned per-unit scale, not one of stepnet's built-in layers).
"""

import argparse
import time

import numpy as np

import stepnet as sn

VOCAB, DIGITS, CLASSES = 12, 4, 4
TEST_SEED, TEST_SIZE = 20_261_126, 2000
TARGET_ACCURACY = 0.95


def make_batch(rng, batch, max_length):
    """``(tokens [batch, T] int64, lengths [batch], labels [batch])`` as
    arrays; past each sequence's length the tokens are 0 (never read)."""
    lengths = rng.integers(4, max_length + 1, batch)
    tokens = np.zeros((batch, int(lengths.max())), np.int64)
    first = rng.integers(0, DIGITS, batch)
    last = rng.integers(0, DIGITS, batch)
    for b, n in enumerate(lengths):
        tokens[b, 0] = first[b]
        tokens[b, 1:n - 1] = rng.integers(DIGITS, VOCAB, n - 2)
        tokens[b, n - 1] = last[b]
    return tokens, lengths, first


def gated_cell(embed, hidden, seed):
    """The custom cell as a step-net: ``h = (1 - z) * h + z * s * tanh(x Wx +
    (r * h) Uh + b)`` with ``z`` and ``r`` sigmoid gates of ``x`` and ``h``;
    its input ``x``, its output every step's ``h``."""
    rng = np.random.default_rng(seed)
    k = 1.0 / np.sqrt(hidden)

    def param(name, *shape):
        return sn.Parameter(rng.uniform(-k, k, shape).astype(np.float32), name=name)

    Wg, Ug, bg = param("Wg", embed, 2 * hidden), param("Ug", hidden, 2 * hidden), param("bg", 2 * hidden)
    Wx, Uh, b = param("Wx", embed, hidden), param("Uh", hidden, hidden), param("b", hidden)
    s = sn.Parameter(np.ones(hidden, np.float32), name="s")
    example = sn.LoDTensor.from_lengths(np.zeros((1, embed), np.float32), [[1]])
    rnn = sn.create_rnn_op(name="gated")
    with rnn.stepnet():
        x = rnn.add_input(example, name="x")
        h = rnn.add_memory(shape=[hidden], name="h")
        hp = h.pre_state()
        z, r = sn.ops.split(sn.ops.sigmoid(x @ Wg + hp @ Ug + bg), 2, axis=1)
        h.update((1 - z) * hp + z * s * sn.ops.tanh(x @ Wx + (r * hp) @ Uh + b))
        rnn.add_outputs(h)
    return rnn


def parse_args(argv, description):
    """The examples' flags: the task's longest sequence, the training (steps,
    batch, Adam's learning rate), the cell's width, the seed, the logging."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--max-length", type=int, default=30, help="longest sequence (default 30)")
    parser.add_argument("--steps", type=int, default=600, help="training steps (default 600)")
    parser.add_argument("--batch", type=int, default=64, help="sequences per step (default 64)")
    parser.add_argument("--hidden", type=int, default=32, help="the cell's width (default 32)")
    parser.add_argument("--lr", type=float, default=0.01, help="Adam learning rate (default 0.01)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and training data")
    parser.add_argument("--log-every", type=int, default=100, help="print the loss every N steps")
    args = parser.parse_args(argv)
    if args.max_length < 4:
        parser.error("--max-length must be at least 4")
    return args


def train(args, where, step, test_accuracy):
    """The examples' loop: ``args.steps`` calls of ``step(rng)`` (one training
    step on a batch it draws from ``rng``; it returns the step's loss), the
    mean loss printed every ``args.log_every`` steps, then the accuracy on
    the test set (``test_accuracy()``: ``TEST_SIZE`` sequences drawn from
    ``TEST_SEED``) printed against ``TARGET_ACCURACY``; returns it."""
    rng = np.random.default_rng(args.seed)
    print(f"remember the first digit: sequences of 4-{args.max_length} tokens, stepnet cell of "
          f"{args.hidden} {where}, batch {args.batch}, {args.steps} Adam steps (lr {args.lr}); "
          f"guessing scores 0.25")
    start, running = time.perf_counter(), []
    for k in range(1, args.steps + 1):
        running.append(step(rng))
        if args.log_every and k % args.log_every == 0:
            print(f"step {k:6d}  loss {np.mean(running):.4f}")
            running = []
    seconds = time.perf_counter() - start
    acc = test_accuracy()
    print(f"trained in {seconds:.1f} s; test accuracy {acc:.3f} on {TEST_SIZE} sequences "
          f"(target >= {TARGET_ACCURACY}: {'met' if acc >= TARGET_ACCURACY else 'NOT met'})")
    return acc
