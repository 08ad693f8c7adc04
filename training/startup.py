"""Start-up in one pass: ``plan_run(cfg, world)`` makes every check that needs no process group and decides,
read-only, what this start trains (``RunPlan``): the model (the preset, model.init_from's config.json, or the
resumed checkpoint's), the tokenizer, the run directory and what train.resume continues in it, the config the run
records and the global batch. ``RunPlan.hold`` then takes the run directory for the run (rank 0 locks it and looks
again; every rank takes rank 0's look) and compares a resume's config with its checkpoint's; ``begin_run`` makes
the run's first writes. The launching process of ``launch.nproc_per_node`` plans too, so that a bad config is one
line before torchrun starts any child.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

import models
import parallelisms
from core import device
from models.hf_io import (args_from_hf_config, check_export_dir, check_export_source, preset_differences,
                          read_hf_config)
from training.checkpoint import save_sizes, space_warnings
from training.config import (TrainConfig, check_resume_config, config_warnings, flat_config, input_paths,
                             schema_defaults, validate)
from training.data.hf_tokenizer import check_export_requirements, run_tokenizer
from training.data.vision import VisionData, vision_for_model
from training.launch import LaunchConfig, one_line_errors
from training.metrics import MetricLogger
from training.planner import fit_warnings
from training.run_dir import (CONFIG_HEADER, RunDir, Start, check_apart, check_checkpoint_dir, check_not_moved,
                              check_run_dir, find_start, lock_checkpoint_dir, lock_run_dir, outside)
from training.run_logs import run_logs
from training.train_state import upgrade_config

logger = logging.getLogger("train")

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class World:
    """The job's processes as the environment gives them before any process group exists: torchrun's WORLD_SIZE
    and RANK, or the loopback world of launch.simulate_world (or, for the launching process, nproc_per_node)."""
    size: int
    rank: int = 0

    @classmethod
    def of(cls, launch: LaunchConfig) -> World:
        if launch.simulate_world:
            return cls(launch.simulate_world, launch.simulate_rank)
        return cls(int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0)))


@dataclass(frozen=True)
class RunPlan:
    """What a start trains and where, decided once (``plan_run``); ``hold`` gives the plan as rank 0 sees the run
    directory under its lock."""
    cfg: TrainConfig  # as given, validated
    resolved: TrainConfig  # the model section as built (model=hf: config.json's architecture)
    spec: models.ModelSpec
    model_args: Any
    tokenizer: str | None  # the data's and the export's (training.data.hf_tokenizer.run_tokenizer)
    vision: VisionData | None  # what the loader needs of the vision tower (``model_vision``); None: text data only
    dev_type: str
    world: World
    run_dir: Path
    ckpt_root: Path
    start: Start  # what train.resume continues (training.run_dir.find_start)
    run_config: dict[str, Any]  # the config as the run records it (config.yaml, every checkpoint)
    global_batch: int  # sequences per step: local_batch_size x grad_accum_steps x dp
    finished: bool = False  # the run is done: nothing to train (known once held)

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.cfg.data.seq_len

    @property
    def first_step(self) -> int:
        return self.start.state["step"] + 1 if self.start.checkpoint is not None else 1

    def hold(self, dims: parallelisms.ParallelDims, run_scope: contextlib.ExitStack) -> tuple[RunPlan, RunDir]:
        """Rank 0 locks the run directory (and a checkpoint.dir of its own) until the run ends and looks again at
        what train.resume continues: the directory may have changed since ``plan_run``'s look. Every rank takes
        rank 0's directory and look (each rank's Hydra clock may name another directory; a lagging rank would see
        rank 0's new files). Then the run's logs open, and a resume's config is compared with the checkpoint's."""

        def look_under_lock() -> tuple[str, Start]:
            run_scope.enter_context(lock_run_dir(self.run_dir))  # the OS releases it if the process dies
            if outside(self.ckpt_root, self.run_dir):
                run_scope.enter_context(lock_checkpoint_dir(self.ckpt_root, self.run_dir))
            return str(self.run_dir), find_start(self.cfg.train.resume, self.cfg.train.discard_newer,
                                                 self.ckpt_root, self.run_dir)

        path, start = on_rank0(dims, look_under_lock)
        plan = self._looked_again(Path(path), start)
        run_dir = RunDir(plan.run_dir, plan.ckpt_root, start)
        if dims.simulated:  # the run directory says what it holds: one simulated rank's log and metrics
            run_dir.record.simulated = f"rank {dims.rank} of {dims.world_size}"
        run_scope.enter_context(run_logs(run_dir.path, 0 if dims.writer else dims.rank, self.cfg.logging.all_ranks))
        return dataclasses.replace(plan, finished=not plan._continues(run_dir, dims.writer)), run_dir

    def _looked_again(self, path: Path, start: Start) -> RunPlan:
        """This plan with rank 0's directory and look; the model resolved again where the look resumes another
        checkpoint config than the first look did."""
        plan = dataclasses.replace(self, run_dir=path, ckpt_root=checkpoint_root(self.cfg, path), start=start)
        if start.resumed_config == self.start.resumed_config:
            return plan
        spec, model_args, tokenizer, vision = check_config(self.cfg, self.world.size, start.resumed_config)
        run_config, resolved = recorded_config(self.cfg, spec, model_args, tokenizer)
        return dataclasses.replace(plan, spec=spec, model_args=model_args, tokenizer=tokenizer, vision=vision,
                                   resolved=resolved, run_config=run_config)

    def _continues(self, run_dir: RunDir, log: bool) -> bool:
        """Whether there is anything to train: a resume (or a restart of a run that wrote no checkpoint) must train
        what the run trained (its checkpoint's config, else its config.yaml); a finished run says so (False)."""
        start = self.start
        source = start.checkpoint or run_dir.path / "config.yaml"
        if start.state is not None or start.previous_config is not None:
            check_resumed_config(start.state or {"config": start.previous_config}, self.run_config,
                                 self.global_batch, self.cfg.train.allow_changes, source, log)
        done = start.state["step"] if start.state is not None else 0
        finished = start.record is not None and start.record.finished
        steps = self.cfg.train.steps
        if finished and start.state is None and steps > start.record.step:
            if start.record.step > 0:
                raise ValueError(f"run {run_dir.path} finished at step {start.record.step} without a checkpoint "
                                 "(checkpoint.at_end=false or train.save_final=false, without checkpoint.interval), "
                                 "so there is no state to train on from: start afresh in another train.output_dir "
                                 "(model.init_from can take an export of its weights)")
            # else a train.steps=0 run, which trained nothing: starting it again from step 1 is continuing it exactly
        elif finished and (start.state is None or done >= steps):
            if log:
                logger.info("run %s is finished (step %d of train.steps=%d; its checkpoints: %s): nothing to do. To "
                            "train on, raise train.steps with train.allow_changes=[train.steps], or start afresh in "
                            "another train.output_dir", run_dir.path, start.record.step, steps,
                            start.checkpoint or "none")
            return False
        if start.state is None and start.previous_config is not None and log:
            logger.info("train.resume=auto: the run in %s wrote no checkpoint (under %s); its config matches, "
                        "starting it again from step 1", run_dir.path, run_dir.ckpt_root)
        return True


def plan_run(cfg: TrainConfig, world: World) -> RunPlan:
    """Every check that needs no process group, in one pass, before anything is written: the config, what
    train.resume continues (read-only), the model, tokenizer and layout (``check_config``)."""
    validate(cfg)  # bad input is one line before anything else
    run_dir = run_path(cfg)
    ckpt_root = checkpoint_root(cfg, run_dir)
    check_outputs_apart(cfg, run_dir)
    if cfg.checkpoint.export_hf_at_end and cfg.train.output_dir is not None:
        check_export_dir(run_dir / "hf")  # before the run directory's own check (find_start): the precise refusal
    start = find_start(cfg.train.resume, cfg.train.discard_newer, ckpt_root, run_dir)  # the run directory checked
    if cfg.checkpoint.dir:
        check_checkpoint_dir(ckpt_root, run_dir)
    spec, model_args, tokenizer, vision = check_config(cfg, world.size, start.resumed_config)
    run_config, resolved = recorded_config(cfg, spec, model_args, tokenizer)
    dp = parallelisms.resolve_sizes(cfg.parallel, world.size).dp
    return RunPlan(cfg, resolved, spec, model_args, tokenizer, vision, device.device_type(cfg.train.device), world,
                   run_dir, ckpt_root, start, run_config,
                   cfg.train.local_batch_size * cfg.train.grad_accum_steps * dp)


def check_config(cfg: TrainConfig, world_size: int, resumed: dict[str, Any] | None = None
                 ) -> tuple[models.ModelSpec, Any, str | None, VisionData | None]:
    """The model, its tokenizer and the layout: the spec and hyper-parameters this start builds (``resumed``: the
    config of the checkpoint being resumed), the tokenizer and what the loader needs of the vision tower
    (``model_vision``), checked against each other, the export and the layout of ``world_size`` processes.
    (``validate`` has checked each group on its own.)"""
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
    check_mtp_trains(model_args, cfg.data.seq_len)
    return spec, model_args, tokenizer, model_vision(cfg.model.init_from, model_args, tokenizer)


def model_vision(init_from: str | None, model_args: Any, tokenizer: str | None) -> VisionData | None:
    """What the loader needs of the model's vision tower to read chats with images (``data=jsonl``): the image
    processor (``init_from``'s preprocessor_config.json, else Qwen3.5's published settings at the tower's sizes) and
    the tokenizer's image token ids, which must be the ones the model looks for. None without a tower (text only:
    images in the data are refused by name) or without a tokenizer of ours (pre-tokenized ids hold no images)."""
    tower = getattr(model_args, "vision_config", None)
    if tower is None or tokenizer is None:
        return None
    vision = vision_for_model(init_from, tokenizer, patch_size=tower.patch_size,
                              temporal_patch_size=tower.temporal_patch_size, merge_size=tower.spatial_merge_size)
    ours = {"image_token_id": vision.image_token_id, "vision_start_token_id": vision.vision_start_token_id,
            "vision_end_token_id": vision.vision_end_token_id}
    wrong = [f"model.arch.vision_config.{k}={getattr(tower, k)} (the {tokenizer} tokenizer's: {v})"
             for k, v in ours.items() if getattr(tower, k) != v]
    if wrong:
        raise ValueError(f"{', '.join(wrong)}: the model would not find the images the data puts in its windows; "
                         "set the tokenizer's ids")
    return vision


def resolve_model(cfg: TrainConfig) -> tuple[models.ModelSpec, Any]:
    """The family's spec and hyper-parameters: the preset, or the config.json of model.init_from (model=hf); the
    vision tower's only with model.vision=true (``models.build_args``)."""
    m = cfg.model
    if m.init_from is None:
        return models.get_spec(m.model_type), models.build_args(m.model_type, dict(m.arch), m.vision)
    hf_config = read_hf_config(m.init_from)
    if m.name == "hf":  # model.arch keys given as well (a training knob: mtp_loss_weight) apply over config.json's
        model_type, args = args_from_hf_config(hf_config, m.vision)
        if m.model_type is not None and m.model_type != model_type:
            raise ValueError(f"model.model_type={m.model_type} with model=hf, whose model_type is config.json's: "
                             f"{m.init_from}/config.json is {model_type}; leave model.model_type unset (null)")
        given = models.arch_given(m.arch)
        if given:
            args = models.build_args(model_type, {**dataclasses.asdict(args), **given}, m.vision)
        return models.get_spec(model_type), args
    # The text models compared (a tower that differs is refused by name when its weights load)
    for line in preset_differences(models.build_args(m.model_type, dict(m.arch)), hf_config):
        logger.warning("model=%s differs from %s/config.json: %s", m.name, m.init_from, line)
    return models.get_spec(m.model_type), models.build_args(m.model_type, dict(m.arch), m.vision)


def as_resumed(cfg: TrainConfig, resumed: dict[str, Any] | None) -> TrainConfig:
    """A resume of a model.init_from run builds its model without init_from (the checkpoint alone holds the weights,
    and init_from may be gone): a preset as on a fresh start; model=hf the architecture its checkpoint records (which
    config.json gave), with every model.arch key given now applied over it, and its model_type and tokenizer unless
    given. What this builds is then compared with the checkpoint's config (``check_resumed_config``): a change is
    listed, or refused unless train.allow_changes names it, as for any other key."""
    saved = (resumed or {}).get("model", {})
    m = cfg.model
    if m.init_from is None or not saved.get("model_type"):
        return cfg
    tokenizer = saved["tokenizer"] if m.tokenizer == "auto" else m.tokenizer  # auto: init_from's, as resolved then
    if m.name != "hf":
        return dataclasses.replace(cfg, model=dataclasses.replace(m, init_from=None, tokenizer=tokenizer))
    return dataclasses.replace(cfg, model=dataclasses.replace(
        m, init_from=None, model_type=m.model_type or saved["model_type"], tokenizer=tokenizer,
        arch={**saved["arch"], **models.arch_given(m.arch)}))


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


def check_mtp_trains(args: Any, seq_len: int) -> None:
    """The MTP head predicts token t+2 at position t of a window of seq_len + 1 tokens: a window of seq_len 1 has no
    such pair, so the head would train on nothing (its loss 0 at every step)."""
    weight = getattr(args, "mtp_loss_weight", 0.0)
    if weight > 0 and seq_len < 2:
        raise ValueError(f"model.arch.mtp_loss_weight={weight} trains the MTP head on token t+2 of each position, and "
                         f"data.seq_len={seq_len} windows ({seq_len + 1} tokens) hold no such pair: the head would "
                         "train on nothing; set data.seq_len >= 2, or model.arch.mtp_loss_weight=0")


def check_outputs_apart(cfg: TrainConfig | DictConfig, run_dir: Path) -> None:
    """The run directory and checkpoint.dir apart from the inputs (``training.run_dir.check_apart``)."""
    outputs = {"train.output_dir": run_dir, "checkpoint.dir": cfg.checkpoint.dir}
    check_apart({key: Path(path) for key, path in outputs.items() if path}, input_paths(cfg))


def check_resumed_config(state: dict[str, Any], run_config: dict[str, Any], global_batch: int, allow: list[str],
                         source: Path, log: bool) -> None:
    """List every config difference from the checkpoint at start-up; refuse those that change what is trained
    unless train.allow_changes names them."""
    if "config" not in state:
        logger.warning("checkpoint %s records no config (written before configs were recorded): not compared", source)
        return
    saved_batch = state.get("global_batch_size")
    saved = upgrade_config(flat_config(state["config"], saved_batch))
    for key, default in schema_defaults(saved.get("model.model_type")).items():
        if not any(k.startswith(key + ".") for k in saved):  # a group saved as its keys (model.arch.vision_config.*)
            saved.setdefault(key, default)  # keys added since the checkpoint: their defaults are what it did
    current = flat_config(run_config, global_batch if saved_batch is not None else None)
    for line in check_resume_config(saved, current, allow, str(source)):
        if log:
            logger.info("config differs from checkpoint %s: %s", source, line)


# ------------------------------------------------------------------------------------------ where the run writes
def run_path(cfg: TrainConfig) -> Path:
    """The run directory this start writes into (train.output_dir, else Hydra's), refused if it is a file."""
    path = Path(cfg.train.output_dir if cfg.train.output_dir is not None else hydra_run_dir())
    if path.exists() and not path.is_dir():
        raise ValueError(f"train.output_dir={path} is a file, not a directory; name a directory")
    return path


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


def rerunnable_config(run_config: dict[str, Any]) -> str:
    """The resolved config as a Hydra primary config: ``python train.py --config-path <abs run dir> --config-name
    config`` trains the same run again (in a new train.output_dir, or continued with train.resume=auto)."""
    hydra_section = OmegaConf.load(REPO / "conf" / "config.yaml").hydra
    rerun = OmegaConf.create({"defaults": ["schema", "_self_"], **run_config, "hydra": hydra_section})
    return (f"{CONFIG_HEADER} --config-path <absolute path of this directory> --config-name config "
            "[train.output_dir=<new dir> | train.resume=auto]\n" + OmegaConf.to_yaml(rerun))


def on_rank0(dims: parallelisms.ParallelDims, decide: Callable[[], Any]) -> Any:
    """``decide()`` on rank 0, its result (or its error) on every rank: one decision about the run directory, taken
    before rank 0 writes into it."""
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


# ------------------------------------------------------------------------------------------ the first writes
def begin_run(plan: RunPlan, run_dir: RunDir, is_writer: bool) -> MetricLogger:
    """Only now, with the resume known good, is anything of the run directory rewritten: config.yaml, the
    record (and what train.discard_newer discards), the metric sinks."""
    from core.files import atomic_write_text

    if is_writer:
        atomic_write_text(run_dir.path / "config.yaml", rerunnable_config(plan.run_config))
    resumed = plan.start.checkpoint is not None
    run_dir.begin(plan.first_step - 1, is_writer)
    return MetricLogger(run_dir.path, plan.cfg.logging, enabled=is_writer,
                        keep_until=plan.first_step - 1 if resumed else None, run_config=plan.run_config)


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def startup_lines(plan: RunPlan, dims: parallelisms.ParallelDims, param_counts: tuple[int, int], kernels: Any,
                  run_dir: Path) -> list[str]:
    """What this run is, in a few lines at the top of its log: model, layout, batch, kernels, where it writes."""
    cfg, total, active = plan.resolved, *param_counts
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
        f"global batch: {plan.global_batch} sequences x {cfg.data.seq_len} tokens = {plan.tokens_per_step:,} "
        f"tokens per step (local {cfg.train.local_batch_size} x grad accum {cfg.train.grad_accum_steps} x dp {dims.dp})"
        f", {cfg.train.steps} steps",
        f"kernels: {', '.join(fast) if fast else 'torch reference for every op'}",
        f"run directory: {run_dir.resolve()}",
    ]


def startup_warnings(plan: RunPlan, model: torch.nn.Module, run_dir: RunDir, world_size: int) -> list[str]:
    """Settings that are valid but probably not meant, too little disk for what the run saves, and a layout the
    planner does not see fit this device's memory: one line each."""
    cfg = plan.cfg
    return (config_warnings(plan.resolved) + space_warnings(save_needs(cfg, model, run_dir.path, run_dir.ckpt_root))
            + fit_warnings(plan.resolved, world_size, device.capacity_gib(plan.dev_type)))


def save_needs(cfg: TrainConfig, model: torch.nn.Module, run_dir: Path, ckpt_root: Path) -> dict[Path, int]:
    """What this run's saves write where (``training.checkpoint.space_warnings``): a checkpoint (periodic, or the
    last step's before the final weights) and the final weights."""
    checkpoint_bytes, weights_bytes = save_sizes(model, getattr(torch, cfg.optim.state_dtype))
    c, steps = cfg.checkpoint, cfg.train.steps
    saves_checkpoint = steps > 0 and ((c.interval > 0 and steps >= c.interval) or (cfg.train.save_final and c.at_end))
    return {ckpt_root: checkpoint_bytes if saves_checkpoint else 0,
            run_dir: weights_bytes if cfg.train.save_final else 0}


# ------------------------------------------------------------------------------------------ Hydra's side
def job_config(cfg: TrainConfig) -> TrainConfig:
    """This Hydra job's config: a multirun job with train.output_dir set gets its own directory under it (Hydra's
    sweep directory is train.output_dir: conf/config.yaml)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode == RunMode.MULTIRUN and cfg.train.output_dir is not None:
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, output_dir=hydra_cfg.runtime.output_dir))
    return cfg


def check_primary_yaml(argv: list[str], script_dir: Path = REPO) -> None:
    """The primary config a command line names (``--config-path DIR --config-name NAME``: a run's config.yaml),
    read as Hydra will read it, before Hydra does: YAML it cannot read (a syntax error, a ``!!python`` tag, which
    OmegaConf's safe loader never constructs) is one line (``training.launch.one_line_errors``), not Hydra's
    traceback. A relative DIR is Hydra's: relative to the script's directory."""

    def option(*names: str) -> str | None:  # Hydra's spellings: --config-path DIR, --config-path=DIR, -cp DIR
        for i, arg in enumerate(argv):
            for name in names:
                if arg == name and i + 1 < len(argv):
                    return argv[i + 1]
                if arg.startswith(name + "="):
                    return arg[len(name) + 1:]
        return None

    config_path, config_name = option("--config-path", "-cp"), option("--config-name", "-cn")
    if config_path is None or config_name is None or config_path.startswith("pkg://"):
        return
    name = config_name if config_name.endswith((".yaml", ".yml")) else config_name + ".yaml"
    path = script_dir / config_path / name
    if path.is_file():
        OmegaConf.load(path)


def primary_config(hydra_cfg) -> tuple[str, str]:
    """The primary config's directory (conf/ or a run directory) and name."""
    primary = next(s for s in hydra_cfg.runtime.config_sources if s.provider == "main")
    return primary.path.removeprefix("file://"), hydra_cfg.job.config_name


def hydra_run_dir_of(output_dir: str | None, default: str, kind: str = "run", _root_: DictConfig | None = None
                     ) -> str:
    """conf/config.yaml's Hydra run (and, ``kind`` sweep, sweep) directory: train.output_dir when set, else
    ``default``. Checked
    here, before Hydra makes it and its log file (one line, not Hydra's traceback): a file there, a directory over
    an input (``_root_``: the whole config), a directory that is neither empty nor a run (``check_run_dir``; not a
    sweep's, which holds its jobs), and a run's config.yaml re-run from a directory its train.output_dir no
    longer names (it would start a run at the old place)."""
    from hydra.core.hydra_config import HydraConfig

    with one_line_errors():
        if output_dir is not None and Path(output_dir).exists() and not Path(output_dir).is_dir():
            raise ValueError(f"train.output_dir={output_dir} is a file, not a directory; name a directory")
        if output_dir is not None and _root_ is not None:
            check_outputs_apart(_root_, Path(output_dir))
        if output_dir is not None and kind != "sweep":  # a sweep's directory holds its jobs' (plan_run checks each)
            check_run_dir(Path(output_dir))
        if HydraConfig.initialized():
            hydra_cfg = HydraConfig.get()
            given = any(o.lstrip("+~").split("=")[0] == "train.output_dir" for o in hydra_cfg.overrides.task)
            check_not_moved(Path(primary_config(hydra_cfg)[0]), None if given else output_dir)
    return default if output_dir is None else output_dir
