"""Shared test helpers: every backend is judged against the interpreter."""

import os

# Without a GPU the CUDA backend runs on Numba's CUDA simulator (it must be
# chosen before numba is imported); tests/test_cuda_backend.py tests it.
if "NUMBA_ENABLE_CUDASIM" not in os.environ and not os.path.exists("/dev/nvidiactl"):
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import stepnet as sn  # noqa: E402

TOL = {np.dtype(np.float32): 1e-5, np.dtype(np.float64): 1e-12, np.dtype(np.float16): 1e-3}


def _data(x):
    return x.data if isinstance(x, sn.LoDTensor) else np.asarray(x)


def assert_close(actual, expected, dtype=None, what="output"):
    """DESIGN.md §4: |a - b| <= tol * max(1, |b|), LoD included."""
    if isinstance(expected, (tuple, list)):
        assert isinstance(actual, (tuple, list)) and len(actual) == len(expected)
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_close(a, e, dtype, f"{what}[{i}]")
        return
    if isinstance(expected, sn.LoDTensor):
        assert isinstance(actual, sn.LoDTensor), f"{what}: expected a LoDTensor"
        assert actual.lod == expected.lod, f"{what}: LoD {actual.lod} != {expected.lod}"
    a, e = _data(actual), _data(expected)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
    assert a.dtype == e.dtype, f"{what}: dtype {a.dtype} != {e.dtype}"
    if e.dtype.kind in "biu":  # masks and counts agree exactly
        mismatched = np.flatnonzero((a != e).ravel())
        assert mismatched.size == 0, (
            f"{what}: {mismatched.size} elements differ, first at flat index {mismatched[:1]}")
        return
    tol = TOL[np.dtype(dtype or e.dtype)]
    err = np.abs(a.astype(np.float64) - e.astype(np.float64))
    bound = tol * np.maximum(1.0, np.abs(e.astype(np.float64)))
    assert np.all(err <= bound), f"{what}: max error {err.max()} (tolerance {tol})"


def available_backends():
    """The compiled CPU backends; the CUDA backend has its own tests at the
    simulator's small sizes (tests/test_cuda_backend.py)."""
    return [b for b in sn.backends() if b not in ("interpreter", "cuda")]


def assert_backends_agree(rnn, output_all_steps=True, backends=None, **feeds):
    """Run ``rnn`` on every backend and compare each with the interpreter."""
    expected = rnn(output_all_steps=output_all_steps, backend="interpreter", **feeds)
    for backend in backends if backends is not None else available_backends():
        actual = rnn(output_all_steps=output_all_steps, backend=backend, **feeds)
        assert_close(actual, expected, what=f"{backend} vs interpreter")
    return expected


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
