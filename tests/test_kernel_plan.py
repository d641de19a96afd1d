"""The kernel plan: what the Numba backend decides about a kernel before it
writes its code (stepnet/jit/kernel_plan.py)."""

import numpy as np
import pytest

import stepnet as sn
from nets import small_gru
from stepnet import schedule

pytest.importorskip("numba")

from stepnet.jit import cpu_codegen  # noqa: E402
from stepnet.jit.kernel_plan import KernelPlan, kernel_plan  # noqa: E402


def _gru_program(hidden=256):
    layer = sn.nn.GRU(16, hidden, seed=3)
    return layer.step_net(0, 0).program(True)


def test_a_gru_plans_its_input_products_by_chunks_and_reads_the_joined_weights():
    """A GRU's three input products are one merged product of 3H columns over
    every token, computed by chunks of steps in its rnn function; its per-gate
    weights are read only joined (by the caller), so the kernel takes the
    joined ones, not the parts."""
    program = _gru_program()
    sched = schedule.schedule(program)
    plan = kernel_plan(program, sched)
    (chunked,) = plan.chunked[sched]
    assert chunked.kind == "gemm" and chunked.merged
    assert sum(v.shape[-1] for v in chunked.outputs) == 3 * 256
    merged_weights = {e.inputs[1] for s in sched.hoisted + sched.step if s.merged for e in s.eqns}
    assert merged_weights and not merged_weights & set(plan.consts)
    assert set(plan.consts) <= set(program.consts)
    source, layout = cpu_codegen.generate_source(program)
    assert layout.plan.consts == plan.consts
    assert "products by chunks of steps" in str(plan)


def test_small_products_stay_before_the_loop():
    program = _gru_program(hidden=32)  # (3 x 32 columns: under the chunks' minimum)
    sched = schedule.schedule(program)
    assert kernel_plan(program, sched).chunked[sched] == frozenset()


def test_a_plan_naming_work_its_net_does_not_schedule_is_refused():
    program = _gru_program()
    sched = schedule.schedule(program)
    plan = kernel_plan(program, sched)
    step_stage = sched.step[0]
    bad = plan._replace(chunked={sched: frozenset({step_stage})})
    with pytest.raises(AssertionError):
        bad.check()
    bad = plan._replace(concats={**plan.concats, sched: (sched.hoisted[0],)})
    with pytest.raises(AssertionError):
        bad.check()
    assert isinstance(plan.check(), KernelPlan)


def test_explain_prints_the_kernel_plan(capsys):
    """``compiled.explain()`` prints the kernel's plan after the call's."""
    rnn = small_gru(np.random.default_rng(0), [[5, 7]], hidden=96)
    compiled = rnn.compile("numba")
    found = compiled.explain()
    out = capsys.readouterr().out
    assert str(found) in out and "kernel: constants read: " in out
    assert out.index(str(found)) < out.index("kernel: constants read: ")
