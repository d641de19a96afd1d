"""The machine a benchmark ran on, named in every report."""

from __future__ import annotations

import platform
import subprocess


def cpu_name() -> str:
    """lscpu's model name (platform.processor() where lscpu is missing)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or "unknown CPU"


def fma_peak_gflops(rounds: int = 5) -> float:
    """One core's float32 multiply-add rate, GFLOP/s: the best of ``rounds``
    runs of a compiled loop of independent multiply-adds on registers only
    (no loads, no stores; the CPU's widest vectors, as stepnet's loops ask),
    as close to the core's peak as Numba's code gets. The chains must hide
    the multiply-add's latency without outgrowing the register file (16
    vector registers with AVX2, 32 with AVX-512; more chains than registers
    spill and measure the stores instead), so each count of 96, 192 and 384
    lanes (12 to 48 vectors of 8, 6 to 24 of 16) is run and the fastest
    taken."""
    return max(_chains_rate(lanes, rounds) for lanes in (96, 192, 384))


def _chains_rate(lanes: int, rounds: int) -> float:
    """GFLOP/s of ``lanes`` independent multiply-add chains on one core."""
    import time

    import numpy as np
    from numba import carray, njit

    from stepnet.jit.atomics import stack_buffer, wide_vectors

    @njit(fastmath={"contract"})
    def chains(scale, shift, n):
        wide_vectors()
        acc = carray(stack_buffer(lanes, np.float32), lanes)
        for j in range(lanes):
            acc[j] = j
        for _ in range(n):
            for j in range(lanes):
                acc[j] = acc[j] * scale + shift
        total = np.float32(0)
        for j in range(lanes):
            total += acc[j]
        return total

    scale, shift = np.float32(0.999), np.float32(0.001)
    chains(scale, shift, 10)
    n = 768_000_000 // lanes
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        chains(scale, shift, n)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * lanes * n / best / 1e9


def single_thread_seconds(m, k, n, rounds=5):
    """Seconds per float32 product ``[m, k] @ [k, n]`` on the calling thread,
    by stepnet's own loop and by each BLAS library stepnet reaches (the best
    of ``rounds`` rounds that take them in turn, by the code stepnet's
    kernels call): ``{name: seconds}``; the report's GEMM ceiling."""
    from stepnet.jit import blas, blas_choice, product_timing

    libraries = [lib for lib in (blas_choice.find_mkl(), blas_choice.find_openblas()) if lib is not None]
    reps = max(5, min(200, 50_000_000 // (m * k * n)))
    best = {}
    for _ in range(rounds):
        own, chosen = product_timing._time_small_and_library(m, k, n)  # (the chosen library's too)
        timed = [("stepnet's own loop", own), (blas.BLAS_NAME, chosen)]
        timed += [(name, s[0]) for name, s in blas_choice.measure(libraries, ((m, k, n, reps, 1),)).items()]
        for name, seconds in timed:
            best[name] = min(best.get(name, float("inf")), seconds)
    return best
