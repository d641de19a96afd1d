"""W5's custom cell trained inside PyTorch: through ``stepnet.torch`` against
the same cell as a PyTorch eager loop and under ``torch.compile``, one process,
one run.

    python benchmarks/torch_bridge.py                  # W5's size: T=100, B=64, I=128, H=256
    python benchmarks/torch_bridge.py --quick --compile none     # tiny sizes: a smoke test
    python benchmarks/torch_bridge.py --rounds 9 --threads 1 --compile cell

A training step is ``opt.zero_grad(); Y, h = model(x); backward((Y, h), (dY,
dh)); opt.step()`` with ``torch.optim.Adam``: W5's cell (benchmarks/workloads.py)
over every step of every sequence, ``Y`` every step's state, ``h`` the last,
``dY`` and ``dh`` fixed ``N(0, 1)`` upstream gradients (as W8's). The peers:

- ``stepnet.torch``: W5's step-net in ``stepnet.torch.Module`` (Numba backend),
  input ``(x [B, T, I], lengths)``;
- ``torch eager``: the same cell as a ``torch.nn.Module``, its input
  projections hoisted into one ``addmm`` before the loop (as benchmarks/peers.py's
  W5 peer), the loop over time in Python;
- ``torch.compile (cell)``: that module's step compiled, the loop in Python;
- ``torch.compile (loop)``: the whole forward compiled (the loop unrolled).

Every model starts from W5's weights; the first step's gradients of each are
checked against a float64 autograd run of the eager model. Timing: after a
warm-up, ``--rounds`` rounds, the models in a shuffled order each round, each
timed over a block of ``--calls`` steps; the median and min are over every
timed step.

The bridge's own overhead is measured inside the bridge's steps: the time of
its forward and backward minus the time spent in stepnet's ``vjp`` and
pullback (what is left: converting tensors to arrays and back, copies, the
autograd node), as a share of the whole step. The figure ``stepnet alone``
is the same forward and backward called on arrays, without torch.

Thread pools: OMP/MKL/OPENBLAS/NUMBA_NUM_THREADS and torch's intra-op threads
are set to ``--threads`` before torch or Numba start, and OMP_WAIT_POLICY to
``--omp-wait-policy`` (``passive`` by default; ``unset`` leaves the
environment's). torch and Numba each bring their own OpenMP runtime (torch's
bundled libgomp, the system's for Numba's ``omp`` layer); with libgomp's
default policy a pool's threads spin for a while after each parallel region,
taking the cores from the other pool's next region (docs/torch.md).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

from machine import cpu_name

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
COMPILE_CHOICES = ("both", "cell", "loop", "none")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=3, help="timed steps per block")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compile", choices=COMPILE_CHOICES, default="both",
                    help="which torch.compile peers to run (the whole loop takes minutes "
                         "to compile)")
    ap.add_argument("--omp-wait-policy", choices=("passive", "active", "unset"), default="passive",
                    help="OMP_WAIT_POLICY for both OpenMP runtimes (default passive)")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    if args.omp_wait_policy != "unset":
        os.environ["OMP_WAIT_POLICY"] = args.omp_wait_policy.upper()
    os.environ["STEPNET_TIERED"] = "0"  # time the compiled kernels, never the interpreter tier
    import torch  # before Numba starts its thread pool

    torch.set_num_threads(args.threads)
    import numpy as np

    for p in (str(HERE), str(ROOT)):
        if p not in sys.path:
            sys.path.insert(0, p)
    import peers
    import workloads

    import stepnet as sn
    import stepnet.pullback
    import stepnet.torch
    import stepnet.torch_autograd

    wl = workloads.make("W5", quick=args.quick)
    T, B, I, H = (wl.dims[k] for k in "TBIH")
    rng = np.random.default_rng(3005)
    dY = rng.standard_normal((B, T, H)).astype(np.float32)
    dh = rng.standard_normal((B, H)).astype(np.float32)

    # -- the models -----------------------------------------------------------------
    w5_rnn = peers.sn_custom_rnn(sn, wl, last_too=True)[0]
    bridge = stepnet.torch.Module(w5_rnn, output_all_steps=(True, False))
    x_bf = torch.from_numpy(wl.x)  # [B, T, I]
    lengths = torch.from_numpy(wl.lengths)
    up_bf = (torch.from_numpy(dY), torch.from_numpy(dh))

    Cell = w5_torch_module(torch)
    x_tm = torch.from_numpy(wl.x_time_major())  # [T, B, I]
    up_tm = (torch.from_numpy(np.ascontiguousarray(dY.transpose(1, 0, 2))), up_bf[1])

    models = {"stepnet.torch": (bridge, lambda m: m(x=(x_bf, lengths)), up_bf)}
    eager = Cell(wl.weights)
    models["torch eager"] = (eager, lambda m: m(x_tm), up_tm)
    if args.compile in ("cell", "both"):
        cell_model = Cell(wl.weights)
        cell_model.step = torch.compile(cell_model.step)
        models["torch.compile (cell)"] = (cell_model, lambda m: m(x_tm), up_tm)
    if args.compile in ("loop", "both"):
        loop_model = Cell(wl.weights)
        whole = torch.compile(loop_model)
        models["torch.compile (loop)"] = (loop_model, lambda m: whole(x_tm), up_tm)

    # -- the gradients of the first step, against float64 autograd ----------------------
    reference = Cell(wl.weights, torch.float64)
    y, h = reference(x_tm.double())
    torch.autograd.backward((y, h), tuple(u.double() for u in up_tm))
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}
    errors, setup = {}, {}
    for name, (model, call, up) in models.items():
        t0 = time.perf_counter()
        model.zero_grad(set_to_none=True)
        y, h = call(model)
        torch.autograd.backward((y, h), up)
        setup[name] = time.perf_counter() - t0
        errors[name] = max(
            float((p.grad.double() - ref_grads[n]).abs().max() / ref_grads[n].abs().max())
            for n, p in model.named_parameters())

    # -- timing ----------------------------------------------------------------------
    optimizers = {name: torch.optim.Adam(m.parameters(), lr=1e-4) for name, (m, _, _) in
                  models.items()}
    times = {name: [] for name in models}
    spent = {"stepnet": 0.0, "fwd_bwd": 0.0, "steps": 0}

    def step(name, timed_parts=False):
        model, call, up = models[name]
        opt = optimizers[name]
        opt.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        y, h = call(model)
        torch.autograd.backward((y, h), up)
        t1 = time.perf_counter()
        opt.step()
        if timed_parts:
            spent["fwd_bwd"] += t1 - t0
            spent["steps"] += 1

    inner = _StepnetTimer(stepnet.torch_autograd, stepnet.pullback)
    for name in models:
        for _ in range(args.warmup):
            step(name)
    random.seed(args.seed)
    for _ in range(args.rounds):
        order = list(models)
        random.shuffle(order)
        for name in order:
            bridged = name == "stepnet.torch"
            for _ in range(args.calls):
                if bridged:
                    inner.enable()
                t = time.perf_counter()
                step(name, timed_parts=bridged)
                times[name].append(time.perf_counter() - t)
                if bridged:
                    spent["stepnet"] += inner.disable()
    alone = _stepnet_alone(sn, bridge, wl, dY, dh, args)

    # -- report ------------------------------------------------------------------------
    med = {n: float(np.median(ts)) for n, ts in times.items()}
    eager_ms = med["torch eager"] * 1e3
    compiled = [n for n in med if n.startswith("torch.compile")]
    fastest_compile = min(compiled, key=med.get) if compiled else None
    overhead = (spent["fwd_bwd"] - spent["stepnet"]) / spent["steps"]
    share = overhead / med["stepnet.torch"]
    load = os.getloadavg()
    print(f"W5 custom cell, training step (forward, backward, Adam), T={T} B={B} I={I} H={H}, "
          f"float32, {args.threads} thread(s), OMP_WAIT_POLICY="
          f"{os.environ.get('OMP_WAIT_POLICY', 'unset')}")
    print(f"CPU: {cpu_name()} ({os.cpu_count()} logical CPUs; load average {load[0]:.2f} "
          f"{load[1]:.2f} {load[2]:.2f}); torch {torch.__version__}, stepnet "
          f"{sn.__version__}, numpy {np.__version__}")
    print(f"{args.rounds} rounds x {args.calls} steps per model, models shuffled per round\n")
    print("| training step | median ms | min ms | / eager | first step s | max rel. grad error |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in models:
        ts = times[name]
        print(f"| {name} | {med[name] * 1e3:.2f} | {min(ts) * 1e3:.2f} | "
              f"{med[name] * 1e3 / eager_ms:.2f} | {setup[name]:.1f} | {errors[name]:.1e} |")
    print(f"| stepnet alone (sn.vjp + pullback on arrays; no optimizer) | {alone * 1e3:.2f} | | "
          f"{alone * 1e3 / eager_ms:.2f} | | |")
    print()
    ratio = med["stepnet.torch"] / med["torch eager"]
    print(f"stepnet.torch / torch eager: {ratio:.2f} (target <= 0.6: "
          f"{'met' if ratio <= 0.6 else 'missed'})")
    if fastest_compile:
        rc = med["stepnet.torch"] / med[fastest_compile]
        print(f"stepnet.torch / {fastest_compile} (the faster compile): {rc:.2f} (target < 1: "
              f"{'met' if rc < 1 else 'missed'})")
    print(f"bridge overhead (forward + backward outside stepnet's vjp and pullback): "
          f"{overhead * 1e3:.3f} ms per step = {100 * share:.2f} % of the step (target < 3 %: "
          f"{'met' if share < 0.03 else 'missed'})")
    return {"median_s": med, "overhead_share": share, "errors": errors}


def w5_torch_module(torch):
    """W5's cell as a torch module over ``x [T, B, I]``: the four input
    projections as one hoisted ``addmm``, then a Python loop of ``step``."""

    class W5Cell(torch.nn.Module):
        def __init__(self, weights, dtype=torch.float32):
            super().__init__()
            for k, v in weights.items():
                self.register_parameter(k, torch.nn.Parameter(torch.tensor(v, dtype=dtype)))

        def step(self, xt, h):
            H = h.shape[1]
            hu = h @ torch.cat([self.Uz, self.Ur], 1)
            z = torch.sigmoid(xt[:, :H] + hu[:, :H])
            r = torch.sigmoid(xt[:, H:2 * H] + hu[:, H:])
            cand = self.s * torch.tanh(xt[:, 2 * H:3 * H] + (r * h) @ self.Wh)
            return (1 - z) * h + z * cand + 0.1 * xt[:, 3 * H:]

        def forward(self, x):
            T, B, _ = x.shape
            H = self.Uz.shape[0]
            wx = torch.cat([self.Wz, self.Wr, self.Wx, self.P], 1)
            bx = torch.cat([self.bz, self.br, self.b, torch.zeros_like(self.b)])
            xp = torch.addmm(bx, x.reshape(T * B, -1), wx).view(T, B, 4 * H)
            h = x.new_zeros(B, H)
            ys = []
            for t in range(T):
                h = self.step(xp[t], h)
                ys.append(h)
            return torch.stack(ys), h

    return W5Cell


class _StepnetTimer:
    """Times stepnet's own work inside the bridge: ``vjp`` (the forward with
    its workspace) and ``Pullback.__call__`` (the backward)."""

    def __init__(self, bridge_module, pullback_module):
        self.total = 0.0
        self.active = False
        timer = self

        def timed(fn):
            def wrapper(*a, **k):
                if not timer.active:
                    return fn(*a, **k)
                t = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    timer.total += time.perf_counter() - t
            return wrapper

        bridge_module.vjp = timed(bridge_module.vjp)
        pullback_module.Pullback.__call__ = timed(pullback_module.Pullback.__call__)

    def enable(self):
        self.total, self.active = 0.0, True

    def disable(self):
        self.active = False
        return self.total


def _stepnet_alone(sn, bridge, wl, dY, dh, args):
    """The median time of the bridge's forward and backward called on arrays."""
    import numpy as np

    rnn = bridge.wrapped
    X = sn.LoDTensor.from_lengths(wl.x_packed(), [wl.lengths.tolist()])
    cts = [np.ascontiguousarray(dY.reshape(-1, dY.shape[-1])), dh]
    times = []
    for i in range(args.warmup + args.rounds * args.calls):
        t = time.perf_counter()
        _, pullback = sn.vjp(rnn, output_all_steps=(True, False), x=X)
        pullback(cts)
        if i >= args.warmup:
            times.append(time.perf_counter() - t)
    return float(np.median(times))


if __name__ == "__main__":
    main()
