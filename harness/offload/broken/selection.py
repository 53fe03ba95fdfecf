"""Broken offloaders that move the wrong groups, or at the wrong time: selection ignored,
nothing moved, the fraction policy's count, weights taken for activations, a no-grad warmup,
a remapped group structure, a step skipped (values stay right; counts and logs show it)."""

from __future__ import annotations

import torch

from harness.offload.policy import apply_delta, apply_margin, fraction_disabled_count, summarize
from harness.offload.reference import ChunkState, GroupState, OffloadContext

EXPERT_BLOCK = ("expert_fc1", "moe_act")
"""The unfused expert path's groups, which TE's fused grouped MLP offloaded as one saved set."""


class UnselectedGroups(OffloadContext):
    """Unselected groups moved (TE fused grouped MLP: TE #3047/#3108/#3128, Megatron-LM #5082).

    The fused op offloaded its whole saved set whenever offloading was on, ignoring the
    per-module selection: with only ``moe_act`` selected, fc1's input moved too. Here selecting
    either expert name opens both. Values stay right; caught by name fidelity and transfer
    counts on rows that select ``moe_act`` without ``expert_fc1``.
    """

    name = "broken.unselected_groups"

    def _opens(self, name: str) -> bool:
        if name in EXPERT_BLOCK and self.config.selected & set(EXPERT_BLOCK):
            return self.enabled and torch.is_grad_enabled()
        return super()._opens(name)


class NoOp(OffloadContext):
    """Nothing moved at all (Megatron-LM 92d5c1f4d1 / #4173: the hybrid model never called
    ``init_chunk_handler``, so offloading was a silent no-op; DeepSpeed #522, Colossal-AI #643).

    Every group start returns a pass-through group. Caught by the offload proof (no selected
    group moved bytes in the warmup step), the transfer counts and the leak check's warmup flag.
    """

    name = "broken.noop"

    def _opens(self, name: str) -> bool:
        return False


class FractionCount(OffloadContext):
    """Wrong group count from the fraction policy (bugs list #20, the float-floor artefact;
    Megatron-LM PR #5101/#7575, partial offload).

    Keeps at least one trailing group per chunk on the device (``max(1, int(n * (1 - f)))``)
    instead of Megatron's ``int(n * (1 - f))``: one group too few offloaded per chunk at f = 1.0,
    and n = 5, f = 0.8 keeps 1 instead of 0. Values stay right; caught by transfer counts (a
    group predicted to move moves nothing).
    """

    name = "broken.fraction_count"

    def _apply_policies(
        self, forward: list[ChunkState], backward: list[ChunkState]
    ) -> dict[str, int]:
        apply_margin(backward)
        apply_delta(backward, self.config.pp_rank * self.config.delta_offload_bytes_across_pp_ranks)
        for chunk in backward:
            eligible = [g for g in chunk.groups if g.offload and g.warmup_bytes > 0]
            count = fraction_disabled_count(len(eligible), self.config.activation_offload_fraction)
            count = max(1, count) if eligible else 0
            for group in eligible[len(eligible) - count :]:
                group.offload, group.decision = False, "kept:fraction"
        return summarize(forward, backward[0] if backward else None)


class OffloadsWeights(OffloadContext):
    """Parameter marks ignored: every weight a group saves (a linear's weight, a view of one)
    is copied out and back with the activations (cf. TransformerEngine's CPU offload before
    weights were tagged do-not-offload; Megatron's scripts require ``NVTE_CPU_OFFLOAD_V1=1``
    with TE >= 2.10 "to avoid offloading weights"; megatron-core 0.19's object check lets a
    view of a parameter through).

    Values stay right (the weight comes back unchanged) and its own log counts the extra
    copies. Caught by the weights check (naming the parameter) and by transfer counts.
    """

    name = "broken.offloads_weights"

    def _is_marked(self, tensor: torch.Tensor) -> bool:
        return False


class NoGradWarmup(OffloadContext):
    """A no-grad pass taken as the warmup (NeMo-RL PR #2279 review; Megatron never reads grad
    mode or ``forward_only``).

    Groups open whatever the grad mode, so a no-grad forward (evaluation, log-probabilities)
    run first records the chunk structure with zero bytes and ends the warmup: the first
    training step runs the steady-state policies on byte counts of zero. Needs a no-grad pass
    before the first training step; the default matrix has none, so it cannot show there (its
    catalogue entry's ``needs``). With one, caught by the leak check (one iteration log too
    many, the warmup flag on the no-grad pass) and, with fraction < 1, transfer counts.
    """

    name = "broken.nograd_warmup"

    def _opens(self, name: str) -> bool:
        return self.enabled and name in self.config.selected


class StructureRemap(OffloadContext):
    """A group-structure change between warmup and steady state mapped silently (Megatron's
    name-based cursor skip and a976754b40's silent "no offload"; bugs list #3, invariant 17).

    The warmup records groups in commit order while steady state starts them in start order;
    with a spanning group (``attn_norm`` spans the attention groups, ``mlp_norm`` the expert
    groups) the two sequences differ. The reference raises ``StructureChangedError`` on any
    difference; this one maps each start to the next recorded group of that name from the
    cursor and silently passes through when none is left. Layer-0 starts get layer-2 groups,
    the last layer offloads nothing: values stay right, policies and ranges belong to the wrong
    groups. Caught by transfer counts on rows selecting ``attn_norm`` or ``mlp_norm``.
    """

    name = "broken.structure_remap"

    def _new_group(self, chunk: ChunkState, name: str, layer: int) -> GroupState | None:
        return GroupState(chunk, name, layer, self.cuda)  # recorded at its commit instead

    def _commit_forward(self, group: GroupState, release: tuple[torch.Tensor, ...]) -> None:
        if self.warmup:
            group.chunk.groups.append(group)
        super()._commit_forward(group, release)

    def _expect_group(self, chunk: ChunkState, name: str, layer: int) -> GroupState | None:
        for index in range(chunk.cursor, len(chunk.groups)):
            if chunk.groups[index].name == name:
                chunk.cursor = index + 1
                return chunk.groups[index]
        return None

    def end_iteration(self) -> None:
        for chunk in self._chunks.values():
            chunk.cursor = len(chunk.groups)  # no end-of-iteration structure check either
        super().end_iteration()


class MiddleStepSkip(OffloadContext):
    """A group left on the device in one step between the warmup and the final one (a per-step
    policy bug: an offloader that moves only on some iterations).

    In step 2 every layer-0 group stays on the device, and its log says so (``kept:skipped``).
    Values stay right and steps 0 and 5 move exactly the prediction, so only a check of every
    step sees it. Caught by transfer counts (the steps before the final one).
    """

    name = "broken.middle_step_skip"

    def _decide(self, group: GroupState) -> str:
        decision = super()._decide(group)
        if len(self._logs) == 2 and group.layer == 0 and decision == "offloaded":
            return "kept:skipped"
        return decision
