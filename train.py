"""Train a Qwen MoE model. ``python train.py`` trains the tiny default on any machine;
``torchrun --nproc_per_node 8 train.py model=qwen3_moe_30b_a3b parallel=ep8`` the real thing.

``run_training`` reads as the outline: config -> process groups and meshes -> the run directory (locked; what
train.resume continues) -> model on meta, parallelized, materialised -> optimizer -> data -> restore (a resume) ->
the first writes -> the loop -> finish (a checkpoint at the last step, the final weights). The steps follow it in
that order; then the loop's parts, the signals, and the Hydra entry point.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import logging
import math
import os
import signal
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

import hydra
import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

import models
import parallelisms
from core import device
from core.files import atomic_write_text, remove, stale_temporaries
from kernels.registry import apply_kernels, select_kernels
from models.causal_lm import MtpBatch, mtp_batch, trained_rows
from models.hf_io import (args_from_hf_config, check_export_dir, check_export_source, check_hf_into_model, export_hf,
                          load_hf_into_model, preset_differences, read_hf_config)
from models.layers import known_documents
from parallelisms.float8 import apply_float8
from training.checkpoint import (CheckpointError, load_checkpoint, rng_state, save_checkpoint, save_model_weights,
                                 save_sizes, set_rng_state, space_warnings)
from training.config import (TrainConfig, check_resume_config, config_warnings, flat_config, input_paths,
                             register_schema, schema_defaults, to_train_config, validate)
from training.data.hf_tokenizer import check_export_requirements, hf_tokenizer_files, run_tokenizer
from training.data.loader import build_data_loader
from training.data.packing import context_shard
from training.evaluate import validation_loss
from training.launch import needs_torchrun, one_line_errors, relaunch_with_torchrun, sweep_job_name
from training.loss import IGNORE_INDEX, router_loss_shares
from training.metrics import (MetricLogger, attended_flops_per_token, moe_metrics, progress_line, reduce_routing,
                              routing_summary)
from training.optim import (SkippedSteps, build_optimizer, build_scheduler, clipped_step, nonfinite_report,
                            queue_step)
from training.planner import fit_warnings
from training.profiling import StepProfiler
from training.router_balance import update_expert_biases
from training.run_dir import (Start, check_apart, check_not_moved, find_start, lock_checkpoint_dir, lock_run_dir,
                              new_record, outside, write_record)
from training.run_logs import run_logs

logger = logging.getLogger("train")


def resolve_model(cfg: TrainConfig) -> tuple[models.ModelSpec, Any]:
    """The family's spec and hyper-parameters: the preset, or the config.json of model.init_from (model=hf)."""
    m = cfg.model
    if m.init_from is None:
        return models.get_spec(m.model_type), models.build_args(m.model_type, dict(m.arch))
    hf_config = read_hf_config(m.init_from)
    if m.name == "hf":  # model.arch keys given as well (a training knob: mtp_loss_weight) apply over config.json's
        model_type, args = args_from_hf_config(hf_config)
        if m.arch:
            args = models.build_args(model_type, {**dataclasses.asdict(args), **m.arch})
        return models.get_spec(model_type), args
    args = models.build_args(m.model_type, dict(m.arch))
    for line in preset_differences(args, hf_config):
        logger.warning("model=%s differs from %s/config.json: %s", m.name, m.init_from, line)
    return models.get_spec(m.model_type), args


def on_rank0(dims: parallelisms.ParallelDims, decide: Callable[[], Any]) -> Any:
    """``decide()`` on rank 0, its result (or its error) on every rank: one decision about the run directory, taken
    before rank 0 writes into it (a lagging rank would otherwise see rank 0's new files, or its own Hydra clock)."""
    box: list[Any] = [None]
    if dims.writer:
        try:
            box = [(True, decide())]
        except Exception as e:  # every rank raises it
            box = [(False, e)]
    if dims.world_size > 1 and not dims.simulated:
        dist.broadcast_object_list(box, src=0)
    ok, value = box[0]
    if not ok:
        raise value
    return value


def check_resumed_config(state: dict[str, Any], run_config: dict[str, Any], global_batch: int, allow: list[str],
                         source: Path, log: bool) -> None:
    """List every config difference from the checkpoint at start-up; refuse those that change what is trained
    unless train.allow_changes names them."""
    if "config" not in state:
        logger.warning("checkpoint %s records no config (written before configs were recorded): not compared", source)
        return
    saved_batch = state.get("global_batch_size")
    saved = flat_config(state["config"], saved_batch)
    if "data.tokenizer" in saved:  # checkpoints before model.tokenizer: the key moved (pre-tokenized data: none)
        tokenizer = saved.pop("data.tokenizer")
        saved.setdefault("model.tokenizer", "none" if saved.get("data.name") == "tokens" else tokenizer)
    for key, default in schema_defaults(saved.get("model.model_type")).items():
        saved.setdefault(key, default)  # keys added since the checkpoint: their defaults are what it did
    current = flat_config(run_config, global_batch if saved_batch is not None else None)
    for line in check_resume_config(saved, current, allow, str(source)):
        if log:
            logger.info("config differs from checkpoint %s: %s", source, line)


def rerunnable_config(run_config: dict[str, Any]) -> str:
    """The resolved config as a Hydra primary config: ``python train.py --config-path <abs run dir> --config-name
    config`` trains the same run again (in a new train.output_dir, or continued with train.resume=auto)."""
    hydra_section = OmegaConf.load(Path(__file__).parent / "conf" / "config.yaml").hydra
    rerun = OmegaConf.create({"defaults": ["schema", "_self_"], **run_config, "hydra": hydra_section})
    return ("# Re-run: python train.py --config-path <absolute path of this directory> --config-name config "
            "[train.output_dir=<new dir> | train.resume=auto]\n" + OmegaConf.to_yaml(rerun))


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def startup_summary(cfg: TrainConfig, param_counts: tuple[int, int], dims: parallelisms.ParallelDims,
                    global_batch: int, kernels, run_dir: Path) -> list[str]:
    """What this run is, in a few lines at the top of its log: model, layout, batch, kernels, where it writes."""
    total, active = param_counts
    p = cfg.parallel
    layout = (f"world {dims.world_size} = dp {dims.dp} x cp {dims.cp}; experts: ep {dims.ep} x efsdp {dims.efsdp} x "
              f"edp {dims.edp}; {p.backend.name}" + (f" (HSDP: replicate {dims.mp_replicate} x shard {dims.mp_shard})"
                                                     if dims.mp_replicate > 1 else "")
              + (f"; dispatcher {cfg.dispatcher.name}" if dims.ep > 1 else "")
              + f"; activation checkpoint {p.activation_checkpoint}")
    fast = [f"{c.op}={c.impl}" for c in kernels.choices.values() if c.impl != "torch"]
    simulated = ([f"SIMULATION: this process is rank {dims.rank} of a {dims.world_size}-rank job whose every peer is "
                  "a copy of it (loopback collectives, parallelisms/loopback.py): its shards, collectives' sizes and "
                  "compute are the real rank's under balanced routing; it writes no checkpoint or weights"]
                 if dims.simulated else [])
    return simulated + [
        f"model {cfg.model.name} ({cfg.model.model_type}): {_count(total)} parameters, {_count(active)} active per token",

        f"layout: {layout}",
        f"global batch: {global_batch} sequences x {cfg.data.seq_len} tokens = {global_batch * cfg.data.seq_len:,} "
        f"tokens per step (local {cfg.train.local_batch_size} x grad accum {cfg.train.grad_accum_steps} x dp {dims.dp})"
        f", {cfg.train.steps} steps",
        f"kernels: {', '.join(fast) if fast else 'torch reference for every op'}",
        f"run directory: {run_dir.resolve()}",
    ]


class StepResult(NamedTuple):
    loss: float  # mean token cross-entropy of the global batch
    aux_loss: float
    z_loss: float
    grad_norm: float
    updated: bool
    # per MoE layer, the global batch's, on the host (training.metrics.reduce_routing); None where not asked for
    routing_LX: torch.Tensor | None
    mtp_loss: float | None = None  # the MTP head's mean token cross-entropy, where it trains


def mtp_loss_weight(model: torch.nn.Module) -> float:
    """model.arch.mtp_loss_weight of a model with an MTP head (one is built only where it is > 0), else 0."""
    return model.args.mtp_loss_weight if model.mtp is not None else 0.0


def global_count(labels: list[torch.Tensor], dims: parallelisms.ParallelDims) -> torch.Tensor:
    """The trained labels (!= -100) of the global batch: every data rank's micro-batches (at least 1)."""
    count = torch.stack([(b != IGNORE_INDEX).sum() for b in labels]).sum().float()
    if dims.data_group is not None:
        dist.all_reduce(count, group=dims.data_group)
    return count.clamp(min=1.0)


def train_step(model: torch.nn.Module, batches: list[dict[str, Any]], optimizer: torch.optim.Optimizer,
               scheduler, cfg: TrainConfig, dims: parallelisms.ParallelDims, args: Any, autocast: torch.autocast,
               update: bool, routing: bool) -> StepResult:
    """Forward/backward over the micro-batches, clip, and (unless told not to, or non-finite) step: the
    optimizer, the schedule and the routers' balancing biases (``args.router_bias_update_rate``). ``routing``: also
    bring the routing summary to the host (a step that logs it: one more small all-reduce under data parallelism)."""
    # Normalise by the global count of trained tokens so every layout optimises the same objective.
    num_tokens = global_count([b["labels"] for b in batches], dims)
    mtp_weight = mtp_loss_weight(model)  # the MTP head's cross-entropy: the same, over its own trained labels
    num_mtp_tokens = global_count([b["mtp"].labels_BT for b in batches], dims) if mtp_weight else None
    ce_share = aux_share = z_share = mtp_share = routing_LX = 0.0
    summarise = routing or args.router_bias_update_rate > 0  # the summary's readers: the logs, the bias update
    for batch in batches:
        with autocast:
            out = model(batch["input_ids"], batch["position_ids"], batch["labels"], packed=batch["packed"],
                        trained_rows=batch["trained_rows"], mtp=batch["mtp"] if mtp_weight else None)
        ce = out.loss_sum / num_tokens
        mtp = out.mtp_loss_sum / num_mtp_tokens if mtp_weight else torch.zeros_like(ce)
        aux, z = (share / len(batches) for share in router_loss_shares(out.router_stats, args.num_experts,
                                                                         dims.data_group))
        ((ce + mtp_weight * mtp + args.router_aux_loss_coef * aux + args.router_z_loss_coef * z)
         * dims.grad_scale).backward()
        ce_share, aux_share, z_share = ce_share + ce.detach(), aux_share + aux.detach(), z_share + z.detach()
        mtp_share = mtp_share + mtp.detach()
        if summarise:
            routing_LX = routing_LX + routing_summary(out.router_stats)
    grad_norm = parallelisms.grad_norm(model, dims)
    losses = torch.stack([ce_share, aux_share, z_share, mtp_share])
    if dims.data_group is not None:
        dist.all_reduce(losses, group=dims.data_group)
    # Queued before the read below, so complete after it.
    routing_host_LX = reduce_routing(routing_LX, dims.data_group) if routing else None
    read_stats = device.queued_read(torch.cat([losses, grad_norm.reshape(1)]))
    # The update is queued before the read where the optimizer decides on the device whether it applies
    # (training.optim.AdamW, the CUDA default), and the read waits for the copy alone, not for the update: the
    # device goes from backward to the update, and on to the next forward, without waiting for the host to read,
    # decide and launch. Not under dispatcher=capacity, whose overflow the host learns of only after the read.
    queued = update and not parallelisms.may_drop_rows(model) and queue_step(optimizer, cfg.optim.grad_clip,
                                                                               grad_norm, losses)
    loss, aux_loss, z_loss, mtp_loss, norm = read_stats().tolist()  # the step's one host sync
    parallelisms.raise_if_dispatch_overflowed(model)  # dispatcher=capacity: a step that dropped rows is not applied
    finite = all(map(math.isfinite, (loss, aux_loss, z_loss, mtp_loss, norm)))  # as queue_step decided on the device
    if queued and not finite:
        optimizer.rewind()  # the device did not apply it
    if not finite and cfg.train.nonfinite == "stop":
        raise FloatingPointError(f"non-finite loss={loss} or grad_norm={norm}: "
                                 f"{nonfinite_report(model, optimizer, loss, norm)}; stopping (train.nonfinite=stop; "
                                 "train.nonfinite=skip would skip such steps)")
    if update and finite:
        if not queued:
            clipped_step(optimizer, model, cfg.optim.grad_clip, norm)
        scheduler.step()
        if args.router_bias_update_rate > 0:
            update_expert_biases(model.routers(), routing_LX[:, :args.num_experts], args.router_bias_update_rate,
                                 dims.data_group)
    optimizer.zero_grad(set_to_none=True)
    return StepResult(loss, aux_loss, z_loss, norm, update and finite, routing_host_LX,
                      mtp_loss if mtp_weight else None)


def check_config(cfg: TrainConfig, world_size: int, resumed: dict[str, Any] | None = None
                 ) -> tuple[models.ModelSpec, Any, str | None]:
    """Every check that needs no process group: config, model and layout; also run by the launching process
    before torchrun starts any child, so an impossible layout is one short error. ``resumed``: the config of the
    checkpoint being resumed."""
    validate(cfg)
    check_outputs_apart(cfg, run_path(cfg))
    source = cfg.model.init_from  # what the export carries, a resume's too (as_resumed builds from the checkpoint)
    cfg = as_resumed(cfg, resumed)
    spec, model_args = resolve_model(cfg)
    tokenizer = run_tokenizer(cfg, model_args.vocab_size)  # one that does not fit the model or the data fails here
    if cfg.checkpoint.export_hf_at_end:
        check_export_requirements(cfg, tokenizer, model_args.vocab_size)
        if cfg.train.output_dir is not None:  # Hydra's own run directory is new: it holds no hf/ yet
            check_export_dir(Path(cfg.train.output_dir) / "hf")  # checked before any step is trained
        if source is not None:  # the export carries the source's untrained tensors and configs
            check_export_source(source, spec.model_type, model_args)
    parallelisms.validate_parallel_config(cfg.parallel, world_size, model_args.num_experts,
                                          heads=spec.cp_head_counts(model_args), seq_len=cfg.data.seq_len)
    check_balanced_routing(model_args, cfg.parallel.cp_size, cfg.data.seq_len)
    return spec, model_args, tokenizer


def check_outputs_apart(cfg: TrainConfig | DictConfig, run_dir: Path) -> None:
    """The run directory and checkpoint.dir apart from the inputs (``training.run_dir.check_apart``)."""
    outputs = {"train.output_dir": run_dir, "checkpoint.dir": cfg.checkpoint.dir}
    check_apart({key: Path(path) for key, path in outputs.items() if path}, input_paths(cfg))


def check_balanced_routing(args: Any, cp: int, seq_len: int) -> None:
    """Round-robin routing (``model.arch.router_force_balance``) goes by a token's position in the rows a rank
    holds: a cp rank's 1/cp of a row routes as one process does only when its first position's experts repeat row
    0's, i.e. when seq_len / cp x K is a multiple of E."""
    local, K, E = seq_len // cp, args.num_experts_per_tok, args.num_experts
    if cp > 1 and args.router_force_balance and (local * K) % E:
        raise ValueError(f"model.arch.router_force_balance=true with parallel.cp_size={cp}: each cp rank holds "
                         f"data.seq_len / cp = {local} tokens of a row, and {local} x "
                         f"model.arch.num_experts_per_tok={K} must be a multiple of model.arch.num_experts={E} for "
                         f"the ranks to route as one process; fix: data.seq_len a multiple of "
                         f"{cp * E // math.gcd(E, K)}")


def as_resumed(cfg: TrainConfig, resumed: dict[str, Any] | None) -> TrainConfig:
    """A resume of a model.init_from run builds the architecture and tokenizer its checkpoint records: the
    checkpoint alone holds the weights, and init_from may be gone. (The config check then compares the rest.)"""
    saved = (resumed or {}).get("model", {})
    if cfg.model.init_from is None or not saved.get("model_type"):
        return cfg
    return dataclasses.replace(cfg, model=dataclasses.replace(
        cfg.model, init_from=None, model_type=saved["model_type"], tokenizer=saved["tokenizer"], arch=saved["arch"]))


def run(cfg: TrainConfig) -> list[dict[str, Any]]:
    """Train as configured; returns the per-step metrics (also written to <run_dir>/metrics.jsonl)."""
    with contextlib.ExitStack() as run_scope:  # what the run opens (its lock, log files) is closed however it ends
        return run_training(cfg, run_scope)


def run_training(cfg: TrainConfig, run_scope: contextlib.ExitStack) -> list[dict[str, Any]]:
    validate(cfg)  # bad input is one line before anything is written
    dev_type = device.device_type(cfg.train.device)
    dims, dev = start_processes(cfg, dev_type)
    resumed = on_rank0(dims, lambda: find_run_start(cfg).resumed_config)  # read-only: what a resume builds
    spec, model_args, tokenizer = check_config(cfg, dims.world_size, resumed)  # every check before any write
    run_dir = open_run_dir(cfg, dims, run_scope)  # locked; what train.resume continues, decided again under it
    if run_dir.start.resumed_config != resumed:  # the directory changed between the look and the lock
        spec, model_args, tokenizer = check_config(cfg, dims.world_size, run_dir.start.resumed_config)
    run_config, resolved = recorded_config(cfg, spec, model_args, tokenizer)
    global_batch = cfg.train.local_batch_size * cfg.train.grad_accum_steps * dims.dp
    if not continues(run_dir, run_config, global_batch, cfg, dims):
        return []  # the run is finished
    torch.manual_seed(cfg.train.seed)
    model, param_counts, kernels = build_model(cfg, spec, model_args, dims, dev, dev_type,
                                               load_init_from=run_dir.start.checkpoint is None)
    optimizer = build_optimizer(model, cfg.optim)
    loader, val_batches = build_data(cfg, dims, tokenizer, model_args.vocab_size)
    tokens_per_step = global_batch * cfg.data.seq_len
    first_step, position, tokens_total = restore(run_dir.start, model, optimizer, loader, dev_type, dims,
                                                 tokens_per_step, cfg.train.allow_changes)
    scheduler = build_scheduler(optimizer, cfg.optim, max(cfg.train.steps, 1), position)
    metric_logger = begin(run_dir, run_config, cfg, dims, first_step)  # the first writes into the run directory
    # Autocast only under DDP: FSDP's mixed-precision policy (or in one process its stand-in) casts the parameters.
    autocast = torch.autocast(dev_type, dtype=torch.bfloat16,
                              enabled=mixed_bf16(cfg, dev_type) and cfg.parallel.backend.name == "ddp")
    parallelisms.clip_grad_norm_(model, 0.0, dims)  # warm-up: initialises every collective on every mesh
    stop = StopSignal(dims, dev)
    profiler = StepProfiler(run_dir.path, cfg.logging.profile_step, cfg.logging.profile_steps,
                           0 if dims.writer else dims.rank, dev_type,
                           cfg.logging.profile_host)
    gc_off = ManualGC(cfg.train.gc_every)

    def checkpoint(step: int) -> Path:
        loader.check_data_unchanged()  # the identity it records is what was read
        train_state = {"scheduler": {"last_epoch": scheduler.last_epoch}, "loader": loader.state_dict(),
                       "rng": rng_state(dev_type), "config": run_config, "global_batch_size": global_batch,
                       "tokens_total": tokens_total}
        path = save_checkpoint(run_dir.ckpt_root, step, model, optimizer, train_state, cfg.checkpoint.keep_last,
                               dims.writer)
        run_dir.saved(step, path, dims.writer)
        return path

    if dims.writer:
        for line in startup_summary(resolved, param_counts, dims, global_batch, kernels, run_dir.path):
            logger.info(line)
        for line in (config_warnings(cfg) + space_warnings(save_needs(cfg, model, run_dir.path, run_dir.ckpt_root))
                     + fit_warnings(resolved, dims.world_size, device.capacity_gib(dev_type))):
            logger.warning(line)
        for line in loader.passes(cfg.train.steps):  # a warning where the run repeats its data
            (logger.warning if " times over: " in line else logger.info)("data: %s", line)
    rates = Rates(tokens_per_step, dims.world_size, model_args.flops_per_token(cfg.data.seq_len),
                  device.peak_tflops(dev_type))
    history: list[dict[str, Any]] = []
    steps = range(first_step, cfg.train.steps + 1) if cfg.train.steps > 0 else [0]  # step 0: measure only
    saved_at = first_step - 1 if run_dir.start.checkpoint else None  # the step the newest checkpoint holds
    skipped = SkippedSteps(cfg.train.steps)  # train.nonfinite=skip: too many in a row stop the run
    start = clock = time.perf_counter()
    for done, step in enumerate(steps, start=1):
        device.reset_peak_memory(dev_type)
        profiler.step_begin(step)
        gc_off.step(step)
        # The cp ranks of a dp slice read the same sequences; each keeps its 1/cp of every one.
        with torch.profiler.record_function("data"):
            data_start = time.perf_counter()
            windows = [next(loader) for _ in range(cfg.train.grad_accum_steps)]
            # Whether a window is packed, and its documents' offsets, read here on the host from this rank's whole
            # sequences (before the cp split): the forward then asks the device nothing (a read that would wait for
            # the step before to finish before it could queue), and the attended FLOPs count the same documents (and
            # the LM head over the trained labels only, as each rank's ``trained_rows`` below has it computed).
            packed = [known_documents(window["position_ids"], dev) for window in windows]
            attended = sum(attended_flops_per_token(model_args, known, tuple(window["input_ids"].shape),
                                                    (window["labels"] != IGNORE_INDEX).double().mean().item())
                           for known, window in zip(packed, windows)) / len(windows)
            if mtp_loss_weight(model):  # shifted on the whole sequence: across the cp shards as in one process
                windows = [{**window, **mtp_batch(window["input_ids"], window["labels"], window["position_ids"])}
                           for window in windows]
            shards = [context_shard(window, dims.cp_rank, dims.cp) for window in windows]
            batches = [{**device.to_device(shard, dev), "packed": known,
                        "trained_rows": trained_rows(shard["labels"], dev)} for shard, known in zip(shards, packed)]
            for batch, shard in zip(batches, shards):
                batch["mtp"] = (MtpBatch(batch["mtp_input_ids"], batch["mtp_labels"],
                                         trained_rows(shard["mtp_labels"], dev)) if "mtp_labels" in batch else None)
            data_time = time.perf_counter() - data_start  # host time, overlapping the previous step's optimizer
        lr = scheduler.get_last_lr()[0]
        logs = StepLogs.at(step, cfg, last=step == steps[-1], evaluates=bool(val_batches))
        result = train_step(model, batches, optimizer, scheduler, cfg, dims, model_args, autocast, update=step > 0,
                            routing=logs.metrics or logs.routing)
        # No device sync at the end of a step: the host logs this step and fetches the next batch while the device
        # runs this step's optimizer. The step's one host read (after backward) paces the loop, so the time between
        # two steps' returns is a step's time; where the host did wait for the device (an eval, a checkpoint, the
        # profiler), the next step is timed from then.
        waited = profiler.step_end(step)  # at the profiled window's end: after a device sync
        now = time.perf_counter()
        step_time, clock = now - clock, now
        tokens_total += tokens_per_step if step > 0 else 0
        metrics = step_metrics(step, result, lr, rates, attended, tokens_total, step_time, data_time, dev_type)
        if logs.evaluate:
            metrics["val_loss"] = validation_loss(model, val_batches, dev, autocast, dims.data_group)
            waited = True
        history.append(metrics)
        log_step(metrics, result, logs, loader, metric_logger, cfg, dims,
                 eta=(time.perf_counter() - start) / done * (len(steps) - done))
        skipped.count(step, metrics["skipped"], model, optimizer, result.loss, result.grad_norm)
        if stop.requested():
            if dims.simulated:  # one rank of N: nothing a resume could use
                logger.info("stopping at step %d on %s (a simulated run saves no checkpoint)", step, stop.name)
                break
            stop.path = checkpoint(step)
            logger.info("stopping at step %d on %s after saving a checkpoint", step, stop.name)
            break
        if cfg.checkpoint.interval > 0 and step > 0 and step % cfg.checkpoint.interval == 0:
            checkpoint(step)
            saved_at, waited = step, True
        if waited:
            device.synchronize(dev_type)
            clock = time.perf_counter()
    else:
        last_step = steps[-1] if steps else first_step - 1  # none left: a resume of the last step's checkpoint
        finish(run_dir, model, spec, tokenizer, cfg, dims, checkpoint, saved_at, last_step)
    profiler.close()  # a run that stopped inside the window still gets its trace and summary
    stop.restore()
    gc_off.restore()
    metric_logger.close()
    if dims.writer:
        logger.info("done: %d of %d steps (%d in this process, %s), %s tokens in all; run directory: %s",
                    history[-1]["step"] if history else first_step - 1, cfg.train.steps, len(history),
                    datetime.timedelta(seconds=round(time.perf_counter() - start)), f"{tokens_total:,}", run_dir.path)
    stop.raise_if_interrupted()
    return history


# ------------------------------------------------------------------------------------------ set-up steps
def start_processes(cfg: TrainConfig, dev_type: str) -> tuple[parallelisms.ParallelDims, torch.device]:
    """The process group (under torchrun, or the loopback world of launch.simulate_world), the layout's meshes and
    this rank's device."""
    world_size, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    if cfg.launch.simulate_world:
        world_size, rank = cfg.launch.simulate_world, cfg.launch.simulate_rank
        parallelisms.init_loopback_world(world_size, rank, dev_type)
    parallelisms.init_distributed(dev_type, cfg.parallel)
    dims = parallelisms.build_parallel_dims(cfg.parallel, world_size, rank, dev_type,
                                            simulated=cfg.launch.simulate_world > 0)
    return dims, device.local_device(dev_type)


class RunDir:
    """The run directory, held (locked) by rank 0 for the run: where it writes, where its checkpoints go, what
    this start continues (``start``) and the run's record (``run.json``, rank 0's)."""

    def __init__(self, path: Path, ckpt_root: Path, start: Start) -> None:
        self.path, self.ckpt_root, self.start = path, ckpt_root, start
        self.record = new_record(path, ckpt_root, start.record, 0)

    def begin(self, step: int, is_writer: bool) -> None:
        """The run starts (or continues) after ``step``: record it; drop what train.discard_newer discards."""
        self.record.step, self.record.finished = step, False
        if self.start.checkpoint is not None:
            self.record.checkpoint = str(self.start.checkpoint)
        if not is_writer:
            return
        for path in stale_temporaries(self.path):  # under the run's lock: no live writer of this run is left
            logger.warning("removing %s, left by a save whose process is gone (killed while writing)", path)
            remove(path)
        for path in self.start.discard:  # a symbolic link goes alone: what it points to is not this run's to remove
            logger.warning("train.discard_newer: removing %s%s (trained after the resumed step %d)", path,
                           f", a link to {path.readlink()} (kept)" if path.is_symlink() else "", step)
            remove(path)
        write_record(self.path, self.record)

    def saved(self, step: int, checkpoint: Path, is_writer: bool) -> None:
        self.record.step, self.record.checkpoint = step, str(checkpoint)
        if is_writer:
            write_record(self.path, self.record)

    def finished(self, step: int, is_writer: bool) -> None:
        self.record.step, self.record.finished = step, True
        if is_writer:
            write_record(self.path, self.record)


def open_run_dir(cfg: TrainConfig, dims: parallelisms.ParallelDims, run_scope: contextlib.ExitStack) -> RunDir:
    """One run directory for all ranks, rank 0's choice (each rank's Hydra clock may differ): locked by rank 0
    (a refusal reaches every rank), its logs opened, and what train.resume continues decided on rank 0 before
    anything of the run is rewritten."""

    def choose() -> tuple[str, Start]:
        path = run_path(cfg)
        run_scope.enter_context(lock_run_dir(path))  # held until the run ends; the OS releases it if we die
        if outside(checkpoint_root(cfg, path), path):  # a checkpoint.dir of its own: held the same way
            run_scope.enter_context(lock_checkpoint_dir(checkpoint_root(cfg, path), path))
        return str(path), find_run_start(cfg)

    path, start = on_rank0(dims, choose)
    run_dir = RunDir(Path(path), checkpoint_root(cfg, Path(path)), start)
    if dims.simulated:  # the run directory says what it holds: one simulated rank's log and metrics
        run_dir.record.simulated = f"rank {dims.rank} of {dims.world_size}"
    run_scope.enter_context(run_logs(run_dir.path, 0 if dims.writer else dims.rank, cfg.logging.all_ranks))
    return run_dir


def run_path(cfg: TrainConfig) -> Path:
    """The run directory this start writes into (train.output_dir, else Hydra's), refused if it is a file."""
    path = Path(cfg.train.output_dir if cfg.train.output_dir is not None else hydra_run_dir())
    if path.exists() and not path.is_dir():
        raise ValueError(f"train.output_dir={path} is a file, not a directory; name a directory")
    return path


def find_run_start(cfg: TrainConfig) -> Start:
    """Read-only: what train.resume continues in the run directory (training.run_dir.find_start)."""
    path = run_path(cfg)
    return find_start(cfg.train.resume, cfg.train.discard_newer, checkpoint_root(cfg, path), path)


def save_needs(cfg: TrainConfig, model: torch.nn.Module, run_dir: Path, ckpt_root: Path) -> dict[Path, int]:
    """What this run's saves write where (``training.checkpoint.space_warnings``): a checkpoint (periodic, or the
    last step's before the final weights) and the final weights."""
    checkpoint_bytes, weights_bytes = save_sizes(model, getattr(torch, cfg.optim.state_dtype))
    c, steps = cfg.checkpoint, cfg.train.steps
    saves_checkpoint = steps > 0 and ((c.interval > 0 and steps >= c.interval) or (cfg.train.save_final and c.at_end))
    return {ckpt_root: checkpoint_bytes if saves_checkpoint else 0,
            run_dir: weights_bytes if cfg.train.save_final else 0}


def hydra_run_dir() -> str:
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.get().runtime.output_dir if HydraConfig.initialized() else "outputs/run"


def checkpoint_root(cfg: TrainConfig, run_dir: Path) -> Path:
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir / "checkpoints"


def recorded_config(cfg: TrainConfig, spec: models.ModelSpec, model_args: Any, tokenizer: str | None
                    ) -> tuple[dict[str, Any], TrainConfig]:
    """The config as the run records it (config.yaml, checkpoints): with the architecture actually built (model=hf
    leaves it to config.json), so export and resume can rebuild it."""
    resolved = dataclasses.replace(cfg, model=dataclasses.replace(
        cfg.model, model_type=spec.model_type, tokenizer=tokenizer or "none", arch=dataclasses.asdict(model_args)))
    return OmegaConf.to_container(OmegaConf.structured(resolved)), resolved


def continues(run_dir: RunDir, run_config: dict[str, Any], global_batch: int, cfg: TrainConfig,
              dims: parallelisms.ParallelDims) -> bool:
    """Whether there is anything to train: a resume (or a restart of a run that wrote no checkpoint) must train
    what the run trained (its checkpoint's config, else its config.yaml); a finished run says so (False)."""
    start = run_dir.start
    source = start.checkpoint or run_dir.path / "config.yaml"
    if start.state is not None or start.previous_config is not None:
        check_resumed_config(start.state or {"config": start.previous_config}, run_config, global_batch,
                             cfg.train.allow_changes, source, dims.writer)
    done = start.state["step"] if start.state is not None else 0
    finished = start.record is not None and start.record.finished
    if finished and start.state is None and cfg.train.steps > start.record.step:
        if start.record.step > 0:
            raise ValueError(f"run {run_dir.path} finished at step {start.record.step} without a checkpoint "
                             "(checkpoint.at_end=false or train.save_final=false, without checkpoint.interval), so "
                             "there is no state to train on from: start afresh in another train.output_dir "
                             "(model.init_from can take an export of its weights)")
        # else a train.steps=0 run, which trained nothing: starting it again from step 1 is continuing it exactly
    elif finished and (start.state is None or done >= cfg.train.steps):
        if dims.writer:
            logger.info("run %s is finished (step %d of train.steps=%d; its checkpoints: %s): nothing to do. To "
                        "train on, raise train.steps with train.allow_changes=[train.steps], or start afresh in "
                        "another train.output_dir", run_dir.path, start.record.step, cfg.train.steps,
                        run_dir.start.checkpoint or "none")
        return False
    if start.state is None and start.previous_config is not None and dims.writer:
        logger.info("train.resume=auto: the run in %s wrote no checkpoint (under %s); its config matches, "
                    "starting it again from step 1", run_dir.path, run_dir.ckpt_root)
    return True


def mixed_bf16(cfg: TrainConfig, dev_type: str) -> bool:
    return cfg.train.mixed_precision == "bf16" or (cfg.train.mixed_precision == "auto" and dev_type != "cpu")


def build_model(cfg: TrainConfig, spec: models.ModelSpec, model_args: Any, dims: parallelisms.ParallelDims,
                dev: torch.device, dev_type: str, load_init_from: bool) -> tuple[torch.nn.Module, tuple[int, int], Any]:
    """Build on meta, shard, then materialise (no rank ever holds the full model in memory): initialised, or
    model.init_from's weights (``load_init_from``; a resume loads its checkpoint later); then the kernels.
    Returns the model, its (total, active) parameter counts and the kernel choices."""
    bf16 = mixed_bf16(cfg, dev_type)
    with torch.device("meta"):
        model = spec.model_cls(model_args)
    param_counts = spec.parameter_counts(model)
    if cfg.train.float8 != "none":  # on meta, before parallelize: AC, EP and FSDP wrap the FP8 modules as any others
        apply_float8(model, spec, cfg.train.float8, dev_type, ep=dims.ep, compiled=cfg.train.compile,
                     tokens=cfg.train.local_batch_size * cfg.data.seq_len // dims.cp)  # per rank, micro-batch
    model = parallelisms.parallelize_qwen3_moe(model, spec, dims, cfg.parallel,
                                           torch.bfloat16 if bf16 else torch.float32, torch.float32, cfg.dispatcher,
                                           compile_blocks=cfg.train.compile)
    if cfg.model.init_from is not None and load_init_from:
        check_hf_into_model(model, cfg.model.init_from)  # on meta: weights that do not fit allocate nothing
    model.to_empty(device=dev)
    if cfg.model.init_from is not None and load_init_from:
        load_hf_into_model(model, cfg.model.init_from)  # each rank reads only the slices it owns
    else:
        model.init_weights()  # every parameter; the rotary tables are computed per call, so no buffers
    model.train()
    kernels = select_kernels(cfg.kernel_config, dev_type)  # a missing requested package fails here, on every rank
    slots = apply_kernels(model, kernels)
    if dims.writer:
        kernels.log(logger)
        delta_rule = kernels.choices["chunk_gated_delta_rule"]
        if dev_type == "cuda" and slots.get("chunk_gated_delta_rule") and delta_rule.impl == "torch":
            logger.warning("Gated DeltaNet runs its torch reference (about half the speed of FLA's kernel: %s); "
                           "for speed: pip install '.[gpu]' with triton >= 3.7.1 (torch >= 2.12.1) and "
                           "kernel_config=auto_fla", delta_rule.reason)
    return model, param_counts, kernels


def build_data(cfg: TrainConfig, dims: parallelisms.ParallelDims, tokenizer: str | None, vocab_size: int):
    """The training loader and the held-out batches (cp-sharded once: every eval step reads the same ones)."""
    loader = build_data_loader(cfg.data, seed=cfg.train.seed, local_batch_size=cfg.train.local_batch_size,
                               dp_rank=dims.dp_rank, dp_size=dims.dp, tokenizer=tokenizer, model_vocab_size=vocab_size)
    val_batches = ([context_shard(b, dims.cp_rank, dims.cp) for b in loader.validation.batches(cfg.train.eval_batches)]
                   if cfg.train.eval_every else [])
    return loader, val_batches


def restore(start: Start, model: torch.nn.Module, optimizer: torch.optim.Optimizer, loader, dev_type: str,
            dims: parallelisms.ParallelDims, tokens_per_step: int, allow_changes: list[str]) -> tuple[int, int, int]:
    """The resumed checkpoint's model, optimizer, data position and RNG (a fresh run: nothing); returns the first
    step, the schedule's position and the tokens trained so far. ``allow_changes``: train.allow_changes (a changed
    data identity is refused unless it names the data)."""
    if start.checkpoint is None:
        return 1, 0, 0
    state = start.state
    load_checkpoint(start.checkpoint, model, optimizer, state.get("files"))
    loader.load_state_dict(state["loader"], allow_changes, checkpoint=f"checkpoint {start.checkpoint}")
    set_rng_state(state["rng"], dev_type)
    if dims.writer:
        logger.info("resumed from %s at step %d", start.checkpoint, state["step"])
    # tokens_total is recorded since issue 21: older checkpoints trained every step at this batch
    tokens_total = state.get("tokens_total", state["step"] * tokens_per_step)
    return state["step"] + 1, state["scheduler"]["last_epoch"], tokens_total


def begin(run_dir: RunDir, run_config: dict[str, Any], cfg: TrainConfig, dims: parallelisms.ParallelDims,
          first_step: int) -> MetricLogger:
    """Only now, with the resume known good, is anything of the run directory rewritten: config.yaml, the
    record (and what train.discard_newer discards), the metric sinks."""
    if dims.writer:
        atomic_write_text(run_dir.path / "config.yaml", rerunnable_config(run_config))
    run_dir.begin(first_step - 1, dims.writer)
    return MetricLogger(run_dir.path, cfg.logging, enabled=dims.writer,
                        keep_until=first_step - 1 if run_dir.start.checkpoint else None, run_config=run_config)


# ------------------------------------------------------------------------------------------ the loop's parts
class Rates(NamedTuple):
    tokens_per_step: int
    world_size: int
    flops_per_token: float
    peak_tflops: float | None


def step_metrics(step: int, result: StepResult, lr: float, rates: Rates, attended: float, tokens_total: int,
                 step_time: float, data_time: float, dev_type: str) -> dict[str, Any]:
    """``attended``: FLOPs per token over the attention pairs the step's windows computed (docs/lab/benchmarks.md)."""
    tokens = rates.tokens_per_step
    per_device = tokens / step_time / rates.world_size
    return {
        "step": step, "loss": result.loss, "aux_loss": result.aux_loss, "z_loss": result.z_loss,
        **({} if result.mtp_loss is None else {"mtp_loss": result.mtp_loss}), "grad_norm": result.grad_norm,
        "lr": lr, "skipped": step > 0 and not result.updated, "tokens": tokens, "tokens_total": tokens_total,
        "tokens_per_s": tokens / step_time, "tokens_per_s_per_device": per_device,
        "tflops_per_device": per_device * rates.flops_per_token / 1e12,
        "mfu": per_device * rates.flops_per_token / (rates.peak_tflops * 1e12) if rates.peak_tflops else None,
        "attended_tflops_per_device": per_device * attended / 1e12,
        "attended_mfu": per_device * attended / (rates.peak_tflops * 1e12) if rates.peak_tflops else None,
        "peak_mem_gib": device.peak_memory_gib(dev_type), "step_time_s": step_time,
        "data_time_s": data_time, "data_share": data_time / step_time,
    }


class StepLogs(NamedTuple):
    """What a step reports, known before it runs (so that a step that logs nothing fetches no routing summary)."""

    evaluate: bool  # a validation loss: every train.eval_every steps and the last, with held-out data
    metrics: bool  # the metric line: every logging.log_every steps, the last, and an eval step
    routing: bool  # the routing record: every logging.routing_every steps

    @classmethod
    def at(cls, step: int, cfg: TrainConfig, last: bool, evaluates: bool) -> StepLogs:
        evaluate = evaluates and (step % cfg.train.eval_every == 0 or last)
        return cls(evaluate, step % cfg.logging.log_every == 0 or last or evaluate,
                   cfg.logging.routing_every > 0 and step % cfg.logging.routing_every == 0)


def log_step(metrics: dict[str, Any], result: StepResult, logs: StepLogs, loader, metric_logger: MetricLogger,
             cfg: TrainConfig, dims: parallelisms.ParallelDims, eta: float) -> None:
    """The step's metric line, its routing record (as ``logs`` says) and, for a skipped step, a warning."""
    step = metrics["step"]
    if metrics["skipped"] and dims.writer:
        logger.warning("step %d skipped: loss=%s, grad_norm=%s: not finite, no update (train.nonfinite=skip)",
                       step, result.loss, result.grad_norm)
    if logs.routing:
        metric_logger.log_routing(step, result.routing_LX)
    if logs.metrics:
        loader.check_data_unchanged()  # a token shard changed under the run stops it by the next logged step
        metrics.update(moe_metrics(result.routing_LX))
        metrics.update(loader.mixture_metrics())  # each data source's realised share (a mixture only)
        metric_logger.log(metrics)
        if dims.writer:
            logger.info(progress_line(metrics, cfg.train.steps, eta))


def finish(run_dir: RunDir, model: torch.nn.Module, spec: models.ModelSpec, tokenizer: str | None,
           cfg: TrainConfig, dims: parallelisms.ParallelDims, checkpoint: Callable[[int], Path],
           saved_at: int | None, last_step: int) -> None:
    """Every step trained: a checkpoint at the last step (checkpoint.at_end, unless one was just saved) before the
    final weights, so that weights which cannot be written lose nothing; then the weights and the HF export."""
    if cfg.train.save_final:
        kept = Path(run_dir.record.checkpoint) if saved_at == last_step else None
        if saved_at != last_step and cfg.checkpoint.at_end and last_step > 0:
            kept = checkpoint(last_step)
        try:
            save_model_weights(model, run_dir.path / "model.safetensors", is_writer=dims.writer, step=last_step)
        except CheckpointError as e:
            raise CheckpointError(f"{e}; " + (f"the trained state is in checkpoint {kept}: make room and run again "
                                              "with train.resume=auto to write the weights" if kept else
                                              "no checkpoint holds the last step (checkpoint.at_end=false)")) from e
    if cfg.checkpoint.export_hf_at_end:
        export_hf(model, spec.model_type, run_dir.path / "hf", extra_files=hf_tokenizer_files(tokenizer),
                  source=cfg.model.init_from)
    run_dir.finished(last_step, dims.writer)


class ManualGC:
    """train.gc_every: Python's automatic GC pauses one rank at a time, and every other rank waits on it; instead,
    young generations only every gc_every steps (as torchtitan: cheap, at the same step on every rank)."""

    def __init__(self, every: int) -> None:
        self.every = every
        if every:
            gc.collect()
            gc.disable()

    def step(self, step: int) -> None:
        if self.every and step % self.every == 0:
            gc.collect(1)

    def restore(self) -> None:
        if self.every:
            gc.enable()


class StopSignal:
    """SIGTERM (slurm preemption, torchrun shutdown), SIGHUP (the terminal or ssh session closed) and a first Ctrl-C
    (SIGINT) ask to stop after the current step, with a checkpoint; ranks agree. A second Ctrl-C stops at once
    (KeyboardInterrupt), without one."""

    _SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)

    def __init__(self, dims: parallelisms.ParallelDims, dev: torch.device) -> None:
        self._dims, self._dev = dims, dev
        self.signum: int | None = None
        self.path: Path | None = None  # the checkpoint saved on the signal
        self._pending: Callable[[], torch.Tensor] | None = None  # the flag the last call queued (several ranks)
        self._previous = {s: signal.signal(s, self._handle) for s in self._SIGNALS}

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else "a peer rank's signal"

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.signum is not None:
            raise KeyboardInterrupt("a second Ctrl-C: stopped at once, without a checkpoint; train.resume=auto "
                                    "continues from the last one")
        self.signum = signum
        if signum == signal.SIGINT:
            logger.warning("Ctrl-C: stopping after this step with a checkpoint (Ctrl-C again stops at once)")

    def requested(self) -> bool:
        """Whether to stop after this step. With several ranks any rank's signal stops all of them, through a flag
        all-reduced each step and read one step late: reading this step's flag would wait for everything queued
        before its all-reduce (the step's update), so each call queues its own and reads the one the call before
        queued, long complete. Every rank reads the same flags at the same calls: all stop at one step, the one
        after the signal's."""
        if self._dims.world_size == 1:
            return self.signum is not None
        flag = torch.full((1,), float(self.signum is not None), device=self._dev)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        previous, self._pending = self._pending, device.queued_read(flag)
        return previous is not None and previous().tolist()[0] > 0

    def restore(self) -> None:
        for s, previous in self._previous.items():
            signal.signal(s, previous)

    def raise_if_interrupted(self) -> None:
        """After a Ctrl-C stop: KeyboardInterrupt, so the process exits 130 as an interrupted command does."""
        if self.signum == signal.SIGINT:
            raise KeyboardInterrupt(f"Ctrl-C: stopped after saving checkpoint {self.path}; train.resume=auto "
                                    "continues from it")


@hydra.main(config_path="conf", config_name="config", version_base=None)
def main(dict_cfg: DictConfig) -> None:
    # The error line (and under torchrun the rank's error file) is written before the process group is torn down:
    # ranks that fail together can abort each other on the way out (gloo), and the launcher reports the rank that
    # wrote its error, not the one that then aborted (training.launch.failure_line).
    from hydra.core.hydra_config import HydraConfig

    try:
        # Bad input ends with one readable line (HYDRA_FULL_ERROR=1 for the traceback); a sweep's job's names the job.
        with one_line_errors(sweep_job_name(HydraConfig.get())):
            cfg = job_config(to_train_config(dict_cfg))
            if needs_torchrun(cfg.launch):
                relaunch(cfg)
                return
            run(cfg)
            if dist.is_initialized():
                # Every rank leaves its last collective before any rank tears its process group down: a rank that
                # exits while a peer still talks to it can abort the peer (seen with gloo).
                dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def job_config(cfg: TrainConfig) -> TrainConfig:
    """This Hydra job's config: a multirun job with train.output_dir set gets its own directory under it (Hydra's
    sweep directory is train.output_dir: conf/config.yaml)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode == RunMode.MULTIRUN and cfg.train.output_dir is not None:
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, output_dir=hydra_cfg.runtime.output_dir))
    return cfg


def primary_config(hydra_cfg) -> tuple[str, str]:
    """The primary config's directory (conf/ or a run directory) and name."""
    primary = next(s for s in hydra_cfg.runtime.config_sources if s.provider == "main")
    return primary.path.removeprefix("file://"), hydra_cfg.job.config_name


def relaunch(cfg: TrainConfig) -> None:
    """This job under torchrun (launch.nproc_per_node), after every check that needs no process group."""
    from hydra.core.hydra_config import HydraConfig

    hydra_cfg = HydraConfig.get()
    run_dir = Path(cfg.train.output_dir or hydra_cfg.runtime.output_dir)
    start = find_start(cfg.train.resume, cfg.train.discard_newer, checkpoint_root(cfg, run_dir), run_dir)
    check_config(cfg, world_size=cfg.launch.nproc_per_node, resumed=start.resumed_config)
    relaunch_with_torchrun(cfg.launch, list(hydra_cfg.overrides.task), str(run_dir), config=primary_config(hydra_cfg),
                           checkpoints=checkpoint_root(cfg, run_dir))


def hydra_run_dir_of(output_dir: str | None, default: str, _root_: DictConfig | None = None) -> str:
    """conf/config.yaml's Hydra run (and sweep) directory: train.output_dir when set, else ``default``. Checked
    here, before Hydra makes it and its log file (one line, not Hydra's traceback): a file there, a directory over
    an input (``_root_``: the whole config), and a run's config.yaml re-run from a directory its train.output_dir no
    longer names (it would start a run at the old place)."""
    from hydra.core.hydra_config import HydraConfig

    with one_line_errors():
        if output_dir is not None and Path(output_dir).exists() and not Path(output_dir).is_dir():
            raise ValueError(f"train.output_dir={output_dir} is a file, not a directory; name a directory")
        if output_dir is not None and _root_ is not None:
            check_outputs_apart(_root_, Path(output_dir))
        if HydraConfig.initialized():
            hydra_cfg = HydraConfig.get()
            given = any(o.lstrip("+~").split("=")[0] == "train.output_dir" for o in hydra_cfg.overrides.task)
            check_not_moved(Path(primary_config(hydra_cfg)[0]), None if given else output_dir)
    return default if output_dir is None else output_dir


register_schema()
OmegaConf.register_new_resolver("run_dir", hydra_run_dir_of, replace=True)
# The run directory of config.yaml files written before the run_dir resolver.
OmegaConf.register_new_resolver("if_none", lambda value, default: default if value is None else value, replace=True)

if __name__ == "__main__":
    main()
