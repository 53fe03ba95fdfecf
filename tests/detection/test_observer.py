"""The harness's black-box observer (``harness.measure.observe``) on offloaders nobody here
wrote, and the checks it feeds: attribution of every copy to a group occurrence, the pack and
unpack checksums, the weights check.

* an H2D issued in another group's window belongs to the group whose D2H wrote its source; the
  model's own copies in a window are not the offloader's; a copy in no window is ``outside``;
* on CPU the observer reads the offloader's ranges as the profiler counts them, and the
  reference's run counts by its own ranges with the windows agreeing;
* the checksums read values in logical order, see one flipped bit, change nothing a run computes
  and name a corrupt reload in the first run;
* the weights check names a parameter copied out (a bf16 cast of one, a view of a shared buffer
  by the bytes read) and passes the reference, showing it watched.

The runs on the seed row are those of the seed row's other judges (``shared_runs``, the row's
xdist group: ``judges_row``).
"""

from __future__ import annotations

import re

import pytest
import torch
from shared_runs import SharedRuns

from harness.cases import SEED_CASE, Case
from harness.execute.baselines import plain_baseline
from harness.execute.environment import Environment
from harness.measure.observe import CopyObserver, Windowed, observe
from harness.offload.passthrough import NoOffload
from harness.verify.detection import SEED
from harness.verify.judge import judge

CPU = torch.device("cpu")
ROW = Case(family="hybrid", offload=("core_attn", "attn_proj"), custom_pattern="+-+-")


def test_reference_counts_by_its_ranges_and_the_windows_agree(shared_runs: SharedRuns) -> None:
    from harness.execute.caserun import attribution_mismatches

    res = shared_runs.case_run(ROW, Environment(device=CPU, backend="reference"))
    assert res.attribution is not None and res.attribution.source == "offloader ranges"
    windows, ranged = res.attribution.windows, res.attribution.profiled
    assert ranged[1].by_group() and windows[1].by_group() == ranged[1].by_group()
    assert windows[0].by_group() == ranged[0].by_group()
    assert attribution_mismatches(res, ROW.steps - 1) == []


def test_observer_attributes_a_prefetch_by_the_host_memory_it_reads() -> None:
    """An H2D issued while another group's window is open belongs to the group whose D2H wrote
    its source; a copy in no window is ``outside`` (CPU device: host copies)."""
    off = Windowed(NoOffload())
    seen: list = []
    a, b = torch.randn(64), torch.randn(32)
    with observe(off, CPU, seen):
        off.begin_microbatch(0)
        group = off.group("core_attn", a, layer=0)
        host_a = torch.empty(64).copy_(a)  # D2H of core_attn
        group.commit(a)
        group = off.group("attn_proj", b, layer=1)
        host_b = torch.empty(32).copy_(b)  # D2H of attn_proj
        back_a = torch.empty(64).copy_(host_a)  # core_attn's reload, issued in attn_proj's window
        group.commit(b)
        torch.empty(32).copy_(b)  # no window, no source a D2H wrote: the model's own copy
    counts = seen[0].counts("cpu").by_group()
    assert counts == {
        (0, 0, "core_attn"): {"d2h_copies": 1, "d2h_bytes": 256, "h2d_copies": 1, "h2d_bytes": 256},
        (0, 1, "attn_proj"): {"d2h_copies": 1, "d2h_bytes": 128, "h2d_copies": 0, "h2d_bytes": 0},
    }
    assert torch.equal(back_a, a) and torch.equal(host_b, b)


def test_the_models_own_copies_in_a_window_are_not_the_offloaders() -> None:
    """A copy the model makes itself inside a group's window (a MoE layer's token counts to the
    host, say) is seen in the hooks baseline too, which moves nothing; ``without`` removes it
    once per occurrence there, so only the offloader's copies are counted."""

    def step(offloaded: bool) -> list:
        off, seen = Windowed(NoOffload()), []
        x = torch.randn(64)
        with observe(off, CPU, seen):
            off.begin_microbatch(0)
            group = off.group("expert_fc1", x, layer=1)
            torch.empty(8).copy_(x[:8])  # the model's own 32-byte copy
            if offloaded:
                torch.empty(64).copy_(x)  # the offloader's
            group.commit(x)
        return seen

    own, seen = step(False)[0], step(True)[0]
    assert own.counts("cpu").by_group() == {
        (0, 1, "expert_fc1"): {"d2h_copies": 1, "d2h_bytes": 32, "h2d_copies": 0, "h2d_bytes": 0}
    }
    assert seen.without(own).counts("cpu").by_group() == {
        (0, 1, "expert_fc1"): {"d2h_copies": 1, "d2h_bytes": 256, "h2d_copies": 0, "h2d_bytes": 0}
    }
    assert step(False)[0].without(own).copies == [], "a disabled offloader: nothing left"


def test_observer_reads_the_offloaders_ranges_as_the_cpu_profiler_counts_them() -> None:
    """On a CPU device a case runs no profiler: the observer reads the offloader's own ranges.
    On the reference's seed row, profiled and observed in the same steps, both give the same
    copies and bytes per range occurrence."""
    import contextlib

    from harness.execute.attribution import _profiled
    from harness.models.train import RunHooks, train
    from harness.offload.reference import OffloadContext

    case = SEED_CASE
    spec, run = case.model_spec("tiny"), case.run_spec()
    offloader = Windowed(OffloadContext(case.offload_config(), CPU))
    profiled, seen = [], []

    def both(step: int) -> contextlib.AbstractContextManager[object]:
        if step not in (0, run.steps - 1):
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(_profiled(CPU, profiled))
        stack.enter_context(observe(offloader, CPU, seen))
        return stack

    train(spec, run, offloader, CPU, hooks=RunHooks(step_context=both))
    offloader.close()
    assert len(profiled) == len(seen) == 2
    for by_profiler, observed in zip(profiled, seen, strict=True):
        assert by_profiler.by_range, "the reference opened ranges"
        assert observed.ranged_counts().by_range == by_profiler.by_range


def test_observer_outside_every_window_on_cuda_is_reported() -> None:
    """On CUDA, a D2H issued in no window is counted as ``outside`` (never dropped)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    device = torch.device("cuda")
    seen: list = []
    off = Windowed(NoOffload())
    x = torch.randn(16, device=device)
    with observe(off, device, seen):
        x.cpu()
    assert len(seen[0].outside()) == 1 and seen[0].counts("device").unattributed["d2h"].copies == 1
    assert isinstance(CopyObserver(off.state, device), CopyObserver)


def test_checksum_reads_values_in_logical_order_and_sees_one_flipped_bit() -> None:
    from harness.measure.observe import checksum

    view = torch.randn(6, 4, dtype=torch.bfloat16).t()
    assert torch.equal(checksum(view), checksum(view.contiguous())), "layout does not matter"
    flipped = view.contiguous()
    flipped.view(torch.int16)[1, 2] ^= 1
    assert not torch.equal(checksum(view), checksum(flipped))


@pytest.mark.usefixtures("shared_runs")
def test_checksums_change_nothing_the_run_computes() -> None:
    """The pack and unpack checksums read every saved tensor; the losses with them on are
    bitwise those with them off (and both the plain baseline's), and every saved tensor of an
    observed step is compared."""
    import contextlib

    from harness.models.train import RunHooks, train
    from harness.offload.reference import OffloadContext

    case = SEED_CASE
    spec, run = case.model_spec("tiny"), case.run_spec()
    losses, compared = {}, {}
    for on in (False, True):
        offloader = Windowed(OffloadContext(case.offload_config(), CPU), checksums=on)
        seen: list = []

        def every(step: int, off=offloader, seen=seen) -> contextlib.AbstractContextManager:
            return observe(off, CPU, seen)

        losses[on] = train(spec, run, offloader, CPU, hooks=RunHooks(step_context=every)).losses
        compared[on] = sum(o.checksummed for o in seen)
        assert not any(o.corrupted for o in seen)
        moved = {c.direction for o in seen for c in o.copies if c.group is not None}
        assert moved == {"d2h", "h2d"}, "the offload happened: copies out and back in windows"
        offloader.close()
    plain = plain_baseline(case, Environment(device=CPU)).result.losses  # NoOffload's run
    assert torch.equal(losses[True], losses[False]) and torch.equal(losses[True], plain)
    assert compared[False] == 0 and compared[True] > 0


@pytest.mark.judges_row(SEED)
def test_a_corrupt_reload_is_named_by_its_checksum_in_the_first_run(
    shared_runs: SharedRuns,
) -> None:
    res = shared_runs.case_run(SEED, Environment(device=CPU, backend="broken.corrupt_reload"))
    assert res.corrupted, "the flipped bit changes the reloaded tensor's checksum"
    step, where = res.corrupted[0]
    assert step == 0 and re.search(r"microbatch \d, layer \d, group \w+, saved tensor \d+", where)
    assert "shape [" in where and "storage offset" in where
    problems = judge(
        SEED, Environment(device=CPU, backend="broken.corrupt_reload"), checks=("equivalence",)
    ).problems
    assert any("reloads differ from what was saved" in p for p in problems), problems


@pytest.mark.judges_row(SEED)
@pytest.mark.usefixtures("shared_runs")
def test_the_weights_check_names_a_parameter_copied_out() -> None:
    judgement = judge(SEED, Environment(device=CPU, backend="broken.offloads_weights"))
    outcome = next(o for o in judgement.outcomes if o.name == "weights")
    assert outcome.status == "fail", judgement.problems
    assert re.search(r"\d+ D2H copies of weights \(\d+ B\) in steps \[0, ", outcome.problems[0])
    assert any(
        re.search(r"step 0, group attn_proj \(microbatch 0, layer 0\): parameter layers\.0\.", p)
        for p in outcome.problems
    ), outcome.problems
    assert outcome.record["weights"]["copies"] > 0


@pytest.mark.judges_row(SEED)
@pytest.mark.usefixtures("shared_runs")
def test_the_weights_check_passes_the_reference_and_proves_it_watched() -> None:
    judgement = judge(SEED, Environment(device=CPU, backend="reference"), checks=("weights",))
    (outcome,) = judgement.outcomes
    assert outcome.status == "pass", outcome.problems
    seen = outcome.record["weights"]
    assert seen["copies"] == 0 and seen["parameter_storages"] > 0 and seen["d2h_observed"] > 0


def test_a_cast_of_a_parameter_saved_by_a_group_is_a_weight() -> None:
    """A bf16 shadow made in the forward (``weight.to(bf16)``) and saved inside a group: the
    observer knows it as a cast of the parameter, so a D2H of it is a weight copy."""
    state_model = torch.nn.Linear(4, 4)
    offloader = Windowed(NoOffload())
    offloader.note_model(state_model)
    seen: list = []
    with observe(offloader, CPU, seen):
        mode = offloader.state.observer
        assert mode is not None
        shadow = state_model.weight.to(torch.bfloat16)
        mode.note_cast(shadow)
        with offloader.group("attn_proj", torch.zeros(1), layer=0):
            torch.empty_like(shadow).copy_(shadow)
            torch.empty_like(state_model.bias).copy_(state_model.bias)
    (observed,) = seen
    weights = sorted(c.weight for c in observed.weight_copies())
    assert weights == ["a bfloat16 cast of parameter weight", "parameter bias"], weights


def test_parameters_sharing_one_buffer_are_named_by_the_bytes_a_copy_reads() -> None:
    """megatron-core's DDP keeps every parameter in one buffer: a copy of the first one's view
    is named after the first, not after whichever parameter was noted last."""
    buffer = torch.zeros(8)
    model = torch.nn.Module()
    model.first = torch.nn.Parameter(buffer[:4].view(2, 2))
    model.second = torch.nn.Parameter(buffer[4:].view(2, 2))
    assert model.first.untyped_storage().data_ptr() == model.second.untyped_storage().data_ptr()
    offloader = Windowed(NoOffload())
    offloader.note_model(model)
    assert len(offloader.state.weights) == 1, "one storage, two parameters in it"
    seen: list = []
    with observe(offloader, CPU, seen), offloader.group("core_attn", torch.zeros(1), layer=0):
        torch.empty(2, 2).copy_(model.first)
    (observed,) = seen
    assert [c.weight for c in observed.weight_copies()] == ["parameter first"]
