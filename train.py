"""Train a Qwen MoE model. ``python train.py`` trains the tiny default on any machine;
``torchrun --nproc_per_node 8 train.py model=qwen3_moe_30b_a3b parallel=ep8`` the real thing.

Reads top to bottom: config -> process groups and meshes -> model on meta -> parallelize ->
materialise (init or load) -> optimizer -> data -> loop -> final weights.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import Any

import hydra
import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

import models
import parallelisms
from models.hf_io import args_from_hf_config, load_hf_state_dict, load_into_model, preset_differences, read_hf_config
from training import device
from training.checkpoint import save_model_weights
from training.config import TrainConfig, register_schema, validate
from training.data import build_data_loader
from training.loss import IGNORE_INDEX, aux_loss_share, cross_entropy_sum
from training.metrics import MetricLogger, progress_line
from training.optim import build_optimizer, build_scheduler

logger = logging.getLogger("train")


def resolve_model_args(cfg: TrainConfig):
    """The family's hyper-parameters: the preset, or the config.json of model.init_from (model=hf)."""
    m = cfg.model
    if m.init_from is None:
        return models.build_args(m.model_type, dict(m.arch))
    hf_config = read_hf_config(m.init_from)
    if m.name == "hf":
        return args_from_hf_config(hf_config)[1]
    args = models.build_args(m.model_type, dict(m.arch))
    for line in preset_differences(args, hf_config):
        logger.warning("model=%s differs from %s/config.json: %s", m.name, m.init_from, line)
    return args


def shared_run_dir(cfg: TrainConfig, dims: parallelisms.ParallelDims) -> Path:
    """One run directory for all ranks: rank 0's choice, broadcast (each rank's Hydra clock may differ)."""
    if cfg.train.output_dir is not None:
        choice = cfg.train.output_dir
    else:
        from hydra.core.hydra_config import HydraConfig

        choice = HydraConfig.get().runtime.output_dir if HydraConfig.initialized() else "outputs/run"
    if dims.world_size > 1:
        box = [choice]
        dist.broadcast_object_list(box, src=0)
        choice = box[0]
    run_dir = Path(choice)
    if dims.rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def run(cfg: TrainConfig) -> list[dict[str, Any]]:
    """Train as configured; returns the per-step metrics (also written to <run_dir>/metrics.jsonl)."""
    validate(cfg)
    dev_type = device.device_type(cfg.train.device)
    world_size, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    model_args = resolve_model_args(cfg)
    spec = models.get_spec(cfg.model.model_type or args_from_hf_config(read_hf_config(cfg.model.init_from))[0])
    parallelisms.validate_parallel_config(cfg.parallel, world_size, model_args.num_experts)

    parallelisms.init_distributed(dev_type, cfg.parallel)
    dims = parallelisms.build_parallel_dims(cfg.parallel, world_size, rank, dev_type)
    dev = device.local_device(dev_type)
    run_dir = shared_run_dir(cfg, dims)
    # Record the architecture actually built (model=hf leaves it to config.json) so export/resume can rebuild it.
    resolved = dataclasses.replace(cfg, model=dataclasses.replace(
        cfg.model, model_type=spec.model_type, arch=dataclasses.asdict(model_args)))
    if dims.rank == 0:
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(resolved)))
    torch.manual_seed(cfg.train.seed)

    # Build on meta, shard, then materialise: no rank ever holds the full model in memory.
    bf16 = cfg.train.mixed_precision == "bf16" or (cfg.train.mixed_precision == "auto" and dev_type != "cpu")
    param_dtype = torch.bfloat16 if bf16 else torch.float32
    with torch.device("meta"):
        model = spec.model_cls(model_args)
    model = parallelisms.parallelize_model(model, spec, dims, cfg.parallel, param_dtype, torch.float32)
    model.to_empty(device=dev)
    if cfg.model.init_from is not None:
        load_into_model(model, load_hf_state_dict(cfg.model.init_from))
    else:
        model.init_weights()  # every parameter; the rotary tables are computed per call, so no buffers
    model.train()

    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, max(cfg.train.steps, 1))
    loader = build_data_loader(cfg.data, seed=cfg.train.seed, local_batch_size=cfg.train.local_batch_size,
                               dp_rank=dims.dp_rank, dp_size=dims.dp)
    if loader.vocab_size > model_args.vocab_size:
        raise ValueError(f"data ids reach {loader.vocab_size - 1} but model.arch.vocab_size={model_args.vocab_size}; "
                         "use a model whose vocabulary covers the tokenizer (or data.tokenizer to match)")
    metric_logger = MetricLogger(run_dir, cfg.logging, enabled=dims.rank == 0,
                                 run_config=OmegaConf.to_container(OmegaConf.structured(resolved)))
    # Autocast only where FSDP's mixed-precision policy does not already cast the parameters.
    autocast = torch.autocast(dev_type, dtype=torch.bfloat16, enabled=bf16 and cfg.parallel.backend.name != "fsdp2")
    flops_per_token = model_args.flops_per_token(cfg.data.seq_len)
    peak_flops = device.peak_tflops(dev_type)
    parallelisms.clip_grad_norm_(model, 0.0, dims)  # warm-up: initialises every collective on every mesh

    history: list[dict[str, Any]] = []
    accum, coef = cfg.train.grad_accum_steps, model_args.router_aux_loss_coef
    steps = range(1, cfg.train.steps + 1) if cfg.train.steps > 0 else [0]  # step 0: measure, never update
    start = time.perf_counter()
    for step in steps:
        device.reset_peak_memory(dev_type)
        step_start = time.perf_counter()
        batches = [{k: v.to(dev, non_blocking=True) for k, v in next(loader).items()} for _ in range(accum)]
        # Normalise by the global count of trained tokens so every layout optimises the same objective.
        num_tokens = torch.stack([(b["labels"] != IGNORE_INDEX).sum() for b in batches]).sum().float()
        if dims.data_group is not None:
            dist.all_reduce(num_tokens, group=dims.data_group)
        num_tokens = num_tokens.clamp(min=1.0)
        ce_share = torch.zeros((), device=dev)
        aux_share = torch.zeros((), device=dev)
        for batch in batches:
            with autocast:
                out = model(batch["input_ids"], batch["position_ids"])
            ce = cross_entropy_sum(out.logits, batch["labels"]) / num_tokens
            aux = aux_loss_share(out.router_stats, model_args.num_experts, dims.data_group) / accum
            ((ce + coef * aux) * dims.grad_scale).backward()
            ce_share += ce.detach()
            aux_share += aux.detach()
        grad_norm = parallelisms.clip_grad_norm_(model, cfg.optim.grad_clip, dims)
        lr = scheduler.get_last_lr()[0]
        if step > 0:
            optimizer.step()
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)

        if step % cfg.logging.log_every == 0 or step == steps[-1]:
            losses = torch.stack([ce_share, aux_share])
            if dims.data_group is not None:
                dist.all_reduce(losses, group=dims.data_group)
            device.synchronize(dev_type)
            step_time = time.perf_counter() - step_start
            tokens = accum * cfg.train.local_batch_size * cfg.data.seq_len * dims.dp
            per_device = tokens / step_time / dims.world_size
            metrics = {
                "step": step, "loss": losses[0].item(), "aux_loss": losses[1].item(),
                "grad_norm": grad_norm.item(), "lr": lr, "tokens": tokens,
                "tokens_per_s": tokens / step_time, "tokens_per_s_per_device": per_device,
                "mfu": per_device * flops_per_token / (peak_flops * 1e12) if peak_flops else None,
                "peak_mem_gib": device.peak_memory_gib(dev_type), "step_time_s": step_time,
            }
            history.append(metrics)
            metric_logger.log(metrics)
            if dims.rank == 0:
                eta = (time.perf_counter() - start) / max(step, 1) * (len(steps) - max(step, 1))
                logger.info(progress_line(metrics, cfg.train.steps, eta))

    if cfg.train.save_final:
        save_model_weights(model, run_dir / "model.safetensors", is_writer=dims.rank == 0)
    metric_logger.close()
    if dims.rank == 0:
        logger.info("run directory: %s", run_dir)
    return history


register_schema()


@hydra.main(config_path="conf", config_name="config", version_base=None)
def main(dict_cfg: DictConfig) -> None:
    cfg: TrainConfig = OmegaConf.to_object(dict_cfg)
    try:
        run(cfg)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
