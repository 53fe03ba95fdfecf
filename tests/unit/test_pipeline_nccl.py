"""The pipeline's point-to-point postings played under NCCL's rules (``harness.models.p2p``): a
communicator runs its operations one after another in the order they were posted (one stream), a
posted receive holds its rank until it completes, an operation completes when its counterpart
runs too, and a pair's messages are matched by order, not by tag - so a matched send and receive
must carry the same tag.

On one communicator per pair (gloo's form) 1F1B and the interleaved order deadlock; on channels
(``StageLinks(channels=True)``, the default on NCCL: a communicator per direction and pair) every
order plays through at PP=2 and 4 with every message matched to its own. The pipeline checks at
every step's end that what a rank posted is ``program``'s list, so what is played here is what
runs. A CPU stand-in for the NCCL run owed to a box of several GPUs."""

from __future__ import annotations

from collections import Counter

import pytest

from harness.models.p2p import PipelineLayout, program
from harness.models.pipeline import stage_order
from harness.vocab.spec import model_chunks

Batch = tuple[tuple[str, int, int], ...]
"""Operations posted together (one NCCL group); ``StageLinks`` posts each on its own."""

SCHEDULES = ("sequential", "gpipe", "1f1b", "interleaved")


def nccl_plays(programs: list[list[Batch]], channels: bool = False) -> tuple[bool, list[str]]:
    """Play every stage's batches under NCCL's rules (module docstring): whether all complete,
    and the matched send/receive pairs whose tags differ. ``channels``: each (direction, from,
    to) has a communicator, so a stream, of its own (``StageLinks(channels=True)``)."""
    where: dict[tuple[str, int, int, int], tuple[int, int]] = {}  # op -> (rank, batch)
    tags: dict[tuple[str, int, int, int], int] = {}
    keys: dict[tuple[int, int], list[tuple[str, int, int, int]]] = {}
    for rank, batches in enumerate(programs):
        sent: Counter[int] = Counter()
        received: Counter[int] = Counter()
        for index, batch in enumerate(batches):
            for op, peer, tag in batch:
                if op == "send":  # the k-th message rank -> peer
                    key = ("send", rank, peer, sent[peer])
                    sent[peer] += 1
                else:
                    key = ("recv", peer, rank, received[peer])
                    received[peer] += 1
                where[key], tags[key] = (rank, index), tag
                keys.setdefault((rank, index), []).append(key)
    wrong = [
        f"{src}->{dst} message {k}: sent with tag {tags[key]}, received as tag "
        f"{tags.get(('recv', src, dst, k))}"
        for key in tags
        if key[0] == "send"
        for _, src, dst, k in [key]
        if tags.get(("recv", src, dst, k)) != tags[key]
    ]
    posted = [0] * len(programs)
    complete: list[set[int]] = [set() for _ in programs]

    def stream(rank: int, index: int) -> object:
        if not channels:
            return None  # one communicator per pair: one stream
        op, peer, tag = programs[rank][index][0]
        return (tag % 2, rank, peer) if op == "send" else (tag % 2, peer, rank)

    def running(rank: int, index: int) -> bool:
        """Posted, not complete, and first of its stream still to complete."""
        if index >= posted[rank] or index in complete[rank]:
            return False
        key = stream(rank, index)
        return all(i in complete[rank] for i in range(index) if stream(rank, i) == key)

    finished: set[tuple[str, int, int, int]] = set()

    def advance(rank: int, index: int) -> bool:
        """Complete the operations of a running batch whose counterparts run too (a batch's
        operations progress on their own); the batch completes once all of them are done."""
        for key in keys.get((rank, index), []):
            other_key = ("recv" if key[0] == "send" else "send", *key[1:])
            other = where.get(other_key)
            if key not in finished and other is not None and running(*other):
                finished.update((key, other_key))
        if all(key in finished for key in keys.get((rank, index), [])):
            complete[rank].add(index)
            return True
        return False

    def blocked(rank: int) -> bool:
        """A receive posted and not complete holds the rank (it waits for its tensor)."""
        return any(
            i not in complete[rank] and any(op == "recv" for op, _, _ in programs[rank][i])
            for i in range(posted[rank])
        )

    progress = True
    while progress:
        progress = False
        for rank, batches in enumerate(programs):
            while posted[rank] < len(batches) and not blocked(rank):
                posted[rank] += 1
                progress = True
        for rank in range(len(programs)):
            for index in range(posted[rank]):
                if running(rank, index) and advance(rank, index):
                    progress = True
    return all(len(complete[r]) == len(p) for r, p in enumerate(programs)), wrong


def _programs(schedule: str, stages: int, microbatches: int) -> list[list[Batch]]:
    layout = PipelineLayout(stages, model_chunks(schedule))
    return [
        [(op,) for op in program(stage_order(schedule, microbatches, stages, s), layout, s)]
        for s in range(stages)
    ]


ROWS = [
    pytest.param(schedule, stages, microbatches, id=f"{schedule}-{stages}x{microbatches}")
    for schedule in SCHEDULES
    for stages in (2, 4)
    for microbatches in (4, 8)
]


@pytest.mark.parametrize(("schedule", "stages", "microbatches"), ROWS)
def test_channels_play_through_under_nccls_rules(
    schedule: str, stages: int, microbatches: int
) -> None:
    ok, wrong = nccl_plays(_programs(schedule, stages, microbatches), channels=True)
    assert ok and not wrong, wrong


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_one_communicator_per_pair_deadlocks_under_nccls_rules(schedule: str) -> None:
    """Why the channels: on one stream stage 0's warmup sends wait for receives stage 1 posts
    only after its own gradient send, which waits behind them."""
    ok, wrong = nccl_plays(_programs(schedule, 2, 4))
    assert not ok and not wrong
    assert nccl_plays(_programs("gpipe", 2, 4))[0]  # all forwards, then all backwards: fine


def test_the_player_sees_a_message_received_out_of_order() -> None:
    """Tags do not match messages under NCCL: two activations received in the other order than
    sent are two mismatched pairs."""
    send = [(("send", 1, 10),), (("send", 1, 12),)]
    recv = [(("recv", 0, 12),), (("recv", 0, 10),)]
    ok, wrong = nccl_plays([send, recv], channels=True)
    assert ok and len(wrong) == 2
