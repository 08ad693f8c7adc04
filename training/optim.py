"""AdamW and the learning-rate schedules: warmup, then cosine, warmup-stable-decay or constant."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch.optim.lr_scheduler import LambdaLR

from training.config import OptimConfig


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (norm weights and other vectors are not decayed)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                             fused=use_fused(cfg, params[0].device.type))


def use_fused(cfg: OptimConfig, device_type: str) -> bool:
    """``optim.fused``, or by default the fused kernel on CUDA: one pass over p, g, m, v instead of foreach's
    one kernel per elementwise op (measured on an H200 with 2.8B parameters per GPU: 72 ms -> see
    docs/benchmarks.md). torch's own default for ``fused=None`` is foreach."""
    return cfg.fused if cfg.fused is not None else device_type == "cuda"


# Decay shapes: the multiplier's fraction of (1 - min_lr_ratio) left at decay progress p in [0, 1].
DECAY = {
    "linear": lambda p: 1 - p,
    "cosine": lambda p: 0.5 * (1 + math.cos(math.pi * p)),
    "sqrt": lambda p: 1 - math.sqrt(p),  # "1-sqrt" cooldown of Hägele et al. 2024 (arXiv:2405.18392)
}


def lr_multiplier(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Multiplier of the peak lr after ``step`` updates, a pure function of the step (so a resume follows it
    exactly): linear warmup over ``warmup_steps``, then ``cfg.schedule``: cosine decays over the remaining steps;
    wsd holds the peak, then decays with ``decay_shape`` over the last ``decay_fraction`` of ``total_steps``
    (MiniCPM's warmup-stable-decay); constant holds the peak. Both decays reach min_lr_ratio at ``total_steps``."""
    if step < cfg.warmup_steps:
        return (step + 1) / (cfg.warmup_steps + 1)
    if cfg.schedule == "constant":
        return 1.0
    if cfg.schedule == "cosine":
        shape, start, length = "cosine", cfg.warmup_steps, max(total_steps - cfg.warmup_steps, 1)
    else:  # wsd
        shape, length = cfg.decay_shape, cfg.decay_fraction * total_steps
        start = total_steps - length
    progress = min(max((step - start) / length, 0.0), 1.0)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * DECAY[shape](progress)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int, position: int = 0
                    ) -> LambdaLR:
    """The schedule at ``position`` (updates taken so far; a resume passes the checkpoint's), always from the
    current config: a resume with a deliberately changed optim.lr or train.steps follows the new schedule from its
    first step, lr = optim.lr x lr_multiplier(position) with the new schedule keys and total."""
    for group in optimizer.param_groups:
        group["initial_lr"] = cfg.lr
    return LambdaLR(optimizer, lambda step: lr_multiplier(step, cfg, total_steps), last_epoch=position - 1)
