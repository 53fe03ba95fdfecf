"""Pinned host buffers of their own size, for the reference's pool.

PyTorch's caching host allocator (``torch.empty(..., pin_memory=True)``) rounds every request up
to a power of two and never splits a block: an 81920 B activation pins 131072 B, and a pool of
such buffers holds up to twice the bytes it has in flight. A pool keeps its buffers for the whole
run, so it gains nothing from the allocator's reuse and pays its rounding every step.

``exact_pinned`` maps the buffer's bytes rounded up to whole pages (anonymous ``mmap``: pages of
its own, shared with no other allocation) and page-locks exactly that range with
``cudaHostRegister``. Copies from and to it are asynchronous DMA like any pinned memory
(``Tensor.is_pinned`` is true). The range is unregistered before its pages are unmapped, when
the last tensor on it is gone (``weakref.finalize`` on its storage, which holds the map). A
buffer registered here is never freed by the caching allocator's event bookkeeping, so its
owner must free it only after the copies that use it have finished: the pool keeps every
buffer until it is closed, after the device is synchronised, or drops an idle one whose last
reader's event has completed.
"""

from __future__ import annotations

import math
import mmap
import os
import weakref

import torch

PAGE = mmap.PAGESIZE


def _unregister(address: int, mapping: mmap.mmap, pid: int) -> None:
    if os.getpid() == pid:  # a forked child inherits the object, not the registration
        torch.cuda.cudart().cudaHostUnregister(address)
    del mapping  # the pages are unmapped once the last reference to the map goes


def _clear_error() -> None:
    """A failed ``cudaHostRegister`` leaves CUDA's last error set; the next kernel launch's check
    would report it as its own. A one-element fill reads (and clears) it here."""
    try:
        torch.empty(1, device="cuda").fill_(0)
    except RuntimeError:
        pass


def exact_pinned(shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """An uninitialised pinned host tensor of ``shape``/``dtype`` occupying whole pages of its
    own (its storage is the page-rounded range, so whoever sums storages sees what is pinned),
    or None where registration fails (the caller then falls back to the caching allocator)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = math.prod(shape) * itemsize
    size = max(PAGE, -(-nbytes // PAGE) * PAGE)
    mapping = mmap.mmap(-1, size)
    pages = torch.frombuffer(mapping, dtype=torch.uint8)
    address = pages.data_ptr()
    cudart = torch.cuda.cudart()
    if cudart.cudaHostRegister(address, size, 0) != cudart.cudaError.success:
        _clear_error()
        del pages
        mapping.close()
        return None
    weakref.finalize(pages.untyped_storage(), _unregister, address, mapping, os.getpid())
    return pages[:nbytes].view(dtype).view(shape)
