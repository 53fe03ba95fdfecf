"""The numerics fingerprint of a machine: what decides which kernels, and so which last bits, a
run gets - the key of the golden traces (``harness.verify.golden``).

Two machines with equal *keyed* fields run the same kernels on the same numbers; a golden trace
recorded on one must then match the other bitwise. The *info* fields are written beside them
(CPU model, thread count, driver) so that a drift message can say what else differed.

CPU, keyed:

* ``torch`` - the torch build (``2.13.0+cpu``);
* ``aten_cpu_capability`` - the vector width of torch's own CPU kernels (``DEFAULT``, ``AVX2``,
  ``AVX512``; honours ``ATEN_CPU_CAPABILITY``), which also decides the CPU initialisation's
  ``normal_`` fill, so CUDA fingerprints carry it too;
* ``onednn_isa`` - the instruction set oneDNN dispatches to, as oneDNN itself reports it
  (honours ``ONEDNN_MAX_CPU_ISA``). It decides whether bf16 matmuls run on native bf16
  dot products (``avx512_bf16``, AMX) or on fp32 emulation, which round differently;
* ``cpu_vendor`` - MKL picks its fp32 GEMM code path by vendor as well as by ISA;
* ``mkl_overrides`` - ``MKL_ENABLE_INSTRUCTIONS``, ``MKL_CBWR``, ``MKL_DEBUG_CPU_TYPE`` if set.

CUDA, keyed: ``torch``, ``cuda`` (the runtime torch was built with), ``gpu`` (device name),
``compute_capability``, ``cudnn``, and the host's ``aten_cpu_capability``.

A field whose value was not recorded is ``?`` (goldens written before fingerprints existed);
such a fingerprint is *partial*: it can confirm a trace, never refute one
(``harness.verify.golden``).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import os
import platform
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import torch

UNKNOWN = "?"
"""The value of a field that was not recorded."""

CPU_KEYED = ("torch", "aten_cpu_capability", "onednn_isa", "cpu_vendor", "mkl_overrides")
CUDA_KEYED = ("torch", "cuda", "gpu", "compute_capability", "cudnn", "aten_cpu_capability")

_MKL_VARIABLES = ("MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR", "MKL_DEBUG_CPU_TYPE")
_CPU_FLAGS = (
    "avx2",
    "avx512f",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
)
"""The /proc/cpuinfo flags worth writing down: what decides bf16 and fp32 kernel choice."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Fingerprint:
    """A machine's keyed numerics fields and its informational ones."""

    device: str
    """``cpu`` or ``cuda``."""
    keyed: tuple[tuple[str, str], ...]
    """(field, value) pairs that decide the numbers, in a fixed order."""
    info: tuple[tuple[str, str], ...] = ()
    """(field, value) pairs recorded for the reader, not part of the key."""

    @property
    def id(self) -> str:
        """The golden folder name: a readable prefix and a hash of the keyed fields,
        ``cpu-avx2-1a2b3c4d`` or ``cuda-h200-5e6f7a8b``."""
        fields = dict(self.keyed)
        if self.device == "cuda":
            prefix = f"cuda-{gpu_short_name(fields.get('gpu', UNKNOWN))}"
        else:
            prefix = f"cpu-{fields.get('aten_cpu_capability', UNKNOWN).lower()}"
        text = "\n".join(f"{k}={v}" for k, v in self.keyed)
        return f"{prefix}-{hashlib.sha256(text.encode()).hexdigest()[:8]}"

    @property
    def partial(self) -> bool:
        """Some keyed field was not recorded."""
        return any(v == UNKNOWN for _, v in self.keyed)

    def fits(self, other: Fingerprint) -> bool:
        """``other`` agrees with every keyed field recorded here (``?`` agrees with anything)."""
        theirs = dict(other.keyed)
        return self.device == other.device and all(
            v == UNKNOWN or theirs.get(k) == v for k, v in self.keyed
        )

    def differences(self, other: Fingerprint, *, keyed_only: bool = False) -> list[str]:
        """``field: ours vs theirs`` for every field (keyed first) whose values differ."""
        out = []
        pairs = [(self.keyed, other.keyed, "keyed")]
        if not keyed_only:
            pairs.append((self.info, other.info, ""))
        for mine, theirs, what in pairs:
            a, b = dict(mine), dict(theirs)
            for field in dict.fromkeys([*a, *b]):
                if a.get(field, UNKNOWN) != b.get(field, UNKNOWN):
                    tag = f" ({what})" if what else ""
                    out.append(f"{field}{tag}: {a.get(field, UNKNOWN)} vs {b.get(field, UNKNOWN)}")
        return out

    def summary(self) -> str:
        """The keyed fields on one line."""
        return ", ".join(f"{k} {v}" for k, v in self.keyed)

    def lines(self) -> list[str]:
        """``field value`` lines: ``device``, the keyed fields, then ``info.<field>`` ones."""
        return [
            f"device {self.device}",
            *(f"{k} {v}" for k, v in self.keyed),
            *(f"info.{k} {v}" for k, v in self.info),
        ]

    @classmethod
    def parse(cls, lines: list[str], source: str = "fingerprint") -> Fingerprint:
        """The inverse of ``lines`` (blank lines ignored); a bad line is a ``ValueError``."""
        device, keyed, info = None, [], []
        for line in lines:
            if not line.strip():
                continue
            field, _, value = line.strip().partition(" ")
            if not value:
                raise ValueError(f"{source}: expected 'field value', got {line.strip()!r}")
            if field == "device":
                device = value
            elif field.startswith("info."):
                info.append((field.removeprefix("info."), value))
            else:
                keyed.append((field, value))
        if device not in ("cpu", "cuda"):
            raise ValueError(f"{source}: no 'device cpu' or 'device cuda' line")
        expected = CUDA_KEYED if device == "cuda" else CPU_KEYED
        if [k for k, _ in keyed] != list(expected):
            raise ValueError(f"{source}: keyed fields must be {', '.join(expected)}")
        return cls(device=device, keyed=tuple(keyed), info=tuple(info))


_VENDOR_WORDS = {"nvidia", "geforce", "tesla", "quadro"}
_VARIANT = re.compile(r"^(\d+gb|sxm\d*|pcie|hbm\d*e?|nvl\d*|mig.*)$")


def gpu_short_name(device_name: str) -> str:
    """``NVIDIA H200`` -> ``h200``, ``NVIDIA H100 80GB HBM3`` -> ``h100``,
    ``NVIDIA GeForce RTX 4090`` -> ``rtx-4090``: the model, without vendor, memory or form
    factor."""
    words = [w for w in re.split(r"[\s\-_]+", device_name.lower()) if w]
    kept: list[str] = []
    for word in words:
        if word in _VENDOR_WORDS:
            continue
        if _VARIANT.match(word):
            break
        kept.append(re.sub(r"[^a-z0-9]", "", word))
    return "-".join(w for w in kept if w) or "unknown"


def of(device: torch.device) -> Fingerprint:
    """This process's fingerprint for runs on ``device`` (computed once per device)."""
    return _of(device.type, device.index if device.type == "cuda" else None)


def cudnn_version() -> str:
    """The cuDNN torch loads, as ``torch.backends.cudnn.version()`` spells it (``91900``), or
    ``none``. When another package puts a different cuDNN first on the library path (e.g.
    TransformerEngine's wheels), torch refuses to report it; the runtime version it found is
    what runs, so that is the key, with torch's own build noted: ``91400 (torch built 91900)``."""
    try:
        if not torch.backends.cudnn.is_available():
            return "none"
        return str(torch.backends.cudnn.version())
    except RuntimeError:
        binding = getattr(torch._C, "_cudnn", None)
        if binding is None:
            return UNKNOWN

        def number(version: tuple[int, int, int]) -> int:
            return version[0] * 10_000 + version[1] * 100 + version[2]

        runtime, built = binding.getRuntimeVersion(), binding.getCompileVersion()
        return f"{number(runtime)} (torch built {number(built)})"


@functools.cache
def _of(kind: str, index: int | None) -> Fingerprint:
    cpu = _cpu_info()
    common_info = (
        *_library_versions(),
        ("cpu_model", cpu["model"]),
        ("cpu_flags", " ".join(f for f in _CPU_FLAGS if f in cpu["flags"]) or "none"),
        ("torch_threads", str(torch.get_num_threads())),
        ("machine", platform.machine() or UNKNOWN),
    )
    if kind == "cuda":
        device = torch.device("cuda", index if index is not None else torch.cuda.current_device())
        major, minor = torch.cuda.get_device_capability(device)
        keyed = (
            ("torch", torch.__version__),
            ("cuda", str(torch.version.cuda)),
            ("gpu", torch.cuda.get_device_name(device)),
            ("compute_capability", f"{major}.{minor}"),
            ("cudnn", cudnn_version()),
            ("aten_cpu_capability", torch.backends.cpu.get_cpu_capability()),
        )
        return Fingerprint(device="cuda", keyed=keyed, info=common_info)
    overrides = [f"{v}={os.environ[v]}" for v in _MKL_VARIABLES if os.environ.get(v)]
    keyed = (
        ("torch", torch.__version__),
        ("aten_cpu_capability", torch.backends.cpu.get_cpu_capability()),
        ("onednn_isa", onednn_isa()),
        ("cpu_vendor", cpu["vendor"]),
        ("mkl_overrides", ",".join(overrides) or "none"),
    )
    return Fingerprint(device="cpu", keyed=keyed, info=common_info)


def _cpu_info() -> dict[str, str]:
    """Vendor, model name and flags of the first processor in /proc/cpuinfo (``?`` where it
    is not readable)."""
    info = {"vendor": UNKNOWN, "model": platform.processor() or UNKNOWN, "flags": ""}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as file:
            first = file.read().split("\n\n", 1)[0]
    except OSError:
        return info
    keys = {"vendor_id": "vendor", "model name": "model", "flags": "flags"}
    for line in first.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in keys:
            info[keys[name.strip()]] = value.strip()
    return info


def _library_versions() -> tuple[tuple[str, str], ...]:
    """The versions of the model libraries megatron-core's rows run on, where installed (read
    from package metadata: nothing is imported)."""
    found = []
    for field, distribution in (
        ("megatron_core", "megatron-core"),
        ("transformer_engine", "transformer_engine"),
    ):
        try:
            found.append((field, importlib.metadata.version(distribution)))
        except importlib.metadata.PackageNotFoundError:
            continue
    return tuple(found)


_ISA_LINE = "info,cpu,isa:"


@functools.cache
def onednn_isa() -> str:
    """The ISA oneDNN dispatches to, in its own words (``Intel AVX2``, ``Intel AVX-512 with
    Intel DL Boost and bfloat16 support``...). oneDNN prints it once per process, on its first
    verbose message, to the C-level stdout: read in this process while it has not printed yet,
    else in a fresh interpreter with the same environment. ``?`` when neither says."""
    if not torch.backends.mkldnn.is_available():
        return "none"
    found = _isa_from(_verbose_conv_output())
    if found is None:
        found = _isa_from(_subprocess_output())
    return found or UNKNOWN


def _isa_from(text: str) -> str | None:
    for line in text.splitlines():
        if _ISA_LINE in line:
            return line.split(_ISA_LINE, 1)[1].strip()
    return None


def _one_convolution() -> None:
    x = torch.ones(1, 2, 5, 5)
    w = torch.ones(2, 2, 3, 3)
    torch.ops.aten.mkldnn_convolution(x, w, None, [0, 0], [1, 1], [1, 1], 1)


def _verbose_conv_output() -> str:
    """What oneDNN writes to file descriptor 1 during one verbose convolution."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:
        return ""
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 1)
        try:
            with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
                _one_convolution()
        except RuntimeError:
            pass
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        capture.seek(0)
        return capture.read().decode(errors="replace")


def _subprocess_output() -> str:
    code = "from harness.measure.fingerprint import _verbose_conv_output as f; print(f())"
    try:
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout
