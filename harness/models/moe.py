"""Mixture-of-experts layer (``E``): pre-MLP norm, softmax top-k router, capacity-bounded token
permutation, experts on an unfused (fc1 -> act -> fc2) or a fused path.

Shape legend:
    B micro-batch size   T sequence length   D hidden size   N tokens (B*T)
    E experts            k top-k             C expert capacity (token slots per expert)
    F expert inner width

Permutation uses one-hot dispatch/combine matrices and matmuls (the Switch-Transformer form)
rather than scatter/index_add, so it needs no host sync for per-expert counts and its backward
has no atomics: results are bitwise reproducible. Tokens beyond an expert's capacity are dropped
(their MoE output is zero), first choices before second choices, earlier tokens first.

Offload groups, Megatron's template for a MoE layer:
    mlp_norm         spans norm + whole MoE block, committed after the residual add
    expert_fc1       fc1 on the permuted tokens; releases the permuted tokens
    moe_act          the activation; committed after fc2; releases fc1's output
    fused_group_mlp  (fused path) the whole fc1+act+fc2 unit; releases the permuted tokens
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from harness.models.layers import RMSNorm, normed_residual
from harness.offload.protocol import Offloader
from harness.vocab.spec import ModelSpec


def expert_capacity(spec: ModelSpec) -> int:
    """Token slots per expert: ceil(N * k / E * capacity_factor)."""
    tokens = spec.micro_batch_size * spec.seq_length
    return math.ceil(tokens * spec.moe_topk / spec.num_experts * spec.moe_capacity_factor)


def route(logits_NE: torch.Tensor, topk: int, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch [N, E, C] (0/1, no grad) and combine [N, E, C] (router weights) matrices."""
    N, E = logits_NE.shape
    probs_NE = torch.softmax(logits_NE.float(), dim=-1)
    weights_Nk, experts_Nk = probs_NE.topk(topk, dim=-1)
    weights_Nk = weights_Nk / weights_Nk.sum(-1, keepdim=True)
    # Queue position of each (choice, token) in its expert: choice-major, then token order.
    onehot_kNE = F.one_hot(experts_Nk.t(), E)
    position_kNE = (onehot_kNE.reshape(topk * N, E).cumsum(0).reshape(topk, N, E) - 1) * onehot_kNE
    position_kN = position_kNE.sum(-1)
    kept_kN = position_kN < capacity
    slot_kNC = F.one_hot(position_kN.clamp(max=capacity - 1), capacity) * kept_kN[..., None]
    dispatch_kNEC = (onehot_kNE[..., None] * slot_kNC[:, :, None, :]).to(logits_NE.dtype)
    dispatch_NEC = dispatch_kNEC.sum(0)
    combine_NEC = (dispatch_kNEC * weights_Nk.t()[:, :, None, None].to(logits_NE.dtype)).sum(0)
    return dispatch_NEC, combine_NEC


class FusedExpertMLP(torch.autograd.Function):
    """fc1 -> silu(gate) * up -> fc2 for all experts as one autograd node (one saved set)."""

    @staticmethod
    def forward(
        ctx: Any, x_ECD: torch.Tensor, fc1_EDF: torch.Tensor, fc2_EFD: torch.Tensor
    ) -> torch.Tensor:
        fc1_ECF = torch.bmm(x_ECD, fc1_EDF)
        gate_ECF, up_ECF = fc1_ECF.chunk(2, dim=-1)
        act_ECF = F.silu(gate_ECF) * up_ECF
        ctx.save_for_backward(x_ECD, fc1_ECF, act_ECF, fc1_EDF, fc2_EFD)
        return torch.bmm(act_ECF, fc2_EFD)

    @staticmethod
    def backward(ctx: Any, grad_ECD: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x_ECD, fc1_ECF, act_ECF, fc1_EDF, fc2_EFD = ctx.saved_tensors
        grad_act_ECF = torch.bmm(grad_ECD, fc2_EFD.transpose(1, 2))
        grad_fc2 = torch.bmm(act_ECF.transpose(1, 2), grad_ECD)
        gate_ECF, up_ECF = fc1_ECF.chunk(2, dim=-1)
        sig_ECF = torch.sigmoid(gate_ECF)
        silu_ECF = gate_ECF * sig_ECF
        dsilu_ECF = sig_ECF * (1 + gate_ECF * (1 - sig_ECF))
        grad_fc1_out = torch.cat((grad_act_ECF * up_ECF * dsilu_ECF, grad_act_ECF * silu_ECF), -1)
        grad_x = torch.bmm(grad_fc1_out, fc1_EDF.transpose(1, 2))
        grad_fc1 = torch.bmm(x_ECD.transpose(1, 2), grad_fc1_out)
        return grad_x, grad_fc1, grad_fc2


class MoE(nn.Module):
    """Router + experts (grouped as [E, ...] batched matmuls)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        D, F_, E = spec.hidden_size, spec.moe_ffn_hidden_size, spec.num_experts
        self.topk = spec.moe_topk
        self.capacity = expert_capacity(spec)
        self.fused = spec.moe_path == "fused"
        self.router = nn.Parameter(torch.empty(E, D))
        self.fc1 = nn.Parameter(torch.empty(E, D, 2 * F_))
        self.fc2 = nn.Parameter(torch.empty(E, F_, D))

    def forward(self, h_BTD: torch.Tensor, off: Offloader, layer: int) -> torch.Tensor:
        B, T, D = h_BTD.shape
        h_ND = h_BTD.reshape(B * T, D)
        dispatch_NEC, combine_NEC = route(F.linear(h_ND, self.router), self.topk, self.capacity)
        N, E, C = dispatch_NEC.shape
        permuted_ECD = (dispatch_NEC.reshape(N, E * C).t() @ h_ND).view(E, C, D)
        if self.fused:
            out_ECD = self._fused(permuted_ECD, off, layer)
        else:
            out_ECD = self._unfused(permuted_ECD, off, layer)
        y_ND = combine_NEC.reshape(N, E * C) @ out_ECD.reshape(E * C, D)
        return y_ND.view(B, T, D)

    def _unfused(self, permuted_ECD: torch.Tensor, off: Offloader, layer: int) -> torch.Tensor:
        fc1 = off.group("expert_fc1", permuted_ECD, layer=layer)
        with fc1:
            fc1_ECF = torch.bmm(fc1.input, self.fc1)
        fc1_ECF = fc1.commit(fc1_ECF, release=(permuted_ECD,))
        act = off.group("moe_act", fc1_ECF, layer=layer)
        with act:
            gate_ECF, up_ECF = act.input.chunk(2, dim=-1)
            act_ECF = F.silu(gate_ECF) * up_ECF
        out_ECD = torch.bmm(act_ECF, self.fc2)
        # Committed after fc2, so fc1's output is back before the activation's backward.
        return act.commit(out_ECD, release=(fc1_ECF,))

    def _fused(self, permuted_ECD: torch.Tensor, off: Offloader, layer: int) -> torch.Tensor:
        fused = off.group("fused_group_mlp", permuted_ECD, layer=layer)
        with fused:
            out_ECD = FusedExpertMLP.apply(fused.input, self.fc1, self.fc2)
        return fused.commit(out_ECD, release=(permuted_ECD,))


class MoELayer(nn.Module):
    """``E``: pre-MLP norm (group mlp_norm, spanning the whole MoE block) + MoE + residual."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.pre_mlp_norm = RMSNorm(spec.hidden_size)
        self.moe = MoE(spec)

    def forward(self, x_BTD: torch.Tensor, off: Offloader, layer: int) -> torch.Tensor:
        return normed_residual(
            off, "mlp_norm", layer, x_BTD, self.pre_mlp_norm, lambda h: self.moe(h, off, layer)
        )
