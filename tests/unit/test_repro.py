"""``offload-harness repro`` without a run: ``command.txt`` parsed again builds the same
reproduction, and bad input is one line that writes nothing. The reproductions themselves (a
clean case, a transport bug reported and bisected, the routing wrapper and the layer-output
capture) are in ``tests/e2e/test_repro_runs.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
from repro_args import CUSTOM

from harness.cases import default_matrix
from harness.cli import _parser, _repro_spec, main


def test_command_reruns_the_same_reproduction(tmp_path: Path) -> None:
    """command.txt, parsed again, builds the same reproduction (and works for --case too)."""
    for argv in (
        [*CUSTOM, "--precision", "bf16", "--seed", "7", "--max-inflight", "none"],
        [*CUSTOM[:3], "--preset", "moe-tiny-fused", "--offload", "fused_group_mlp"],
        ["repro", "--device", "cpu", "--case", default_matrix()[0].name, "--steps", "3"],
    ):
        spec = _repro_spec(_parser().parse_args(argv))
        again = _repro_spec(_parser().parse_args(spec.command()[1:]))
        assert again.to_json() == spec.to_json(), argv
    fused = _repro_spec(
        _parser().parse_args([*CUSTOM[:3], "--preset", "moe-tiny-fused", "--offload", "core_attn"])
    )
    assert fused.model.moe_path == "fused" and fused.case.family == "moe-fused"


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["repro", "--device", "cpu"], "needs both --pattern and --offload"),
        ([*CUSTOM, "--case", "x"], "exclusive"),
        (["repro", "--device", "cpu", "--case", "no-such-case"], "no-such-case"),
        ([*CUSTOM, "--seed", "-1"], "seed"),
        ([*CUSTOM, "--preset", "huge"], "--preset"),
        ([*CUSTOM, "--steps", "0"], "steps"),
        ([*CUSTOM, "--backend", "nope"], "--backend"),
    ],
)
def test_bad_input(
    argv: list[str], fragment: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*argv, "--report-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and fragment in err[0], err
    assert not list(tmp_path.iterdir())
