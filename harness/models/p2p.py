"""Point-to-point links between pipeline stages on different ranks: a stage's output activations
forward to the next virtual stage, its input gradients back to the previous one.

``harness.models.pipeline`` runs one rank's part of a pipeline and calls ``StageLinks`` for every
tensor that crosses a stage boundary. Every message is one tensor of the boundary's fixed shape
and dtype (the hidden states [B, T, D] in the compute dtype, and their gradient), as Megatron-Core
fixes ``tensor_shape`` for a whole schedule, so no size travels ahead of it.

Sends are non-blocking (``isend``) and are waited for at the end of the step (``finish``): a rank
never blocks on a send, only on a receive whose tensor its next pass needs. A schedule in which
every pass's inputs come from passes earlier in some global order (GPipe, 1F1B, Megatron's
interleaved 1F1B) therefore cannot deadlock, whatever order the ranks post in. Each message
carries a tag of its own (``message_tag``: direction, receiving virtual stage, microbatch), so a
receive matches its send by tag, not by arrival order.

Under NCCL that form can deadlock: NCCL runs the operations of one communicator in the order they
were posted, on one stream, and matches a pair's messages by order, not by tag. A rank whose
activation send waits, on that stream, for a receive the peer posts only after its own gradient
send - which waits behind this rank's activation send - hangs both (1F1B's steady state does
exactly that). So on an NCCL group (or with ``OFFLOAD_HARNESS_P2P_CHANNELS=1``) ``StageLinks``
sends each (direction, from stage, to stage) on a process group of its own (``channels``):
a stream per direction and pair, on which the sender posts in the order the receiver receives
(every schedule here does; the tags prove it on gloo). A message then waits only for the
messages before it on its own channel, as on gloo. ``program`` lists what a stage posts in a
step (the pipeline checks each step posted exactly that); tests/unit/test_pipeline_nccl.py plays
every schedule's postings under NCCL's rules: on one stream 1F1B and the interleaved order
deadlock, on channels every order plays through with every message matched to its own. On gloo
the channels run every pipeline row bitwise (a ``.ci/run`` step); on NCCL nothing has run yet.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

Posting = tuple[str, int, int]
"""One operation posted: ``send`` or ``recv``, the peer stage, the tag."""

FORWARD = 0
"""A message's direction: an activation into the next virtual stage."""
BACKWARD = 1
"""A message's direction: a gradient into the previous virtual stage."""


class P2PError(RuntimeError):
    """A send or receive between stages failed (a peer died, the process group's timeout ran out
    in a receive, another stage gave up: ``AbortBoard``): the message names the rank, stage,
    step, virtual stage, microbatch and operation."""


POLL_S = 0.05
POST_GRACE_S = 2.0
"""How long a failed wait looks for a peer's posted line before it says the wait just failed."""
"""How often a rank waiting on a message or a collective looks at the abort board."""


class AbortBoard:
    """Where a rank that gives up on a pipeline run says so, for the ranks waiting on it: a key
    in the process group's store, one per run (``run`` counts the runs, the same on every rank).
    Every wait of a run (``wait``) runs in a helper thread while this rank's main thread polls
    the board: a wait on a rank that raised ends at once with its line; a test's timeout
    (``harness.plugin.timeouts.CaseTimeout``, a signal in the main thread) interrupts the poll
    with the operation named; a dead peer fails the wait itself (gloo's closed connection)."""

    _runs = 0

    def __init__(self, store: dist.Store | None) -> None:
        AbortBoard._runs += 1
        self.key = f"pipeline/run-{AbortBoard._runs}/abort"
        self.store = store

    def post(self, line: str) -> None:
        """Say why this rank gives up (the first line posted stays)."""
        if self.store is not None and not self.store.check([self.key]):
            self.store.set(self.key, line)

    def posted(self) -> str | None:
        if self.store is None or not self.store.check([self.key]):
            return None
        return self.store.get(self.key).decode()

    def wait(self, work: dist.Work, what: str) -> None:
        """``work.wait()``, given up when another rank posts (``P2PError`` naming ``what`` and
        that rank's line) or when an exception reaches this thread meanwhile (re-raised with
        ``what`` noted, and posted for the others)."""
        failed: list[BaseException] = []

        def waiting() -> None:
            try:
                work.wait()
            except BaseException as exc:  # handed to the main thread
                failed.append(exc)

        helper = threading.Thread(target=waiting, name="pipeline-wait", daemon=True)
        helper.start()
        try:
            while helper.is_alive():
                helper.join(POLL_S)
                if helper.is_alive():
                    line = self.posted()
                    if line is not None:
                        raise P2PError(f"{what}: given up, {line}")
        except P2PError:
            raise
        except BaseException as exc:  # a test's timeout, Ctrl-C: say where it waited
            self.post(f"{what}: interrupted ({type(exc).__name__})")
            exc.add_note(f"while waiting in the pipeline: {what}")
            raise
        if failed:  # a peer that gave up first may have closed the connection: say so
            line = self.posted_soon()
            cause = f"given up, {line}" if line is not None else f"failed: {failed[0]}"
            raise P2PError(f"{what}: {cause}") from failed[0]

    def posted_soon(self, grace: float = POST_GRACE_S) -> str | None:
        """``posted``, waiting up to ``grace`` seconds: a peer that raised posts its line, then
        its process ends and its connections close; this rank's wait can fail on the closed
        connection before the post is readable in the store."""
        deadline = time.monotonic() + grace
        while True:
            line = self.posted()
            if line is not None or time.monotonic() >= deadline:
                return line
            time.sleep(POLL_S)


@dataclass(frozen=True, slots=True)
class PipelineLayout:
    """How a model's layers are placed: ``stages`` pipeline ranks (PP), each running ``chunks``
    model chunks (VPP); ``stages * chunks`` virtual stages in model order. Megatron's interleaved
    assignment: rank ``r``'s chunk ``c`` is virtual stage ``c * stages + r``, so the activations go
    round the ranks ``chunks`` times, and virtual stage 0 (the embedding) is rank 0's, the last
    one (the head and the loss) the last rank's."""

    stages: int
    chunks: int = 1

    def __post_init__(self) -> None:
        if self.stages < 2 or self.chunks < 1:
            raise ValueError(
                f"a pipeline across ranks needs stages >= 2 and chunks >= 1, got "
                f"stages={self.stages}, chunks={self.chunks}"
            )

    @property
    def virtual_stages(self) -> int:
        """Virtual stages in the model (``stages * chunks``)."""
        return self.stages * self.chunks

    def virtual_stage(self, stage: int, chunk: int) -> int:
        """The virtual stage that ``stage``'s model chunk ``chunk`` runs."""
        return chunk * self.stages + stage

    def owner(self, virtual: int) -> tuple[int, int]:
        """(stage, chunk) running virtual stage ``virtual``."""
        chunk, stage = divmod(virtual, self.stages)
        return stage, chunk


def message_tag(direction: int, virtual: int, microbatch: int, virtual_stages: int) -> int:
    """The tag of the message into virtual stage ``virtual`` for ``microbatch`` going
    ``direction`` (``FORWARD``, ``BACKWARD``): unique within a step, which is as long as any
    message lives (``StageLinks.finish``)."""
    return (microbatch * virtual_stages + virtual) * 2 + direction


class StageLinks:
    """One rank's sends and receives for one pipeline run, over ``group`` (the default group when
    None; ``stage`` is this rank's rank in it). Boundary tensors are ``shape`` in ``dtype`` on
    ``device``."""

    def __init__(
        self,
        layout: PipelineLayout,
        stage: int,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        group: dist.ProcessGroup | None = None,
        board: AbortBoard | None = None,
        channels: bool | None = None,
        timeout: Any = None,
    ) -> None:
        self.layout, self.stage, self.group = layout, stage, group
        self.shape, self.dtype, self.device = shape, dtype, device
        self.board = board or AbortBoard(None)
        self.step = 0
        """The step the runner is in (for messages)."""
        self._pending: list[tuple[dist.Work, torch.Tensor, str]] = []
        if channels is None:
            forced = os.environ.get("OFFLOAD_HARNESS_P2P_CHANNELS")
            channels = forced == "1" if forced else dist.get_backend(group) == "nccl"
        self.channels: dict[tuple[int, int, int], dist.ProcessGroup] = (
            _channel_groups(layout.stages, group, timeout) if channels else {}
        )
        """(direction, from stage, to stage) -> a process group of its own for those messages
        only (module docstring); empty: every message on ``group``. By default on an NCCL
        group, or as ``OFFLOAD_HARNESS_P2P_CHANNELS`` (``1``/``0``) says."""
        self.posted: list[Posting] = []
        """Every operation posted this step, in order (``program`` predicts them)."""

    def send_activation(self, virtual: int, microbatch: int, tensor: torch.Tensor) -> None:
        """Send virtual stage ``virtual``'s output of ``microbatch`` to the next virtual stage."""
        self._send(FORWARD, virtual + 1, microbatch, tensor)

    def recv_activation(self, virtual: int, microbatch: int) -> torch.Tensor:
        """Receive virtual stage ``virtual``'s input of ``microbatch`` from the previous one."""
        return self._recv(FORWARD, virtual, microbatch)

    def send_gradient(self, virtual: int, microbatch: int, tensor: torch.Tensor) -> None:
        """Send the gradient of virtual stage ``virtual``'s input to the previous virtual stage."""
        self._send(BACKWARD, virtual - 1, microbatch, tensor)

    def recv_gradient(self, virtual: int, microbatch: int) -> torch.Tensor:
        """Receive the gradient of virtual stage ``virtual``'s output from the next one."""
        return self._recv(BACKWARD, virtual, microbatch)

    def finish(self) -> None:
        """Wait for every send posted since the last call (the end of a step: each was matched by
        a receive of the same step, so none outlives it)."""
        pending, self._pending = self._pending, []
        for work, _, what in pending:
            self._wait(work, what)

    def _send(self, direction: int, into: int, microbatch: int, tensor: torch.Tensor) -> None:
        peer, _ = self.layout.owner(into)
        what = self._describe("send", direction, into, microbatch, peer)
        if tuple(tensor.shape) != self.shape or tensor.dtype != self.dtype:
            raise P2PError(
                f"{what}: the tensor is {tuple(tensor.shape)} {tensor.dtype}, the boundary "
                f"{self.shape} {self.dtype}"
            )
        if not tensor.is_contiguous():
            # The receiver gets it contiguous; a strided original could take other kernels
            # (other rounding) than on one rank, so this is refused, not silently copied.
            raise P2PError(f"{what}: the tensor is not contiguous (strides {tensor.stride()})")
        tag = message_tag(direction, into, microbatch, self.layout.virtual_stages)
        self.posted.append(("send", peer, tag))
        group, peer_in = self._route(direction, self.stage, peer, peer)
        try:
            work = dist.isend(tensor, group=group, group_dst=peer_in, tag=tag)
        except RuntimeError as exc:
            raise P2PError(f"{what} failed: {exc}") from exc
        self._pending.append((work, tensor, what))

    def _recv(self, direction: int, into: int, microbatch: int) -> torch.Tensor:
        source = into - 1 if direction == FORWARD else into + 1
        peer, _ = self.layout.owner(source)
        what = self._describe("recv", direction, into, microbatch, peer)
        buffer = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        tag = message_tag(direction, into, microbatch, self.layout.virtual_stages)
        self.posted.append(("recv", peer, tag))
        group, peer_in = self._route(direction, peer, self.stage, peer)
        try:
            work = dist.irecv(buffer, group=group, group_src=peer_in, tag=tag)
        except RuntimeError as exc:
            raise P2PError(f"{what} failed: {exc}") from exc
        self._wait(work, what)
        return buffer

    def _route(
        self, direction: int, source: int, target: int, peer: int
    ) -> tuple[dist.ProcessGroup | None, int]:
        """The group a message from stage ``source`` to ``target`` travels on, and ``peer``'s
        rank in it."""
        channel = self.channels.get((direction, source, target))
        if channel is None:
            return self.group, peer
        return channel, dist.get_group_rank(channel, _global(self.group, peer))

    def close(self) -> None:
        """Destroy the channel groups (the run is over)."""
        for channel in self.channels.values():
            dist.destroy_process_group(channel)
        self.channels = {}

    def _wait(self, work: dist.Work, what: str) -> None:
        self.board.wait(work, what)

    def collective(self, work: dist.Work, what: str) -> None:
        """Wait for a collective of the run (the loss broadcast, the clip's gather) as for a
        message: given up when another rank posts on the board."""
        self.board.wait(
            work,
            f"rank {dist.get_rank()} (pipeline stage {self.stage}): {what} in step {self.step}",
        )

    def _describe(self, op: str, direction: int, into: int, microbatch: int, peer: int) -> str:
        kind = "activation" if direction == FORWARD else "gradient"
        side = "to" if op == "send" else "from"
        return (
            f"rank {dist.get_rank()} (pipeline stage {self.stage}): step {self.step}, {op} of "
            f"the {kind} into virtual stage {into}, microbatch {microbatch}, {side} stage {peer}"
        )


def _global(group: dist.ProcessGroup | None, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def _channel_groups(
    stages: int, group: dist.ProcessGroup | None, timeout: Any
) -> dict[tuple[int, int, int], dist.ProcessGroup]:
    """One process group per (direction, from stage, to stage) a pipeline of ``stages`` sends
    on: activations to the next stage, gradients to the previous one, around the ring (the
    interleaved order wraps). Collective: every rank creates every group, in the same order."""
    out = {}
    for direction, step in ((FORWARD, 1), (BACKWARD, -1)):
        for source in range(stages):
            target = (source + step) % stages
            ranks = [_global(group, source), _global(group, target)]
            out[(direction, source, target)] = dist.new_group(ranks, timeout=timeout)
    return out


def program(order: list[tuple[str, int]], layout: PipelineLayout, stage: int) -> list[Posting]:
    """What ``StageLinks`` posts in one step of ``stage`` running ``order`` (its ("F"|"B", pass)
    list; a pass is ``microbatch * chunks + chunk``), in order: in the
    forward of a pass its input's receive (not on virtual stage 0), then its output's send (not
    on the last); in the backward its output gradient's receive (not on the last), then its
    input gradient's send (not on virtual stage 0)."""
    V = layout.virtual_stages
    out: list[Posting] = []
    for kind, p in order:
        mb, chunk = divmod(p, layout.chunks)
        v = layout.virtual_stage(stage, chunk)
        if kind == "F":
            if v > 0:
                out.append(("recv", layout.owner(v - 1)[0], message_tag(FORWARD, v, mb, V)))
            if v < V - 1:
                out.append(("send", layout.owner(v + 1)[0], message_tag(FORWARD, v + 1, mb, V)))
        else:
            if v < V - 1:
                out.append(("recv", layout.owner(v + 1)[0], message_tag(BACKWARD, v, mb, V)))
            if v > 0:
                out.append(("send", layout.owner(v - 1)[0], message_tag(BACKWARD, v - 1, mb, V)))
    return out
