"""Comparing runs: per-microbatch loss traces, gradients and weights, and the verdict that tells
a graph change (the hooks alone change the numbers) from transport corruption (the copies do).

Exact comparison means bitwise: ``torch.equal`` on the fp32 loss tensors (NaN never equals).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True, slots=True)
class Divergence:
    """The first (step, microbatch) whose losses differ beyond the tolerance."""

    step: int
    microbatch: int
    expected: float
    got: float
    labels: tuple[str, str] = ("baseline", "offload")
    """What the expected and the got values are, for the message."""

    @property
    def abs_diff(self) -> float:
        return abs(self.got - self.expected)

    def __str__(self) -> str:
        return (
            f"step {self.step} microbatch {self.microbatch}: {self.labels[0]} {self.expected!r} "
            f"vs {self.labels[1]} {self.got!r} (|diff| {self.abs_diff:.3e})"
        )


def losses_match(a: torch.Tensor, b: torch.Tensor, tolerance: float = 0.0) -> bool:
    """Bitwise equality, or |a - b| <= tolerance everywhere (never true with NaN)."""
    if a.shape != b.shape:
        return False
    if tolerance == 0.0:
        return torch.equal(a, b)
    return bool(((a - b).abs() <= tolerance).all())


def first_divergence(
    expected: torch.Tensor,
    got: torch.Tensor,
    tolerance: float = 0.0,
    labels: tuple[str, str] = ("baseline", "offload"),
) -> Divergence | None:
    """The first (step, microbatch) in row-major order that does not match."""
    steps, microbatches = expected.shape
    for step in range(steps):
        for mb in range(microbatches):
            e, g = expected[step, mb], got[step, mb]
            if not losses_match(e.reshape(1), g.reshape(1), tolerance):
                return Divergence(
                    step=step, microbatch=mb, expected=float(e), got=float(g), labels=labels
                )
    return None


def first_tensor_difference(
    expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]
) -> tuple[str, float] | None:
    """(name, max |diff|) of the first tensor, in ``expected``'s order, not bitwise equal."""
    for name, tensor in expected.items():
        other = got.get(name)
        if other is None or not torch.equal(tensor, other):
            if other is None or tensor.shape != other.shape:
                return name, float("inf")
            diff = (tensor.float() - other.float()).abs().max()
            return name, float(diff)
    return None


def ulps(expected: float, got: float, dtype: torch.dtype) -> int:
    """Distance in units in the last place of ``dtype`` between two values (0 when equal)."""
    int_dtype = {
        torch.float32: torch.int32,
        torch.bfloat16: torch.int16,
        torch.float16: torch.int16,
    }
    if dtype not in int_dtype:
        raise ValueError(f"ulps: unsupported dtype {dtype}")

    def ordered(value: float) -> int:
        bits = int(torch.tensor([value], dtype=dtype).view(int_dtype[dtype]).item())
        # Map the sign-magnitude bit pattern onto a monotonic integer line.
        width = torch.finfo(dtype).bits
        return bits if bits >= 0 else -(bits & ((1 << (width - 1)) - 1))

    return abs(ordered(got) - ordered(expected))


_SHORT_DTYPE = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def loss_table(
    expected: torch.Tensor, got: torch.Tensor, labels: tuple[str, str] = ("baseline", "offload")
) -> str:
    """Per step x microbatch: both losses, abs and rel difference, and the distance in ULPs of
    the dtype the losses were computed in (fp32: the loss is reduced in fp32 in both
    precisions, so bf16 ULPs would round real differences away)."""
    dtype = expected.dtype
    ulps_label = f"ulps {_SHORT_DTYPE.get(dtype, str(dtype))}"
    lines = [
        f"{'step':>4} {'mb':>3} {labels[0]:>22} {labels[1]:>22} {'abs diff':>10} "
        f"{'rel diff':>10} {ulps_label:>9}"
    ]
    steps, microbatches = expected.shape
    for step in range(steps):
        for mb in range(microbatches):
            e, g = float(expected[step, mb]), float(got[step, mb])
            diff = abs(g - e)
            rel = diff / abs(e) if e else float("inf") if diff else 0.0
            lines.append(
                f"{step:>4} {mb:>3} {e!r:>22} {g!r:>22} {diff:>10.3e} {rel:>10.3e} "
                f"{ulps(e, g, dtype):>9}"
            )
    return "\n".join(lines)


@dataclass(frozen=True, kw_only=True, slots=True)
class Verdict:
    """Offload vs the two baselines."""

    ok: bool
    kind: str
    """``pass``, ``graph_change`` (hooks baseline already differs, or offload equals hooks) or
    ``transport`` (hooks equal plain, offload differs: the copies corrupt data)."""
    message: str


def verdict(
    plain: torch.Tensor, hooks: torch.Tensor | None, offload: torch.Tensor, tolerance: float
) -> Verdict:
    """Classify the offload run against the ``plain`` and ``hooks`` baselines."""
    divergence = first_divergence(plain, offload, tolerance)
    if divergence is None:
        return Verdict(ok=True, kind="pass", message="offload matches the plain baseline")
    if hooks is None:
        return Verdict(ok=False, kind="mismatch", message=f"first divergence at {divergence}")
    hooks_vs_plain = first_divergence(plain, hooks, tolerance)
    offload_vs_hooks = first_divergence(hooks, offload, tolerance)
    if hooks_vs_plain is not None or offload_vs_hooks is None:
        why = (
            f"the hooks baseline already differs from plain at {hooks_vs_plain}"
            if hooks_vs_plain is not None
            else "offload equals the hooks baseline"
        )
        return Verdict(
            ok=False,
            kind="graph_change",
            message=f"graph change: the offload machinery changes the computation ({why}); "
            f"first divergence from plain at {divergence}",
        )
    return Verdict(
        ok=False,
        kind="transport",
        message=f"transport corruption: hooks baseline equals plain but offload differs; "
        f"first divergence at {divergence}",
    )


def layout_verdict(
    plain: torch.Tensor, layout: torch.Tensor, offload: torch.Tensor, tolerance: float
) -> Verdict:
    """Classify an offload run whose backend declares contiguous reloads against the layout
    baseline (``harness.offload.layout``); the layout change's own effect on the plain baseline
    is stated, not judged."""
    effect = first_divergence(plain, layout, tolerance)
    said = (
        "the layout change alone leaves every loss bitwise equal to the plain baseline's"
        if effect is None
        else f"the layout change alone first moves the plain baseline's loss at {effect}"
    )
    divergence = first_divergence(layout, offload, tolerance)
    if divergence is None:
        return Verdict(
            ok=True,
            kind="pass",
            message="offload matches the layout baseline (the declared contiguous reloads made "
            f"on the device, nothing moved); {said}",
        )
    return Verdict(
        ok=False,
        kind="transport",
        message="transport corruption: offload differs from the layout baseline (the declared "
        f"contiguous reloads made on the device, nothing moved); first divergence at "
        f"{divergence}; {said}",
    )
