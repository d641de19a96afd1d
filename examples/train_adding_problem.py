"""Train a GRU on the adding problem (Hochreiter & Schmidhuber, 1997).

Each sequence has ``--length`` steps (100 by default) of two features: a value
drawn uniformly from [0, 1] and a marker, 1 at exactly two steps (one in the
first half of the sequence, one in the second) and 0 elsewhere. The target is
the sum of the two marked values. Always answering the mean, 1, scores a mean
squared error of Var(sum) = 2/12 = 0.167; solving the task means carrying the
first marked value across up to ``length`` steps.

Model: ``stepnet.nn.GRU(2, hidden)`` and a linear readout of its last hidden
state ``h_n``. The readout and the loss are NumPy with their gradients written
out; the GRU's gradients come from ``sn.vjp``, which runs the forward once and
returns a pullback taking ``[dY, dh_n]``. Adam updates every Parameter in place,
after the gradients are clipped to a joint norm of 1.

The data are generated here from ``--seed``; the test set (1000 sequences) from
a seed of its own, so it is the same whatever the training flags. The script
prints the training loss every ``--log-every`` steps and the test MSE at the
end, and exits with status 1 if the test MSE is not below 0.01.

Run it: ``python examples/train_adding_problem.py`` (``--help`` lists the flags).
"""

import argparse
import sys
import time

import numpy as np

import stepnet as sn
from stepnet.optim import Adam, clip_grad_norm, train

TARGET_MSE = 0.01
TEST_SEED, TEST_SIZE = 20_231_124, 1000


def adding_batch(rng, batch, length):
    """``X [batch, length, 2]`` (value, marker) and the targets ``y [batch, 1]``."""
    values = rng.uniform(0.0, 1.0, (batch, length)).astype(np.float32)
    markers = np.zeros((batch, length), np.float32)
    rows = np.arange(batch)
    markers[rows, rng.integers(0, length // 2, batch)] = 1.0
    markers[rows, rng.integers(length // 2, length, batch)] = 1.0
    X = np.stack([values, markers], axis=-1)
    y = (values * markers).sum(axis=1, keepdims=True)
    return X, y


class AddingModel:
    """A GRU and a linear readout ``y = h_n @ w + b`` of its last state."""

    def __init__(self, hidden, seed, backend):
        self.gru = sn.nn.GRU(2, hidden, seed=seed)
        k = 1.0 / np.sqrt(hidden)  # PyTorch's nn.Linear initialization
        rng = np.random.default_rng(seed + 1)
        self.w = sn.Parameter(rng.uniform(-k, k, (hidden, 1)).astype(np.float32), name="readout_w")
        self.b = sn.Parameter(rng.uniform(-k, k, (1,)).astype(np.float32), name="readout_b")
        self.backend = backend

    def parameters(self):
        return self.gru.parameters() + [self.w, self.b]

    @staticmethod
    def _input(X):
        return X, np.full(len(X), X.shape[1])  # (padded, lengths): every sequence is full

    def predict(self, X):
        _, h_n = self.gru(self._input(X), backend=self.backend)
        return h_n[0] @ self.w.value + self.b.value

    def error_sums(self, batch):
        """The sum of squared errors over a batch, its gradients with respect
        to every parameter, and the number of examples: what each worker of a
        data-parallel step computes on its shard."""
        X, y = batch
        (_, h_n), pullback = sn.vjp(self.gru, self._input(X), backend=self.backend)
        h = h_n[0]  # [B, H]: one layer, one direction
        err = h @ self.w.value + self.b.value - y
        dpred = 2.0 * err  # d sum(err^2) / d prediction
        dh_n = (dpred @ self.w.value.T)[None]  # shaped like h_n: [1, B, H]
        grads = list(pullback([None, dh_n], wrt=self.gru.parameters()))
        grads += [h.T @ dpred, dpred.sum(axis=0)]
        return float(np.sum(err ** 2)), grads, err.size

    def loss_and_grads(self, batch):
        """Mean squared error of a batch and the clipped gradients of every parameter."""
        loss, grads, count = self.error_sums(batch)
        return mean_and_clip(loss / count, [g / count for g in grads])


def mean_and_clip(loss, grads):
    clip_grad_norm(grads, 1.0)
    return loss, grads


def error_sums(model, shard):
    """``AddingModel.error_sums`` as a function, for stepnet.distributed."""
    return model.error_sums(shard)


def test_mse(model, length):
    X, y = adding_batch(np.random.default_rng(TEST_SEED), TEST_SIZE, length)
    return float(np.mean((model.predict(X) - y) ** 2))


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=100, help="steps per sequence (default 100)")
    parser.add_argument("--steps", type=int, default=800, help="training steps (default 800)")
    parser.add_argument("--batch", type=int, default=32, help="sequences per step (default 32)")
    parser.add_argument("--hidden", type=int, default=16, help="GRU hidden size (default 16)")
    parser.add_argument("--lr", type=float, default=0.01, help="Adam learning rate (default 0.01)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and training data")
    parser.add_argument("--backend", default=None, help="stepnet backend (default: numba)")
    parser.add_argument("--log-every", type=int, default=50, help="print the loss every N steps")
    parser.add_argument("--workers", type=int, default=0,
                        help="data-parallel on N local Dask workers (default 0: this process)")
    args = parser.parse_args(argv)
    if args.length < 2:
        parser.error("--length must be at least 2 (one marker in each half)")
    return args


def main(argv=None):
    """Train as the flags say; returns the final test MSE."""
    args = parse_args(argv)
    model = AddingModel(args.hidden, args.seed, args.backend)
    optimizer = Adam(model.parameters(), lr=args.lr)
    rng = np.random.default_rng(args.seed)
    batches = (adding_batch(rng, args.batch, args.length) for _ in range(args.steps))
    print(f"adding problem: length {args.length}, GRU hidden {args.hidden}, batch {args.batch}, "
          f"{args.steps} Adam steps (lr {args.lr}); predicting the mean scores 0.167")
    start = time.perf_counter()
    if args.workers:
        from stepnet import distributed

        with distributed.local_client(args.workers) as client:
            parallel = distributed.data_parallel(model, error_sums, client)
            train(lambda batch: mean_and_clip(*parallel(batch)), optimizer, batches,
                  log_every=args.log_every)
    else:
        train(model.loss_and_grads, optimizer, batches, log_every=args.log_every)
    seconds = time.perf_counter() - start
    mse = test_mse(model, args.length)
    print(f"trained in {seconds:.1f} s; test MSE {mse:.5f} on {TEST_SIZE} sequences "
          f"(target < {TARGET_MSE}: {'met' if mse < TARGET_MSE else 'NOT met'})")
    return mse


if __name__ == "__main__":
    sys.exit(0 if main() < TARGET_MSE else 1)
