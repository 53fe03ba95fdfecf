"""Autograd helpers shared by the harness's unit tests."""

from __future__ import annotations

from typing import Any

import torch


class SaveAndHandBack(torch.autograd.Function):
    """Identity on ``x``; saves ``tensors`` and appends what backward unpacks to ``sink``."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, sink: list[torch.Tensor], *tensors: torch.Tensor
    ) -> torch.Tensor:
        ctx.sink = sink
        ctx.save_for_backward(*tensors)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        unpacked = ctx.saved_tensors
        ctx.sink.extend(unpacked)
        return (grad, None, *([None] * len(unpacked)))
