"""HybridModel: embedding, one layer per pattern symbol, final norm, output head; its builder,
deterministic initialisation and the token-batch generator.

Shape legend: B micro-batch size, T sequence length, D hidden size, V vocabulary size.

``build_model(spec, generator)`` is a pure function: two builds from generators seeded alike
are bitwise identical, and nothing touches the global RNG. A case trains the same (spec, seed)
four times (plain, hooks, offload, disabled), so ``seeded_model`` and ``make_batches`` keep their
last result per process and hand out copies of it: bitwise the same as building anew.
"""

from __future__ import annotations

import functools
import importlib

import torch
import torch.nn.functional as F
from torch import nn

from harness.models.layers import RMSNorm
from harness.offload.protocol import Offloader
from harness.vocab.groups import LAYERS
from harness.vocab.spec import ModelSpec, chunk_layers


def layer_class(symbol: str) -> type[nn.Module]:
    """Our layer class for a pattern symbol (``harness.vocab.groups.LAYERS``' ``layer_class``)."""
    module, _, name = LAYERS[symbol].layer_class.partition(":")
    return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]


INIT_STD = 0.02
DATA_SHARD_STRIDE = 7_919 * 1_000_003
"""Generator-seed distance between data shards (larger than any (seed, step, mb) offset)."""


class HybridModel(nn.Module):
    """A decoder stack built from a layer pattern; forward takes the offloader explicitly."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.embedding = nn.Parameter(torch.empty(spec.vocab_size, spec.hidden_size))
        self.layers = nn.ModuleList(layer_class(symbol)(spec) for symbol in spec.layers)
        self.final_norm = RMSNorm(spec.hidden_size)
        self.head = nn.Parameter(torch.empty(spec.vocab_size, spec.hidden_size))
        for layer in self.layers:
            layer.register_forward_pre_hook(_mark_layer_parameters)

    def forward(self, tokens_BT: torch.Tensor, off: Offloader) -> torch.Tensor:
        """Logits [B, T, V] (Megatron marks parameters not-offloadable on the first forward;
        marking is idempotent, so it is done on every forward).

        Each layer marks its own parameters in a forward pre-hook: under FSDP2 a layer's
        unsharded parameters exist only from its own pre-forward hook on (FSDP2 prepends its
        hook, so ours runs after the all-gather), and the sharded ones outside are DTensors
        with no storage of their own."""
        return self.forward_chunk(tokens_BT, off, 0, 1)

    def forward_chunk(
        self, x: torch.Tensor, off: Offloader, chunk: int, chunks: int
    ) -> torch.Tensor:
        """One model chunk's forward (a virtual pipeline stage): chunk 0 embeds tokens [B, T],
        a later one takes the previous chunk's hidden states [B, T, D]; the last chunk returns
        logits [B, T, V], the others hidden states. ``forward`` is the single chunk 0 of 1."""
        root = [p for name, p in self.named_parameters() if not name.startswith("layers.")]
        off.mark_not_offloadable(*root, *self.buffers())
        x_BTD = F.embedding(x, self.embedding) if chunk == 0 else x
        for index in chunk_layers(len(self.layers), chunk, chunks):
            x_BTD = self.layers[index](x_BTD, off, index)
        if chunk < chunks - 1:
            return x_BTD
        return F.linear(self.final_norm(x_BTD), self.head)


def _mark_layer_parameters(layer: nn.Module, args: tuple[object, ...]) -> None:
    """Forward pre-hook of a layer (called as ``layer(x, offloader, index)``)."""
    off: Offloader = args[1]  # type: ignore[assignment]
    off.mark_not_offloadable(*layer.parameters())


def init_weights(model: nn.Module, generator: torch.Generator) -> None:
    """Norm weights 1, everything else N(0, 0.02), drawn in ``named_parameters`` order."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                values = torch.empty(param.shape, dtype=torch.float32)
                values.normal_(0.0, INIT_STD, generator=generator)
                param.copy_(values)


def build_model(spec: ModelSpec, generator: torch.Generator) -> HybridModel:
    """A fp32 CPU model for ``spec`` with weights drawn from ``generator``."""
    model = HybridModel(spec)
    init_weights(model, generator)
    return model


_INITIAL_WEIGHTS: dict[tuple[ModelSpec, int], dict[str, torch.Tensor]] = {}
"""The initial weights of the last ``seeded_model`` build in this process (one entry)."""


def seeded_model(spec: ModelSpec, seed: int) -> HybridModel:
    """``build_model(spec, torch.Generator().manual_seed(seed))``, bitwise, without drawing the
    weights again when this process built the same (spec, seed) last (drawing hybrid-small's 56M
    weights from the generator takes 0.5-0.75 s on the 2-core CPU machine; with this and
    ``make_batches``' reuse the seed row's plain run on the H200 fell from 1.57 to 1.17 s)."""
    key = (spec, seed)
    weights = _INITIAL_WEIGHTS.get(key)
    if weights is None:
        model = build_model(spec, torch.Generator().manual_seed(seed))
        _INITIAL_WEIGHTS.clear()
        _INITIAL_WEIGHTS[key] = {n: p.detach().clone() for n, p in model.named_parameters()}
        return model
    model = HybridModel(spec)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(weights[name])
    return model


def loss_fn(logits_BTV: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy, computed in fp32."""
    return F.cross_entropy(logits_BTV.float().flatten(0, 1), targets_BT.flatten())


def make_batches(
    spec: ModelSpec, *, seed: int, steps: int, microbatches: int, shard: int = 0
) -> torch.Tensor:
    """Token sequences [steps, microbatches, B, T + 1] (``draw_batches``), a fresh copy of the
    last ones drawn in this process when the arguments are the same (hybrid-small's take about
    0.2 s to draw: a loop over its 1024 positions per microbatch)."""
    return _last_batches(spec, seed, steps, microbatches, shard).clone()


@functools.lru_cache(maxsize=1)
def _last_batches(
    spec: ModelSpec, seed: int, steps: int, microbatches: int, shard: int
) -> torch.Tensor:
    return draw_batches(spec, seed=seed, steps=steps, microbatches=microbatches, shard=shard)


def draw_batches(
    spec: ModelSpec, *, seed: int, steps: int, microbatches: int, shard: int = 0
) -> torch.Tensor:
    """Token sequences [steps, microbatches, B, T + 1], fixed per (seed, shard, step,
    microbatch); ``shard`` selects a data-parallel rank's own samples of the same language.

    Each sequence mostly follows a fixed random successor table (90%) with random jumps, so the
    model has something to learn and the loss falls. Inputs are ``[..., :-1]``, targets
    ``[..., 1:]``. Each (step, microbatch) draws from its own generator, so a batch does not
    depend on how many steps or microbatches a run has.
    """
    V, B, T = spec.vocab_size, spec.micro_batch_size, spec.seq_length
    table = torch.randperm(V, generator=torch.Generator().manual_seed(seed))
    out = torch.empty(steps, microbatches, B, T + 1, dtype=torch.long)
    for step in range(steps):
        for mb in range(microbatches):
            index = seed * 1_000_003 + step * 1_009 + mb + 1
            gen = torch.Generator().manual_seed(index + shard * DATA_SHARD_STRIDE)
            jumps = torch.randint(V, (B, T + 1), generator=gen)
            follow = torch.rand((B, T + 1), generator=gen) < 0.9
            seq = out[step, mb]
            seq[:, 0] = jumps[:, 0]
            for t in range(1, T + 1):
                seq[:, t] = torch.where(follow[:, t], table[seq[:, t - 1]], jumps[:, t])
    return out
