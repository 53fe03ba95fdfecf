"""Hypothesis strategies for saved-tensor round trips through an activation offloader.

Every strategy is a typed ``@st.composite`` with size caps (at most ``MAX_DIMS`` dims of at most
``MAX_SIDE`` elements for a base tensor). Values never come from the global RNG: a strategy draws
a seed and ``filled`` expands it through a private ``torch.Generator``, so an example replays
exactly from Hypothesis's database or its printed blob.

The layouts cover what autograd can hand a pack hook:

    dense             contiguous, any shape, 0-size included
    strided slice     a step > 1 along one dim, from any start
    transpose         two dims swapped; square ones keep the shape and change only the layout
    offset view       a narrow() window: non-zero storage offset, contiguous or not
    expand            stride-0 broadcasts of a smaller base
    misaligned        a 2/4/8-byte view of a byte storage whose size is not a multiple of it
    two views         two views of one storage, saved by the same node
    saved twice       one tensor object saved twice by the same node
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from hypothesis import strategies as st

from harness.plugin.properties import setup_profiles

setup_profiles()  # the entry point does it where offload-harness is installed; idempotent

MAX_SIDE = 4
"""Largest size of one dim of a drawn base tensor."""
MAX_DIMS = 3
"""Most dims of a drawn base tensor (so a base holds at most 4**3 = 64 elements)."""

DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.int64,
    torch.bool,
)
"""Dtypes the round-trip properties cover."""

_MULTI_BYTE_DTYPES = tuple(d for d in DTYPES if d.itemsize > 1)


def dtypes() -> st.SearchStrategy[torch.dtype]:
    """One of ``DTYPES``."""
    return st.sampled_from(DTYPES)


def seeds() -> st.SearchStrategy[int]:
    """A seed for ``filled``."""
    return st.integers(min_value=0, max_value=2**32 - 1)


def filled(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A contiguous tensor whose values are a pure function of (shape, dtype, seed).

    Numeric dtypes get uniformly random bytes, so floats include NaN, +-inf, -0.0 and
    subnormals: a round trip must keep bit patterns, not just values. Bools get 0/1.
    """
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        bits = torch.randint(0, 2, (math.prod(shape),), generator=generator, dtype=torch.uint8)
        return bits.bool().reshape(shape)
    num_bytes = math.prod(shape) * dtype.itemsize
    raw = torch.randint(0, 256, (num_bytes,), generator=generator, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def normal(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Finite fp32 N(0, 1) values, a pure function of (shape, seed): weights and inputs of the
    fake models (``filled`` would hand them NaN and inf)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator, dtype=torch.float32)


@st.composite
def shapes(
    draw: st.DrawFn,
    *,
    min_dims: int = 0,
    max_dims: int = MAX_DIMS,
    min_side: int = 0,
    max_side: int = MAX_SIDE,
) -> tuple[int, ...]:
    """A shape with ``min_dims..max_dims`` dims of ``min_side..max_side`` elements each."""
    num_dims = draw(st.integers(min_dims, max_dims))
    side = st.integers(min_side, max_side)
    return tuple(draw(st.lists(side, min_size=num_dims, max_size=num_dims)))


@st.composite
def dense_tensors(
    draw: st.DrawFn, *, min_dims: int = 0, min_side: int = 0, max_dims: int = MAX_DIMS
) -> torch.Tensor:
    """A contiguous tensor of any dtype in ``DTYPES`` (0-size unless ``min_side`` > 0)."""
    dtype = draw(dtypes())
    shape = draw(shapes(min_dims=min_dims, max_dims=max_dims, min_side=min_side))
    return filled(shape, dtype, draw(seeds()))


@st.composite
def strided_slices(draw: st.DrawFn) -> torch.Tensor:
    """``base[..., start::step, ...]`` along one dim, step 2 or 3."""
    base = draw(dense_tensors(min_dims=1, min_side=1))
    dim = draw(st.integers(0, base.dim() - 1))
    start = draw(st.integers(0, base.shape[dim] - 1))
    step = draw(st.integers(2, 3))
    index = [slice(None)] * base.dim()
    index[dim] = slice(start, None, step)
    return base[tuple(index)]


@st.composite
def transposes(draw: st.DrawFn, *, square: bool = False) -> torch.Tensor:
    """Two dims of a dense base swapped; ``square``: the last two dims of an (..., n, n) base."""
    if square:
        side = draw(st.integers(1, MAX_SIDE))
        batch = draw(shapes(max_dims=1, min_side=1))
        base = filled((*batch, side, side), draw(dtypes()), draw(seeds()))
        return base.transpose(-2, -1)
    base = draw(dense_tensors(min_dims=2))
    dim0 = draw(st.integers(0, base.dim() - 1))
    dim1 = draw(st.sampled_from([d for d in range(base.dim()) if d != dim0]))
    return base.transpose(dim0, dim1)


@st.composite
def offset_views(draw: st.DrawFn) -> torch.Tensor:
    """``base.narrow(dim, start >= 1, length)``: a window with a non-zero storage offset."""
    base = draw(dense_tensors(min_dims=1, min_side=2))
    dim = draw(st.integers(0, base.dim() - 1))
    start = draw(st.integers(1, base.shape[dim] - 1))
    length = draw(st.integers(0, base.shape[dim] - start))
    return base.narrow(dim, start, length)


@st.composite
def expanded_views(draw: st.DrawFn) -> torch.Tensor:
    """``base.expand(lead, *sizes)``: a new stride-0 leading dim, size-1 dims broadcast too."""
    base_shape = draw(shapes(max_dims=2, min_side=1))
    base = filled(base_shape, draw(dtypes()), draw(seeds()))
    sizes = [draw(st.integers(0, MAX_SIDE)) if side == 1 else side for side in base_shape]
    lead = draw(st.integers(2, MAX_SIDE))
    return base.expand(lead, *sizes)


@st.composite
def misaligned_views(draw: st.DrawFn) -> torch.Tensor:
    """A strided view of a byte storage whose size is not a multiple of the view's itemsize
    (such a storage cannot be copied whole as a flat tensor of that dtype)."""
    dtype = draw(st.sampled_from(_MULTI_BYTE_DTYPES))
    count = draw(st.integers(2, 3 * MAX_SIDE))
    spare_bytes = draw(st.integers(1, dtype.itemsize - 1))
    raw = filled((count * dtype.itemsize + spare_bytes,), torch.uint8, draw(seeds()))
    step = draw(st.integers(2, 3))
    return raw[: count * dtype.itemsize].view(dtype)[::step]


def single_views() -> st.SearchStrategy[torch.Tensor]:
    """One tensor of any of the layouts above."""
    return st.one_of(
        dense_tensors(),
        strided_slices(),
        transposes(),
        transposes(square=True),
        offset_views(),
        expanded_views(),
        misaligned_views(),
    )


_VIEWS_OF_MATRIX: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "whole": lambda t: t,
    "transpose": lambda t: t.transpose(0, 1),
    "every_other_row": lambda t: t[::2],
    "columns_from_1": lambda t: t[:, 1:],
    "flat_tail": lambda t: t.reshape(-1)[1:],
    "diagonal": lambda t: t.diagonal(),
}


@st.composite
def two_views_of_one_storage(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor]:
    """Two views (possibly of the same layout, never the same object) of one dense base."""
    base = draw(dense_tensors(min_dims=2, max_dims=2, min_side=1))
    names = st.sampled_from(sorted(_VIEWS_OF_MATRIX))
    first, second = draw(names), draw(names)
    return _VIEWS_OF_MATRIX[first](base[:]), _VIEWS_OF_MATRIX[second](base[:])


@st.composite
def saved_twice(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor]:
    """The same tensor object twice."""
    tensor = draw(single_views())
    return tensor, tensor


@st.composite
def saved_sets(draw: st.DrawFn, *, max_items: int = 3) -> tuple[torch.Tensor, ...]:
    """What one autograd node saves: 1..``max_items`` items (a single view, two views of one
    storage, or one tensor twice), flattened in order."""
    item = st.one_of(
        single_views().map(lambda tensor: (tensor,)),
        two_views_of_one_storage(),
        saved_twice(),
    )
    items = draw(st.lists(item, min_size=1, max_size=max_items))
    return tuple(tensor for group in items for tensor in group)
