"""Every configuration rule of the offloader, the model spec and the run spec raises a
``ValueError`` whose single line says what is wrong and what is allowed."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from harness.cases import Case, model_spec
from harness.offload.backends import resolve_backend
from harness.offload.config import OffloadConfig
from harness.offload.reference import OffloadContext, RaceDelays
from harness.vocab.spec import ModelSpec, RunSpec, parse_pattern, preset

BAD_INPUTS: list[tuple[str, Callable[[], object], str]] = [
    ("empty pattern", lambda: parse_pattern(""), "non-empty"),
    ("unknown symbol", lambda: parse_pattern("+x-"), "unknown symbol 'x'"),
    ("attention with MLA", lambda: parse_pattern("*-+-"), "mixes '*'"),
    ("stage boundary", lambda: parse_pattern("+-|+-"), "pipeline-stage"),
    ("MTP separator", lambda: parse_pattern("+-/+-"), "multi-token"),
    ("zero hidden size", lambda: ModelSpec(pattern="+-", hidden_size=0), "hidden_size"),
    ("heads not dividing", lambda: ModelSpec(pattern="+-", num_heads=5), "divisible"),
    ("top-k above experts", lambda: ModelSpec(pattern="E", moe_topk=9), "moe_topk"),
    ("unknown MoE path", lambda: ModelSpec(pattern="E", moe_path="grouped"), "moe_path"),
    ("zero steps", lambda: RunSpec(steps=0), "steps"),
    ("unknown schedule", lambda: RunSpec(schedule="zb"), "schedule"),
    ("unknown precision", lambda: RunSpec(precision="fp8"), "precision"),
    ("unknown optimizer", lambda: RunSpec(optimizer="lion"), "optimizer"),
    ("negative clip", lambda: RunSpec(grad_clip=-1.0), "grad_clip"),
    ("unknown preset", lambda: preset("hybrid-huge"), "unknown model preset"),
    ("unknown family", lambda: model_spec("rnn", "tiny"), "unknown model family"),
    ("unknown module", lambda: OffloadConfig(offload_modules=("mlp_fc1",)), "unknown offload"),
    ("no modules", lambda: OffloadConfig(offload_modules=()), "must not be empty"),
    ("string modules", lambda: OffloadConfig(offload_modules="core_attn"), "tuple of names"),
    ("duplicate module", lambda: OffloadConfig(offload_modules=("core_attn",) * 2), "twice"),
    ("attn_proj alone", lambda: OffloadConfig(offload_modules=("attn_proj",)), "requires"),
    (
        "fused with fc1",
        lambda: OffloadConfig(offload_modules=("fused_group_mlp", "expert_fc1")),
        "cannot be combined",
    ),
    (
        "negative min size",
        lambda: OffloadConfig(offload_modules=("core_attn",), min_offloaded_tensor_size=-1),
        "min_offloaded_tensor_size",
    ),
    (
        "fraction above 1",
        lambda: OffloadConfig(offload_modules=("core_attn",), activation_offload_fraction=1.5),
        "[0, 1]",
    ),
    (
        "negative max in-flight",
        lambda: OffloadConfig(offload_modules=("core_attn",), max_inflight_offloads=-1),
        "max_inflight_offloads",
    ),
    (
        "bool max in-flight",
        lambda: OffloadConfig(offload_modules=("core_attn",), max_inflight_offloads=True),
        "max_inflight_offloads",
    ),
    (
        "negative delta",
        lambda: OffloadConfig(
            offload_modules=("core_attn",), delta_offload_bytes_across_pp_ranks=-5
        ),
        "delta_offload_bytes",
    ),
    (
        "mlp_norm without MoE",
        lambda: OffloadConfig(offload_modules=("mlp_norm",)).check_applies_to(
            ModelSpec(pattern="+-+-+-")
        ),
        "cannot apply",
    ),
    (
        "fused name on the unfused path",
        lambda: OffloadConfig(offload_modules=("fused_group_mlp",)).check_applies_to(
            ModelSpec(pattern="*E")
        ),
        "cannot apply",
    ),
    ("unknown backend", lambda: resolve_backend("megatron"), "unknown backend"),
    ("backend module missing", lambda: resolve_backend("no_such_mod:make"), "cannot import"),
    (
        "backend attribute missing",
        lambda: resolve_backend("harness.vocab.spec:nothing"),
        "no callable",
    ),
    (
        "race delays on CPU",
        lambda: OffloadContext(
            OffloadConfig(offload_modules=("core_attn",)), "cpu", delays=RaceDelays(d2h=10)
        ),
        "CUDA",
    ),
    ("negative delay", lambda: RaceDelays(h2d=-1), "RaceDelays.h2d"),
    (
        "tolerance without reason",
        lambda: Case(family="hybrid", offload=("core_attn",), tolerance=1e-6),
        "tolerance_reason",
    ),
]


@pytest.mark.parametrize(
    ("build", "fragment"),
    [pytest.param(build, fragment, id=name) for name, build, fragment in BAD_INPUTS],
)
def test_bad_input_is_one_clear_line(build: Callable[[], object], fragment: str) -> None:
    with pytest.raises(ValueError) as info:
        build()
    message = str(info.value)
    assert fragment in message, f"message {message!r} lacks {fragment!r}"
    assert "\n" not in message, f"message spans several lines: {message!r}"


def test_cuda_offloader_without_gpu_is_refused() -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible; the refusal only applies without one")
    with pytest.raises(ValueError, match="no CUDA device is visible"):
        OffloadContext(OffloadConfig(offload_modules=("core_attn",)), "cuda")
