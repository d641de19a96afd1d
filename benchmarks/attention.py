"""One training step of an attention seq2seq model: stepnet (no padding)
against the same model in PyTorch (padded batch, masked attention), on the
same data, in one run.

    python benchmarks/attention.py                    # B=64, sources of 5-30 digits, H=64
    python benchmarks/attention.py --quick            # tiny sizes: a smoke test
    python benchmarks/attention.py --batch 128 --max-length 60 --steps 30

The model is examples/train_attention.py's: a bidirectional GRU encoder, a
decoder whose every step attends (dot-product) over its sentence's encoder
states, feeds the context and the previous digit to a GRU cell
(``sn.nn.GRUCell``; ``torch.nn.GRUCell`` with the same weights) and gives
logits; the loss is the mean cross-entropy over the target digits (reversed
sources). A training step is the forward, the gradients of every parameter,
the gradient-norm clip and an Adam update.

- ``stepnet``: ``Seq2Seq.train_step`` of the example (Numba backend): the
  encoder layer, the decoder step-net with the encoder output as its ragged
  static input; every sentence does its own number of steps over its own
  memory rows.
- ``torch``: the same weights in PyTorch 2 eager, written the usual way:
  the sources packed through ``torch.nn.GRU`` and padded back, the decoder a
  Python loop over the longest target, attention scores over the longest
  source with padded positions masked to -inf, the loss masked.

Each peer runs in a process of its own (``--worker``) with
OMP/MKL/OPENBLAS/NUMBA_NUM_THREADS and torch's intra-op threads set to
``--threads``. Both see the same batches (``--steps`` of them, seeded); the
first step's losses are compared (they must agree to 1e-4). Timing: after
``--warmup`` steps, the median and min over ``--steps`` steps. Printed: the
table, the ratio stepnet / torch, and the share of PyTorch's work that is
padding (decoder steps, and attention scores).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from machine import cpu_name

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--min-length", type=int, default=5)
    ap.add_argument("--max-length", type=int, default=30)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20, help="timed training steps")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="tiny sizes, few steps")
    ap.add_argument("--worker", choices=("stepnet", "torch"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.batch, args.max_length, args.hidden, args.steps, args.warmup = 8, 8, 16, 3, 1
    return args


def _example():
    spec = importlib.util.spec_from_file_location("train_attention",
                                                  ROOT / "examples" / "train_attention.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _batches(example, args):
    import numpy as np
    rng = np.random.default_rng(1)
    return [example.batch(rng, args.batch, (args.min_length, args.max_length))
            for _ in range(args.warmup + args.steps)]


def _time(step, batches, warmup):
    """(first loss, seconds of each timed step)."""
    first = step(batches[0])
    for b in batches[1:warmup]:
        step(b)
    times = []
    for b in batches[warmup:]:
        start = time.perf_counter()
        step(b)
        times.append(time.perf_counter() - start)
    return first, times


def stepnet_worker(args):
    os.environ.setdefault("STEPNET_TIERED", "0")
    from stepnet.optim import Adam, clip_grad_norm
    example = _example()
    model = example.Seq2Seq(args.hidden, seed=0)
    opt = Adam(model.parameters(), lr=1e-3)

    def step(batch):
        loss, grads = model.train_step(*batch)
        clip_grad_norm(grads, 1.0)
        opt.step(grads)
        return loss

    return _time(step, _batches(example, args), args.warmup)


def torch_worker(args):
    import numpy as np
    import torch
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
    torch.set_num_threads(args.threads)
    example = _example()
    model = example.Seq2Seq(args.hidden, seed=0)  # the same initial weights
    encoder, cell = model.encoder.to_torch(), model.cell.to_torch()
    p = torch.nn.ParameterDict({n: torch.nn.Parameter(torch.tensor(v.value))
                                for n, v in model.params.items()})
    params = list(p.values()) + list(cell.parameters()) + list(encoder.parameters())
    opt = torch.optim.Adam(params, lr=1e-3)
    H = args.hidden

    def padded(lod, width):
        """[B, T, width] zero-padded, and the lengths."""
        lengths = np.diff(lod.levels[0])
        out = np.zeros((len(lengths), int(lengths.max()), width), np.float32)
        for s, n in enumerate(lengths):
            out[s, :n] = lod.sequence(s)
        return torch.tensor(out), torch.tensor(lengths)

    def step(batch):
        enc, dec, target = batch
        src, lengths = padded(enc, enc.shape[1])
        inp, _ = padded(dec, dec.shape[1])
        B, T = inp.shape[:2]
        valid = torch.arange(T)[None, :] < lengths[:, None]          # [B, T]
        tgt = torch.zeros(B, T, dtype=torch.long)
        tgt[valid] = torch.tensor(target)
        opt.zero_grad()
        packed = pack_padded_sequence(src.transpose(0, 1), lengths, enforce_sorted=False)
        memory, _ = pad_packed_sequence(encoder(packed)[0])             # [S, B, 2H]
        memory = memory.transpose(0, 1)                                  # [B, S, 2H]
        h, logits = torch.zeros(B, H), []
        for t in range(T):
            scores = (memory @ (h @ p["Wq"])[:, :, None])[:, :, 0]      # [B, S]
            weights = torch.softmax(scores.masked_fill(~valid, float("-inf")), dim=1)
            context = (weights[:, None, :] @ memory)[:, 0]              # [B, 2H]
            h = cell(torch.cat([inp[:, t], context], dim=1), h)
            logits.append(torch.cat([h, context], dim=1) @ p["Wo"] + p["bo"])
        logits = torch.stack(logits, dim=1)                              # [B, T, 10]
        loss = torch.nn.functional.cross_entropy(logits[valid], tgt[valid])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        return float(loss)

    return _time(step, _batches(example, args), args.warmup)


def _padding_share(example, args):
    """Of PyTorch's work on these batches: the share of decoder steps and of
    attention scores that are padding."""
    import numpy as np
    steps = scores = real_steps = real_scores = 0
    for enc, _, _ in _batches(example, args)[args.warmup:]:
        n = np.diff(enc.levels[0])
        steps += len(n) * n.max()
        real_steps += n.sum()
        scores += len(n) * n.max() * n.max()  # each padded step over the longest source
        real_scores += (n * n).sum()          # each real step over its own source
    return 1 - real_steps / steps, 1 - real_scores / scores


def _run_worker(name, args, argv):
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS"):
        env[var] = str(args.threads)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, __file__, *argv, "--worker", name], env=env,
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{name} worker failed:\n{proc.stdout}\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker:
        first, times = (stepnet_worker if args.worker == "stepnet" else torch_worker)(args)
        print(json.dumps({"first_loss": first, "times": times}))
        return 0
    import numpy as np
    results = {name: _run_worker(name, args, argv) for name in ("stepnet", "torch")}
    step_share, score_share = _padding_share(_example(), args)
    print(f"## attention seq2seq, one training step\n\nMachine: {cpu_name()}; "
          f"{args.threads} threads per peer, each in its own process. B={args.batch}, "
          f"sources of {args.min_length}-{args.max_length} digits, H={args.hidden}, "
          f"{args.steps} timed steps after {args.warmup}.\n")
    print("| peer | median ms | min ms | / torch |\n|---|---:|---:|---:|")
    torch_median = float(np.median(results["torch"]["times"]))
    for name, r in results.items():
        median = float(np.median(r["times"]))
        print(f"| {name} | {median * 1e3:.2f} | {min(r['times']) * 1e3:.2f} | "
              f"{median / torch_median:.2f} |")
    a, b = results["stepnet"]["first_loss"], results["torch"]["first_loss"]
    print(f"\nFirst step's loss: stepnet {a:.6f}, torch {b:.6f} (|diff| {abs(a - b):.1e}).")
    print(f"Padding in PyTorch's work: {step_share:.1%} of its decoder steps, "
          f"{score_share:.1%} of its attention scores.")
    if abs(a - b) > 1e-4:
        print("the two models disagree", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
