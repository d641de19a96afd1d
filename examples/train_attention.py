"""Train a sequence-to-sequence model with attention: reverse digit strings.

Data. A source is a string of 5 to 30 random digits; its target is the same
digits in reverse order. Reversal needs attention: at output step t the model
must find source position n - 1 - t, and a fixed-size summary of up to 30
digits cannot hold them all.

The model, every piece compiled by stepnet (no padding anywhere: a 5-digit
source costs 5 tokens of work):

* **Encoder**: ``sn.nn.GRU`` reading one-hot digits, bidirectional (its
  all-steps output, ``[tokens, 2H]``, is the memory).
* **Decoder**: a step-net whose step input is the previous target digit
  (teacher forcing; a start symbol first) and whose **static input is the
  encoder's output**, a LoDTensor holding each sentence's own source rows.
  Each step scores its own sentence's rows with the previous state
  (``sn.ops.attention``: a softmax over that sentence's rows only), feeds the
  context and the input digit to a built-in GRU cell (``sn.nn.GRUCell``, one
  step of a GRU inside the block), and gives logits over the 10 digits from
  the new state and the context.

The loss is the mean cross-entropy over every target digit, in NumPy. The
decoder's gradients come from ``sn.gradients`` on the kept workspace, with
respect to its Parameters **and to its static input "M"** (the encoder's
output); that gradient is handed to the encoder layer's pullback. Adam
updates every Parameter.

The script prints the loss every ``--log-every`` steps and, last, the token
accuracy on held-out data (greedy decoding: each step is fed its own
prediction); it exits with status 1 below ``--target`` (0.98). With
``--quantize int8`` (or ``bf16``) it then scores the trained model quantized
by ``sn.quantize`` on the same sentences and prints the change in points.

Run it: ``python examples/train_attention.py`` (``--help`` lists the flags).
"""

import argparse
import copy
import sys
import time

import numpy as np

import stepnet as sn
from stepnet.optim import Adam, clip_grad_norm

DIGITS, START = 10, 10  # the digits 0-9; the decoder's first input is symbol 10
TEST_SEED = 20_261_125


def batch(rng, size, lengths=(5, 30)):
    """``size`` random sources and their reversals: one-hot encoder input,
    one-hot decoder input (start symbol, then the target shifted), targets."""
    n = rng.integers(lengths[0], lengths[1] + 1, size)
    source = [rng.integers(0, DIGITS, k) for k in n]
    target = [s[::-1] for s in source]
    flat_src, flat_tgt = np.concatenate(source), np.concatenate(target)
    shifted = np.concatenate([np.concatenate([[START], t[:-1]]) for t in target])
    enc = sn.LoDTensor.from_lengths(np.eye(DIGITS, dtype=np.float32)[flat_src], [n.tolist()])
    dec = sn.LoDTensor.from_lengths(np.eye(DIGITS + 1, dtype=np.float32)[shifted], [n.tolist()])
    return enc, dec, flat_tgt


class Seq2Seq:
    def __init__(self, hidden, seed):
        rng = np.random.default_rng(seed)
        H, D = hidden, 2 * hidden

        def param(name, *shape, scale=None):
            scale = scale or 1 / np.sqrt(shape[0])
            return sn.Parameter(rng.uniform(-scale, scale, shape).astype(np.float32), name=name)

        self.encoder = sn.nn.GRU(DIGITS, H, direction="bidirectional_concat", seed=seed,
                                 linear_before_reset=True)  # PyTorch's GRU
        self.cell = sn.nn.GRUCell(DIGITS + 1 + D, H, linear_before_reset=True, seed=seed + 1)
        self.params = {"Wq": param("Wq", H, D), "Wo": param("Wo", H + D, DIGITS),
                       "bo": param("bo", DIGITS, scale=0.1)}
        enc, dec, _ = batch(rng, 2)
        self.decoder = self._decoder(H, dec, self.encoder(enc)[0])

    def _decoder(self, H, dec, memory):
        p = self.params
        rnn = sn.create_rnn_op()
        with rnn.stepnet():
            x = rnn.add_input(dec, name="X")
            mem = rnn.add_static_input(memory, name="M")
            h = rnn.add_memory(shape=[H], name="h")
            context = sn.ops.attention(h.pre_state() @ p["Wq"], mem)   # [B, 2H]
            self.cell(sn.ops.concat([x, context], axis=1), h)            # updates h
            logits = sn.ops.concat([h, context], axis=1) @ p["Wo"] + p["bo"]
            rnn.add_outputs(logits)
        return rnn

    def parameters(self):
        return self.decoder_parameters() + self.encoder.parameters()

    def decoder_parameters(self):
        return list(self.params.values()) + self.cell.parameters()

    def train_step(self, enc, dec, target):
        """Loss and one gradient per parameter (as parameters() orders them)."""
        (memory, _), enc_pullback = sn.vjp(self.encoder, enc)
        logits = self.decoder(X=dec, M=memory, keep_workspace=True).data
        z = logits - logits.max(1, keepdims=True)
        prob = np.exp(z)
        prob /= prob.sum(1, keepdims=True)
        rows = np.arange(len(target))
        loss = float(-np.log(prob[rows, target] + 1e-12).mean())
        dlogits = prob
        dlogits[rows, target] -= 1
        dlogits /= len(target)
        *dec_grads, dmemory = sn.gradients(self.decoder, wrt=[*self.decoder_parameters(), "M"],
                                           grad_outputs=[dlogits])
        enc_grads = enc_pullback([dmemory, None], wrt=self.encoder.parameters())
        return loss, dec_grads + enc_grads

    def greedy(self, enc):
        """Each sentence's predicted target, feeding each step its own
        prediction: the decoder runs one step at a time over the batch."""
        memory = self.encoder(enc)[0]
        n = np.diff(enc.levels[0])
        inputs = [[START] for _ in n]
        for t in range(int(n.max())):
            alive = [s for s in range(len(n)) if n[s] > t]
            rows = np.eye(DIGITS + 1, dtype=np.float32)[np.concatenate([inputs[s] for s in alive])]
            dec = sn.LoDTensor.from_lengths(rows, [[t + 1] * len(alive)])
            logits = self.decoder(X=dec, M=memory.select(alive)).data
            last = logits.reshape(len(alive), t + 1, DIGITS)[:, -1].argmax(1)
            for s, d in zip(alive, last):
                inputs[s].append(int(d))
        return [np.array(inputs[s][1:n[s] + 1]) for s in range(len(n))]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=1500, help="training steps")
    ap.add_argument("--batch", type=int, default=64, help="sentences per step")
    ap.add_argument("--hidden", type=int, default=64, help="hidden size H")
    ap.add_argument("--lr", type=float, default=3e-3, help="Adam's learning rate")
    ap.add_argument("--test-size", type=int, default=200, help="held-out sentences")
    ap.add_argument("--log-every", type=int, default=100)
    ap.add_argument("--target", type=float, default=0.98, help="token accuracy to reach")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quantize", choices=("int8", "bf16"),
                    help="also score the trained model quantized (sn.quantize) on the same data")
    args = ap.parse_args(argv)

    model = Seq2Seq(args.hidden, args.seed)
    opt = Adam(model.parameters(), lr=args.lr)
    rng = np.random.default_rng(args.seed)
    start, losses = time.perf_counter(), []
    for step in range(1, args.steps + 1):
        loss, grads = model.train_step(*batch(rng, args.batch))
        clip_grad_norm(grads, 1.0)
        opt.step(grads)
        losses.append(loss)
        if args.log_every and step % args.log_every == 0:
            print(f"step {step:5d}  loss {np.mean(losses[-args.log_every:]):.4f}  "
                  f"{time.perf_counter() - start:6.1f} s", flush=True)
    enc, _, target = batch(np.random.default_rng(TEST_SEED), args.test_size)
    accuracy = float(np.mean(np.concatenate(model.greedy(enc)) == target))
    print(f"held-out token accuracy {accuracy:.4f} (target {args.target})")
    if args.quantize:  # the encoder layer and the decoder step-net, quantized
        small = copy.copy(model)
        small.encoder = sn.quantize(model.encoder, args.quantize)
        small.decoder = sn.quantize(model.decoder, args.quantize)
        quantized = float(np.mean(np.concatenate(small.greedy(enc)) == target))
        print(f"held-out token accuracy {quantized:.4f} quantized to {args.quantize} "
              f"({100 * (quantized - accuracy):+.2f} points)")
    return 0 if accuracy >= args.target else 1


if __name__ == "__main__":
    sys.exit(main())
