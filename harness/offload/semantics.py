"""The copy rules an offloader declares: which saved tensors an offload moves and how many bytes.

``Semantics`` is the part of Megatron's rules that differs between offloader versions; a backend
declares its own in its ``Capabilities`` record (``harness.offload.protocol``). It lives on the
offload side, beside ``Capabilities``, so that the offloaders (the reference, the adapters, the
layout baseline) and the independent prediction (``harness.execute.predict``) both read it and no
offloader imports the prediction. The pure per-tensor rules (``copy_bytes``, ``eligible``,
``skip_reason``) belong to it: they read one saved tensor's record and the declared rules, nothing
of a run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from harness.offload.config import OffloadConfig

if TYPE_CHECKING:  # a type only: the rules sit below the recorder that fills it
    from harness.offload.recorder import SavedInfo

GroupKey = tuple[int, int, str]  # (microbatch, layer, name)


@dataclass(frozen=True, kw_only=True, slots=True)
class Semantics:
    """The rules that differ between offloader versions; a backend may declare its own in its
    ``Capabilities`` record (``harness.offload.protocol``; default: Megatron-Core main, the
    reference's)."""

    view_copy: str = "coverage"
    """``coverage``: a non-contiguous view covering >= 50% of its storage is copied as the whole
    storage (Megatron-Core main); ``gather``: every non-contiguous tensor is gathered
    (``.contiguous()``) and copied alone (megatron-core 0.19); ``base``: every tensor that is a
    part of a larger storage is copied as that whole storage, once per storage in a group
    (TransformerEngine copies a view's base tensor)."""
    skip: str = "storage"
    """``storage``: tensors sharing a storage with a parameter or a marked tensor stay;
    ``object``: only ``Parameter`` objects and tensors themselves marked stay (Megatron's
    attribute check), so a view of a parameter saved by autograd is offloaded; ``none``: every
    saved tensor on the device moves, parameters included."""
    policies: str = "megatron"
    """``megatron``: every selected group in the warmup iteration, then Megatron's margin,
    delta, fraction and last-of-name policies keep some on the device; ``every``: every
    selected group of every iteration moves (no policy keeps any)."""
    size_threshold: bool = True
    """Whether tensors smaller than ``min_offloaded_tensor_size`` elements stay."""
    host_reload: bool = True
    """Whether a reload on a CPU device copies the host copy back (False: the unpack hands out
    the host copy itself, so a CPU run has no H2D; CUDA runs always reload)."""
    reload_layout: str = "saved"
    """``saved``: a reloaded tensor has the saved tensor's strides, so backward runs exactly as
    without offload and the offload run must equal the plain baseline bitwise; ``contiguous``:
    it comes back as a fresh contiguous tensor (``torch.empty(size)`` then ``copy_``, as
    ``save_on_cpu`` packs), so a backward kernel may take another path for a former view and
    round differently (bf16). The offload run is then compared bitwise with the *layout
    baseline*: the same copies made on the device, nothing moved (``harness.offload.layout``);
    how far that baseline is from the plain one is reported, not judged."""
    min_size: int | None = None
    """With ``size_threshold``: the backend's own threshold in elements, where it is not the
    configuration's ``min_offloaded_tensor_size`` (TransformerEngine's 2**20, or one learned
    from an undeclared offloader's copies)."""
    keep_last: int = 0
    """With ``policies="every"``: the last ``keep_last`` selected group occurrences of each
    pass's forward stay on the device, in every iteration (TransformerEngine keeps its last
    layer)."""
    prefetch_depth: int | None = None
    """When reloads may be issued in backward (the cadence check, ``harness.execute.cadence``).
    ``None``: Megatron-Core's rule - each group occurrence's backward end issues one reload,
    the most recently committed offloaded group of its pass still on the host, else the top
    one of the next pass to run backward if that pass's forward is done (so a pass whose
    backward ends with k groups kept on the device has k + 1 offloaded groups reloaded ahead at
    once, the #7575 pile-up, which this rule predicts). ``d >= 0``: a group occurrence's
    reload comes no earlier than the end of the backward of the occurrence ``d`` places before
    it in the step's backward order (0: not before its own backward starts, a reload at
    unpack)."""
    layers: frozenset[int] | None = None
    """With ``policies="every"``: only the selected groups of these layers move, in every
    iteration (TransformerEngine's ``num_layers``: the first few layers are offloaded); None:
    every layer's."""
    batched: bool = False
    """Each group occurrence's moved tensors travel in one copy each way (packed into one
    buffer at commit), not one copy per tensor: the same bytes, one copy."""
    threshold_unit: str = "elements"
    """What the size threshold counts: ``elements`` (Megatron's ``min_offloaded_tensor_size``)
    or ``bytes`` (a tensor of fewer bytes stays, whatever its dtype)."""
    observed: bool = False
    """Learned from the offloader's own copies (``harness.execute.learn``), not declared by it: the
    checks hold it to this rule and say so, but cannot hold it to Megatron's."""
    label: str = "Megatron-Core main's rules"
    """What the prediction's messages call this model."""

    def __post_init__(self) -> None:
        if self.view_copy not in ("coverage", "gather", "base"):
            raise ValueError(
                f"Semantics.view_copy must be coverage, gather or base, got {self.view_copy!r}"
            )
        if self.skip not in ("storage", "object", "none"):
            raise ValueError(f"Semantics.skip must be storage, object or none, got {self.skip!r}")
        if self.policies not in ("megatron", "every"):
            raise ValueError(f"Semantics.policies must be megatron or every, got {self.policies!r}")
        if self.keep_last < 0 or (self.min_size is not None and self.min_size < 0):
            raise ValueError("Semantics.keep_last and min_size must be >= 0")
        if self.prefetch_depth is not None and (
            isinstance(self.prefetch_depth, bool)
            or not isinstance(self.prefetch_depth, int)
            or self.prefetch_depth < 0
        ):
            raise ValueError(
                f"Semantics.prefetch_depth must be None or an int >= 0, got {self.prefetch_depth!r}"
            )
        if self.threshold_unit not in ("elements", "bytes"):
            raise ValueError(
                f"Semantics.threshold_unit must be elements or bytes, got {self.threshold_unit!r}"
            )
        if self.reload_layout not in ("saved", "contiguous"):
            raise ValueError(
                f"Semantics.reload_layout must be saved or contiguous, got {self.reload_layout!r}"
            )

    def reloads_on(self, device_type: str) -> bool:
        """Whether a reload copies back (an H2D) on a device of this type."""
        return device_type == "cuda" or self.host_reload

    def threshold(self, config: OffloadConfig) -> int:
        """Elements (``threshold_unit``: or bytes) below which a saved tensor stays (0: no
        threshold)."""
        if not self.size_threshold:
            return 0
        return config.min_offloaded_tensor_size if self.min_size is None else self.min_size


MEGATRON_MAIN = Semantics()

COVERAGE = 0.5
"""The share of its storage a non-contiguous view must cover to be copied as the whole storage
under ``view_copy="coverage"`` (Megatron-Core main's ``BASE_OFFLOAD_MIN_COVERAGE``)."""


def copy_bytes(info: SavedInfo, semantics: Semantics = MEGATRON_MAIN) -> int:
    """Bytes one offload of ``info`` copies (whole storage for a covering view)."""
    own = info.numel * info.itemsize
    if semantics.view_copy == "base":
        return max(own, info.storage_nbytes)
    if info.contiguous or semantics.view_copy == "gather":
        return own
    whole = info.storage_nbytes
    if whole % info.itemsize == 0 and own >= COVERAGE * whole:
        return whole
    return own


def eligible(info: SavedInfo, config: OffloadConfig, semantics: Semantics = MEGATRON_MAIN) -> bool:
    """Whether an offload of the group moves this saved tensor."""
    return skip_reason(info, config, semantics) is None


def skip_reason(
    info: SavedInfo, config: OffloadConfig, semantics: Semantics = MEGATRON_MAIN
) -> str | None:
    """Why an offload of the group leaves this saved tensor on the device (None: it moves)."""
    if not info.on_device:
        return "not on the model's device"
    if semantics.skip == "storage" and info.parameter:
        return "shares its storage with a parameter or a marked tensor"
    if semantics.skip == "object" and info.marked_itself:
        return "is a parameter or a marked tensor itself"
    if info.numel == 0:
        return "is empty"
    threshold = semantics.threshold(config)
    size = info.numel * info.itemsize if semantics.threshold_unit == "bytes" else info.numel
    if size < threshold:
        what = "min_offloaded_tensor_size" if semantics.min_size is None else "its size threshold"
        return f"{size} {semantics.threshold_unit} < {what} {threshold}"
    return None
