"""A custom stepnet cell inside a PyTorch model, trained by ``torch.optim.Adam``.

The task: sequences of 4 to ``--max-length`` tokens (30 by default) over a
vocabulary of 12: four "digit" tokens 0-3 and eight noise tokens. Every
sequence begins and ends with a digit, with noise between; the label is the
first digit, which must be carried across the whole, variable-length
sequence while the last digit, the most recent input, is a decoy. Guessing
scores 0.25, and so does answering the last digit.

The model is ``torch.nn.Embedding(12, 16)`` -> a gated recurrent cell written
in stepnet's DSL (below: a minimal gated unit with a learned per-unit scale,
not one of stepnet's built-in layers) wrapped by ``stepnet.torch.Module`` ->
``torch.nn.Linear(hidden, 4)`` on each sequence's last state, trained with
cross-entropy. The batch goes to the cell as ``(padded embeddings, lengths)``;
the cell runs each sequence over its own length only (Numba backend) and its
backward is stepnet's pullback, so the gradients reach the embedding through
the cell.

The data are generated from ``--seed``; the test set (2000 sequences) from a
seed of its own. The script prints the training loss every ``--log-every``
steps and the test accuracy at the end, and exits with status 1 if the test
accuracy is below 0.95. It sets ``OMP_WAIT_POLICY=PASSIVE`` unless the
environment sets it (see docs/torch.md: torch and Numba each run an OpenMP
thread pool; with threads spinning between parallel regions a step took 6x
longer on a 2-core machine).

Run it: ``python examples/torch_custom_cell.py`` (``--help`` lists the flags).
"""

import argparse
import os
import sys
import time

# torch's and Numba's OpenMP pools share the cores: threads that sleep when
# idle instead of spinning let each run at full speed (docs/torch.md). It must
# be set before torch is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import stepnet as sn  # noqa: E402
import stepnet.torch  # noqa: E402

TARGET_ACCURACY = 0.95
VOCAB, DIGITS, CLASSES = 12, 4, 4
TEST_SEED, TEST_SIZE = 20_261_126, 2000


def make_batch(rng, batch, max_length):
    """``(tokens [batch, T] int64, lengths [batch], labels [batch])``; past
    each sequence's length the tokens are 0 (never read)."""
    lengths = rng.integers(4, max_length + 1, batch)
    tokens = np.zeros((batch, int(lengths.max())), np.int64)
    first = rng.integers(0, DIGITS, batch)
    last = rng.integers(0, DIGITS, batch)
    for b, n in enumerate(lengths):
        tokens[b, 0] = first[b]
        tokens[b, 1:n - 1] = rng.integers(DIGITS, VOCAB, n - 2)
        tokens[b, n - 1] = last[b]
    labels = first
    return torch.from_numpy(tokens), torch.from_numpy(lengths), torch.from_numpy(labels)


def gated_cell(embed, hidden, seed):
    """The custom cell as a step-net: ``h = (1 - z) * h + z * s * tanh(x Wx +
    (r * h) Uh + b)`` with ``z`` and ``r`` sigmoid gates of ``x`` and ``h``."""
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


class Classifier(torch.nn.Module):
    """Embedding -> the stepnet cell (last state) -> a linear head."""

    def __init__(self, hidden, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.cell = stepnet.torch.Module(gated_cell(16, hidden, seed), output_all_steps=False)
        self.head = torch.nn.Linear(hidden, CLASSES)

    def forward(self, tokens, lengths):
        last = self.cell(x=(self.embed(tokens), lengths))  # [batch, hidden]
        return self.head(last)


def accuracy(model, max_length):
    tokens, lengths, labels = make_batch(np.random.default_rng(TEST_SEED), TEST_SIZE, max_length)
    with torch.no_grad():
        return float((model(tokens, lengths).argmax(1) == labels).float().mean())


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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


def main(argv=None):
    """Train as the flags say; returns the test accuracy."""
    args = parse_args(argv)
    model = Classifier(args.hidden, args.seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    rng = np.random.default_rng(args.seed)
    print(f"remember the first digit: sequences of 4-{args.max_length} tokens, stepnet cell of "
          f"{args.hidden}, batch {args.batch}, {args.steps} Adam steps (lr {args.lr}); guessing "
          f"scores 0.25")
    start, running = time.perf_counter(), []
    for step in range(1, args.steps + 1):
        tokens, lengths, labels = make_batch(rng, args.batch, args.max_length)
        loss = torch.nn.functional.cross_entropy(model(tokens, lengths), labels)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        running.append(loss.item())
        if args.log_every and step % args.log_every == 0:
            print(f"step {step:6d}  loss {np.mean(running):.4f}")
            running = []
    seconds = time.perf_counter() - start
    acc = accuracy(model, args.max_length)
    print(f"trained in {seconds:.1f} s; test accuracy {acc:.3f} on {TEST_SIZE} sequences "
          f"(target >= {TARGET_ACCURACY}: {'met' if acc >= TARGET_ACCURACY else 'NOT met'})")
    return acc


if __name__ == "__main__":
    sys.exit(0 if main() >= TARGET_ACCURACY else 1)
