"""Per-step metrics: one strict JSON object per line in metrics.jsonl (a non-finite value is written as null and
its key listed under "nonfinite"), tensorboard scalars, optional wandb, and a concise console line."""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import string
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from models.moe import RouterStats
from training.checkpoint import atomic_write_text
from training.config import LoggingConfig

logger = logging.getLogger("train")


class MetricLogger:
    """Writes only on the process that owns the run directory (rank 0); a no-op elsewhere.

    A resume (``keep_until``: the checkpoint's step) continues every sink from step ``keep_until + 1``, dropping
    what an interrupted attempt logged after that step: metrics.jsonl keeps its lines up to the step, tensorboard
    purges later events on read (``purge_step``), and wandb continues the same run (its id is kept in
    ``<run_dir>/wandb_run_id``). wandb's steps only increase, so steps the interrupted attempt already gave wandb
    keep their old values there (see ``_init_wandb``)."""

    def __init__(self, run_dir: Path, cfg: LoggingConfig, enabled: bool, run_config: dict[str, Any],
                 keep_until: int | None = None) -> None:
        """``keep_until``: resuming after that step, keep earlier lines of metrics.jsonl (a fresh run truncates)."""
        self.enabled = enabled
        self._jsonl = self._tb = self._wandb = None
        self._wandb_skip_until: int | None = None  # wandb already holds the steps up to here
        if not enabled:
            return
        path = run_dir / "metrics.jsonl"
        logged = _read_lines(path) if keep_until is not None and path.exists() else []
        atomic_write_text(path, "".join(line + "\n" for step, line in logged if step <= keep_until))
        self._jsonl = open(path, "a", buffering=1)
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # Readers drop events of earlier event files at and after purge_step: the interrupted attempt's tail
            # (or, on a fresh start in a reused directory, all of an attempt that never checkpointed).
            purge_step = 0 if keep_until is None else keep_until + 1
            self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=purge_step)
        if cfg.wandb:
            last_logged = max((step for step, _ in logged), default=None)
            self._wandb, self._wandb_skip_until = _init_wandb(run_dir, cfg, run_config, keep_until, last_logged)

    def log(self, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._jsonl.write(json.dumps(strict_json(metrics), allow_nan=False) + "\n")
        step = metrics["step"]
        scalars = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and k != "step" and math.isfinite(v)}
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None and (self._wandb_skip_until is None or step > self._wandb_skip_until):
            self._wandb.log(scalars, step=step)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


WANDB_ID_FILE = "wandb_run_id"


def new_wandb_id() -> str:
    """8 random lowercase letters and digits, as wandb's own ids."""
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


def _init_wandb(run_dir: Path, cfg: LoggingConfig, run_config: dict[str, Any], keep_until: int | None,
                last_logged: int | None) -> tuple[Any, int | None]:
    """The wandb run, and the last step it already holds from an interrupted attempt (None: none to skip).

    A fresh run gets a new id, written to ``<run_dir>/wandb_run_id`` before ``wandb.init``. A resume passes that
    id with ``resume="allow"``: online, wandb continues the run if its server has it and creates it otherwise
    ("must" would fail the resume when the first attempt never reached the server: it ran offline and was never
    synced, or died first; a logging sink should not stop a training run). Offline, there is no server to ask:
    each attempt writes its own ``wandb/offline-run-*-<id>`` directory, and ``wandb sync`` uploads the
    directories of one id into one run, in order of start time.

    wandb's steps must increase: a step at or below the last one the run holds is dropped (online, with a warning
    per step). When the checkpoint is older than the last step the interrupted attempt logged, the steps after the
    checkpoint up to that one keep the interrupted attempt's values in wandb; they are not sent again (one warning
    here), and wandb continues after them. metrics.jsonl and tensorboard hold the resumed values. (wandb's
    rewind, ``wandb.init(resume_from=f"{id}?_step={step}")``, would replace the tail, but it is a preview feature
    that the account must have enabled, and is not used.)"""
    try:
        import wandb
    except ImportError as e:
        raise ImportError("logging.wandb=true needs wandb: pip install '.[wandb]'") from e
    os.environ.setdefault("WANDB_MODE", cfg.wandb_mode)
    id_path = run_dir / WANDB_ID_FILE
    run_id = id_path.read_text().strip() if keep_until is not None and id_path.is_file() else ""
    if not run_id:
        if keep_until is not None:
            logger.info("wandb: no %s in %s (wandb was off before?): starting a new wandb run", WANDB_ID_FILE, run_dir)
        run_id = new_wandb_id()
        atomic_write_text(id_path, run_id + "\n")
        return wandb.init(project=cfg.wandb_project, dir=str(run_dir), config=run_config, id=run_id), None
    skip_until = None
    if last_logged is not None and last_logged > keep_until:
        skip_until = last_logged
        logger.warning("wandb: run %s already holds steps %d..%d from the interrupted attempt and wandb's steps "
                       "only increase: it keeps those values and continues at step %d (metrics.jsonl and "
                       "tensorboard have the resumed ones)", run_id, keep_until + 1, last_logged, last_logged + 1)
    run = wandb.init(project=cfg.wandb_project, dir=str(run_dir), config=run_config, id=run_id, resume="allow")
    logger.info("wandb: continuing run %s after step %d", run_id, keep_until)
    return run, skip_until


def _read_lines(path: Path) -> list[tuple[int, str]]:
    """(step, line) for the lines of metrics.jsonl; a line cut short by a killed run is dropped."""
    lines = []
    for line in path.read_text().splitlines():
        try:
            lines.append((int(json.loads(line)["step"]), line))
        except (json.JSONDecodeError, TypeError, KeyError, ValueError):
            logger.warning("%s: dropping an unreadable line (cut short by a killed run?): %.80s", path, line)
    return lines


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
