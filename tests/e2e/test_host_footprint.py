"""The host footprint of whole runs on CPU (``harness.measure.footprint``): what the harness finds
held through its copies at each group boundary of the final step, beside the bytes in flight,
for an offloader that keeps the last step's host copies and for the bundled reference (held to
its declared bound)."""

from __future__ import annotations

import pytest
import torch

from harness.cases import default_matrix
from harness.execute.environment import Environment
from harness.execute.steps import run_case
from harness.offload.protocol import Capabilities
from harness.offload.reference import HOST_BOUND, OffloadContext
from harness.verify.hostchecks import footprint_problems


def _final(backend: str, case_name: str) -> tuple[object, object]:
    case = next(c for c in default_matrix() if c.name == case_name)
    res = run_case(case, Environment(device=torch.device("cpu"), backend=backend))
    return case, res


SEQUENTIAL = "hybrid-+-+-+-_core_attn+attn_proj_sequential_bf16"


@pytest.mark.parametrize("backend", ["slow_offloaders:HoldsTwice"])
def test_an_offloader_keeping_last_steps_copies_holds_four_times_its_peak(backend: str) -> None:
    """Sequential, 2 microbatches: at most one microbatch's copies are in flight at once, while
    an offloader keeping the last step's copies to the end of this one holds both steps' at
    this step's last forward commit: 2 steps x 2 microbatches = 4x."""
    _, res = _final(backend, SEQUENTIAL)
    final = res.footprint
    step_bytes = res.per_step[-1].totals()["d2h"].bytes
    assert final.peak_in_flight == step_bytes // 2
    assert final.peak_held == 2 * step_bytes
    assert final.ratio == 4.0


def test_the_reference_holds_what_it_has_in_flight() -> None:
    """The bundled reference's pool holds its first steady step's buffers: at most its declared
    bound over what is in flight at the final step's peak, one microbatch's copies (derived from
    the step's copies: sequential, 2 microbatches moving the same)."""
    case, res = _final("reference", SEQUENTIAL)
    final = res.footprint
    assert final.peak_in_flight == res.per_step[-1].totals()["d2h"].bytes // 2
    assert final.ratio is not None and final.ratio <= HOST_BOUND
    assert footprint_problems(case, res, Capabilities(host_pool=True, host_bound=HOST_BOUND)) == []


class _RegrowingPool(OffloadContext):
    """The reference, but its pool drops every buffer when an iteration ends and its log is
    withheld: every step allocates its host buffers again (on CPU often at the addresses just
    freed), and only the harness's own records can tell."""

    capabilities = Capabilities(host_pool=True)

    def end_iteration(self) -> None:
        super().end_iteration()
        self.pool.clear()

    def iteration_logs(self) -> list:
        return []


def test_a_pool_allocating_again_after_the_warmup_fails_leaks_from_the_copies_alone() -> None:
    case = next(c for c in default_matrix() if c.name == SEQUENTIAL)
    env = Environment(device=torch.device("cpu"), backend=f"{__name__}:_RegrowingPool")
    res = run_case(case, env)
    problems = footprint_problems(case, res, env.record.capabilities)
    assert len(problems) == 1 and problems[0].startswith(
        "step 1: the offloader keeps a host pool, yet its D2H copies wrote"
    ), problems
    assert all(sum(n for _, n in new) for new in res.new_host[1:])  # every step after the warmup
    # the reference itself, same row: nothing new after the warmup
    plain = run_case(case, Environment(device=torch.device("cpu"), backend="reference"))
    assert not any(plain.new_host[1:])
