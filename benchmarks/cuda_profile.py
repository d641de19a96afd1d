"""Where a call of stepnet's cuda backend spends its time.

    python benchmarks/cuda_profile.py            # W1, W3 (both loop drivers), W5
    python benchmarks/cuda_profile.py --quick    # tiny sizes (on Numba's simulator too)

Each workload's call is timed whole (the mean of three calls after two
warm-up calls), then once more with a device sync around every kernel launch
and every host-to-device copy, which gives each stage kernel's time per call
(its launch on the host included) and what is left: Python around the
kernels, the persistent kernel where it runs (one launch that is not timed
apart), the copies back. W3 runs on the persistent kernel and again with one
launch per stage and step (``PERSISTENT_MAX_ELEMENTS = 0``).
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import peers  # noqa: E402
import workloads  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    args = ap.parse_args(argv)

    from numba import cuda

    import stepnet.jit.cuda_run as nc

    times, counts = collections.defaultdict(float), collections.Counter()
    launch, device = nc._launch, nc._device

    def timed(name, fn, *call_args):
        cuda.synchronize()
        start = time.perf_counter()
        out = fn(*call_args)
        cuda.synchronize()
        times[name] += time.perf_counter() - start
        counts[name] += 1
        return out

    def timed_launch(kernel, count, *call_args):
        name = getattr(getattr(kernel, "py_func", None), "__name__", None) or str(kernel)[:40]
        return timed(f"kernel {name}", launch, kernel, count, *call_args)

    persistent = nc.PERSISTENT_MAX_ELEMENTS
    from numba import config

    if config.ENABLE_CUDASIM:
        where = "Numba's CUDA simulator (timings meaningless)"
    else:
        name = cuda.get_current_device().name
        where = name.decode() if isinstance(name, bytes) else name
    print(f"device: {where}; milliseconds per call")
    for key, per_stage in (("W1", False), ("W3", False), ("W3", True), ("W5", False)):
        nc.PERSISTENT_MAX_ELEMENTS = 0 if per_stage else persistent
        wl = workloads.make(key, quick=args.quick)
        run = (peers.stepnet_cuda_custom if key == "W5" else peers.stepnet_cuda_gru)(wl)
        run()
        run()
        start = time.perf_counter()
        for _ in range(3):
            run()
        whole = (time.perf_counter() - start) / 3
        times.clear()
        counts.clear()
        nc._launch = timed_launch
        nc._device = lambda a: timed("host->device copies", device, a)
        try:
            start = time.perf_counter()
            run()
            synced = time.perf_counter() - start
        finally:
            nc._launch, nc._device = launch, device
        print(f"\n{key}{' one launch per stage' if per_stage else ''}: {whole * 1e3:.2f} a call "
              f"({synced * 1e3:.2f} with a sync around each launch)")
        for name, seconds in sorted(times.items(), key=lambda kv: -kv[1]):
            print(f"  {seconds * 1e3:10.3f}  x{counts[name]:<6d} {name}")
        print(f"  {(synced - sum(times.values())) * 1e3:10.3f}  the rest (Python, the persistent "
              "kernel where it runs, copies back)")
    nc.PERSISTENT_MAX_ELEMENTS = persistent


if __name__ == "__main__":
    main()
