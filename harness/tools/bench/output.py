"""The printed tables of one model (variants, ``--breakdown``, copy rates, baseline compute,
targets) and the JSON form of the results for ``bench.json``."""

from __future__ import annotations

import statistics
from typing import Any

from harness.tools.bench.common import MIB, _mib
from harness.tools.bench.measure import VariantResult
from harness.tools.bench.targets import Target


def render(entry: dict[str, Any], found_targets: list[Target]) -> str:
    """The model's tables as text."""
    v: dict[str, VariantResult] = entry["variants"]
    sizes = v["reference"].group_bytes
    groups = (
        f"{len(sizes)} offloaded groups/step of {min(sizes) / MIB:.1f}-{max(sizes) / MIB:.1f} MiB "
        f"(mean {statistics.mean(sizes) / MIB:.1f})"
        if sizes
        else "no group offloaded by the reference"
    )
    run = entry["run"]
    rounds = entry.get("rounds", 1)
    # One round: no range column (the table as before --rounds).
    range_head = f" {'range':>11}" if rounds > 1 else ""
    lines = [
        f"== {entry['model']} ({entry['pattern']}, {run['precision']}, {run['microbatches']} mb "
        f"{run['schedule']}, offload {'+'.join(entry['offload'])}): {groups}"
        + (f"; medians of {rounds} rounds" if rounds > 1 else ""),
        f"{'variant':<12} {'step ms':>9} {'x base':>7}{range_head} {'D2H MiB':>9} {'H2D MiB':>9} "
        f"{'eff GB/s':>9} {'fwd MiB':>9} {'peak MiB':>9}  status",
    ]
    for name, r in v.items():
        step = "-" if r.step_s is None else f"{r.step_s * 1e3:.2f}"
        ratio = "-" if r.ratio is None else f"{r.ratio:.3f}"
        spread = "-" if r.ratio_range is None else "{:.3f}-{:.3f}".format(*r.ratio_range)
        spread = f" {spread:>11}" if rounds > 1 else ""
        eff = "-" if r.effective_gbs is None else f"{r.effective_gbs:.1f}"
        lines.append(
            f"{name:<12} {step:>9} {ratio:>7}{spread} {_mib(r.d2h_bytes):>9} "
            f"{_mib(r.h2d_bytes):>9} {eff:>9} {_mib(r.after_forward_bytes):>9} "
            f"{_mib(r.peak_bytes):>9}  {r.status}"
        )
    lines += render_breakdown(entry)
    rates = entry.get("copy_rates")
    if rates:
        raw = rates["raw"]
        lines.append(
            f"copy-only at {rates['size_bytes'] // MIB} MiB x {rates['groups']} groups (GB/s): "
            f"raw pinned copy_ D2H {raw['d2h_gbs']:.1f} H2D {raw['h2d_gbs']:.1f}"
        )
        for name, r in rates.items():
            if name in ("raw", "size_bytes", "groups"):
                continue
            if "status" in r:
                lines.append(f"  {name:<12} {r['status']}")
                continue
            lines.append(
                f"  {name:<12} D2H {r['d2h_gbs']:.1f} ({r['d2h_gbs'] / raw['d2h_gbs']:.0%})  "
                f"H2D {r['h2d_gbs']:.1f} ({r['h2d_gbs'] / raw['h2d_gbs']:.0%})"
            )
    lines += render_compute(entry)
    for t in found_targets:
        lines.append(target_line(t))
    return "\n".join(lines)


def render_compute(entry: dict[str, Any]) -> list[str]:
    """The baseline's device compute next to the copies at the raw rate (CUDA only)."""
    lines: list[str] = []
    v: dict[str, VariantResult] = entry["variants"]
    compute = entry.get("baseline_compute")
    if isinstance(compute, dict):
        base = v["baseline"].step_s
        lines.append(
            f"device compute of a traced baseline step: busy {_ms(compute['step_s'])} of a "
            f"{_ms(base)} ms step, forwards {_ms(compute['forward_s'])}, backwards "
            f"{_ms(compute['backward_s'])}"
            + (
                f"; reference copies at the raw rate D2H {_ms(entry['raw_d2h_s'])}, H2D "
                f"{_ms(entry['raw_h2d_s'])}"
                if entry.get("raw_d2h_s") is not None
                else ""
            )
        )
    elif compute is not None:
        lines.append(f"device compute of the baseline: {compute}")
    return lines


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f}"


def render_breakdown(entry: dict[str, Any]) -> list[str]:
    """The ``--breakdown`` table (none without it): median ms per phase, then each variant's
    difference to the baseline."""
    v: dict[str, VariantResult] = entry["variants"]
    measured = {name: r.breakdown for name, r in v.items() if r.breakdown}
    if not measured:
        return []
    M = entry["run"]["microbatches"]
    columns = [f"fwd{m}" for m in range(M)] + [f"bwd{m}" for m in range(M)]
    columns += ["end_it", "optim", "drain", "other"]

    def cells(b: dict[str, Any]) -> list[float]:
        return [
            *b["forward_s"],
            *b["backward_s"],
            b["end_iteration_s"],
            b["optimizer_s"],
            b["drain_s"],
            b["other_s"],
        ]

    first = next(iter(measured.values()))
    clock = "CUDA events on the compute stream" if first["clock"] == "cuda" else "host clock"
    medians = f"medians of {first['timed_steps']} timed steps"
    if first.get("rounds", 1) > 1:
        medians += f" per round, median of {first['rounds']} rounds"
    lines = [
        f"breakdown (ms, {medians}, {clock}): fwd/bwd per "
        "microbatch, end_it the offloader's end_iteration, optim the optimizer, drain side "
        "streams after compute, other the rest",
        f"{'variant':<12} {'step ms':>9} " + " ".join(f"{c:>7}" for c in columns),
    ]
    for name, r in v.items():
        b = measured.get(name)
        if b is None:
            lines.append(f"{name:<12} {'-':>9}  {r.status}")
            continue
        values = " ".join(f"{x * 1e3:>7.2f}" for x in cells(b))
        lines.append(f"{name:<12} {_ms(b['step_s']):>9} {values}")
    base = measured.get("baseline")
    others = [name for name in measured if name != "baseline"]
    if base is not None and others:
        lines.append("minus baseline (ms):")
        for name in others:
            b = measured[name]
            diffs = [x - y for x, y in zip(cells(b), cells(base), strict=True)]
            values = " ".join(f"{d * 1e3:>+7.2f}" for d in diffs)
            step = f"{(b['step_s'] - base['step_s']) * 1e3:+.2f}"
            lines.append(f"{name:<12} {step:>9} {values}")
    return lines


def _json(value: Any) -> Any:
    if isinstance(value, VariantResult | Target):
        fields = dict(value.__dict__)
        if isinstance(value, VariantResult):
            fields["effective_gbs"] = value.effective_gbs
            fields["ratio"] = value.ratio
            fields["ratio_range"] = value.ratio_range
            for optional in (
                "breakdown",
                "trace",
                "timeline",
                "host_time",
                "host_footprint",
            ):  # only when asked
                if fields[optional] is None:
                    del fields[optional]
        return fields
    return str(value)


def target_line(target: Target) -> str:
    """``[PASS ] what: measured`` (SHORT, n/a)."""
    return f"[{target.verdict:<5}] {target.target}: {target.measured}"
