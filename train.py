"""Train a Qwen MoE model. ``python train.py`` trains the tiny default on any machine;
``torchrun --nproc_per_node 8 train.py model=qwen3_moe_30b_a3b parallel=ep8`` the real thing.

Reads top to bottom: config -> process groups and meshes -> model on meta -> parallelize ->
materialise (init or load) -> optimizer -> data -> loop -> final weights.
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
from core.files import atomic_write_text
from kernels.registry import apply_kernels, select_kernels
from models.hf_io import (args_from_hf_config, check_export_dir, export_hf, load_hf_into_model, preset_differences,
                          read_hf_config)
from parallelisms.float8 import apply_float8
from training.checkpoint import (load_checkpoint, read_train_state, resolve_resume, rng_state, save_checkpoint,
                                 save_model_weights, set_rng_state)
from training.config import (TrainConfig, check_resume_config, flat_config, register_schema, schema_defaults,
                             to_train_config, validate)
from training.data.hf_tokenizer import check_export_requirements, hf_tokenizer_files, run_tokenizer
from training.data.loader import build_data_loader
from training.data.packing import context_shard
from training.evaluate import validation_loss
from training.launch import needs_torchrun, one_line_errors, relaunch_with_torchrun
from training.loss import IGNORE_INDEX, router_loss_shares
from training.metrics import (MetricLogger, attended_flops_per_token, moe_metrics, progress_line, reduce_routing,
                              routing_summary)
from training.optim import build_optimizer, build_scheduler
from training.profiling import StepProfiler
from training.router_balance import update_expert_biases
from training.run_logs import run_logs

logger = logging.getLogger("train")


def resolve_model(cfg: TrainConfig) -> tuple[models.ModelSpec, Any]:
    """The family's spec and hyper-parameters: the preset, or the config.json of model.init_from (model=hf)."""
    m = cfg.model
    if m.init_from is None:
        return models.get_spec(m.model_type), models.build_args(m.model_type, dict(m.arch))
    hf_config = read_hf_config(m.init_from)
    if m.name == "hf":
        model_type, args = args_from_hf_config(hf_config)
        return models.get_spec(model_type), args
    args = models.build_args(m.model_type, dict(m.arch))
    for line in preset_differences(args, hf_config):
        logger.warning("model=%s differs from %s/config.json: %s", m.name, m.init_from, line)
    return models.get_spec(m.model_type), args


def on_rank0(dims: parallelisms.ParallelDims, decide: Callable[[], Any]) -> Any:
    """``decide()`` on rank 0, its result (or its error) on every rank: one decision about the run directory, taken
    before rank 0 writes into it (a lagging rank would otherwise see rank 0's new files, or its own Hydra clock)."""
    box: list[Any] = [None]
    if dims.rank == 0:
        try:
            box = [(True, decide())]
        except Exception as e:  # every rank raises it
            box = [(False, e)]
    if dims.world_size > 1:
        dist.broadcast_object_list(box, src=0)
    ok, value = box[0]
    if not ok:
        raise value
    return value


def shared_run_dir(cfg: TrainConfig, dims: parallelisms.ParallelDims) -> Path:
    """One run directory for all ranks: rank 0's choice (each rank's Hydra clock may differ)."""

    def choose() -> str:
        if cfg.train.output_dir is not None:
            return cfg.train.output_dir
        from hydra.core.hydra_config import HydraConfig

        return HydraConfig.get().runtime.output_dir if HydraConfig.initialized() else "outputs/run"

    run_dir = Path(on_rank0(dims, choose))
    if dims.rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


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
    return [
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
    routing_LX: torch.Tensor  # per MoE layer, this rank's share: see training.metrics.routing_summary


def train_step(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]], optimizer: torch.optim.Optimizer,
               scheduler, cfg: TrainConfig, dims: parallelisms.ParallelDims, args: Any, autocast: torch.autocast,
               update: bool) -> StepResult:
    """Forward/backward over the micro-batches, clip, and (unless told not to, or non-finite) step: the
    optimizer, the schedule and the routers' balancing biases (``args.router_bias_update_rate``)."""
    # Normalise by the global count of trained tokens so every layout optimises the same objective.
    num_tokens = torch.stack([(b["labels"] != IGNORE_INDEX).sum() for b in batches]).sum().float()
    if dims.data_group is not None:
        dist.all_reduce(num_tokens, group=dims.data_group)
    num_tokens = num_tokens.clamp(min=1.0)
    ce_share = aux_share = z_share = routing_LX = 0.0
    for batch in batches:
        with autocast:
            out = model(batch["input_ids"], batch["position_ids"], batch["labels"])  # chunked LM head + CE
        ce = out.loss_sum / num_tokens
        aux, z = (share / len(batches) for share in router_loss_shares(out.router_stats, args.num_experts,
                                                                         dims.data_group))
        ((ce + args.router_aux_loss_coef * aux + args.router_z_loss_coef * z) * dims.grad_scale).backward()
        ce_share, aux_share, z_share = ce_share + ce.detach(), aux_share + aux.detach(), z_share + z.detach()
        routing_LX = routing_LX + routing_summary(out.router_stats)
    grad_norm = parallelisms.grad_norm(model, dims)  # clipped below, once the host has the norm
    losses = torch.stack([ce_share, aux_share, z_share])
    if dims.data_group is not None:
        dist.all_reduce(losses, group=dims.data_group)
    loss, aux_loss, z_loss, norm = (*losses.tolist(), grad_norm.item())  # the step's one host sync
    parallelisms.raise_if_dispatch_overflowed(model)  # dispatcher=capacity: a step that dropped rows is not applied
    finite = math.isfinite(loss) and math.isfinite(norm)
    if not finite and cfg.train.nonfinite == "stop":
        raise FloatingPointError(f"non-finite loss={loss} or grad_norm={norm}; stopping (train.nonfinite=stop; "
                                 "train.nonfinite=skip would skip such steps)")
    if update and finite:
        coef = parallelisms.clip_coefficient(cfg.optim.grad_clip, norm)
        if cfg.optim.grad_clip > 0 and coef < 1:  # a step within the norm skips the pass over every gradient
            parallelisms.scale_grads_(model, coef)
        optimizer.step()
        scheduler.step()
        if args.router_bias_update_rate > 0:
            update_expert_biases(model.routers(), routing_LX[:, :args.num_experts], args.router_bias_update_rate,
                                 dims.data_group)
    optimizer.zero_grad(set_to_none=True)
    return StepResult(loss, aux_loss, z_loss, norm, update and finite, routing_LX)


def check_config(cfg: TrainConfig, world_size: int) -> tuple[models.ModelSpec, Any, str | None]:
    """Every check that needs no process group: config, model and layout; also run by the launching process
    before torchrun starts any child, so an impossible layout is one short error."""
    validate(cfg)
    spec, model_args = resolve_model(cfg)
    tokenizer = run_tokenizer(cfg, model_args.vocab_size)  # one that does not fit the model or the data fails here
    if cfg.checkpoint.export_hf_at_end:
        check_export_requirements(cfg, tokenizer, model_args.vocab_size)
        if cfg.train.output_dir is not None:  # Hydra's own run directory is new: it holds no hf/ yet
            check_export_dir(Path(cfg.train.output_dir) / "hf")  # checked before any step is trained
    parallelisms.validate_parallel_config(cfg.parallel, world_size, model_args.num_experts,
                                          heads=spec.cp_head_counts(model_args), seq_len=cfg.data.seq_len)
    return spec, model_args, tokenizer


def run(cfg: TrainConfig) -> list[dict[str, Any]]:
    """Train as configured; returns the per-step metrics (also written to <run_dir>/metrics.jsonl)."""
    with contextlib.ExitStack() as run_scope:  # what the run opens (log files) is closed however it ends
        return run_training(cfg, run_scope)


def run_training(cfg: TrainConfig, run_scope: contextlib.ExitStack) -> list[dict[str, Any]]:
    dev_type = device.device_type(cfg.train.device)
    world_size, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    spec, model_args, tokenizer = check_config(cfg, world_size)

    parallelisms.init_distributed(dev_type, cfg.parallel)
    dims = parallelisms.build_parallel_dims(cfg.parallel, world_size, rank, dev_type)
    dev = device.local_device(dev_type)
    run_dir = shared_run_dir(cfg, dims)
    run_scope.enter_context(run_logs(run_dir, dims.rank, cfg.logging.all_ranks))
    ckpt_root = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir / "checkpoints"
    # Record the architecture actually built (model=hf leaves it to config.json) so export/resume can rebuild it.
    resolved = dataclasses.replace(cfg, model=dataclasses.replace(
        cfg.model, model_type=spec.model_type, tokenizer=tokenizer or "none", arch=dataclasses.asdict(model_args)))
    run_config = OmegaConf.to_container(OmegaConf.structured(resolved))
    global_batch = cfg.train.local_batch_size * cfg.train.grad_accum_steps * dims.dp
    # A resume is checked (config, then keys, shapes and file checksums) before anything of the run is rewritten.
    resume_from = on_rank0(dims, lambda: resolve_resume(cfg.train.resume, ckpt_root, run_dir))
    state = read_train_state(resume_from) if resume_from else None
    if state is not None:
        check_resumed_config(state, run_config, global_batch, cfg.train.allow_changes, resume_from, dims.rank == 0)
    torch.manual_seed(cfg.train.seed)

    # Build on meta, shard, then materialise: no rank ever holds the full model in memory.
    bf16 = cfg.train.mixed_precision == "bf16" or (cfg.train.mixed_precision == "auto" and dev_type != "cpu")
    with torch.device("meta"):
        model = spec.model_cls(model_args)
    param_counts = spec.parameter_counts(model)
    if cfg.train.float8 != "none":  # on meta, before parallelize: AC, EP and FSDP wrap the FP8 modules as any others
        apply_float8(model, spec, cfg.train.float8, dev_type, ep=dims.ep, compiled=cfg.train.compile,
                     tokens=cfg.train.local_batch_size * cfg.data.seq_len // dims.cp)  # per rank, micro-batch
    model = parallelisms.parallelize_model(model, spec, dims, cfg.parallel,
                                           torch.bfloat16 if bf16 else torch.float32, torch.float32, cfg.dispatcher,
                                           compile_blocks=cfg.train.compile)
    model.to_empty(device=dev)
    if cfg.model.init_from is not None and resume_from is None:
        load_hf_into_model(model, cfg.model.init_from)  # each rank reads only the slices it owns
    else:
        model.init_weights()  # every parameter; the rotary tables are computed per call, so no buffers
    model.train()
    kernels = select_kernels(cfg.kernel_config, dev_type)  # a missing requested package fails here, on every rank
    slots = apply_kernels(model, kernels)
    if dims.rank == 0:
        kernels.log(logger)
        delta_rule = kernels.choices["chunk_gated_delta_rule"]
        if dev_type == "cuda" and slots.get("chunk_gated_delta_rule") and delta_rule.impl == "torch":
            logger.warning("Gated DeltaNet runs its torch reference (about half the speed of FLA's kernel: %s); "
                           "for speed: pip install '.[gpu]' with triton >= 3.7.1 (torch >= 2.12.1) and "
                           "kernel_config=auto_fla", delta_rule.reason)

    optimizer = build_optimizer(model, cfg.optim)
    loader = build_data_loader(cfg.data, seed=cfg.train.seed, local_batch_size=cfg.train.local_batch_size,
                               dp_rank=dims.dp_rank, dp_size=dims.dp,
                               tokenizer=tokenizer, model_vocab_size=model_args.vocab_size)
    # The held-out batches, cp-sharded once: every eval step reads the same ones.
    val_batches = ([context_shard(b, dims.cp_rank, dims.cp) for b in loader.validation.batches(cfg.train.eval_batches)]
                   if cfg.train.eval_every else [])
    first_step, position = 1, 0
    if state is not None:
        load_checkpoint(resume_from, model, optimizer, state.get("files"))
        loader.load_state_dict(state["loader"], cfg.train.allow_changes)
        set_rng_state(state["rng"], dev_type)
        first_step, position = state["step"] + 1, state["scheduler"]["last_epoch"]
        if dims.rank == 0:
            logger.info("resumed from %s at step %d", resume_from, state["step"])
    scheduler = build_scheduler(optimizer, cfg.optim, max(cfg.train.steps, 1), position)
    # Only now, with the resume known good, is anything of the run directory rewritten.
    if dims.rank == 0:
        atomic_write_text(run_dir / "config.yaml", rerunnable_config(run_config))
    metric_logger = MetricLogger(run_dir, cfg.logging, enabled=dims.rank == 0,
                                 keep_until=first_step - 1 if state is not None else None, run_config=run_config)
    # Autocast only under DDP: FSDP's mixed-precision policy (or in one process its stand-in) casts the parameters.
    autocast = torch.autocast(dev_type, dtype=torch.bfloat16, enabled=bf16 and cfg.parallel.backend.name == "ddp")
    flops_per_token = model_args.flops_per_token(cfg.data.seq_len)
    peak_flops = device.peak_tflops(dev_type)
    parallelisms.clip_grad_norm_(model, 0.0, dims)  # warm-up: initialises every collective on every mesh
    stop = StopSignal(dims, dev)
    profiler = StepProfiler(run_dir, cfg.logging.profile_step, cfg.logging.profile_steps, dims.rank, dev_type)
    if cfg.train.gc_every:  # Python's automatic GC pauses one rank at a time, and every other rank waits on it
        gc.collect()
        gc.disable()

    def checkpoint(step: int) -> None:
        train_state = {"scheduler": {"last_epoch": scheduler.last_epoch}, "loader": loader.state_dict(),
                       "rng": rng_state(dev_type), "config": run_config, "global_batch_size": global_batch,
                       "tokens_total": tokens_total}
        save_checkpoint(ckpt_root, step, model, optimizer, train_state, cfg.checkpoint.keep_last, dims.rank == 0)

    tokens_per_step = global_batch * cfg.data.seq_len
    # Checkpoints before tokens_total was recorded: the steps so far at this batch.
    tokens_total = state.get("tokens_total", (first_step - 1) * tokens_per_step) if state is not None else 0
    if dims.rank == 0:
        for line in startup_summary(resolved, param_counts, dims, global_batch, kernels, run_dir):
            logger.info(line)
    history: list[dict[str, Any]] = []
    steps = range(first_step, cfg.train.steps + 1) if cfg.train.steps > 0 else [0]  # step 0: measure only
    start = time.perf_counter()
    for done, step in enumerate(steps, start=1):
        device.reset_peak_memory(dev_type)
        profiler.step_begin(step)
        step_start = time.perf_counter()
        if cfg.train.gc_every and step % cfg.train.gc_every == 0:
            gc.collect(1)  # young generations only, as torchtitan: cheap, at the same step on every rank
        # The cp ranks of a dp slice read the same sequences; each keeps its 1/cp of every one.
        with torch.profiler.record_function("data"):
            data_start = time.perf_counter()
            windows = [next(loader) for _ in range(cfg.train.grad_accum_steps)]
            # This rank's whole sequences (before the cp split): the attention pairs its dp slice computes.
            attended = sum(attended_flops_per_token(model_args, w["position_ids"]) for w in windows) / len(windows)
            shards = [context_shard(window, dims.cp_rank, dims.cp) for window in windows]
            batches = [{k: v.to(dev, non_blocking=True) for k, v in shard.items()} for shard in shards]
            data_time = time.perf_counter() - data_start  # the loader is on the critical path: keep this small
        lr = scheduler.get_last_lr()[0]
        result = train_step(model, batches, optimizer, scheduler, cfg, dims, model_args, autocast, update=step > 0)
        device.synchronize(dev_type)
        step_time = time.perf_counter() - step_start
        profiler.step_end(step)  # after the sync: the profiled wall time is complete
        tokens = tokens_per_step
        tokens_total += tokens if step > 0 else 0
        per_device = tokens / step_time / dims.world_size
        metrics: dict[str, Any] = {
            "step": step, "loss": result.loss, "aux_loss": result.aux_loss, "z_loss": result.z_loss,
            "grad_norm": result.grad_norm,
            "lr": lr, "skipped": step > 0 and not result.updated, "tokens": tokens, "tokens_total": tokens_total,
            "tokens_per_s": tokens / step_time, "tokens_per_s_per_device": per_device,
            "tflops_per_device": per_device * flops_per_token / 1e12,
            "mfu": per_device * flops_per_token / (peak_flops * 1e12) if peak_flops else None,
            "attended_tflops_per_device": per_device * attended / 1e12,
            "attended_mfu": per_device * attended / (peak_flops * 1e12) if peak_flops else None,
            "peak_mem_gib": device.peak_memory_gib(dev_type), "step_time_s": step_time,
            "data_time_s": data_time, "data_share": data_time / step_time,
        }
        if val_batches and (step % cfg.train.eval_every == 0 or step == steps[-1]):
            metrics["val_loss"] = validation_loss(model, val_batches, dev, autocast, dims.data_group)
        history.append(metrics)
        if metrics["skipped"] and dims.rank == 0:
            logger.warning("step %d skipped: loss=%s, grad_norm=%s: not finite, no update (train.nonfinite=skip)",
                           step, result.loss, result.grad_norm)
        log_now = step % cfg.logging.log_every == 0 or step == steps[-1] or "val_loss" in metrics
        record_routing = cfg.logging.routing_every > 0 and step % cfg.logging.routing_every == 0
        if log_now or record_routing:  # one all-reduce and one small copy to the host, shared by log and record
            routing_LX = reduce_routing(result.routing_LX, dims.data_group)
        if record_routing:
            metric_logger.log_routing(step, routing_LX)
        if log_now:
            metrics.update(moe_metrics(routing_LX))
            metrics.update(loader.mixture_metrics())  # each data source's realised share (a mixture only)
            metric_logger.log(metrics)
            if dims.rank == 0:
                eta = (time.perf_counter() - start) / done * (len(steps) - done)
                logger.info(progress_line(metrics, cfg.train.steps, eta))
        if stop.requested():
            checkpoint(step)
            logger.info("stopping at step %d on SIGTERM after saving a checkpoint", step)
            break
        if cfg.checkpoint.interval > 0 and step > 0 and step % cfg.checkpoint.interval == 0:
            checkpoint(step)
    else:
        if cfg.train.save_final:
            save_model_weights(model, run_dir / "model.safetensors", is_writer=dims.rank == 0)
        if cfg.checkpoint.export_hf_at_end:
            export_hf(model, spec.model_type, run_dir / "hf", extra_files=hf_tokenizer_files(tokenizer))
    profiler.close()  # a run that stopped inside the window still gets its trace and summary
    stop.restore()
    if cfg.train.gc_every:
        gc.enable()
    metric_logger.close()
    if dims.rank == 0:
        logger.info("done: %d of %d steps (%d in this process, %s), %s tokens in all; run directory: %s",
                    history[-1]["step"] if history else first_step - 1, cfg.train.steps, len(history),
                    datetime.timedelta(seconds=round(time.perf_counter() - start)), f"{tokens_total:,}", run_dir)
    return history


class StopSignal:
    """SIGTERM (slurm preemption, torchrun shutdown) asks to stop after the current step; ranks agree."""

    def __init__(self, dims: parallelisms.ParallelDims, dev: torch.device) -> None:
        self._dims, self._dev = dims, dev
        self._flag = False
        self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame) -> None:
        self._flag = True

    def requested(self) -> bool:
        if self._dims.world_size == 1:
            return self._flag
        flag = torch.tensor([float(self._flag)], device=self._dev)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # any rank's signal stops all of them at the same step
        return bool(flag.item())

    def restore(self) -> None:
        signal.signal(signal.SIGTERM, self._previous)


register_schema()
# conf/config.yaml: Hydra's run directory is train.output_dir when that is set, else a new dated one.
OmegaConf.register_new_resolver("if_none", lambda value, default: default if value is None else value, replace=True)


@hydra.main(config_path="conf", config_name="config", version_base=None)
def main(dict_cfg: DictConfig) -> None:
    with one_line_errors():  # bad input ends with one readable line; HYDRA_FULL_ERROR=1 for the traceback
        cfg = to_train_config(dict_cfg)
        if needs_torchrun(cfg.launch):
            from hydra.core.hydra_config import HydraConfig

            check_config(cfg, world_size=cfg.launch.nproc_per_node)  # before any child starts
            hydra_cfg = HydraConfig.get()
            primary = next(s for s in hydra_cfg.runtime.config_sources if s.provider == "main")  # conf/ or a run dir
            relaunch_with_torchrun(cfg.launch, list(hydra_cfg.overrides.task),
                                   cfg.train.output_dir or hydra_cfg.runtime.output_dir,
                                   config=(primary.path.removeprefix("file://"), hydra_cfg.job.config_name))
            return
        try:
            run(cfg)
            if dist.is_initialized():
                # Every rank leaves its last collective before any rank tears its process group down: a rank that
                # exits while a peer still talks to it can abort the peer (seen with gloo).
                dist.barrier()
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


if __name__ == "__main__":
    main()
