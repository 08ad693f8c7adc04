"""AdamW and the warmup + cosine learning-rate schedule."""

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


def lr_lambda(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the peak lr after ``step`` updates: linear warmup, then cosine to min_lr_ratio."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    decay_steps = max(total_steps - warmup_steps, 1)
    progress = min((step - warmup_steps) / decay_steps, 1.0)
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int, position: int = 0
                    ) -> LambdaLR:
    """The schedule at ``position`` (updates taken so far; a resume passes the checkpoint's), always from the
    current config: a resume with a deliberately changed optim.lr or train.steps follows the new schedule from its
    first step, lr = optim.lr x multiplier(position) with the new warmup, total and min_lr_ratio."""
    for group in optimizer.param_groups:
        group["initial_lr"] = cfg.lr
    return LambdaLR(optimizer, lambda step: lr_lambda(step, cfg.warmup_steps, total_steps, cfg.min_lr_ratio),
                    last_epoch=position - 1)
