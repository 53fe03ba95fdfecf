"""The shared baselines: rows with the same ``plain_key`` train the same plain run and read the
same no-offload memory, so the first row's serves them all. ``Baselines`` holds this process's
latest of each (one entry each: rows sharing a key run one after another, one pytest-xdist group
per key, one worker call per key in ``offload-harness run``); ``BASELINES`` is the process-wide
one the runs use unless given another. Also the keys and the sharing groups the schedulers use."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch

from harness.cases import Case
from harness.execute.attribution import profile_steps
from harness.execute.environment import Environment
from harness.measure.transfers import TransferCounts
from harness.models.runs import TrainResult
from harness.models.train import train
from harness.offload.passthrough import NoOffload
from harness.util import distributed
from harness.vocab.spec import ModelSpec, RunSpec


@dataclass(frozen=True)
class SharedPlain:
    """A plain baseline and what identifies it: every row with the same ``key`` trains the same
    plain run, so the first one's serves them all (``plain_baseline``)."""

    key: str
    """A digest of what the plain run depends on (``plain_key``)."""
    made_by: str
    """The case whose run trained it."""
    result: TrainResult
    runner_copies: tuple[TransferCounts, TransferCounts] | None
    """Profiler counts of its first and final steps on CUDA (None on CPU)."""


class Baselines:
    """This process's latest plain baseline (``SharedPlain``) and baseline memory reading
    (``harness.execute.memory.SharedMemoryBaseline``), each with the key it was made for."""

    def __init__(self) -> None:
        self.plain: SharedPlain | None = None
        self.memory: Any = None
        """A ``harness.execute.memory.SharedMemoryBaseline`` (typed loosely: that module imports
        this one)."""

    def plain_for(self, key: str) -> SharedPlain | None:
        """The kept plain baseline if it was made for ``key``."""
        return self.plain if self.plain is not None and self.plain.key == key else None

    def memory_for(self, key: str) -> Any:
        """The kept baseline memory reading if it was read for ``key``, else None."""
        return self.memory if self.memory is not None and self.memory.key == key else None

    def forget(self) -> None:
        """Drop both (a test that changes how runs train)."""
        self.plain = None
        self.memory = None


BASELINES = Baselines()
"""The process-wide baselines the runs share unless given others."""


def forget_plain_baselines() -> None:
    """Drop this process's shared plain baseline and baseline memory reading (a test that
    changes how runs train)."""
    BASELINES.forget()


def plain_key(case: Case, env: Environment) -> str:
    """What a case's plain baseline depends on - the model spec, the run spec (steps,
    microbatches, schedule, precision, seed, evaluation pass, optimizer), the sharding, the
    device and the world size - as a 12-digit digest; never the offload selection, the
    tolerance or the backend: the plain run has no offloader."""
    return _digest(env.spec(case), case.run_spec(), case.sharding, env.device)


def sharing_key(case: Case, env: Environment) -> str:
    """What schedules a case with the rows it shares a plain baseline with: ``plain_key``, or
    the case's own name for a row that does not apply to its model (it fails alone)."""
    try:
        return plain_key(case, env)
    except ValueError:
        return case.name


MAX_ROWS_SHARING = 4
"""The most case rows in one sharing group. The rows of a group run one after another on one
worker, which trains their plain baseline once; beyond this many, the further rows of a key
form further groups, each training the baseline again (about a second on the H200), so that
the full matrix's keys of 12 and 15 rows spread over the workers."""


def sharing_groups(cases: list[Case], env: Environment) -> list[str]:
    """Each case's group: ``plain-<sharing key>`` for its key's first ``MAX_ROWS_SHARING`` cases
    in table order, ``plain-<key>.2`` for the next ones, and so on (the pytest plugin's xdist
    groups, ``offload-harness run``'s bundles)."""
    seen: dict[str, int] = {}
    groups = []
    for case in cases:
        key = sharing_key(case, env)
        earlier = seen.get(key, 0)
        seen[key] = earlier + 1
        chunk = earlier // MAX_ROWS_SHARING
        groups.append(f"plain-{key}" + (f".{chunk + 1}" if chunk else ""))
    return groups


def _digest(spec: ModelSpec, run: RunSpec, sharding: str, device: torch.device) -> str:
    text = repr((spec, run, sharding, str(device), distributed.world_size()))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def plain_baseline(case: Case, env: Environment, baselines: Baselines | None = None) -> SharedPlain:
    """The case's plain baseline: the one ``baselines`` (default ``BASELINES``) kept if its key
    is the same, else trained now (and kept in its place)."""
    kept = BASELINES if baselines is None else baselines
    spec, run = env.spec(case), case.run_spec()
    key = _digest(spec, run, case.sharding, env.device)
    found = kept.plain_for(key)
    if found is not None:
        return found
    kept.plain = None
    sink: list[TransferCounts] = []
    result = train(
        spec,
        run,
        NoOffload(),
        env.device,
        # The runner's own copies only matter on CUDA (on CPU only copies inside offload
        # ranges are counted); profiling costs seconds per step on the CPU machine.
        hooks=profile_steps(env.device, {0, run.steps - 1}, sink, ranges=False)
        if env.device.type == "cuda"
        else None,
        keep_grads=True,
        keep_final_state=True,
        sharding=case.sharding,
    )
    shared = SharedPlain(key, case.name, result, (sink[0], sink[-1]) if sink else None)
    kept.plain = shared
    return shared
