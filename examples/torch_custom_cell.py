"""A custom stepnet cell inside a PyTorch model, trained by ``torch.optim.Adam``.

The task (``first_digit.py``): remember the first digit of sequences of 4 to
``--max-length`` tokens (30 by default), the last digit a decoy; guessing
scores 0.25.

The model is ``torch.nn.Embedding(12, 16)`` -> a gated recurrent cell written
in stepnet's DSL (``first_digit.gated_cell``: a minimal gated unit with a
learned per-unit scale, not one of stepnet's built-in layers) wrapped by ``stepnet.torch.Module`` ->
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

import os
import sys

# torch's and Numba's OpenMP pools share the cores: threads that sleep when
# idle instead of spinning let each run at full speed (docs/torch.md). It must
# be set before torch is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import stepnet.torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from first_digit import (CLASSES, TARGET_ACCURACY, TEST_SEED, TEST_SIZE, VOCAB,  # noqa: E402
                         gated_cell, parse_args, train)
from first_digit import make_batch as make_arrays  # noqa: E402


def make_batch(rng, batch, max_length):
    """``first_digit.make_batch`` as torch tensors."""
    return tuple(torch.from_numpy(a) for a in make_arrays(rng, batch, max_length))


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


def main(argv=None):
    """Train as the flags say; returns the test accuracy."""
    args = parse_args(argv, __doc__.split("\n\n")[0])
    model = Classifier(args.hidden, args.seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    def step(rng):
        tokens, lengths, labels = make_batch(rng, args.batch, args.max_length)
        loss = torch.nn.functional.cross_entropy(model(tokens, lengths), labels)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return loss.item()

    return train(args, "in PyTorch", step, lambda: accuracy(model, args.max_length))


if __name__ == "__main__":
    sys.exit(0 if main() >= TARGET_ACCURACY else 1)
