"""Per-step metrics: one strict JSON object per line in metrics.jsonl (a non-finite value is written as null and
its key listed under "nonfinite"), tensorboard scalars, optional wandb, and a concise console line."""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from models.moe import RouterStats
from training.checkpoint import atomic_write_text
from training.config import LoggingConfig

logger = logging.getLogger("train")


class MetricLogger:
    """Writes only on the process that owns the run directory (rank 0); a no-op elsewhere."""

    def __init__(self, run_dir: Path, cfg: LoggingConfig, enabled: bool, run_config: dict[str, Any],
                 keep_until: int | None = None) -> None:
        """``keep_until``: resuming after that step, keep earlier lines of metrics.jsonl (a fresh run truncates)."""
        self.enabled = enabled
        self._jsonl = self._tb = self._wandb = None
        if not enabled:
            return
        path = run_dir / "metrics.jsonl"
        kept = _lines_until(path, keep_until) if keep_until is not None and path.exists() else []
        atomic_write_text(path, "".join(line + "\n" for line in kept))
        self._jsonl = open(path, "a", buffering=1)
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        if cfg.wandb:
            try:
                import wandb
            except ImportError as e:
                raise ImportError("logging.wandb=true needs wandb: pip install '.[wandb]'") from e
            os.environ.setdefault("WANDB_MODE", cfg.wandb_mode)
            self._wandb = wandb.init(project=cfg.wandb_project, dir=str(run_dir), config=run_config)

    def log(self, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._jsonl.write(json.dumps(strict_json(metrics), allow_nan=False) + "\n")
        step = metrics["step"]
        scalars = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and k != "step" and math.isfinite(v)}
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _lines_until(path: Path, step: int) -> list[str]:
    """The lines of metrics.jsonl up to ``step``; a line cut short by a killed run is dropped."""
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line)
        except (json.JSONDecodeError, TypeError, KeyError):
            logger.warning("%s: dropping an unreadable line (cut short by a killed run?): %.80s", path, line)
    return kept


def strict_json(metrics: dict[str, Any]) -> dict[str, Any]:
    """``metrics`` with non-finite floats as None, their keys listed under "nonfinite" (JSON has no NaN)."""
    bad = [k for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v)]
    if not bad:
        return metrics
    return {**{k: None if k in bad else v for k, v in metrics.items()}, "nonfinite": bad}


def progress_line(m: dict[str, Any], total_steps: int, eta_s: float) -> str:
    mfu = f" | mfu {m['mfu']:.1%}" if m.get("mfu") is not None else ""
    skipped = " | SKIPPED: non-finite loss or grad norm, no update" if m.get("skipped") else ""
    return (f"step {m['step']:>5}/{total_steps}{skipped} | loss {m['loss']:.4f} | aux {m['aux_loss']:.4f} | "
            f"gnorm {m['grad_norm']:.3f} | lr {m['lr']:.2e} | {m['tokens_per_s_per_device']:,.0f} tok/s/dev"
            f"{mfu} | moe imb {m['moe/max_imbalance']:.2f} | mem {m['peak_mem_gib']:.2f} GiB | eta {_hms(eta_s)}")


def _hms(seconds: float) -> str:
    minutes, s = divmod(int(seconds), 60)
    h, minutes = divmod(minutes, 60)
    return f"{h}h{minutes:02d}m{s:02d}s" if h else f"{minutes}m{s:02d}s"


def routing_summary(stats: list[RouterStats]) -> torch.Tensor:
    """[L, 2E + 2] per MoE layer: routed slots per expert, router probability sums per expert, entropy sum,
    token count (no grad, stays on device)."""
    return torch.stack([torch.cat([s.counts_E, s.prob_sum_E.detach(), s.entropy_sum.reshape(1),
                                   s.counts_E.new_tensor([s.num_tokens])]) for s in stats]).detach()


def moe_metrics(routing_LX: torch.Tensor, group: dist.ProcessGroup | None) -> dict[str, float]:
    """Per layer over the global batch: load imbalance (max / mean slots per expert; 1 is perfect balance),
    mean router entropy (nats) and the layer's Switch aux loss ``E * sum_e f_e * P_e``; plus the worst
    imbalance over layers."""
    if group is not None:
        routing_LX = routing_LX.clone()
        dist.all_reduce(routing_LX, group=group)
    num_experts = (routing_LX.shape[1] - 2) // 2
    counts_LE, prob_sum_LE = routing_LX[:, :num_experts], routing_LX[:, num_experts:2 * num_experts]
    entropy_L, tokens_L = routing_LX[:, -2], routing_LX[:, -1].clamp_min(1)
    imbalance_L = (counts_LE.max(dim=1).values / counts_LE.mean(dim=1).clamp_min(1e-9)).tolist()
    aux_L = (num_experts * (counts_LE * prob_sum_LE).sum(dim=1) / tokens_L**2).tolist()
    entropy_L = (entropy_L / tokens_L).tolist()
    out: dict[str, float] = {"moe/max_imbalance": max(imbalance_L)}
    for layer, (imbalance, entropy, aux) in enumerate(zip(imbalance_L, entropy_L, aux_L)):
        out[f"moe/layer{layer}/imbalance"] = imbalance
        out[f"moe/layer{layer}/router_entropy"] = entropy
        out[f"moe/layer{layer}/aux_loss"] = aux
    return out
