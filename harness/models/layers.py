"""Dense layers of the hybrid model: RMSNorm, RoPE, unfused core attention, MLA, standard
attention, SwiGLU MLP; and the layer wrappers that open Megatron-Core's offload groups.

Shape legend (suffixes on tensor names):
    B micro-batch size   T sequence length   D hidden size       H attention heads
    K query/key head width   Kn no-rope part   R rope part       Dv value head width
    F MLP inner width    Q q LoRA rank       C kv LoRA rank

Every layer takes the offloader and its own layer index and opens exactly the groups of its
symbol's template (``harness.vocab.spec.group_template``), with Megatron's forced-release tensors.
Unselected groups pass through, so the same code is the baseline.

Only deterministic kernels are used (matmul, softmax, elementwise, cat): no atomics, so two runs
with the same inputs are bitwise equal on CPU and, with deterministic algorithms on, on CUDA.
Parameters are plain ``nn.Parameter(torch.empty(...))`` filled later by ``init_weights`` from an
explicit generator: constructors touch no RNG.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from harness.offload.protocol import Offloader
from harness.vocab.spec import ModelSpec


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape))


class _RMSNormFunction(torch.autograd.Function):
    """Fused RMSNorm (as TransformerEngine's): one autograd node that saves (x, rstd).

    One node matters for bitwise parity: a group start is an identity op in front of the norm,
    so the norm's input gradient reaches the residual stream as a single term either way. An
    unfused norm reads x twice (pow, mul), and the identity op would then change the order in
    which three fp32 gradient terms are summed.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x.float()
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, rstd, weight)
        return (x32 * rstd).to(x.dtype) * weight

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, rstd, weight = ctx.saved_tensors
        xhat = x.float() * rstd
        grad_xhat = grad.float() * weight.float()
        dot = (grad_xhat * xhat).mean(-1, keepdim=True)
        grad_x = ((grad_xhat - xhat * dot) * rstd).to(x.dtype)
        grad_w = (grad.float() * xhat.to(x.dtype).float()).flatten(0, -2).sum(0)
        return grad_x, grad_w.to(weight.dtype), None


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32, returned in the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNormFunction.apply(x, self.weight, self.eps)


class Rotary(nn.Module):
    """Rotary position embedding over the last dim (split-half form); tables are buffers."""

    def __init__(self, dim: int, seq_length: int, base: float = 10000.0) -> None:
        super().__init__()
        half = dim // 2
        inv_freq = base ** (-torch.arange(half, dtype=torch.float64) / half)
        angles_TR = torch.outer(torch.arange(seq_length, dtype=torch.float64), inv_freq)
        self.register_buffer("cos_TR", angles_TR.cos().float(), persistent=False)
        self.register_buffer("sin_TR", angles_TR.sin().float(), persistent=False)

    def forward(self, x_BTHR: torch.Tensor) -> torch.Tensor:
        # Multiplying by a table that needs no grad saves only the table (marked
        # not-offloadable by the model), never the activation.
        T = x_BTHR.shape[1]
        cos = self.cos_TR[:T, None, :]
        sin = self.sin_TR[:T, None, :]
        x1, x2 = x_BTHR.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def causal_bias(seq_length: int) -> torch.Tensor:
    """Additive mask: 0 on and below the diagonal, -inf above (an add saves nothing)."""
    return torch.full((seq_length, seq_length), float("-inf")).triu(1)


def core_attention(
    q_BHTK: torch.Tensor, k_BHTK: torch.Tensor, v_BHTV: torch.Tensor, bias_TT: torch.Tensor
) -> torch.Tensor:
    """Unfused causal attention (matmul, softmax in fp32, matmul); returns [B, T, H*Dv]."""
    B, _, T, K = q_BHTK.shape
    scores_BHTT = torch.matmul(q_BHTK, k_BHTK.transpose(-2, -1)) * (1.0 / math.sqrt(K))
    scores_BHTT = scores_BHTT + bias_TT.to(scores_BHTT.dtype)
    probs_BHTT = torch.softmax(scores_BHTT.float(), dim=-1).to(q_BHTK.dtype)
    out_BHTV = torch.matmul(probs_BHTT, v_BHTV)
    return out_BHTV.transpose(1, 2).reshape(B, T, -1)


class _AttentionTail(nn.Module):
    """core_attn and attn_proj groups, shared by MLA and standard attention."""

    def __init__(self, spec: ModelSpec, value_width: int) -> None:
        super().__init__()
        self.proj = _param(spec.hidden_size, value_width)
        self.register_buffer("bias_TT", causal_bias(spec.seq_length), persistent=False)

    def forward(
        self,
        q_BHTK: torch.Tensor,
        k_BHTK: torch.Tensor,
        v_BHTV: torch.Tensor,
        off: Offloader,
        layer: int,
    ) -> torch.Tensor:
        core = off.group("core_attn", q_BHTK, layer=layer)
        with core:
            attn_BTX = core_attention(core.input, k_BHTK, v_BHTV, self.bias_TT)
        attn_BTX = core.commit(attn_BTX, release=(q_BHTK, k_BHTK, v_BHTV))
        proj = off.group("attn_proj", attn_BTX, layer=layer)
        with proj:
            out_BTD = F.linear(proj.input, self.proj)
        return proj.commit(out_BTD, release=(attn_BTX,))


class MLASelfAttention(nn.Module):
    """Multi-latent attention: LoRA-compressed q, compressed kv with a shared rope key part."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        H, Kn, R, Dv = spec.num_heads, spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim
        self.heads, self.nope, self.rope_dim, self.v_dim = H, Kn, R, Dv
        self.kv_rank = spec.kv_lora_rank
        self.q_down = _param(spec.q_lora_rank, spec.hidden_size)
        self.q_norm = RMSNorm(spec.q_lora_rank)
        self.q_up = _param(H * (Kn + R), spec.q_lora_rank)
        self.kv_down = _param(spec.kv_lora_rank + R, spec.hidden_size)
        self.kv_norm = RMSNorm(spec.kv_lora_rank)
        self.kv_up = _param(H * (Kn + Dv), spec.kv_lora_rank)
        self.rotary = Rotary(R, spec.seq_length)
        self.tail = _AttentionTail(spec, H * Dv)

    def forward(self, h_BTD: torch.Tensor, off: Offloader, layer: int) -> torch.Tensor:
        B, T, _ = h_BTD.shape
        H, Kn, R = self.heads, self.nope, self.rope_dim
        qkv = off.group("qkv_linear", h_BTD, layer=layer)
        with qkv:
            x_BTD = qkv.input
            q_BTHK = F.linear(self.q_norm(F.linear(x_BTD, self.q_down)), self.q_up)
            q_BTHK = q_BTHK.view(B, T, H, Kn + R)
            q_nope_BTHn, q_pe_BTHR = q_BTHK.split((Kn, R), dim=-1)
            kv_BTX = F.linear(x_BTD, self.kv_down)
            c_BTC, k_pe_BTR = kv_BTX.split((self.kv_rank, R), dim=-1)
            kv_BTHX = F.linear(self.kv_norm(c_BTC), self.kv_up).view(B, T, H, Kn + self.v_dim)
            k_nope_BTHn, v_BTHV = kv_BTHX.split((Kn, self.v_dim), dim=-1)
            k_pe_BT1R = self.rotary(k_pe_BTR.unsqueeze(2))
            q_BHTK = torch.cat((q_nope_BTHn, self.rotary(q_pe_BTHR)), dim=-1).transpose(1, 2)
            k_BTHK = torch.cat((k_nope_BTHn, k_pe_BT1R.expand(B, T, H, R)), dim=-1)
            k_BHTK = k_BTHK.transpose(1, 2)
            v_BHTV = v_BTHV.transpose(1, 2)
        # MLA's qkv_linear releases its input (the norm output) once offloaded.
        q_BHTK, k_BHTK, v_BHTV = qkv.commit((q_BHTK, k_BHTK, v_BHTV), release=(h_BTD,))
        return self.tail(q_BHTK, k_BHTK, v_BHTV, off, layer)


class SelfAttention(nn.Module):
    """Standard attention with the input norm fused into the QKV projection (as Megatron's
    TELayerNormColumnParallelLinear): the norm runs inside qkv_linear, there is no attn_norm."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.heads = spec.num_heads
        self.head_dim = spec.hidden_size // spec.num_heads
        self.norm = RMSNorm(spec.hidden_size)
        self.qkv = _param(3 * spec.hidden_size, spec.hidden_size)
        self.rotary = Rotary(self.head_dim, spec.seq_length)
        self.tail = _AttentionTail(spec, spec.hidden_size)

    def forward(self, x_BTD: torch.Tensor, off: Offloader, layer: int) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        qkv = off.group("qkv_linear", x_BTD, layer=layer)
        with qkv:
            qkv_BT3HK = F.linear(self.norm(qkv.input), self.qkv).view(
                B, T, 3, self.heads, self.head_dim
            )
            q_BTHK, k_BTHK, v_BTHK = qkv_BT3HK.unbind(2)
            q_BHTK = self.rotary(q_BTHK).transpose(1, 2)
            k_BHTK = self.rotary(k_BTHK).transpose(1, 2)
            v_BHTK = v_BTHK.transpose(1, 2)
        q_BHTK, k_BHTK, v_BHTK = qkv.commit((q_BHTK, k_BHTK, v_BHTK), release=())
        return self.tail(q_BHTK, k_BHTK, v_BHTK, off, layer)


class SwiGLU(nn.Module):
    """Dense MLP: fc1 to 2F, silu(gate) * up, fc2 back to D."""

    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.fc1 = _param(2 * inner, hidden)
        self.fc2 = _param(hidden, inner)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        gate_BTF, up_BTF = F.linear(x_BTD, self.fc1).chunk(2, dim=-1)
        return F.linear(F.silu(gate_BTF) * up_BTF, self.fc2)


def normed_residual(
    off: Offloader,
    name: str,
    layer: int,
    x_BTD: torch.Tensor,
    norm: nn.Module,
    body: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """``x + body(norm(x))`` with the norm in group ``name`` (attn_norm, mlp_norm): the group
    spans the whole block, commits after the residual add and releases the residual input."""
    group = off.group(name, x_BTD, layer=layer)
    with group:
        h_BTD = norm(group.input)
    out_BTD = x_BTD + body(h_BTD)
    return group.commit(out_BTD, release=(x_BTD,))


class MLALayer(nn.Module):
    """``+``: input norm (group attn_norm, spanning the whole attention block) + MLA."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.input_norm = RMSNorm(spec.hidden_size)
        self.attention = MLASelfAttention(spec)

    def forward(self, x_BTD: torch.Tensor, off: Offloader, layer: int) -> torch.Tensor:
        return normed_residual(
            off, "attn_norm", layer, x_BTD, self.input_norm, lambda h: self.attention(h, off, layer)
        )


class AttentionLayer(nn.Module):
    """``*``: standard attention with its norm fused into qkv_linear; residual add."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.attention = SelfAttention(spec)

    def forward(self, x_BTD: torch.Tensor, off: Offloader, layer: int) -> torch.Tensor:
        return x_BTD + self.attention(x_BTD, off, layer)


class MLPLayer(nn.Module):
    """``-``: norm fused into fc1, dense SwiGLU, residual add; opens no offload group."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.norm = RMSNorm(spec.hidden_size)
        self.mlp = SwiGLU(spec.hidden_size, spec.ffn_hidden_size)

    def forward(self, x_BTD: torch.Tensor, off: Offloader, layer: int) -> torch.Tensor:
        return x_BTD + self.mlp(self.norm(x_BTD))
