"""How the cases are grouped (``harness.execute.baselines.sharing_groups``: at most
``MAX_ROWS_SHARING``
rows of one plain baseline, for pytest-xdist and ``offload-harness run``) and how the plugin
orders them (``harness.plugin.cases.longest_groups_first``: the groups with the most work
first)."""

from __future__ import annotations

import math
from collections import Counter
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from harness.cases import Case, matrix
from harness.execute.baselines import MAX_ROWS_SHARING, plain_key, sharing_groups
from harness.execute.environment import Environment
from harness.plugin.cases import longest_groups_first

ENV = Environment(device=torch.device("cpu"))


def test_full_matrix_groups_hold_one_plain_baseline_and_at_most_four_rows() -> None:
    rows = matrix("full")
    groups = sharing_groups(rows, ENV)
    sizes = Counter(groups)
    assert max(sizes.values()) == MAX_ROWS_SHARING  # the full matrix has keys of 12-15 rows
    keys: dict[str, set[str]] = {}
    for row, group in zip(rows, groups, strict=True):
        keys.setdefault(group, set()).add(plain_key(row, ENV))
    assert all(len(found) == 1 for found in keys.values()), "a group mixes plain baselines"
    per_key = Counter(plain_key(row, ENV) for row in rows)
    expected = sum(math.ceil(n / MAX_ROWS_SHARING) for n in per_key.values())
    assert len(sizes) == expected  # no key split into more groups than it needs


def test_default_matrix_keeps_its_groups_whole() -> None:
    rows = matrix("default")
    groups = sharing_groups(rows, ENV)
    assert all("." not in group for group in groups)
    assert len(set(groups)) == len({plain_key(row, ENV) for row in rows})


class _Item:
    """What ``longest_groups_first`` reads of a pytest item."""

    def __init__(self, name: str, group: str | None, case: Case | None) -> None:
        self.name = name
        self.callspec = SimpleNamespace(params={"case": case}) if case is not None else None
        self._marker = SimpleNamespace(args=(group,)) if group is not None else None

    def get_closest_marker(self, name: str) -> Any:
        return self._marker if name == "xdist_group" else None


def test_the_group_with_the_most_work_comes_first_each_in_its_order() -> None:
    small, big, other = (
        Case(family="hybrid", offload=("core_attn",), steps=2),
        Case(family="hybrid", offload=("core_attn",), steps=6),
        Case(family="hybrid", offload=("qkv_linear",), steps=3),
    )
    assert big.work > other.work + small.work > small.work
    items = [
        _Item("plain", None, None),
        _Item("small-eq", "g-small", small),
        _Item("big-eq", "g-big", big),
        _Item("other-eq", "g-small", other),
        _Item("small-mem", "g-small", small),
        _Item("big-mem", "g-big", big),
    ]
    longest_groups_first(items)  # type: ignore[arg-type]
    assert [i.name for i in items] == [
        "big-eq", "big-mem", "small-eq", "other-eq", "small-mem", "plain",
    ]  # fmt: skip


@pytest.mark.parametrize("name", ["default", "full"])
def test_on_a_matrix_groups_come_whole_and_by_falling_work(name: str) -> None:
    """A matrix's tests as collected (test file by test file, rows in table order), ordered:
    no group reappears once another one started, and the groups' work never rises."""
    rows = matrix(name)
    groups = sharing_groups(rows, ENV)
    items = [
        _Item(f"{test}[{row.name}]", group, row)
        for test in ("equivalence", "memory", "transfers")
        for row, group in zip(rows, groups, strict=True)
    ]
    longest_groups_first(items)  # type: ignore[arg-type]
    order = [item._marker.args[0] for item in items]
    runs = [group for i, group in enumerate(order) if i == 0 or order[i - 1] != group]
    assert len(runs) == len(set(runs)), "a group's tests are not contiguous"
    work = {g: sum(r.work for r, rg in zip(rows, groups, strict=True) if rg == g) for g in runs}
    assert [work[g] for g in runs] == sorted(work.values(), reverse=True)
    first = [item.name for item in items if item._marker.args[0] == runs[0]]
    assert first[0].startswith("equivalence[")  # a group's tests keep their own order
