"""A complete activation offloader for offload-harness (docs/backends.md walks through it).

cd examples && offload-harness run --backend my_offloader:MyOffloader
"""

import contextlib

import torch

from harness.offload.protocol import Capabilities
from harness.offload.semantics import Semantics


class Group:
    def __init__(self, hooks, x):
        self.hooks, self.input = hooks, x

    def __enter__(self):  # inside the group, autograd's saved tensors go through the hooks
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)

    def commit(self, output, release=()):
        return output


class MyOffloader:
    name = "my-offloader"
    capabilities = Capabilities(  # what the harness predicts from (docs/backends.md)
        description="each selected group's saved activations: out in forward, back in backward",
        semantics=Semantics(
            policies="every",
            skip="storage",
            view_copy="gather",
            size_threshold=False,
            label="my offloader's rules",
        ),
    )

    def __init__(self, config, device):
        self.selected, self.device = set(config.offload_modules), device
        self.enabled, self.weights = True, []

    def stays(self, t):  # not an activation on our device (the weights: where they live now)
        weights = {w.untyped_storage().data_ptr() for w in self.weights}
        return t.device.type != self.device.type or t.untyped_storage().data_ptr() in weights

    def pack(self, t):  # forward: copy out (to pinned host memory on CUDA)
        if self.stays(t):
            return t
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
        return t.device, host.copy_(t, non_blocking=t.is_cuda)

    def unpack(self, packed):  # backward: copy back
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        return torch.empty(host.shape, dtype=host.dtype, device=device).copy_(host, True)

    def group(self, name, x, *, layer):
        if self.enabled and name in self.selected:
            return Group(torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack), x)
        return Group(contextlib.nullcontext(), x)

    def mark_not_offloadable(self, *tensors):  # parameters: never offloaded
        self.weights += tensors  # (FSDP2 frees and re-gathers them: compare live storages)

    def end_iteration(self):
        self.weights.clear()  # the model marks them again in every forward

    def set_enabled(self, enabled):
        self.enabled = enabled

    def begin_microbatch(self, microbatch): ...
    def iteration_logs(self):
        return []

    def close(self): ...
