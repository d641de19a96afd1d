"""Where a call of stepnet's cuda backend spends its time, by time-loop driver.

    python benchmarks/cuda_profile.py            # W1, W3, W5
    python benchmarks/cuda_profile.py --quick    # tiny sizes (on Numba's simulator too)

Each workload runs under every driver its plan can take (``cuda_run.LoopPlan``:
the one the plan picks, one block, a cooperative grid with the weights resident
in shared memory and reading them from global memory, a launch per stage and
step); each line gives the mean of five calls after two warm-up calls, the
plan (blocks x threads, shared bytes a block) and what the call counted
(launches, syncs a step). One call of the planned driver is then timed by
phase, a device sync around each (layout, copies, hoisted kernels, loop,
outputs back).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import peers  # noqa: E402
import workloads  # noqa: E402

# each driver as the module constants that force it
DRIVERS = {
    "as planned": {},
    "one block": {"BLOCK_MAX_MACS": 1 << 62},
    "grid, weights resident": {"BLOCK_MAX_MACS": -1},
    "grid, weights in global memory": {"BLOCK_MAX_MACS": -1, "_shared_limit": lambda: 0},
    "a launch per stage and step": {"PERSISTENT_MAX_ELEMENTS": 0},
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    ap.add_argument("--workloads", default="W1,W3,W5")
    args = ap.parse_args(argv)

    from numba import config, cuda

    import stepnet.jit.cuda_run as nc

    if config.ENABLE_CUDASIM:
        where = "Numba's CUDA simulator (timings meaningless)"
    else:
        name = cuda.get_current_device().name
        where = name.decode() if isinstance(name, bytes) else name
    print(f"device: {where}; milliseconds per call")
    calls = []
    original_call = nc._Run.__call__

    def recorded(self, *call_args, **kwargs):
        calls.append(self)
        return original_call(self, *call_args, **kwargs)

    nc._Run.__call__ = recorded
    saved = {name: getattr(nc, name) for values in DRIVERS.values() for name in values}
    for key in args.workloads.split(","):
        wl = workloads.make(key, quick=args.quick)
        reference = None  # the planned driver's final state
        for driver, values in DRIVERS.items():
            for name, value in values.items():
                setattr(nc, name, value)
            try:
                run = (peers.stepnet_cuda_custom if key == "W5" else peers.stepnet_cuda_gru)(wl)
                last = np.asarray(run()[1])
                reference = last if reference is None else reference
                run()
                start = time.perf_counter()
                for _ in range(5):
                    run()
                ms = (time.perf_counter() - start) / 5 * 1e3
                counts = calls[-1].last_call
                plan = counts.plan
                print(f"{key:3s} {driver:32s} {ms:9.3f}  {plan.driver}: {plan.blocks} x "
                      f"{plan.threads}, {plan.shared_bytes} B shared; {counts.launches} launches, "
                      f"{counts.grid_syncs_per_step} grid / {counts.block_syncs_per_step} block "
                      f"syncs a step, {counts.global_weight_bytes_per_step} weight B from global "
                      f"a step, {counts.copies_to_device} copies; max|dh| "
                      f"{np.max(np.abs(last - reference)):.1e} from the planned driver's")
                if driver == "as planned":
                    _phases(nc, run, key)
            finally:
                for name, value in saved.items():
                    setattr(nc, name, value)


def _phases(nc, run, key):
    """One call's time by phase, each between device syncs: the batch's
    layout on the host, the inputs to the device, the hoisted kernels, the
    time loop, the outputs back."""
    from numba import cuda

    spent = {}

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            cuda.synchronize()
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            cuda.synchronize()
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - start
            return out
        return wrapper

    names = {"_inputs": "inputs to the device", "_hoisted": "hoisted kernels",
             "_loop": "time loop", "_outputs": "outputs back"}
    saved = {m: getattr(nc._Run, m) for m in names}
    batch = nc._Batch
    nc._Batch = timed("layout on the host", batch)
    for m, name in names.items():
        setattr(nc._Run, m, timed(name, saved[m]))
    try:
        start = time.perf_counter()
        run()
        whole = time.perf_counter() - start
    finally:
        nc._Batch = batch
        for m, fn in saved.items():
            setattr(nc._Run, m, fn)
    parts = ", ".join(f"{name} {seconds * 1e3:.3f}" for name, seconds in spent.items())
    print(f"{key:3s} {'  phases':32s} {whole * 1e3:9.3f}  {parts}")


if __name__ == "__main__":
    main()
