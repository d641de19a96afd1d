"""Throughput of stepnet.distributed: one process, then 1 and 2 Dask workers.

    python benchmarks/scale_out.py                 # 20,000 sequences
    python benchmarks/scale_out.py --sequences 2000 --rounds 2

The workload is a GRU (input 32, hidden 64, float32, numba backend) over
``--sequences`` sequences of 10-50 steps (seeded). Every worker is a process
with one thread, and so is the in-process run (``NUMBA_NUM_THREADS=1``, set
before stepnet is imported), so the only difference is the number of
processes. Printed: tokens/s per setting (best of ``--rounds``), the scaling
efficiency of 2 workers over 1, and the scheduling overhead per partition (a
batch of one short sequence per partition, timed per partition).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("NUMBA_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("STEPNET_TIERED", "0")  # time the compiled kernels

import numpy as np  # noqa: E402

import stepnet as sn  # noqa: E402
from stepnet import distributed as sd  # noqa: E402


def workload(num_seq, seed=0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(10, 51, num_seq)
    X = sn.LoDTensor.from_lengths(rng.standard_normal((int(lengths.sum()), 32)).astype(np.float32),
                                  [lengths.tolist()])
    return sn.nn.GRU(32, 64, seed=seed), X


def best(fn, rounds):
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sequences", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    gru, X = workload(args.sequences)
    tokens = X.data.shape[0]
    expected = gru(X)  # also compiles the kernel into the disk cache the workers read
    rows = [("one process, no Dask", best(lambda: gru(X), args.rounds), None)]
    for workers in (1, 2):
        with sd.local_client(workers) as client:
            for parts in (workers, 4 * workers):
                out = sd.run(gru, {"X": X}, client=client, partitions=parts)  # warm-up, checked
                assert np.allclose(out[1], expected[1], atol=1e-5)
                secs = best(lambda p=parts: sd.run(gru, {"X": X}, client=client, partitions=p),
                            args.rounds)
                rows.append((f"{workers} worker(s), {parts} partitions", secs, workers))
            if workers == 2:
                tiny_gru, tiny = workload(64, seed=1)
                sd.run(tiny_gru, {"X": tiny}, client=client, partitions=64)
                overhead = best(lambda g=tiny_gru, x=tiny: sd.run(g, {"X": x}, client=client,
                                                                   partitions=64), args.rounds) / 64
    print(f"stepnet.distributed: GRU 32 -> 64, {args.sequences:,} sequences, {tokens:,} tokens, "
          f"{os.cpu_count()} cores, best of {args.rounds}")
    print()
    print("| setting | seconds | tokens/s |")
    print("|---|---:|---:|")
    for name, secs, _ in rows:
        print(f"| {name} | {secs:.3f} | {tokens / secs:,.0f} |")
    one = min(s for _, s, w in rows if w == 1)
    two = min(s for _, s, w in rows if w == 2)
    print()
    print(f"scaling efficiency, 2 workers over 1 (best partitioning each): {one / two / 2:.2f}")
    print(f"scheduling overhead per partition (64 one-sequence partitions): {overhead * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
