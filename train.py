"""Train a Qwen MoE model. ``python train.py`` trains the tiny default on any machine;
``torchrun --nproc_per_node 8 train.py model=qwen3_moe_30b_a3b parallel=ep8`` the real thing.

``run_training`` reads as the outline: the plan (every check, once: training/startup.py) -> process groups and
meshes -> the run directory held -> model on meta, parallelized, materialised -> optimizer -> data -> restore (a
resume) -> the first writes -> the loop -> finish (a checkpoint at the last step, the final weights). Then the step,
in two phases around its one host read; the loop's parts; and the Hydra entry point.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

import hydra
import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

import parallelisms
from core import device
from kernels.registry import apply_kernels, select_kernels
from models.hf_io import check_hf_into_model, export_hf, load_hf_into_model, record_source
from parallelisms.float8 import apply_float8
from training.batch import Batch, prepare_batches, validation_shard
from training.checkpoint import CheckpointError, load_checkpoint, save_checkpoint, save_model_weights
from training.config import TrainConfig, register_schema, to_train_config
from training.data.hf_tokenizer import hf_export_files
from training.data.loader import build_data_loader
from training.evaluate import validation_loss
from training.launch import needs_torchrun, one_line_errors, relaunch_with_torchrun, sweep_job_name
from training.loss import IGNORE_INDEX, router_loss_shares
from training.metrics import MetricLogger, moe_metrics, progress_line, reduce_routing, routing_summary
from training.optim import SkippedSteps, Schedule, Update, build_optimizer, build_update, nonfinite_report
from training.profiling import StepProfiler
from training.router_balance import update_expert_biases
from training.run_dir import RunDir
from training.loop_controls import ManualGC, StopSignal
from training.startup import (RunPlan, World, begin_run, check_primary_yaml, hydra_run_dir_of, job_config, plan_run,
                              primary_config, startup_lines, startup_warnings)
from training.train_state import InitFrom, Progress, run_state, upgrade_state

logger = logging.getLogger("train")


def run(cfg: TrainConfig) -> list[dict[str, Any]]:
    """Train as configured; returns the per-step metrics (also written to <run_dir>/metrics.jsonl)."""
    with contextlib.ExitStack() as run_scope:  # what the run opens (its lock, log files) is closed however it ends
        return run_training(cfg, run_scope)


def run_training(cfg: TrainConfig, run_scope: contextlib.ExitStack) -> list[dict[str, Any]]:
    plan = plan_run(cfg, World.of(cfg.launch))  # every check, read-only: before any process group or write
    dims, dev = start_processes(cfg, plan)
    plan, run_dir = plan.hold(dims, run_scope)  # rank 0 locks it and looks again; every rank takes its look
    if plan.finished:
        return []
    torch.manual_seed(cfg.train.seed)
    model, param_counts, kernels = build_model(plan, dims, dev)
    optimizer = build_optimizer(model, cfg.optim)
    update = build_update(optimizer, model, cfg.optim.grad_clip)  # queued before the step's read, or after it
    loader, val_batches = build_data(cfg, dims, plan)
    start = plan.start
    if start.checkpoint is not None:  # a resume: the model and optimizer first, then what the train state holds
        load_checkpoint(start.checkpoint, model, optimizer, start.state.get("files"))
    schedule, progress = Schedule(optimizer, cfg.optim, max(cfg.train.steps, 1)), Progress()
    # What the export will carry from model.init_from, as loaded (a resume takes its checkpoint's record).
    init_from = InitFrom(record_source(cfg.model.init_from, plan.spec.model_type, plan.model_args)
                         if dims.writer and cfg.model.init_from and start.checkpoint is None else None)
    train_state = run_state(schedule, loader, progress, plan.dev_type, cfg.train.allow_changes,
                            f"checkpoint {start.checkpoint}", plan.run_config, plan.global_batch, init_from)
    if start.checkpoint is not None:
        train_state.load_state_dict(upgrade_state(start.state, plan.tokens_per_step))
        if dims.writer:
            logger.info("resumed from %s at step %d", start.checkpoint, start.state["step"])
    metric_logger = begin_run(plan, run_dir, dims.writer)  # the first writes into the run directory
    # Autocast only under DDP: FSDP's mixed-precision policy (or in one process its stand-in) casts the parameters.
    autocast = torch.autocast(plan.dev_type, dtype=torch.bfloat16,
                              enabled=mixed_bf16(cfg, plan.dev_type) and cfg.parallel.backend.name == "ddp")
    parallelisms.clip_grad_norm_(model, 0.0, dims)  # warm-up: initialises every collective on every mesh
    stop = StopSignal(dims, dev)
    profiler = StepProfiler(run_dir.path, cfg.logging.profile_step, cfg.logging.profile_steps,
                            0 if dims.writer else dims.rank, plan.dev_type, cfg.logging.profile_host)
    gc_off = ManualGC(cfg.train.gc_every)

    def checkpoint(step: int) -> Path:
        loader.check_data_unchanged()  # the identity it records is what was read
        path = save_checkpoint(run_dir.ckpt_root, step, model, optimizer, train_state.state_dict(),
                               cfg.checkpoint.keep_last, dims.writer)
        run_dir.saved(step, path, dims.writer)
        return path

    if dims.writer:
        for line in startup_lines(plan, dims, param_counts, kernels, run_dir.path):
            logger.info(line)
        for line in startup_warnings(plan, model, run_dir, dims.world_size):
            logger.warning(line)
        for line in loader.passes(cfg.train.steps):  # a warning where the run repeats its data
            (logger.warning if " times over: " in line else logger.info)("data: %s", line)
    rates = Rates(plan.tokens_per_step, dims.world_size, plan.model_args.flops_per_token(cfg.data.seq_len),
                  device.peak_tflops(plan.dev_type))
    history: list[dict[str, Any]] = []
    steps = range(plan.first_step, cfg.train.steps + 1) if cfg.train.steps > 0 else [0]  # step 0: measure only
    saved_at = plan.first_step - 1 if start.checkpoint else None  # the step the newest checkpoint holds
    skipped = SkippedSteps(cfg.train.steps)  # train.nonfinite=skip: too many in a row stop the run
    trains_mtp = mtp_loss_weight(model) > 0
    begin = clock = time.perf_counter()
    for done, step in enumerate(steps, start=1):
        device.reset_peak_memory(plan.dev_type)
        profiler.step_begin(step)
        gc_off.step(step)
        with torch.profiler.record_function("data"):  # host time, overlapping the previous step's optimizer
            data_start = time.perf_counter()
            windows = [next(loader) for _ in range(cfg.train.grad_accum_steps)]
            batches = prepare_batches(windows, plan.model_args, dims.cp_rank, dims.cp, dev, mtp=trains_mtp)
            data_time = time.perf_counter() - data_start
        lr = schedule.lr
        logs = StepLogs.at(step, cfg, last=step == steps[-1], evaluates=bool(val_batches))
        result = train_step(model, batches, update, schedule, cfg, dims, plan.model_args, autocast, apply=step > 0,
                            routing=logs.metrics or logs.routing)
        # No device sync at the end of a step: the host logs this step and fetches the next batch while the device
        # runs this step's optimizer. The step's one host read (after backward) paces the loop, so the time between
        # two steps' returns is a step's time; where the host did wait for the device (an eval, a checkpoint, the
        # profiler), the next step is timed from then.
        waited = profiler.step_end(step)  # at the profiled window's end: after a device sync
        now = time.perf_counter()
        step_time, clock = now - clock, now
        progress.tokens_total += plan.tokens_per_step if step > 0 else 0
        attended = sum(b.attended_flops for b in batches) / len(batches)
        metrics = step_metrics(step, result, lr, rates, attended, progress.tokens_total, step_time, data_time,
                               plan.dev_type)
        if logs.evaluate:
            metrics["val_loss"] = validation_loss(model, val_batches, dev, autocast, dims.data_group)
            waited = True
        history.append(metrics)
        log_step(metrics, result, logs, loader, metric_logger, cfg, dims,
                 eta=(time.perf_counter() - begin) / done * (len(steps) - done))
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
            device.synchronize(plan.dev_type)
            clock = time.perf_counter()
    else:
        last_step = steps[-1] if steps else plan.first_step - 1  # none left: a resume of the last step's checkpoint
        finish(plan, run_dir, model, dims, checkpoint, saved_at, last_step, init_from.loaded)
    profiler.close()  # a run that stopped inside the window still gets its trace and summary
    stop.restore()
    gc_off.restore()
    metric_logger.close()
    if dims.writer:
        logger.info("done: %d of %d steps (%d in this process, %s), %s tokens in all; run directory: %s",
                    history[-1]["step"] if history else plan.first_step - 1, cfg.train.steps, len(history),
                    datetime.timedelta(seconds=round(time.perf_counter() - begin)), f"{progress.tokens_total:,}",
                    run_dir.path)
    stop.raise_if_interrupted()
    return history


# ------------------------------------------------------------------------------------------ set-up steps
def start_processes(cfg: TrainConfig, plan: RunPlan) -> tuple[parallelisms.ParallelDims, torch.device]:
    """The process group of the plan's world (under torchrun, or the loopback world of launch.simulate_world), the
    layout's meshes and this rank's device."""
    world, dev_type = plan.world, plan.dev_type
    if cfg.launch.simulate_world:
        parallelisms.init_loopback_world(world.size, world.rank, dev_type, cfg.launch.links)
    parallelisms.init_distributed(dev_type, cfg.parallel)
    dims = parallelisms.build_parallel_dims(cfg.parallel, world.size, world.rank, dev_type,
                                            simulated=cfg.launch.simulate_world > 0)
    return dims, device.local_device(dev_type)


def mixed_bf16(cfg: TrainConfig, dev_type: str) -> bool:
    return cfg.train.mixed_precision == "bf16" or (cfg.train.mixed_precision == "auto" and dev_type != "cpu")


def build_model(plan: RunPlan, dims: parallelisms.ParallelDims, dev: torch.device
                ) -> tuple[torch.nn.Module, tuple[int, int], Any]:
    """Build on meta, shard, then materialise (no rank ever holds the full model in memory): initialised, or
    model.init_from's weights (a resume loads its checkpoint later); then the kernels. Returns the model, its
    (total, active) parameter counts and the kernel choices."""
    cfg, spec, dev_type = plan.cfg, plan.spec, plan.dev_type
    init_from = cfg.model.init_from if plan.start.checkpoint is None else None
    with torch.device("meta"):
        model = spec.model_cls(plan.model_args)
    if cfg.model.freeze_vision:  # before the plan: FSDP reduces no gradient, the optimizer keeps no state for it
        spec.vision_tower(model).requires_grad_(False)
    param_counts = spec.parameter_counts(model)
    if cfg.train.float8 != "none":  # on meta, before parallelize: AC, EP and FSDP wrap the FP8 modules as any others
        apply_float8(model, spec, cfg.train.float8, dev_type, ep=dims.ep, compiled=cfg.train.compile,
                     tokens=cfg.train.local_batch_size * cfg.data.seq_len // dims.cp)  # per rank, micro-batch
    model = parallelisms.parallelize_qwen3_moe(model, spec, dims, cfg.parallel,
                                               torch.bfloat16 if mixed_bf16(cfg, dev_type) else torch.float32,
                                               torch.float32, cfg.dispatcher, compile_blocks=cfg.train.compile)
    if init_from is not None:
        check_hf_into_model(model, init_from)  # on meta: weights that do not fit allocate nothing
    model.to_empty(device=dev)
    if init_from is not None:
        load_hf_into_model(model, init_from)  # each rank reads only the slices it owns
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


def build_data(cfg: TrainConfig, dims: parallelisms.ParallelDims, plan: RunPlan):
    """The training loader (chats with images read for a model with its vision tower: ``plan.vision``) and the
    held-out batches (cp-sharded once, their images kept whole: every eval step reads the same ones)."""
    loader = build_data_loader(cfg.data, seed=cfg.train.seed, local_batch_size=cfg.train.local_batch_size,
                               dp_rank=dims.dp_rank, dp_size=dims.dp, tokenizer=plan.tokenizer,
                               model_vocab_size=plan.model_args.vocab_size, vision=plan.vision)
    val_batches = ([validation_shard(b, dims.cp_rank, dims.cp)
                    for b in loader.validation.batches(cfg.train.eval_batches)] if cfg.train.eval_every else [])
    return loader, val_batches


# ------------------------------------------------------------------------------------------ the step
class StepResult(NamedTuple):
    loss: float  # mean token cross-entropy of the global batch
    aux_loss: float
    z_loss: float
    grad_norm: float
    updated: bool
    # per MoE layer, the global batch's, on the host (training.metrics.reduce_routing); None where not asked for
    routing_LX: torch.Tensor | None
    mtp_loss: float | None = None  # the MTP head's mean token cross-entropy, where it trains


class QueuedStep(NamedTuple):
    """A step whose every kernel is queued: what its one host read and its resolution need."""
    read: Callable[[], torch.Tensor]  # losses (ce, aux, z, mtp) and the gradient norm, once on the host
    routing_LX: torch.Tensor | float  # the routers' summary on the device, where summarised (0.0: not)
    routing_host_LX: torch.Tensor | None  # the same reduced over the data ranks, queued to the host (the logs')
    mtp_weight: float


def mtp_loss_weight(model: torch.nn.Module) -> float:
    """model.arch.mtp_loss_weight of a model with an MTP head (one is built only where it is > 0), else 0."""
    return model.args.mtp_loss_weight if model.mtp is not None else 0.0


def global_count(labels: list[torch.Tensor], dims: parallelisms.ParallelDims) -> torch.Tensor:
    """The trained labels (!= -100) of the global batch: every data rank's micro-batches (at least 1)."""
    count = torch.stack([(b != IGNORE_INDEX).sum() for b in labels]).sum().float()
    if dims.data_group is not None:
        dist.all_reduce(count, group=dims.data_group)
    return count.clamp(min=1.0)


def train_step(model: torch.nn.Module, batches: list[Batch], update: Update, schedule: Schedule, cfg: TrainConfig,
               dims: parallelisms.ParallelDims, args: Any, autocast: torch.autocast, apply: bool,
               routing: bool) -> StepResult:
    """One optimizer step in two phases around its one host read: ``queue_step`` queues every kernel of the step and
    reads nothing; the read brings the losses and the gradient norm to the host; ``resolve_step`` takes the host's
    decisions on them. (tests/test_host_sync.py counts the reads on CPU; on a GPU it runs the two phases under
    ``torch.cuda.set_sync_debug_mode("error")``.)"""
    queued = queue_step(model, batches, update, cfg, dims, args, autocast, apply, routing)
    values = queued.read().tolist()  # the step's one host sync
    return resolve_step(queued, values, model, update, schedule, cfg, dims, args, apply)


def queue_step(model: torch.nn.Module, batches: list[Batch], update: Update, cfg: TrainConfig,
               dims: parallelisms.ParallelDims, args: Any, autocast: torch.autocast, apply: bool,
               routing: bool) -> QueuedStep:
    """Forward/backward over the micro-batches, the gradient norm, the losses reduced over the data ranks and, where
    the update decides on the device (``training.optim.QueuedUpdate``), the update: all queued, nothing read.
    ``routing``: also queue the routing summary to the host (a step that logs it: one more small all-reduce under
    data parallelism)."""
    # Normalise by the global count of trained tokens so every layout optimises the same objective.
    num_tokens = global_count([b.labels for b in batches], dims)
    mtp_weight = mtp_loss_weight(model)  # the MTP head's cross-entropy: the same, over its own trained labels
    num_mtp_tokens = global_count([b.mtp.labels_BT for b in batches], dims) if mtp_weight else None
    ce_share = aux_share = z_share = mtp_share = routing_LX = 0.0
    summarise = routing or args.router_bias_update_rate > 0  # the summary's readers: the logs, the bias update
    for batch in batches:
        with autocast:
            out = model(batch.input_ids, batch.position_ids, batch.labels,
                        **{**batch.forward_kwargs(), "mtp": batch.mtp if mtp_weight else None})
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
    # Queued before the read, so complete after it.
    routing_host_LX = reduce_routing(routing_LX, dims.data_group) if routing else None
    read = device.queued_read(torch.cat([losses, grad_norm.reshape(1)]))
    # The update is queued after the copy the read waits for, and not waited for: the device goes from backward to
    # the update, and on to the next forward, without waiting for the host to read, decide and launch.
    if apply:
        update.queue(grad_norm, losses)
    return QueuedStep(read, routing_LX, routing_host_LX, mtp_weight)


def resolve_step(queued: QueuedStep, values: list[float], model: torch.nn.Module, update: Update, schedule: Schedule,
                 cfg: TrainConfig, dims: parallelisms.ParallelDims, args: Any, apply: bool) -> StepResult:
    """The host's decisions on what the read found (``values``: the losses and the gradient norm): a step that is not
    finite applies no update (and stops the run under train.nonfinite=stop); one that is moves the schedule and the
    routers' balancing biases (``args.router_bias_update_rate``)."""
    loss, aux_loss, z_loss, mtp_loss, norm = values
    parallelisms.raise_if_dispatch_overflowed(model)  # dispatcher=capacity: a step that dropped rows is not applied
    finite = all(map(math.isfinite, values))  # as a queued update decided on the device
    if apply:
        update.resolve(finite, norm)
    if not finite and cfg.train.nonfinite == "stop":
        raise FloatingPointError(f"non-finite loss={loss} or grad_norm={norm}: "
                                 f"{nonfinite_report(model, update.optimizer, loss, norm)}; stopping "
                                 "(train.nonfinite=stop; train.nonfinite=skip would skip such steps)")
    if apply and finite:
        schedule.step()
        if args.router_bias_update_rate > 0:
            update_expert_biases(model.routers(), queued.routing_LX[:, :args.num_experts],
                                 args.router_bias_update_rate, dims.data_group)
    update.optimizer.zero_grad(set_to_none=True)
    return StepResult(loss, aux_loss, z_loss, norm, apply and finite, queued.routing_host_LX,
                      mtp_loss if queued.mtp_weight else None)


# ------------------------------------------------------------------------------------------ the loop's parts
class Rates(NamedTuple):
    tokens_per_step: int
    world_size: int
    flops_per_token: float
    peak_tflops: float | None


def step_metrics(step: int, result: StepResult, lr: float, rates: Rates, attended: float, tokens_total: int,
                 step_time: float, data_time: float, dev_type: str) -> dict[str, Any]:
    """``attended``: FLOPs per token over the attention pairs the step's windows computed
    (``training.metrics.attended_flops_per_token``)."""
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


def finish(plan: RunPlan, run_dir: RunDir, model: torch.nn.Module, dims: parallelisms.ParallelDims,
           checkpoint: Callable[[int], Path], saved_at: int | None, last_step: int,
           loaded: dict[str, Any] | None = None) -> None:
    """Every step trained: a checkpoint at the last step (checkpoint.at_end, unless one was just saved) before the
    final weights, so that weights which cannot be written lose nothing; then the weights and the HF export.
    ``loaded``: what the run loaded from model.init_from (recorded with the weights; the export checks its source)."""
    cfg = plan.cfg
    if cfg.train.save_final:
        kept = Path(run_dir.record.checkpoint) if saved_at == last_step else None
        if saved_at != last_step and cfg.checkpoint.at_end and last_step > 0:
            kept = checkpoint(last_step)
        try:
            save_model_weights(model, run_dir.path / "model.safetensors", is_writer=dims.writer, step=last_step,
                               init_from=loaded)
        except CheckpointError as e:
            raise CheckpointError(f"{e}; " + (f"the trained state is in checkpoint {kept}: make room and run again "
                                              "with train.resume=auto to write the weights" if kept else
                                              "no checkpoint holds the last step (checkpoint.at_end=false)")) from e
    if cfg.checkpoint.export_hf_at_end:
        processing = plan.vision.processing if plan.vision is not None else None  # the model's, for serving
        export_hf(model, plan.spec.model_type, run_dir.path / "hf", source=cfg.model.init_from, loaded=loaded,
                  extra_files=hf_export_files(plan.tokenizer, processing))
    run_dir.finished(last_step, dims.writer)


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


def relaunch(cfg: TrainConfig) -> None:
    """This job under torchrun (launch.nproc_per_node), after every check that needs no process group."""
    from hydra.core.hydra_config import HydraConfig

    hydra_cfg = HydraConfig.get()
    plan = plan_run(cfg, World(cfg.launch.nproc_per_node))
    relaunch_with_torchrun(cfg.launch, list(hydra_cfg.overrides.task), str(plan.run_dir),
                           config=primary_config(hydra_cfg), checkpoints=plan.ckpt_root)


register_schema()
OmegaConf.register_new_resolver("run_dir", hydra_run_dir_of, replace=True)
# The run directory of config.yaml files written before the run_dir resolver.
OmegaConf.register_new_resolver("if_none", lambda value, default: default if value is None else value, replace=True)

if __name__ == "__main__":
    with one_line_errors():  # a run's config.yaml that YAML cannot read: one line, before Hydra's traceback
        check_primary_yaml(sys.argv[1:])
    main()
