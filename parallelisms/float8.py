"""FP8 training, ``train.float8=rowwise``: the decoder blocks' projections (attention, DeltaNet, dense MLPs) become
torchao ``Float8Linear`` and the routed experts' grouped GEMMs run ``kernels.float8.grouped_mm`` (the first one
fused with the dispatch gather where the dispatcher hands over its rows ungathered: ``kernels.float8.permute``), all
with dynamic rowwise scales, each only where it is measured to be faster on the running GPU.

Applied once, to the model on the meta device, before activation checkpointing, EP and FSDP: those then wrap and
shard the converted modules like any others. ``Float8Linear`` keeps ``weight`` as the same high-precision
parameter (quantised per call), so FSDP all-gathers bf16 as without FP8 (float8 all-gather stays off), and
parameter names, state dicts, checkpoints and the export are unchanged.

Never converted: the router (``TopKRouter``, never an ``nn.Linear``), the embeddings and what runs after the blocks
(``ModelSpec.final``: final norm, LM head), norms, and GEMMs with a dim not a multiple of 16 (the FP8 kernels'
alignment). The rest are candidates, decided per shape from the measured table (``kernels/float8/table.py``) of
this GPU model: a linear (in, out) at this run's tokens per rank (``train.local_batch_size x data.seq_len / cp``),
compiled times under ``train.compile`` (which compiles the projections), eager ones otherwise; an experts GEMM
(in, out) over its E / ep local experts at tokens x top-k routed rows, eager times (``train.compile`` leaves the
experts eager). FP8 where its forward + backward, quantisation included, is at least ``MIN_SPEEDUP`` x faster than
bf16; bf16 otherwise. The start-up log has one line per decision (a shape in all layers at once). A GPU the table
does not know converts nothing and warns, naming the command that measures it; so does a model of which nothing
qualifies: the run is then bf16, as the warning says.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch.nn as nn

from core import device
from kernels.float8.grouped_mm import ALIGN
from kernels.float8.permute import Float8GroupedMM
from kernels.float8.table import TABLE_PATH, WRITE_COMMAND, Timing, grouped_timing, linear_timing, load_table
from models import ModelSpec
from models.moe import GroupedExperts, TopKRouter

logger = logging.getLogger(__name__)

FLOAT8_MODES = ("none", "rowwise")  # train.float8
FP8_UNITS_CAPABILITY = (8, 9)  # Ada: the first CUDA GPUs with FP8 tensor cores
# torch._scaled_grouped_mm (the experts' FP8 GEMM) has kernels for Hopper (sm_90) and newer only.
MIN_FLOAT8_CAPABILITY = (9, 0)
# FP8 only where the table says it is at least this much faster: a gain within the timing noise of
# scripts/check_float8.py (about 1%) is not worth the FP8 rounding.
MIN_SPEEDUP = 1.02
FLOAT8_EXTRA = "pip install torchao (or pip install -e '.[float8]')"


def check_float8_device(device_type: str, capability: tuple[int, int] | None) -> None:
    """Raise ValueError, naming train.float8 and the fix, unless the device has FP8 matrix units and torch's FP8
    grouped GEMM: CUDA with compute capability >= MIN_FLOAT8_CAPABILITY."""
    fix = "fix: train.float8=none (bf16)"
    if device_type != "cuda":
        raise ValueError(f"train.float8=rowwise needs an NVIDIA GPU with FP8 matrix units (CUDA compute capability "
                         f">= {_sm(MIN_FLOAT8_CAPABILITY)}); this run is on {device_type}; {fix}")
    if capability is None or tuple(capability) < FP8_UNITS_CAPABILITY:
        raise ValueError(f"train.float8=rowwise: this GPU ({_sm(capability)}) has no FP8 matrix units (they start "
                         f"at {_sm(FP8_UNITS_CAPABILITY)}, Ada; the experts' FP8 grouped GEMM needs "
                         f"{_sm(MIN_FLOAT8_CAPABILITY)}, Hopper); {fix}")
    if tuple(capability) < MIN_FLOAT8_CAPABILITY:
        raise ValueError(f"train.float8=rowwise: torch._scaled_grouped_mm, the experts' FP8 GEMM, needs "
                         f"{_sm(MIN_FLOAT8_CAPABILITY)} (Hopper) or newer; this GPU is {_sm(capability)}; {fix}")


def _sm(capability: tuple[int, int] | None) -> str:
    return "unknown capability" if capability is None else f"sm_{capability[0]}{capability[1]}"


@dataclass(frozen=True)
class Candidate:
    """GEMMs of one shape that may run in FP8: linears (``name`` within a block, e.g. ``self_attn.q_proj``) or one
    of the experts' grouped GEMMs (``experts gate_up`` / ``experts down``), with their FQNs (linears) or the experts
    modules' FQNs."""

    kind: str  # "linear" or "experts"
    name: str
    d_in: int
    d_out: int
    groups: int  # local experts (0 for a linear)
    fqns: tuple[str, ...]

    @property
    def aligned(self) -> bool:
        return self.d_in % ALIGN == 0 and self.d_out % ALIGN == 0

    def describe(self) -> str:
        where = f"{len(self.fqns)} layer{'s' * (len(self.fqns) != 1)}"
        grouped = f", {self.groups} local experts" if self.kind == "experts" else ""
        return f"{self.name} {self.d_in} -> {self.d_out}{grouped} ({where})"


def float8_candidates(model: nn.Module, spec: ModelSpec, ep: int = 1) -> list[Candidate]:
    """The decoder blocks' ``nn.Linear`` outside any router and ``ModelSpec.final``, and the experts' two grouped
    GEMMs (gate_up: hidden -> 2 x intermediate, down: intermediate -> hidden, over E / ep local experts), grouped by
    shape and name within a block, in model order."""
    blocks = spec.blocks + "."
    kept_prefixes = tuple(name + "." for name in (spec.embeddings, *spec.final))
    routers = tuple(name + "." for name, m in model.named_modules() if isinstance(m, TopKRouter))
    groups: dict[tuple, list[str]] = defaultdict(list)
    for fqn, module in model.named_modules():
        if isinstance(module, nn.Linear) and fqn.startswith(blocks) and not fqn.startswith(kept_prefixes + routers):
            leaf = fqn[len(blocks):].partition(".")[2]
            groups["linear", leaf, module.in_features, module.out_features, 0].append(fqn)
    for index, block in enumerate(model.get_submodule(spec.blocks)):
        experts = block.get_submodule(spec.experts)
        assert isinstance(experts, GroupedExperts), type(experts)
        E, I2, D = experts.gate_up_proj.shape
        fqn = f"{spec.blocks}.{index}.{spec.experts}"
        groups["experts", "experts gate_up", D, I2, E // ep].append(fqn)
        groups["experts", "experts down", I2 // 2, D, E // ep].append(fqn)
    return [Candidate(*key, tuple(fqns)) for key, fqns in groups.items()]


@dataclass
class Float8Plan:
    """What ``apply_float8`` converts and the start-up log lines that say why (one per candidate)."""

    linears: list[str] = field(default_factory=list)  # FQNs of the linears to convert
    expert_gemms: dict[str, set[tuple[int, int]]] = field(default_factory=dict)  # experts FQN -> FP8 (in, out)
    decisions: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.linears and not self.expert_gemms


def plan_float8(candidates: list[Candidate], gpu: str, entry: dict[str, Any] | None, tokens: int, top_k: int,
                compiled: bool) -> Float8Plan:
    """Decide each candidate from the GPU's table ``entry`` (None: the GPU is not in the table: nothing in FP8)."""
    plan = Float8Plan()
    for c in candidates:
        fp8, reason = _decide(c, gpu, entry, tokens, top_k, compiled)
        plan.decisions.append(f"{c.describe()}: {reason}")
        if fp8 and c.kind == "linear":
            plan.linears.extend(c.fqns)
        elif fp8:
            for fqn in c.fqns:
                plan.expert_gemms.setdefault(fqn, set()).add((c.d_in, c.d_out))
    return plan


def _decide(c: Candidate, gpu: str, entry: dict[str, Any] | None, tokens: int, top_k: int, compiled: bool
            ) -> tuple[bool, str]:
    """(FP8 or not, the reason as the log line says it)."""
    if not c.aligned:
        return False, f"bf16: a dim is not a multiple of {ALIGN} (the FP8 kernels' alignment)"
    if entry is None:
        return False, f"bf16: {gpu!r} is not in the FP8 table"
    if c.kind == "linear":
        size, unit, mode = tokens, "tokens", "compiled" if compiled else "eager"
        timing = linear_timing(entry, c.d_in, c.d_out, tokens, compiled)
    else:  # train.compile leaves the experts eager
        size, unit, mode = tokens * top_k, "rows", "eager"
        timing = grouped_timing(entry, c.d_in, c.d_out, c.groups, size, compiled=False)
    if timing is None:
        return False, f"bf16: this shape is not in {gpu}'s FP8 table (measure it: {WRITE_COMMAND})"
    speedup = timing.speedup
    if speedup is None:
        return False, f"bf16: {gpu}'s FP8 table has no {mode} time of this shape (measure it: {WRITE_COMMAND})"
    fp8 = speedup >= MIN_SPEEDUP
    verdict = "FP8" if fp8 else f"bf16: FP8 is not >= {MIN_SPEEDUP}x faster"
    return fp8, (f"{verdict}: {mode} fwd+bwd {speedup:.2f}x ({_times(timing)}, measured at {timing.measured_at} "
                 f"{unit}; this run {size})")


def _times(t: Timing) -> str:
    return f"bf16 {t.bf16_ms:.3f} ms, fp8 {t.fp8_ms:.3f} ms"


def _torchao_float8():
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        raise ImportError(f"train.float8=rowwise needs torchao (0.18 tested): {FLOAT8_EXTRA}; ({e})") from e
    return Float8LinearConfig, convert_to_float8_training


def apply_float8(model: nn.Module, spec: ModelSpec, mode: str, device_type: str, *, tokens: int, ep: int = 1,
                 compiled: bool = False, capability: tuple[int, int] | None = None, gpu: str | None = None,
                 table: dict[str, dict[str, Any]] | None = None, check_device: bool = True) -> Float8Plan:
    """Convert ``model`` in place for ``train.float8=mode`` (not ``none``), before any sharding, where the FP8
    table of ``gpu`` says FP8 is faster; returns the plan. ``tokens``: tokens per rank and micro-batch; ``ep``: the
    expert-parallel degree; ``compiled``: ``train.compile``. ``capability`` and ``gpu`` (the CUDA compute capability
    and device name) default to this machine's, ``table`` to ``kernels/float8/table.json``. ``check_device=False``
    (tests) converts on any device; the experts then run the exact CPU emulation of the FP8 GEMM."""
    if mode not in FLOAT8_MODES or mode == "none":
        raise ValueError(f"train.float8={mode!r}: apply_float8 takes one of {', '.join(FLOAT8_MODES[1:])}")
    if check_device:
        if device_type == "cuda" and capability is None:
            capability = tuple(device.module("cuda").get_device_capability())
        check_float8_device(device_type, capability)
    Float8LinearConfig, convert_to_float8_training = _torchao_float8()
    if gpu is None:
        gpu = device.module(device_type).get_device_name()
    entry = (load_table() if table is None else table).get(gpu)
    plan = plan_float8(float8_candidates(model, spec, ep), gpu, entry, tokens, model.args.num_experts_per_tok,
                       compiled)
    if entry is None:  # one line says it for every candidate
        logger.warning("train.float8=%s: no FP8 timings for this GPU (%r) in %s: nothing is converted and this run "
                       "is bf16; to measure them on this GPU: %s", mode, gpu, TABLE_PATH, WRITE_COMMAND)
        return plan
    for line in plan.decisions:
        logger.info("train.float8=%s: %s", mode, line)
    if plan.empty:
        logger.warning("train.float8=%s: FP8 is faster for none of this model's GEMMs at these shapes on %s (the "
                       "lines above): nothing is converted and this run is bf16", mode, gpu)
        return plan
    chosen = set(plan.linears)  # decided once, by name: torchao passes each module's FQN as named_modules gives it
    # Rowwise: dynamic e4m3 scales per row of input, weight and grad_output, rounded to powers of 2; the default
    # enable_fsdp_float8_all_gather=False keeps FSDP's all-gathers in bf16 (rowwise has no fp8 all-gather).
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(mode),
                               module_filter_fn=lambda module, fqn: fqn in chosen)
    for fqn, shapes in plan.expert_gemms.items():
        # A callable on the module, not a registry choice: the registry picks a device's kernel for the same
        # product and installs it per device type after parallelize; FP8 is a different product, chosen by
        # train.float8 per GEMM shape. The model just calls it.
        model.get_submodule(fqn).grouped_mm = Float8GroupedMM(shapes)
    logger.info("train.float8=%s: %d linears and the grouped GEMMs of %d experts modules in FP8, the rest in bf16",
                mode, len(plan.linears), len(plan.expert_gemms))
    return plan
