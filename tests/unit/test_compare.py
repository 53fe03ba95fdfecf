"""Loss comparison helpers: bitwise matching, first divergence, ULP distance, verdicts."""

from __future__ import annotations

import math

import pytest
import torch

from harness.util.compare import (
    first_divergence,
    first_tensor_difference,
    losses_match,
    ulps,
    verdict,
)

PLAIN = torch.tensor([[1.0, 2.0], [3.0, 4.0]])


def _bumped(step: int, mb: int, by: float = 1e-3) -> torch.Tensor:
    out = PLAIN.clone()
    out[step, mb] += by
    return out


def test_bitwise_match_and_nan() -> None:
    assert losses_match(PLAIN, PLAIN.clone())
    assert not losses_match(PLAIN, _bumped(1, 1))
    nan = PLAIN.clone()
    nan[0, 0] = math.nan
    assert not losses_match(nan, nan.clone()), "NaN must never count as equal"
    assert losses_match(PLAIN, _bumped(1, 1, 1e-4), tolerance=1e-3)


def test_first_divergence_is_row_major() -> None:
    got = _bumped(1, 0)
    got[1, 1] += 1.0
    found = first_divergence(PLAIN, got)
    assert found is not None and (found.step, found.microbatch) == (1, 0)
    assert found.expected == 3.0 and found.got == pytest.approx(3.001)
    assert first_divergence(PLAIN, PLAIN.clone()) is None


@pytest.mark.parametrize(
    ("a", "b", "dtype", "expected"),
    [
        (1.0, 1.0, torch.float32, 0),
        (1.0, math.nextafter(1.0, 2.0), torch.float64, None),  # unsupported dtype
        (1.0, 1.0 + 2**-23, torch.float32, 1),
        (1.0, 1.0 + 2 * 2**-23, torch.float32, 2),
        (-0.0, 0.0, torch.float32, 0),
        (-(2**-149), 2**-149, torch.float32, 2),  # across zero: two denormal steps
        (1.0, 1.0 + 2**-7, torch.bfloat16, 1),
    ],
)
def test_ulps(a: float, b: float, dtype: torch.dtype, expected: int | None) -> None:
    if expected is None:
        with pytest.raises(ValueError, match="unsupported dtype"):
            ulps(a, b, dtype)
        return
    assert ulps(a, b, dtype) == expected
    assert ulps(b, a, dtype) == expected


def test_verdict_classifies_graph_change_and_transport() -> None:
    ok = verdict(PLAIN, PLAIN.clone(), PLAIN.clone(), 0.0)
    assert ok.ok and ok.kind == "pass"
    transport = verdict(PLAIN, PLAIN.clone(), _bumped(0, 1), 0.0)
    assert not transport.ok and transport.kind == "transport"
    assert "step 0 microbatch 1" in transport.message
    hooks_differ = verdict(PLAIN, _bumped(0, 0), _bumped(0, 0), 0.0)
    assert hooks_differ.kind == "graph_change"
    offload_equals_hooks = verdict(PLAIN, _bumped(1, 0), _bumped(1, 0), 0.0)
    assert offload_equals_hooks.kind == "graph_change"


def test_first_tensor_difference_names_the_tensor() -> None:
    a = {"w1": torch.zeros(3), "w2": torch.ones(2)}
    b = {"w1": torch.zeros(3), "w2": torch.tensor([1.0, 1.5])}
    assert first_tensor_difference(a, b) == ("w2", 0.5)
    assert first_tensor_difference(a, a) is None
    assert first_tensor_difference(a, {"w1": torch.zeros(3)}) == ("w2", math.inf)
