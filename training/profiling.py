"""Where the step time goes: ``logging.profile_step`` runs torch.profiler over a few training steps and
writes ``<run_dir>/profile/trace_rank{r}.json.gz`` (chrome://tracing, Perfetto) and a markdown summary of
device-kernel time by category, compute busy/idle time and exposed communication. Under the loopback world
(``launch.simulate_world``) the copies that stand in for collectives are counted apart, never as compute."""

from __future__ import annotations

import json
import logging
import re
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import NamedTuple

import torch

from core import device
from core.files import atomic_write_text

logger = logging.getLogger(__name__)

COMMUNICATION = "communication"
LOOPBACK = "loopback copies (collective stand-ins, not compute)"
# First match wins, so the order matters: NCCL kernel names contain "gather"/"reduce", cutlass grouped GEMMs
# and fmha kernels contain "cutlass", optimizer and copy kernels are "elementwise" kernels.
CATEGORIES: list[tuple[str, re.Pattern[str]]] = [
    (COMMUNICATION, re.compile(r"nccl|hccl", re.I)),
    ("grouped GEMM (experts)", re.compile(r"grouped|groupproblemshape", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|sdpa", re.I)),
    ("GEMM", re.compile(r"gemm|cutlass|xmma|nvjet|cublas|matmul|^kernel2$|sm\d+_|ampere_|hopper_", re.I)),
    ("optimizer", re.compile(r"multi_tensor|adam|foreach", re.I)),
    ("cross-entropy / softmax", re.compile(r"softmax|nll|cross_entropy", re.I)),
    ("copy / cast", re.compile(r"copy|memcpy|memset|(?<!broad)cast|fill", re.I)),
    ("index / permute", re.compile(r"index|gather|scatter|sort|radix|topk|scan|histo", re.I)),
    ("norm / activation (Triton & elementwise)", re.compile(r"triton|elementwise|vectorized|reduce|norm", re.I)),
]
OTHER = "other"


class KernelInterval(NamedTuple):
    """One device kernel (or memcpy/memset) as the profiler saw it."""

    name: str
    start_us: float
    end_us: float
    stream: int


def classify(name: str) -> str:
    return next((category for category, pattern in CATEGORIES if pattern.search(name)), OTHER)


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, disjoint intervals covering the same time."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _length(merged: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in merged)


def _intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total time covered by both of two merged interval lists (one sweep over both)."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _cell(name: str) -> str:
    """A kernel name as a table cell: C++ template names run to hundreds of characters."""
    name = name if len(name) <= 80 else name[:77] + "..."
    return name.replace("|", "\\|")


def summarize(kernels: list[KernelInterval], wall_s: float, steps: int,
              loopback: list[KernelInterval] | None = None) -> str:
    """A markdown report per step: wall time, compute busy/idle, hidden vs exposed communication, kernel time
    by category and the top 15 kernels. Concurrent kernels (streams) count once in the busy time. ``loopback``:
    the loopback world's copies (``split_loopback``), a category of their own, outside the busy time."""
    wall_ms = wall_s * 1e3 / steps
    lines = ["| per step | ms | share of wall |", "|---|---|---|", f"| wall time | {wall_ms:.2f} | 100.0% |"]
    if not kernels:
        return "\n".join([*lines, "", "No device kernels were recorded (a CPU run, or the profiler saw no device)."])

    def row(label: str, total_us: float) -> str:
        ms = total_us / 1e3 / steps
        return f"| {label} | {ms:.2f} | {ms / wall_ms:.1%} |"

    category_of = {name: classify(name) for name in {k.name for k in kernels}}  # a step has ~10^4 kernels
    compute = _merge([(k.start_us, k.end_us) for k in kernels if category_of[k.name] != COMMUNICATION])
    comm = _merge([(k.start_us, k.end_us) for k in kernels if category_of[k.name] == COMMUNICATION])
    busy_us, comm_us = _length(compute), _length(comm)
    exposed_us = comm_us - _intersection(comm, compute)
    # The window opens on a synchronised device (StepProfiler.step_begin), so its wall also holds the first step's
    # lead-in (the host fetches the batch and launches the first kernels on an idle device), which a steady-state
    # step hides behind the step before's optimizer. The idle from the first kernel to the last leaves that out.
    span_us = compute[-1][1] - compute[0][0] if compute else 0.0
    lines += [row("compute kernels busy (union over streams)", busy_us),
              row("GPU idle (no compute kernel running)", max(wall_s * 1e6 - busy_us, 0.0)),
              row("GPU idle from the first compute kernel to the last", span_us - busy_us),
              row("communication (union)", comm_us),
              row("exposed communication (not overlapped by compute)", exposed_us)]

    time_us: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for k in loopback or []:
        time_us[LOOPBACK] += k.end_us - k.start_us
        count[LOOPBACK] += 1
    for k in kernels:
        time_us[category_of[k.name]] += k.end_us - k.start_us
        count[category_of[k.name]] += 1
        by_name[k.name][0] += k.end_us - k.start_us
        by_name[k.name][1] += 1
    kernel_us = sum(time_us.values())
    lines += ["", "| category | ms/step | share of kernel time | kernels/step |", "|---|---|---|---|"]
    for category, total in sorted(time_us.items(), key=lambda item: -item[1]):
        lines.append(f"| {category} | {total / 1e3 / steps:.2f} | {total / kernel_us:.1%} | "
                     f"{count[category] / steps:g} |")
    lines += ["", "| top kernels | ms/step | calls/step | category |", "|---|---|---|---|"]
    for name, (total, calls) in sorted(by_name.items(), key=lambda item: -item[1][0])[:15]:
        lines.append(f"| {_cell(name)} | {total / 1e3 / steps:.2f} | {calls / steps:g} | {category_of[name]} |")
    return "\n".join(lines)


def step_profile(kernels: list[KernelInterval], wall_s: float, steps: int, loopback: dict[str, float]) -> dict:
    """The summary's numbers per step, in ms, for scripts: wall, compute busy (union over streams) and idle, kernel
    time by category, and the loopback copies by collective (``kernels`` without them: ``split_loopback``)."""
    compute = _merge([(k.start_us, k.end_us) for k in kernels if classify(k.name) != COMMUNICATION])
    by_category: dict[str, float] = defaultdict(float)
    for k in kernels:
        by_category[classify(k.name)] += (k.end_us - k.start_us) / 1e3 / steps
    wall_ms, busy_ms = wall_s * 1e3 / steps, _length(compute) / 1e3 / steps
    return {"wall_ms": wall_ms, "busy_ms": busy_ms, "idle_ms": max(wall_ms - busy_ms, 0.0),
            "categories_ms": dict(by_category), "loopback_ms": loopback}


def _loopback_ranges(prof: torch.profiler.profile) -> list:
    """The host ranges ``loopback <collective>`` (``parallelisms.loopback``) of a stopped profiler."""
    return [evt for evt in prof.events()
            if evt.name.startswith("loopback ") and evt.device_type == torch.autograd.DeviceType.CPU]


def loopback_ms(prof: torch.profiler.profile, steps: int) -> dict[str, float]:
    """Device time per step of the kernels launched inside each ``loopback <collective>`` range (the loopback
    world's copies, ``parallelisms.loopback``), by collective; {} when there are none or no device was recorded."""
    out: dict[str, float] = defaultdict(float)
    for evt in _loopback_ranges(prof):
        out[evt.name.removeprefix("loopback ")] += evt.device_time_total / 1e3 / steps
    return {kind: ms for kind, ms in out.items() if ms > 0}


def split_loopback(prof: torch.profiler.profile, kernels: list[KernelInterval]
                   ) -> tuple[list[KernelInterval], list[KernelInterval]]:
    """``kernels`` -> (the others, the loopback copies): the kernels launched by a host op inside a ``loopback``
    range. The profiler links a launch to its kernel by name and duration only (``FunctionEvent.kernels``), so a
    kernel is matched by both; two kernels of one name and one duration are interchangeable in every figure but the
    busy union, which then may shift by one such kernel."""
    launched: Counter[tuple[str, float]] = Counter()
    stack = _loopback_ranges(prof)
    while stack:
        evt = stack.pop()
        launched.update((k.name, k.duration) for k in evt.kernels)
        stack.extend(evt.cpu_children)
    rest, copies = [], []
    for k in kernels:
        key = (k.name, k.end_us - k.start_us)
        if launched[key] > 0:
            launched[key] -= 1
            copies.append(k)
        else:
            rest.append(k)
    return rest, copies


def kernel_intervals(prof: torch.profiler.profile) -> list[KernelInterval]:
    """The device kernels of a stopped profiler (GPU-side user annotations span kernels: left out)."""
    device_types = (torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.PrivateUse1)
    return [KernelInterval(evt.name, evt.time_range.start, evt.time_range.end,
                           getattr(evt, "device_resource_id", evt.thread))
            for evt in prof.events()
            if evt.device_type in device_types and not getattr(evt, "is_user_annotation", False)]


def _activities(device_type: str, host: bool = True) -> list[torch.profiler.ProfilerActivity]:
    """What the profiler records. Recording every host op slows the host, and so inflates exactly the host-bound
    gaps that GPU idle is made of; without the host (CUDA only) the kernels, and the gaps between them, are the
    step's own, and the trace shows no host side."""
    if device_type == "cuda" and not host:
        return [torch.profiler.ProfilerActivity.CUDA]
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device_type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    elif device_type == "npu":
        # torch_npu has its own profiler with a different result API; the host side still shows the gaps.
        logger.info("profiling: NPU kernels are not recorded (use torch_npu.profiler for them); host ops only")
    return activities


class StepProfiler:
    """Profiles steps start_step .. start_step + num_steps - 1; start_step 0 makes every method a no-op.
    The training loop calls ``step_begin``/``step_end`` around each step (the window's steps run as the others do,
    without a device sync between them) and ``close`` after the loop, which also ends a window the run stopped
    inside."""

    def __init__(self, run_dir: Path, start_step: int, num_steps: int, rank: int, device_type: str,
                 host: bool = True) -> None:
        self._dir, self._rank, self._device_type, self._host = run_dir / "profile", rank, device_type, host
        self._enabled, self._first, self._last = start_step > 0, start_step, start_step + num_steps - 1
        self._prof: torch.profiler.profile | None = None
        self._start, self._steps = 0.0, 0

    def step_begin(self, step: int) -> None:
        if self._enabled and step == self._first:
            # The training loop does not wait for a step's optimizer: the window starts on an idle device, so no
            # kernel of the step before runs inside it unrecorded.
            device.synchronize(self._device_type)
            self._prof = torch.profiler.profile(activities=_activities(self._device_type, self._host))
            self._prof.start()
            self._start = time.perf_counter()

    def step_end(self, step: int) -> bool:
        """After each step; at the window's last, waits for the device and writes the profile (returns True)."""
        if self._prof is not None:
            self._steps += 1
            if step == self._last:
                self.close()
                return True
        return False

    def close(self) -> None:
        """Stop, write the trace and summary of this rank, and log the summary on rank 0."""
        if self._prof is None:
            return
        device.synchronize(self._device_type)  # the window's wall time holds all of its kernels
        wall_s = time.perf_counter() - self._start
        prof, self._prof = self._prof, None
        prof.stop()
        self._dir.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self._dir / f"trace_rank{self._rank}.json.gz"))  # .gz: torch gzips it
        last = self._first + self._steps - 1
        title = (f"Profile of steps {self._first}..{last}, rank {self._rank}"
                 + ("" if self._host else ", device kernels only (logging.profile_host=false)"))
        kernels, copies = split_loopback(prof, kernel_intervals(prof))
        summary = summarize(kernels, wall_s, self._steps, copies)
        loopback = loopback_ms(prof, self._steps)
        if loopback:
            summary += "\n\n| loopback copies (stand-ins for collectives, launch.simulate_world) | ms/step |\n|---|---|\n" \
                + "\n".join(f"| {kind} | {ms:.2f} |" for kind, ms in sorted(loopback.items()))
        (self._dir / f"summary_rank{self._rank}.md").write_text(f"# {title}\n\n{summary}\n")
        atomic_write_text(self._dir / f"summary_rank{self._rank}.json",
                          json.dumps(step_profile(kernels, wall_s, self._steps, loopback), indent=1))
        if self._rank == 0:
            logger.info("%s (trace and summaries in %s):\n%s", title, self._dir, summary)
