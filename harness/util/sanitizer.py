"""PyTorch's CUDA stream sanitizer (``--cuda-sanitizer``, ``TORCH_CUDA_SANITIZER=1``) as a race
guard, and its findings as one line of a verdict.

What it does: a dispatch mode that records, for every op, which device tensors it reads and
writes on which stream, and the events and stream waits between streams; an access to a tensor
while another stream's access to it is not ordered before it (no event waited for, no
synchronisation) raises ``CUDASanitizerErrors`` from that op. The case's run raises, and the
check that read the run fails with ``describe``'s line.

What it does not see: host memory. A pinned host buffer read by an H2D before its D2H finished
(Megatron-LM #7398) or rewritten while an H2D still reads it is a race between two copies on
host memory the sanitizer does not track; nor a device source freed while its D2H still reads
it (the caching allocator hands the block to a new tensor and the sanitizer starts afresh
there). Race delays (``--race-delays``) widen those windows until the values show them. It also
knows only ops that pass PyTorch's dispatcher (a kernel an extension launches itself is unseen)
and slows every op down (a Python call per op).
"""

from __future__ import annotations

from typing import Any


def enable() -> None:
    """Turn PyTorch's CUDA stream sanitizer on in this process (a no-op when it is on: torch
    turns it on at import when ``TORCH_CUDA_SANITIZER`` is set then)."""
    from torch.cuda import _sanitizer as csan

    if csan.cuda_sanitizer is None or not csan.cuda_sanitizer.enabled:
        csan.enable_cuda_sanitizer()


def describe(exc: BaseException) -> str | None:
    """One line for a ``CUDASanitizerErrors`` (None for any other exception): how many races,
    and the first one's tensor, streams, ops and the innermost harness or offloader frame."""
    if type(exc).__name__ != "CUDASanitizerErrors":
        return None
    errors = list(getattr(exc, "errors", []))
    if not errors:
        return "the CUDA stream sanitizer raised without naming a race"
    first = errors[0]
    current = getattr(first, "current_access", None)
    previous = getattr(first, "previous_access", None)
    if current is None or previous is None:
        return f"the CUDA stream sanitizer found {len(errors)} errors; the first: {first}"
    return (
        f"the CUDA stream sanitizer found {len(errors)} possible data race(s); the first, on the "
        f"device tensor at data pointer {first.data_ptr}: stream {current.stream} "
        f"{_kind(current)}s it in {_where(current)} without waiting for stream "
        f"{previous.stream}'s {_kind(previous)} in {_where(previous)}"
    )


def _kind(access: Any) -> str:
    return str(getattr(access.type, "name", access.type)).lower()


def _where(access: Any) -> str:
    return f"{access.operator} ({_frame(access.stack_trace)})"


def _frame(stack: Any) -> str:
    """The innermost frame in the harness, an example or a test; else the innermost one."""
    frames = list(stack or [])
    if not frames:
        return "no stack"
    for frame in reversed(frames):
        if "/torch/" not in frame.filename:
            return f"{frame.filename}:{frame.lineno} {frame.name}"
    last = frames[-1]
    return f"{last.filename}:{last.lineno} {last.name}"
