"""A custom stepnet cell inside a JAX model, trained with Adam under
``jax.jit(jax.value_and_grad(...))``.

The task (``first_digit.py``): remember the first digit of sequences of 4 to
``--max-length`` tokens (30 by default), the last digit a decoy; guessing
scores 0.25.

The model, a pytree of JAX arrays: an embedding table ``[12, 16]`` -> the
gated recurrent cell written in stepnet's DSL (``first_digit.gated_cell``)
as ``stepnet.jax.function(cell, output_all_steps=False)`` -> a linear head on
each sequence's last state, trained with cross-entropy. The batch goes to
the cell as ``(padded embeddings, lengths)``, every batch padded to
``--max-length`` steps so that ``jax.jit`` traces one shape; the cell runs
each sequence over its own length only (Numba backend) and its gradient is
stepnet's pullback, so the gradients reach the embedding through the cell.
Adam and the gradient's clipping by global norm are written out in JAX
(a few lines; no optimizer library needed).

The data are generated from ``--seed``; the test set (2000 sequences) from a
seed of its own. The script prints the training loss every ``--log-every``
steps and the test accuracy at the end, and exits with status 1 if the test
accuracy is below 0.95.

Run it: ``python examples/jax_custom_cell.py`` (``--help`` lists the flags).
"""

import os
import sys

import jax
import numpy as np

import stepnet.jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from first_digit import (CLASSES, TARGET_ACCURACY, TEST_SEED, TEST_SIZE, VOCAB,  # noqa: E402
                         gated_cell, make_batch, parse_args, train)

jnp = jax.numpy
EMBED = 16


def padded_batch(rng, batch, max_length):
    """``first_digit.make_batch`` with the tokens padded to ``max_length``."""
    tokens, lengths, labels = make_batch(rng, batch, max_length)
    full = np.zeros((batch, max_length), np.int64)
    full[:, :tokens.shape[1]] = tokens
    return full, lengths.astype(np.int32), labels


def build(hidden, seed):
    """``(forward, params)``: ``forward(params, tokens, lengths)`` gives the
    logits ``[batch, 4]``."""
    cell = stepnet.jax.function(gated_cell(EMBED, hidden, seed), output_all_steps=False)
    rng = np.random.default_rng(seed + 1)
    k = 1.0 / np.sqrt(hidden)
    params = {"embed": jnp.asarray(rng.standard_normal((VOCAB, EMBED)).astype(np.float32)),
              "cell": cell.params,
              "head_w": jnp.asarray(rng.uniform(-k, k, (hidden, CLASSES)).astype(np.float32)),
              "head_b": jnp.zeros(CLASSES, jnp.float32)}

    def forward(params, tokens, lengths):
        last = cell(params["cell"], x=(params["embed"][tokens], lengths))  # [batch, hidden]
        return last @ params["head_w"] + params["head_b"]

    return forward, params


def adam(lr, b1=0.9, b2=0.999, eps=1e-8, clip=1.0):
    """``(init, update)`` of Adam on a pytree, the gradient clipped to a
    global norm of ``clip`` first (as torch's ``clip_grad_norm_``)."""
    def init(params):
        zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
        return zeros, zeros, jnp.zeros((), jnp.float32)

    def update(grads, state, params):
        m, v, t = state
        norm = jnp.sqrt(sum(jnp.sum(g ** 2) for g in jax.tree_util.tree_leaves(grads)))
        grads = jax.tree_util.tree_map(lambda g: g * jnp.minimum(1.0, clip / (norm + 1e-6)), grads)
        t += 1
        m = jax.tree_util.tree_map(lambda m, g: b1 * m + (1 - b1) * g, m, grads)
        v = jax.tree_util.tree_map(lambda v, g: b2 * v + (1 - b2) * g * g, v, grads)
        scale = lr * jnp.sqrt(1 - b2 ** t) / (1 - b1 ** t)
        params = jax.tree_util.tree_map(lambda p, m, v: p - scale * m / (jnp.sqrt(v) + eps),
                                        params, m, v)
        return params, (m, v, t)

    return init, jax.jit(update)


def main(argv=None):
    """Train as the flags say; returns the test accuracy."""
    args = parse_args(argv, __doc__.split("\n\n")[0])
    forward, params = build(args.hidden, args.seed)

    def loss(params, tokens, lengths, labels):
        logits = forward(params, tokens, lengths)
        return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(labels.shape[0]), labels])

    value_and_grad = jax.jit(jax.value_and_grad(loss))
    init, update = adam(args.lr)
    state = init(params)

    def step(rng):
        nonlocal params, state
        value, grads = value_and_grad(params, *padded_batch(rng, args.batch, args.max_length))
        params, state = update(grads, state, params)
        return float(value)

    def test_accuracy():
        tokens, lengths, labels = padded_batch(np.random.default_rng(TEST_SEED), TEST_SIZE,
                                               args.max_length)
        return float(np.mean(np.asarray(forward(params, tokens, lengths)).argmax(1) == labels))

    return train(args, "inside JAX", step, test_accuracy)


if __name__ == "__main__":
    sys.exit(0 if main() >= TARGET_ACCURACY else 1)
