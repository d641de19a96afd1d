"""What ``stepnet info`` prints about the BLAS and stepnet's own product
loop: the choice (:mod:`stepnet.jit.blas_choice`) and what the engine
(:mod:`stepnet.jit.blas`) measured from it; outside the engine, which it
only reads. Importing this starts the engine."""

from __future__ import annotations

from .jit import blas, blas_choice, own_loop, product_timing, transposed
from .jit.blas_choice import EVERY_PRODUCT


def describe() -> str:
    """What ``stepnet info`` prints about the BLAS."""
    c = blas_choice.choose()
    lines = [f"BLAS: {c['name']} ({c['reason']})", f"CPU: {c['cpu']}"]
    for name, path in c["libraries"].items():
        lines.append(f"  {name}: {path}")
    for name, secs in c.get("seconds", {}).items():
        rates = ", ".join(f"{2 * m * k * n / s / 1e9:.0f} GFLOP/s at {m}x{k} @ {k}x{n}"
                          for (m, k, n, _, _), s in zip(blas_choice._SHAPES, secs))
        lines.append(f"  {name}, one thread: {rates}")
    table = product_timing.small_rows_table(float64=True)  # measured here if not known yet
    if blas.DETERMINISTIC:
        lines.append("small products: every product runs stepnet's own loop "
                     "(STEPNET_DETERMINISTIC)")
    else:
        for part, dtype in ((0, "float32"), (3, "float64"))[:len(table) // 3]:
            limits = ", ".join(f"{'any number of' if r == EVERY_PRODUCT else f'up to {r}'} rows for "
                               f"{'any weights' if size == EVERY_PRODUCT else f'weights up to {size}'}"
                               f"{'' if shares else ' (not shared with the helper)'}"
                               for size, r, shares in zip(*table[part:part + 3].tolist()))
            lines.append(f"small products, {dtype}: stepnet's own loop for {limits} "
                         f"({blas_choice._SMALL_PRODUCTS.get(dtype, {}).get('reason')})")
    size, count = own_loop.vector_registers()
    lines.append(f"  stepnet's own loop: blocks of {own_loop._BLOCK_ROWS} rows x {own_loop._COLS} columns"
                 f"{'' if size == 64 else ' (4 rows in float64)'}, "
                 f"one row x {own_loop._WIDE_ACCUMULATORS} in float32, for {count} vector registers "
                 f"of {size} bytes ({'AVX-512' if size == 64 else 'AVX2'})")
    from .jit import int8_gemm

    lines.append(f"quantized products (sn.quantize): int8 by {int8_gemm.int8_path()}; bf16 by "
                 f"{int8_gemm.bf16_path()}")
    transposed._tn_by_own_loop("float32")  # measured here if it is not known yet
    if blas.DETERMINISTIC:
        lines.append("weight gradients (a.T @ b): stepnet's own loop (STEPNET_DETERMINISTIC)")
    else:
        rows, m, n = blas_choice._TN_SHAPE
        for dtype, found in sorted(blas_choice._TRANSPOSED.items()):
            own, lib = found["seconds"]
            lines.append(f"weight gradients (a.T @ b), {dtype}: "
                         f"{'stepnet own loop' if own < lib else c['name']} "
                         f"({found['reason']}; [{rows}, {m}].T @ [{rows}, {n}], one thread: "
                         f"own loop {2 * rows * m * n / own / 1e9:.0f}, {c['name']} "
                         f"{2 * rows * m * n / lib / 1e9:.0f} GFLOP/s)")
    for dtype, small in sorted(blas_choice._SMALL_PRODUCTS.items()):
        figures = _figures(small, c["name"])
        lines += [f"small products measured, {dtype}:"] * bool(figures) + figures
    return "\n".join(lines)


def _figures(small, library):
    """The lines of ``small_product_rows``' figures ``small`` (one dtype's)."""
    lines = []
    for k, n in blas_choice._STEP_WEIGHTS:
        row = [(m, own, lib) for m, kk, nn, own, lib in (*small.get("points", ()), *small.get("many", ()))
               if (kk, nn) == (k, n)]
        if row:  # (the last: over many rows as the kernels run a product outside the time loop)
            figures = ", ".join(f"{m}{' outside' if m == blas_choice._MANY_ROWS else ''}: {own * 1e6:.1f}/"
                                f"{lib * 1e6:.1f}" for m, own, lib in row)
            lines.append(f"  rows x {k} @ {k}x{n}, us own loop/{library}: {figures}")
        for m, kk, nn, alone, cut in small.get("shared", ()):
            if (kk, nn) == (k, n):
                lines.append(f"    {m} row, us own loop alone/shared with the helper: "
                             f"{alone * 1e6:.1f}/{cut * 1e6:.1f}")
    return lines
