"""Four broken variants of ``my_offloader.MyOffloader``, each a bug class the harness must catch
with a message naming the step, microbatch, layer and group (tests/detection/test_third_party.py).

    cd examples && offload-harness run --backend my_offloader_broken:DropsOneReload
"""

import torch
from my_offloader import Group, MyOffloader


class DropsOneReload(MyOffloader):
    """Layer 0's groups come back as zeros instead of being copied back."""

    name = "my-offloader.drops-one-reload"

    def group(self, name, x, *, layer):
        group = super().group(name, x, layer=layer)
        if layer == 0 and self.enabled and name in self.selected:
            group.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.zeros)
        return group

    def zeros(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        return torch.zeros(host.shape, dtype=host.dtype, device=device)


class EvenStepsOnly(MyOffloader):
    """Layer 0's groups move in even steps only (steps are counted by ``end_iteration``)."""

    name = "my-offloader.even-steps-only"

    def __init__(self, config, device):
        super().__init__(config, device)
        self.step = 0

    def group(self, name, x, *, layer):
        if layer == 0 and self.step % 2:
            return Group(torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t), x)
        return super().group(name, x, layer=layer)

    def end_iteration(self):
        super().end_iteration()
        self.step += 1


class Pageable(MyOffloader):
    """Copies into pageable host memory (CUDA: a synchronous copy, and slow)."""

    name = "my-offloader.pageable"

    def pack(self, t):
        if self.stays(t):
            return t
        return t.device, torch.empty(t.shape, dtype=t.dtype).copy_(t)


class KeepsOnePerStep(MyOffloader):
    """The first tensor each step copies out is kept on the host for good and never unpacked
    (backward gets the device tensor): host memory grows by one copy per step."""

    name = "my-offloader.keeps-one-per-step"

    def __init__(self, config, device):
        super().__init__(config, device)
        self.kept, self.kept_this_step = [], False

    def pack(self, t):
        packed = super().pack(t)
        if isinstance(packed, torch.Tensor) or self.kept_this_step:
            return packed
        self.kept.append(packed[1])  # the bug: held across iterations, never handed back
        self.kept_this_step = True
        return t

    def end_iteration(self):
        super().end_iteration()
        self.kept_this_step = False
