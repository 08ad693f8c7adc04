"""FP8 training, ``train.float8=rowwise``: the decoder blocks' projections (attention, DeltaNet, dense MLPs) become
torchao ``Float8Linear`` and the routed experts run ``kernels.float8_grouped_mm``, all with dynamic rowwise scales.

Applied once, to the model on the meta device, before activation checkpointing, EP and FSDP: those then wrap and
shard the converted modules like any others. ``Float8Linear`` keeps ``weight`` as the same high-precision
parameter (quantised per call), so FSDP all-gathers bf16 as without FP8 (float8 all-gather stays off), and
parameter names, state dicts, checkpoints and the export are unchanged.

Kept in high precision: the router (``TopKRouter``, never an ``nn.Linear``), the embeddings and what runs after the
blocks (``ModelSpec.final``: final norm, LM head), norms, and linears with a dim not a multiple of 16 (the FP8
kernels' alignment) or below ``MIN_FLOAT8_LINEAR_DIM``.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch.nn as nn

from core import device
from kernels.float8_grouped_mm import float8_grouped_mm, float8_grouped_mm_ok
from models import ModelSpec
from models.moe import GroupedExperts, TopKRouter

logger = logging.getLogger(__name__)

FLOAT8_MODES = ("none", "rowwise")  # train.float8
FP8_UNITS_CAPABILITY = (8, 9)  # Ada: the first CUDA GPUs with FP8 tensor cores
# torch._scaled_grouped_mm (the experts' FP8 GEMM) has kernels for Hopper (sm_90) and newer only.
MIN_FLOAT8_CAPABILITY = (9, 0)
# A linear with in- or out-features below this stays in bf16: its per-row quantisation passes cost about what the
# FP8 GEMM saves (torchao's rowwise H100 table: no gain at K or N <= 1024; scripts/check_float8.py measures ours).
MIN_FLOAT8_LINEAR_DIM = 1024
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


def float8_linear_filter(model: nn.Module, spec: ModelSpec, min_dim: int = MIN_FLOAT8_LINEAR_DIM
                         ) -> Callable[[nn.Module, str], bool]:
    """torchao's ``module_filter_fn``: (module, FQN) -> convert it. Only ``nn.Linear`` inside the decoder blocks,
    outside any router, with both dims multiples of 16 and >= ``min_dim``."""
    blocks = spec.blocks + "."
    kept_prefixes = tuple(name + "." for name in (spec.embeddings, *spec.final))
    routers = tuple(name + "." for name, m in model.named_modules() if isinstance(m, TopKRouter))

    def convert(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear) or not fqn.startswith(blocks) or fqn.startswith(kept_prefixes + routers):
            return False
        dims = (module.in_features, module.out_features)
        return all(d % 16 == 0 and d >= min_dim for d in dims)

    return convert


def float8_linear_fqns(model: nn.Module, spec: ModelSpec, min_dim: int = MIN_FLOAT8_LINEAR_DIM) -> list[str]:
    """The FQNs of the linears ``apply_float8`` converts."""
    convert = float8_linear_filter(model, spec, min_dim)
    return [name for name, module in model.named_modules() if convert(module, name)]


def _torchao_float8():
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        raise ImportError(f"train.float8=rowwise needs torchao (0.18 tested): {FLOAT8_EXTRA}; ({e})") from e
    return Float8LinearConfig, convert_to_float8_training


def apply_float8(model: nn.Module, spec: ModelSpec, mode: str, device_type: str,
                 capability: tuple[int, int] | None = None, min_dim: int = MIN_FLOAT8_LINEAR_DIM,
                 check_device: bool = True) -> tuple[list[str], int]:
    """Convert ``model`` in place for ``train.float8=mode`` (not ``none``), before any sharding; returns the
    converted linears' FQNs and how many experts modules run the FP8 grouped GEMM. ``capability``: the CUDA
    compute capability (None: this machine's). ``check_device=False`` (tests) converts on any device; the
    experts then run the exact CPU emulation of the FP8 GEMM."""
    if mode not in FLOAT8_MODES or mode == "none":
        raise ValueError(f"train.float8={mode!r}: apply_float8 takes one of {', '.join(FLOAT8_MODES[1:])}")
    if check_device:
        if device_type == "cuda" and capability is None:
            capability = tuple(device.module("cuda").get_device_capability())
        check_float8_device(device_type, capability)
    Float8LinearConfig, convert_to_float8_training = _torchao_float8()
    fqns = float8_linear_fqns(model, spec, min_dim)
    chosen = set(fqns)  # decided once, by name: torchao passes each module's FQN as named_modules gives it
    # Rowwise: dynamic e4m3 scales per row of input, weight and grad_output, rounded to powers of 2; the default
    # enable_fsdp_float8_all_gather=False keeps FSDP's all-gathers in bf16 (rowwise has no fp8 all-gather).
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(mode),
                               module_filter_fn=lambda module, fqn: fqn in chosen)
    experts = [block.get_submodule(spec.experts) for block in model.get_submodule(spec.blocks)]
    fp8_experts = 0
    for module in experts:
        assert isinstance(module, GroupedExperts), type(module)
        if all(float8_grouped_mm_ok(w.transpose(-2, -1)) for w in (module.gate_up_proj, module.down_proj)):
            # A flag on the module, not a registry choice: the registry picks a device's kernel for the same
            # product and installs it per device type after parallelize; FP8 is a different product, chosen by
            # train.float8 per experts module (shapes the kernel cannot take stay bf16). The model just calls it.
            module.grouped_mm = float8_grouped_mm
            fp8_experts += 1
    logger.info("train.float8=%s: %d linears in FP8 (%s), the routed experts of %d of %d layers in FP8; the rest "
                "(router, embeddings, LM head, norms, linears with a dim < %d or not a multiple of 16) in high "
                "precision", mode, len(fqns), _summary(fqns, spec), fp8_experts, len(experts), min_dim)
    return fqns, fp8_experts


def _summary(fqns: list[str], spec: ModelSpec) -> str:
    """The converted linears by their name within a block (``self_attn.q_proj``), without the layer index."""
    leaves = sorted({f[len(spec.blocks) + 1:].partition(".")[2] for f in fqns})
    return ", ".join(leaves) if leaves else "none"
