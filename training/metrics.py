"""Per-step metrics: one strict JSON object per line in metrics.jsonl (a non-finite value is written as null and
its key listed under "nonfinite"), tensorboard scalars, optional wandb, and a concise console line; each MoE layer's
per-expert token shares in routing.jsonl every ``logging.routing_every`` steps."""

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

from models.layers import KnownDocuments
from models.moe import RouterStats
from core.files import atomic_write_text
from training.config import LoggingConfig

logger = logging.getLogger("train")
METRICS_FILE = "metrics.jsonl"  # one strict JSON object per logged step
ROUTING_FILE = "routing.jsonl"  # {"step": s, "expert_share": [[E shares] per MoE layer]} per line


class MetricLogger:
    """Writes only on the process that owns the run directory (rank 0); a no-op elsewhere.

    A resume (``keep_until``: the checkpoint's step) continues every sink from step ``keep_until + 1``, dropping
    what an interrupted attempt logged after that step: metrics.jsonl (and routing.jsonl) keep their lines up to the
    step, tensorboard purges later events on read (``purge_step``), and wandb continues the same run (its id is kept
    in ``<run_dir>/wandb_run_id``). wandb's steps only increase, so steps the interrupted attempt already gave wandb
    keep their old values there (see ``_init_wandb``)."""

    def __init__(self, run_dir: Path, cfg: LoggingConfig, enabled: bool, run_config: dict[str, Any],
                 keep_until: int | None = None) -> None:
        """``keep_until``: resuming after that step, keep earlier lines of metrics.jsonl and routing.jsonl (a fresh
        run empties them)."""
        self.enabled = enabled
        self._jsonl = self._routing = self._tb = self._wandb = None
        self._routing_path: Path | None = None  # with logging.routing_every; the file is opened by the first record
        self._wandb_skip_until: int | None = None  # wandb already holds the steps up to here
        if not enabled:
            return
        logged = _keep_steps(run_dir / METRICS_FILE, keep_until)
        self._jsonl = open(run_dir / METRICS_FILE, "a", buffering=1)
        if cfg.routing_every:
            self._routing_path = run_dir / ROUTING_FILE
            if self._routing_path.exists():  # an earlier attempt's: keep its records up to keep_until
                _keep_steps(self._routing_path, keep_until)
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

    def log_routing(self, step: int, routing_LX: torch.Tensor) -> None:
        """One line of routing.jsonl from the global routing statistics (``reduce_routing``)."""
        if self._routing_path is None:
            return
        if self._routing is None:  # opened here, so a run that records no step leaves no empty file
            self._routing = open(self._routing_path, "a", buffering=1)
        self._routing.write(json.dumps({"step": step, "expert_share": expert_shares(routing_LX)}) + "\n")

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._routing is not None:
            self._routing.close()
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


def _keep_steps(path: Path, keep_until: int | None) -> list[tuple[int, str]]:
    """Rewrite ``path`` (a JSONL of steps) with its lines up to step ``keep_until`` (None: a fresh run, emptied);
    the (step, line) pairs it held."""
    logged, dropped = read_step_lines(path) if keep_until is not None and path.exists() else ([], [])
    for line in dropped:
        logger.warning("%s: dropping an unreadable line (cut short by a killed run?): %.80s", path, line)
    atomic_write_text(path, "".join(line + "\n" for step, line in logged if step <= keep_until))
    return logged


def read_step_lines(path: Path) -> tuple[list[tuple[int, str]], list[str]]:
    """(step, line) for the lines of a JSONL of steps, and the unreadable lines (one cut short by a killed run)."""
    lines, dropped = [], []
    for line in path.read_text().splitlines():
        try:
            lines.append((int(json.loads(line)["step"]), line))
        except (json.JSONDecodeError, TypeError, KeyError, ValueError):
            dropped.append(line)
    return lines, dropped


def strict_json(metrics: dict[str, Any]) -> dict[str, Any]:
    """``metrics`` with non-finite floats as None, their keys listed under "nonfinite" (JSON has no NaN)."""
    bad = [k for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v)]
    if not bad:
        return metrics
    return {**{k: None if k in bad else v for k, v in metrics.items()}, "nonfinite": bad}


def progress_line(m: dict[str, Any], total_steps: int, eta_s: float) -> str:
    mfu = f" | mfu {m['mfu']:.1%}" if m.get("mfu") is not None else ""
    skipped = " | SKIPPED: non-finite loss or grad norm, no update" if m.get("skipped") else ""
    val = f" | val {m['val_loss']:.4f}" if "val_loss" in m else ""
    mtp = f" | mtp {m['mtp_loss']:.4f}" if "mtp_loss" in m else ""
    return (f"step {m['step']:>5}/{total_steps}{skipped} | loss {m['loss']:.4f}{mtp} | aux {m['aux_loss']:.4f} | "
            f"gnorm {m['grad_norm']:.3f} | lr {m['lr']:.2e} | {m['tokens_per_s_per_device']:,.0f} tok/s/dev"
            f"{mfu} | moe imb {m['moe/max_imbalance']:.2f}{val} | mem {m['peak_mem_gib']:.2f} GiB | eta {_hms(eta_s)}")


def _hms(seconds: float) -> str:
    minutes, s = divmod(int(seconds), 60)
    h, minutes = divmod(minutes, 60)
    return f"{h}h{minutes:02d}m{s:02d}s" if h else f"{minutes}m{s:02d}s"


ROUTING_EXTRA = 3  # the columns of routing_summary after the 2E per-expert ones: entropy sum, z sum, token count


def attended_flops_per_token(args: Any, packed: KnownDocuments | bool, shape_BT: tuple[int, int],
                             trained_fraction: float = 1.0) -> float:
    """Training FLOPs per token of the attention pairs and LM-head rows actually computed (the "attended MFU" of
    docs/results.md#packed-documents-and-long-windows): the model's ``flops_per_token`` with its attention term
    (linear in the sequence length: ``flops_per_token(1) - flops_per_token(0)`` per attended pair) counted over each
    document's causal half, sum n^2 / 2 over the documents the model is told of (``packed``, as
    ``models.layers.known_documents`` gives it; False: each of the B rows of ``shape_BT`` is one document), and its
    LM-head term (6 x hidden x vocab, where untied) over the ``trained_fraction`` of the labels (the rows
    ``models.causal_lm.trained_rows`` keeps)."""
    base = args.flops_per_token(0)
    per_pair = args.flops_per_token(1) - base
    rows, seq_len = shape_BT
    lengths_n = packed.lengths_n if packed else torch.full((rows,), seq_len)
    return (base - 6 * args.lm_head_params() * (1 - trained_fraction)
            + per_pair * lengths_n.double().square().sum().item() / 2 / (rows * seq_len))


def tower_flops_per_token(vision_args: Any, grid_thw_A3: torch.Tensor, tokens: int) -> float:
    """Training FLOPs of the vision tower on a window's images (``grid_thw_A3``, host; each frame one attention
    segment: ``flops_per_patch``) per token of the ``tokens`` of the window: what the attended MFU adds for data with
    images. A window without any counts none (its dummy image is no useful work)."""
    return sum(t * h * w * vision_args.flops_per_patch(h * w) for t, h, w in grid_thw_A3.tolist()) / tokens


def routing_summary(stats: list[RouterStats]) -> torch.Tensor:
    """[L, 2E + 3] per MoE layer: routed slots per expert, router probability sums per expert, entropy sum, sum of
    squared router logsumexps (z), token count (no grad, stays on device: no tensor from host data, whose copy
    would sync)."""
    return torch.stack([torch.cat([s.counts_E, s.prob_sum_E.detach(), s.entropy_sum.reshape(1),
                                   s.z_sum.detach().reshape(1), s.counts_E.new_full((1,), s.num_tokens)])
                        for s in stats]).detach()


def reduce_routing(routing_LX: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The global batch's ``routing_summary`` on the host: summed over the data-parallel group, then one small
    device->host copy, which ``moe_metrics`` and ``expert_shares`` share. From an accelerator the copy is queued
    into pinned memory, not waited for: read the result after a blocking read queued behind it (train_step's)."""
    if group is not None:
        routing_LX = routing_LX.clone()
        dist.all_reduce(routing_LX, group=group)
    host_LX = torch.empty(routing_LX.shape, dtype=routing_LX.dtype, pin_memory=routing_LX.device.type != "cpu")
    return host_LX.copy_(routing_LX, non_blocking=True)


def expert_shares(routing_LX: torch.Tensor) -> list[list[float]]:
    """Per layer, each expert's share of the routed slots (sums to 1), from ``reduce_routing``'s output."""
    counts_LE = routing_LX[:, :(routing_LX.shape[1] - ROUTING_EXTRA) // 2]
    return (counts_LE / counts_LE.sum(dim=1, keepdim=True).clamp_min(1)).tolist()


def moe_metrics(routing_LX: torch.Tensor) -> dict[str, float]:
    """Per layer over the global batch (``reduce_routing``'s output): load imbalance (max / mean slots per expert;
    1 is perfect balance), mean router entropy (nats), the layer's Switch aux loss ``E * sum_e f_e * P_e`` and
    router z-loss (mean squared logsumexp of the router logits); plus the worst imbalance over layers."""
    num_experts = (routing_LX.shape[1] - ROUTING_EXTRA) // 2
    counts_LE, prob_sum_LE = routing_LX[:, :num_experts], routing_LX[:, num_experts:2 * num_experts]
    entropy_L, z_L, tokens_L = routing_LX[:, -3], routing_LX[:, -2], routing_LX[:, -1].clamp_min(1)
    imbalance_L = (counts_LE.max(dim=1).values / counts_LE.mean(dim=1).clamp_min(1e-9)).tolist()
    aux_L = (num_experts * (counts_LE * prob_sum_LE).sum(dim=1) / tokens_L**2).tolist()
    entropy_L, z_L = (entropy_L / tokens_L).tolist(), (z_L / tokens_L).tolist()
    out: dict[str, float] = {"moe/max_imbalance": max(imbalance_L)}
    for layer, (imbalance, entropy, aux, z) in enumerate(zip(imbalance_L, entropy_L, aux_L, z_L)):
        out[f"moe/layer{layer}/imbalance"] = imbalance
        out[f"moe/layer{layer}/router_entropy"] = entropy
        out[f"moe/layer{layer}/aux_loss"] = aux
        out[f"moe/layer{layer}/z_loss"] = z
    return out
