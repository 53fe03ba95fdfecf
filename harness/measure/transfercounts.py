"""The counts a transfer counter gives (``Counts``, ``TransferCounts``), the directions, and
the element sizes a CPU copy's bytes are read with (``harness.measure.transfers`` counts them)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Literal

from harness.offload.ranges import Direction, RangeKey

DIRECTIONS: tuple[Direction, ...] = ("d2h", "h2d")

# Element sizes by the C++ type name the profiler writes in ``Input type`` (c10 TypeMeta names,
# demangled; checked against torch 2.13 on Linux). "long long" variants cover other platforms.
ELEMENT_SIZES: dict[str, int] = {
    "float": 4,
    "double": 8,
    "c10::Half": 2,
    "c10::BFloat16": 2,
    "c10::complex<c10::Half>": 4,
    "c10::complex<float>": 8,
    "c10::complex<double>": 16,
    "bool": 1,
    "signed char": 1,
    "unsigned char": 1,
    "short int": 2,
    "short unsigned int": 2,
    "int": 4,
    "unsigned int": 4,
    "long int": 8,
    "long unsigned int": 8,
    "long long int": 8,
    "long long unsigned int": 8,
    "c10::Float8_e4m3fn": 1,
    "c10::Float8_e4m3fnuz": 1,
    "c10::Float8_e5m2": 1,
    "c10::Float8_e5m2fnuz": 1,
    "c10::Float8_e8m0fnu": 1,
    "c10::Float4_e2m1fn_x2": 1,
    "c10::qint8": 1,
    "c10::quint8": 1,
    "c10::qint32": 4,
    "c10::quint4x2": 1,
    "c10::quint2x4": 1,
    "c10::bits1x8": 1,
    "c10::bits2x4": 1,
    "c10::bits4x2": 1,
    "c10::bits8": 1,
    "c10::bits16": 2,
}


class TraceFormatError(ValueError):
    """The trace lacks what the counter needs (shapes, memcpy bytes) or has an unknown type."""


@dataclass(frozen=True, slots=True)
class Counts:
    """A number of copies and the bytes they moved."""

    copies: int = 0
    bytes: int = 0

    def __add__(self, other: Counts) -> Counts:
        return Counts(self.copies + other.copies, self.bytes + other.bytes)


@dataclass(frozen=True)
class TransferCounts:
    """What a profiled run copied, per offload range occurrence."""

    by_range: dict[RangeKey, Counts]
    """Per (direction, group name, microbatch, layer): the copies attributed to that range."""
    unattributed: dict[Direction, Counts] = field(
        default_factory=lambda: {d: Counts() for d in DIRECTIONS}
    )
    """Device mode: DtoH/HtoD memcpys outside our ranges, per direction (always 0 on CPU)."""
    pageable: int = 0
    """Device mode: attributed memcpys from/to pageable (unpinned) host memory."""
    mode: Literal["device", "cpu"] = "cpu"
    """How the copies were found (see the module docstring)."""

    def by_name(self) -> dict[tuple[Direction, str], Counts]:
        """Attributed totals per (direction, group name)."""
        out: dict[tuple[Direction, str], Counts] = defaultdict(Counts)
        for key, counts in self.by_range.items():
            out[(key.direction, key.name)] += counts
        return dict(out)

    def totals(self) -> dict[Direction, Counts]:
        """Attributed totals per direction (both directions always present)."""
        out = {d: Counts() for d in DIRECTIONS}
        for key, counts in self.by_range.items():
            out[key.direction] += counts
        return out

    def by_group(self) -> dict[tuple[int, int, str], dict[str, int]]:
        """Per ``GroupRecord.key`` (microbatch, layer, name): the GroupRecord counter fields
        ``d2h_copies``, ``d2h_bytes``, ``h2d_copies``, ``h2d_bytes``."""
        out: dict[tuple[int, int, str], dict[str, int]] = {}
        for key, counts in self.by_range.items():
            row = out.setdefault(
                (key.microbatch, key.layer, key.name),
                {f"{d}_{what}": 0 for d in DIRECTIONS for what in ("copies", "bytes")},
            )
            row[f"{key.direction}_copies"] += counts.copies
            row[f"{key.direction}_bytes"] += counts.bytes
        return out


def element_size(type_name: str) -> int:
    """Bytes per element of a profiler ``Input type`` name (``float``, ``c10::BFloat16`` ...)."""
    size = ELEMENT_SIZES.get(type_name)
    if size is None and type_name.startswith(("c10::dummy_int1_7_t<", "c10::dummy_uint1_7_t<")):
        size = 1  # torch.int1..int7 / uint1..uint7: one byte per element in storage
    if size is None:
        raise TraceFormatError(
            f"unknown tensor type name {type_name!r} in the trace; add it to "
            "harness.measure.transfers.ELEMENT_SIZES"
        )
    return size
