"""The structured config: one dataclass per Hydra group, registered as the schema of conf/config.yaml,
so a misspelt key fails at start-up. Cross-field checks live in ``validate`` and run before any
process group exists."""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

import models
from core.config import execution, execution_keys
from kernels.config import KernelConfig, validate_kernel_config
from parallelisms.config import ParallelConfig
from parallelisms.dispatchers.base import validate_dispatcher_config
from parallelisms.dispatchers.config import DispatcherConfig
from parallelisms.float8 import FLOAT8_MODES
from training.checkpoint import CheckpointConfig
from training.data.config import DataConfig, glob_root, token_paths, validate_data_config
from training.data.hf_tokenizer import CHOICES as TOKENIZER_CHOICES
from training.launch import LaunchConfig, simulation_errors


@dataclass
class ModelConfig:
    name: str = execution(default="qwen3_moe_debug")  # the preset's name; what it builds is compared
    model_type: str | None = "qwen3_moe"  # None with model=hf: taken from init_from's config.json
    # The vocabulary the data is tokenized with and the export writes: qwen3 | qwen3_5 (training.data.tokenizer), auto
    # (model.init_from's tokenizer files; model=hf) or none (pre-tokenized data of another vocabulary)
    tokenizer: str = "qwen3"
    init_from: str | None = execution(default=None)  # a Hugging Face directory (config.json + safetensors) to load weights from
    arch: dict[str, Any] = field(default_factory=dict)  # the family's hyper-parameters (models/<family>/args.py)
    # Build and train the vision tower (model.arch.vision_config; model=hf: config.json's), for data with images;
    # false: the text model alone (a source's tower is carried to the export untouched)
    vision: bool = False
    freeze_vision: bool = False  # the vision tower (its merger too) gets no gradient and no optimizer state


SCHEDULES = ("cosine", "wsd", "constant")  # optim.schedule
DECAY_SHAPES = ("linear", "cosine", "sqrt")  # optim.decay_shape


@dataclass
class OptimConfig:
    name: str = "adamw"
    lr: float = 3e-3
    # After warmup_steps of linear warmup: cosine (decay over every later step) | wsd (warmup-stable-decay: the peak,
    # then a decay over the last decay_fraction of train.steps) | constant (the peak); see training.optim
    schedule: str = "cosine"
    min_lr_ratio: float = 0.1  # cosine and wsd decay to lr * min_lr_ratio
    warmup_steps: int = 10
    decay_fraction: float = 0.2  # wsd: the share of train.steps that decays, in (0, 1]
    decay_shape: str = "sqrt"  # wsd: linear | cosine | sqrt (1 - sqrt(progress), Hägele et al. 2024)
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global gradient norm; <= 0 disables clipping
    # None: training.optim.AdamW on CUDA (Triton), torch's foreach elsewhere; true / false: torch's fused / foreach
    # (float32 state only)
    fused: bool | None = None
    # The AdamW moments' dtype: float32 (torch's AdamW) | bfloat16 (half the state, fp32 master weights and update:
    # training.optim.AdamW)
    state_dtype: str = "float32"
    vision_lr_scale: float = 1.0  # the vision tower's and its merger's learning rate: optim.lr times this


@dataclass
class TrainSection:
    steps: int = 100  # optimizer steps; 0 logs the first batch's loss (step 0) and updates nothing
    # A resume compares the global batch (local_batch_size x grad_accum_steps x dp), not its factors
    local_batch_size: int = execution(default=4)  # sequences per rank per micro-batch
    grad_accum_steps: int = execution(default=1)
    seed: int = 0
    device: str = execution(default="auto")  # auto | cpu | cuda | npu
    mixed_precision: str = execution(default="auto")  # auto (bf16 on accelerators, fp32 on CPU) | bf16 | fp32
    # none | rowwise: FP8 GEMMs with dynamic rowwise scales for the blocks' projections and the routed experts
    # (parallelisms/float8.py; CUDA sm_90+, needs torchao)
    float8: str = execution(default="none")  # like mixed_precision: how the same weights are computed
    # torch.compile each decoder block but its routed experts (parallelisms/compile.py); the same weights and maths
    compile: bool = execution(default=False)
    output_dir: str | None = execution(default=None)  # run directory; None: Hydra's run directory
    save_final: bool = execution(default=True)  # write the final weights to <run_dir>/model.safetensors
    resume: str = execution(default="none")  # none | auto (newest complete checkpoint of the run, if any) | a checkpoint directory
    # train.resume=<an older checkpoint of this run>: discard the run's newer checkpoints, metric lines and final
    # weights (removed once the resume has loaded); without it such a resume is refused
    discard_newer: bool = execution(default=False)
    nonfinite: str = execution(default="stop")  # a non-finite loss or gradient norm: stop (raise with a report) | skip (no update)
    gc_every: int = execution(default=50)  # steps between manual Python GCs (automatic GC off during the loop); 0: automatic GC
    # Validation loss (val_loss) every eval_every steps and at the last (0: off), over the first eval_batches global
    # batches of the data held out by data.val_fraction
    eval_every: int = 0
    eval_batches: int = 4
    # On resume: keys (or whole groups, e.g. data) deliberately changed from the checkpoint's config, which
    # would otherwise refuse to resume (see check_resume_config)
    allow_changes: list[str] = execution(default_factory=list)


@dataclass
class LoggingConfig:
    log_every: int = 1  # steps between metric lines (metrics.jsonl, tensorboard, wandb)
    # Steps between records of each MoE layer's per-expert token shares in <run_dir>/routing.jsonl (plotted by
    # scripts/plot_routing.py); 0: off. A record costs what a log step's MoE metrics do, shared when both fall due.
    routing_every: int = 10
    all_ranks: bool = False  # also write every other rank's log to <run_dir>/logs/rank_<r>.log (rank 0: train.log)
    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "qwen-moe"
    wandb_mode: str = "offline"  # offline | online
    # 0: off; profile steps profile_step .. profile_step+profile_steps-1 (trace + summary in <run_dir>/profile)
    profile_step: int = 0
    profile_steps: int = 2
    # false: record device kernels alone (CUDA), so the host runs unslowed and the idle figure is the step's own
    profile_host: bool = True


@dataclass
class TrainConfig:
    """Every group; those marked ``execution`` say how the run executes, so a resume may change any key in them
    (``core.config``), as it may the keys so marked in the other groups."""
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = execution(default_factory=ParallelConfig)
    dispatcher: DispatcherConfig = execution(default_factory=DispatcherConfig)
    kernel_config: KernelConfig = execution(default_factory=KernelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainSection = field(default_factory=TrainSection)
    logging: LoggingConfig = execution(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = execution(default_factory=CheckpointConfig)
    launch: LaunchConfig = execution(default_factory=LaunchConfig)


def to_train_config(node: DictConfig) -> TrainConfig:
    """The typed config of a composed Hydra node. Hydra's ``+key=value`` can add keys the schema lacks, which
    ``OmegaConf.to_object`` would drop silently: reject them by name instead (``model.arch`` is free-form
    and checked against the model family)."""
    _reject_unknown_keys(TrainConfig, node, "")
    return OmegaConf.to_object(node)


def _reject_unknown_keys(schema: type, node: DictConfig, path: str) -> None:
    types = typing.get_type_hints(schema)
    unknown = sorted(set(node) - set(types))
    if unknown:
        raise ValueError(f"{path or 'config'} has unknown keys {unknown}; known: {sorted(types)}")
    for key in node:
        if dataclasses.is_dataclass(types[key]):
            _reject_unknown_keys(types[key], node[key], f"{path}.{key}".lstrip("."))


def register_schema() -> None:
    ConfigStore.instance().store(name="schema", node=TrainConfig)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


# Values no run should take, refused at start-up (``validate``):
# optim.lr: AdamW moves each weight by about lr a step whatever the gradient's scale (its update m / (sqrt(v) + eps) is
# about +-1), so from lr = 1 a step moves every weight by more than the weights' own size (initialised at std 0.02,
# the norms at 1): it rewrites the model rather than trains it. Published LLM runs train at 1e-5 .. 1e-2.
MAX_LR = 1.0
MIN_LR = 2.0**-149  # the smallest float32: below it an lr is 0 in the float32 update, which then moves nothing
# train.steps: the longest published pre-training runs take about 1e6 optimizer steps; 1e9 is a thousand times that,
# and 116 days even at 10 ms a step (the tiny debug model on a CPU; a real model's step takes seconds).
MAX_STEPS = 10**9
# Tokens trained (train.steps x the global batch x data.seq_len): 1e15 is 25 times the largest published pre-training
# corpus (Qwen3's 36T tokens), 32 years at a million tokens a second.
MAX_TOKENS = 10**15


def non_finite(node: Any, key: str = "") -> Iterator[tuple[str, float]]:
    """(dotted key, value) of every nan or infinite float of a config (a dataclass, dict or list, walked): no key
    means anything by one (nan passes no comparison, so a check written as a range would let it through)."""
    if isinstance(node, float):
        if not math.isfinite(node):
            yield key, node
    elif dataclasses.is_dataclass(node):
        for f in dataclasses.fields(node):
            yield from non_finite(getattr(node, f.name), f"{key}.{f.name}".lstrip("."))
    elif isinstance(node, dict):
        for name, value in node.items():
            yield from non_finite(value, f"{key}.{name}".lstrip("."))
    elif isinstance(node, (list, tuple)):
        for i, value in enumerate(node):
            yield from non_finite(value, f"{key}[{i}]")


def validate(cfg: TrainConfig) -> None:
    """Every single-field and cross-field check that needs no process group, with the key in the message."""
    t, o = cfg.train, cfg.optim
    _check(t.steps >= 0, f"train.steps={t.steps} must be >= 0")
    _check(t.steps <= MAX_STEPS, f"train.steps={t.steps:,} is absurd: more than {MAX_STEPS:,} optimizer steps (a "
           "thousand times the longest published pre-training runs, about 1e6 steps; 116 days even at 10 ms a step): "
           "set train.steps to the steps the run should train")
    _check(t.local_batch_size > 0, f"train.local_batch_size={t.local_batch_size} must be positive")
    _check(t.grad_accum_steps > 0, f"train.grad_accum_steps={t.grad_accum_steps} must be positive")
    _check(t.mixed_precision in ("auto", "bf16", "fp32"),
           f"train.mixed_precision={t.mixed_precision!r} must be auto, bf16 or fp32")
    _check(t.float8 in FLOAT8_MODES,
           f"train.float8={t.float8!r} is unknown; choose one of {', '.join(FLOAT8_MODES)}")
    _check(t.float8 == "none" or t.device not in ("cpu", "npu"),
           f"train.float8={t.float8} needs FP8 matrix units (a CUDA GPU, sm_90+); train.device={t.device} has none: "
           "set train.float8=none")
    _check(t.float8 == "none" or t.mixed_precision != "fp32",
           f"train.float8={t.float8} computes from bf16 (torch's rowwise FP8 GEMMs write bf16), not "
           "train.mixed_precision=fp32: set train.mixed_precision=auto or bf16, or train.float8=none")
    _check(0 <= t.seed < 2**32, f"train.seed={t.seed} must be in [0, 2**32) (numpy's and torch's seed range)")
    _check(not t.discard_newer or t.resume not in ("none", "auto"),
           f"train.discard_newer=true discards the steps after the checkpoint that train.resume names, and "
           f"train.resume={t.resume}: name the checkpoint to go back to (train.resume=<run>/checkpoints/step_...)")
    _check(t.nonfinite in ("stop", "skip"), f"train.nonfinite={t.nonfinite!r} must be stop or skip")
    _check(t.gc_every >= 0, f"train.gc_every={t.gc_every} must be >= 0 (0: Python's automatic GC)")
    _check(t.eval_every >= 0, f"train.eval_every={t.eval_every} must be >= 0 (0: no validation)")
    _check(t.eval_batches > 0, f"train.eval_batches={t.eval_batches} must be positive")
    _check(not t.eval_every or cfg.data.val_fraction > 0,
           f"train.eval_every={t.eval_every} needs held-out data: set data.val_fraction (e.g. 0.01)")
    _check(cfg.checkpoint.interval >= 0, f"checkpoint.interval={cfg.checkpoint.interval} must be >= 0 (0: off)")
    _check(cfg.checkpoint.keep_last >= 1, f"checkpoint.keep_last={cfg.checkpoint.keep_last} must be >= 1")
    _check(cfg.launch.nproc_per_node >= 1, f"launch.nproc_per_node={cfg.launch.nproc_per_node} must be >= 1")
    _check(cfg.launch.simulate_world >= 0, f"launch.simulate_world={cfg.launch.simulate_world} must be >= 0 (0: off)")
    writes = {key: off for key, on, off in (
        ("train.save_final", t.save_final, "false"), ("checkpoint.interval", cfg.checkpoint.interval > 0, "0"),
        ("checkpoint.export_hf_at_end", cfg.checkpoint.export_hf_at_end, "false"),
        ("train.resume", t.resume != "none", "none")) if on}
    for error in simulation_errors(cfg.launch, writes, cfg.dispatcher.name):
        raise ValueError(error)
    _check(o.name == "adamw", f"optim.name={o.name!r}: only adamw is implemented")
    _check(o.lr > 0, f"optim.lr={o.lr} must be positive")
    _check(o.grad_clip == o.grad_clip, f"optim.grad_clip={o.grad_clip} must be a number: the largest gradient norm "
                                       "(> 0), or <= 0 for no clipping")  # NaN, unequal to itself, would clip nothing
    for key, value in non_finite(cfg):  # optim.lr=inf, optim.betas[0]=nan, model.arch.router_z_loss_coef=nan, ...
        raise ValueError(f"{key}={value} must be a finite number" + (
            " (optim.grad_clip <= 0: no clipping)" if key == "optim.grad_clip" else ""))
    _check(o.lr < MAX_LR, f"optim.lr={o.lr:g} is too large: AdamW moves every weight by about lr a step whatever the "
           f"gradient's scale, so from lr={MAX_LR:g} a step moves each by more than the weights' own size (initialised "
           "at std 0.02, norms at 1) and rewrites the model rather than trains it; LLMs train at 1e-5 to 1e-2")
    _check(o.lr >= MIN_LR, f"optim.lr={o.lr:g} is below the smallest float32 ({MIN_LR:.2g}): the update computes in "
           "float32, where it is 0, so nothing would train")
    _check(o.warmup_steps <= MAX_STEPS, f"optim.warmup_steps={o.warmup_steps:,} is absurd: more than {MAX_STEPS:,} "
           "steps (see train.steps); the lr would stay near 0 for the whole run")
    _check(o.weight_decay >= 0, f"optim.weight_decay={o.weight_decay} must be >= 0 (0: no decay): a negative decay "
           "grows every matrix each step")
    _check(o.lr * o.weight_decay < 1, f"optim.lr={o.lr:g} x optim.weight_decay={o.weight_decay:g} >= 1: AdamW scales "
           "every matrix by 1 - lr x weight_decay each step, which would zero or flip it; lower optim.weight_decay")
    _check(all(0 <= b < 1 for b in o.betas), f"optim.betas={list(o.betas)}: each must be in [0, 1) (beta1 = 1 never "
           "moves the first moment off 0, so nothing trains; beta2 = 1 divides by zero in the bias correction)")
    _check(o.eps > 0, f"optim.eps={o.eps} must be positive: an expert no token reached has a zero gradient, and its "
           "update 0 / (sqrt(0) + eps) is nan at eps = 0")
    tokens = t.steps * t.local_batch_size * t.grad_accum_steps * cfg.data.seq_len  # x dp more: this is the least
    _check(tokens <= MAX_TOKENS, f"train.steps={t.steps:,} trains at least {tokens:.3g} tokens (x train."
           f"local_batch_size={t.local_batch_size} x train.grad_accum_steps={t.grad_accum_steps} x data.seq_len="
           f"{cfg.data.seq_len}, and x dp): more than 1e15, 25 times the largest published pre-training corpus (36T "
           "tokens), 32 years at a million tokens a second; set train.steps to the steps the run should train")
    _check(0 <= o.min_lr_ratio <= 1, f"optim.min_lr_ratio={o.min_lr_ratio} must be in [0, 1]")
    _check(o.warmup_steps >= 0, f"optim.warmup_steps={o.warmup_steps} must be >= 0")
    _check_state_dtype(o)
    _check_schedule(o, t.steps)
    _check(cfg.logging.log_every > 0, f"logging.log_every={cfg.logging.log_every} must be positive")
    _check(cfg.logging.routing_every >= 0, f"logging.routing_every={cfg.logging.routing_every} must be >= 0 (0: off)")
    _check(cfg.logging.wandb_mode in ("offline", "online"),
           f"logging.wandb_mode={cfg.logging.wandb_mode!r} must be offline or online")
    _check(cfg.logging.profile_step >= 0, f"logging.profile_step={cfg.logging.profile_step} must be >= 0 (0: off)")
    _check(cfg.logging.profile_step <= t.steps,
           f"logging.profile_step={cfg.logging.profile_step} is past the last step (train.steps={t.steps})")
    _check(cfg.logging.profile_steps >= 1, f"logging.profile_steps={cfg.logging.profile_steps} must be >= 1")
    m = cfg.model
    _check(m.model_type is not None or m.init_from is not None,
           "model.model_type is unset: pick a preset (model=qwen3_moe_debug) or give model.init_from=<hf dir>")
    _check(m.tokenizer in TOKENIZER_CHOICES,
           f"model.tokenizer={m.tokenizer!r} is unknown; choose one of {', '.join(TOKENIZER_CHOICES)}")
    _check(m.tokenizer != "auto" or m.init_from is not None,
           "model.tokenizer=auto takes the tokenizer of model.init_from's directory, and model.init_from is unset: "
           "name the tokenizer (model.tokenizer=qwen3 or qwen3_5)")
    _check_vision(cfg)
    validate_data_config(cfg.data)
    validate_kernel_config(cfg.kernel_config)
    validate_dispatcher_config(cfg.dispatcher)


STATE_DTYPES = ("float32", "bfloat16")  # optim.state_dtype
BF16_MIN_STEP = 2**-8  # the largest relative half ulp of bf16: a moment moving by less rounds back where it was


def input_paths(cfg: TrainConfig | DictConfig) -> list[tuple[str, Path]]:
    """(key, path) of each input a fresh start reads from the file system: model.init_from and the data's files
    (a glob: the directory it searches; a data.path that is no path, as a hub dataset's name, is left out).
    ``cfg``: the TrainConfig, or the composed config where Hydra resolves its run directory."""
    paths = [("model.init_from", cfg.model.init_from)] if cfg.model.init_from else []
    paths += [(key, str(glob_root(path))) for key, path in token_paths(cfg.data) if path]
    return [(key, Path(path)) for key, path in paths if Path(path).exists()]


def _check_state_dtype(o: OptimConfig) -> None:
    _check(o.state_dtype in STATE_DTYPES,
           f"optim.state_dtype={o.state_dtype!r} is unknown; choose one of {', '.join(STATE_DTYPES)}")
    _check(o.state_dtype != "bfloat16" or o.fused is None,
           f"optim.fused={o.fused} picks torch's AdamW kernel, which keeps fp32 moments; with "
           "optim.state_dtype=bfloat16 leave optim.fused unset")
    _check(o.state_dtype != "bfloat16" or all(1 - b >= BF16_MIN_STEP for b in o.betas),
           f"optim.betas={list(o.betas)} move the bf16 moments by less than bf16 resolves (1 - beta < 2^-8): the "
           "updates would round away; use betas <= 0.996 or optim.state_dtype=float32")


def _check_vision(cfg: TrainConfig) -> None:
    """model.vision, model.freeze_vision and optim.vision_lr_scale together (model.arch.vision_config is the
    family's: ``models.with_vision``)."""
    m, scale = cfg.model, cfg.optim.vision_lr_scale
    _check(scale > 0, f"optim.vision_lr_scale={scale} must be positive (model.freeze_vision=true trains no tower)")
    _check(m.vision or not m.freeze_vision, "model.freeze_vision=true freezes the vision tower, and model.vision=false "
           "builds none: set model.vision=true, or leave model.freeze_vision unset")
    _check(m.vision or scale == 1, f"optim.vision_lr_scale={scale} scales the vision tower's learning rate, and "
           "model.vision=false builds none: set model.vision=true, or leave optim.vision_lr_scale at 1")
    _check(not m.freeze_vision or scale == 1, f"optim.vision_lr_scale={scale} scales the learning rate of a vision "
           "tower that model.freeze_vision=true does not train: leave one of them unset")


def _check_schedule(o: OptimConfig, steps: int) -> None:
    """optim.schedule and its wsd keys (decay_fraction, decay_shape are read by wsd only)."""
    _check(o.schedule in SCHEDULES, f"optim.schedule={o.schedule!r} is unknown; choose one of {', '.join(SCHEDULES)}")
    _check(o.decay_shape in DECAY_SHAPES,
           f"optim.decay_shape={o.decay_shape!r} is unknown; choose one of {', '.join(DECAY_SHAPES)}")
    _check(0 < o.decay_fraction <= 1, f"optim.decay_fraction={o.decay_fraction} must be in (0, 1] (the share of "
           "train.steps that wsd decays over)")
    decay_start = (1 - o.decay_fraction) * steps
    _check(o.schedule != "wsd" or steps == 0 or o.warmup_steps <= decay_start,
           f"optim.warmup_steps={o.warmup_steps} runs into the wsd decay, which starts at step {decay_start:g} "
           f"(the last optim.decay_fraction={o.decay_fraction} of train.steps={steps}): lower optim.warmup_steps "
           "or optim.decay_fraction")


def config_warnings(cfg: TrainConfig) -> list[str]:
    """Settings that are valid but probably not meant (a short smoke run may mean them), one line each."""
    o, steps = cfg.optim, cfg.train.steps
    lines = ([f"optim.warmup_steps={o.warmup_steps} is more than train.steps={steps}: the lr rises for the whole run "
              f"and never reaches optim.lr={o.lr:g}; lower optim.warmup_steps (or raise train.steps)"]
             if 0 < steps < o.warmup_steps else [])
    if cfg.train.compile:
        lines.append(COMPILE_VERDICT)
    if cfg.model.arch.get("router_force_balance"):
        lines.append("model.arch.router_force_balance=true: every router sends its tokens round robin (equal expert "
                     "loads, a benchmark setting): the routing is not learned, so this run trains no usable model")
    return lines


# What train.compile measured (docs/results.md): said at start-up so nobody waits on a compile for nothing.
COMPILE_VERDICT = ("train.compile=true: measured no faster than eager on one H200 (torch 2.11, 4-layer Qwen3-30B-A3B, "
                   "4 x 4,096 tokens: 99,627 vs 102,034 tokens/s; 235B shapes, 1 layer: 80,348 vs 80,585): the "
                   "blocks compile around their eager experts, and the eager path's kernels are already fused; "
                   "it costs a minute of compilation at start")


GLOBAL_BATCH_KEY = "train.global_batch_size"  # local_batch_size x grad_accum_steps x dp: compared, not a key


def flat_config(tree: dict[str, Any], global_batch_size: int | None = None) -> dict[str, Any]:
    """Dotted key -> leaf value of a config as a dict (lists are leaves), plus the derived global batch."""
    flat: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict) and node:
            for key, value in node.items():
                walk(value, f"{prefix}{key}.")
        else:
            flat[prefix[:-1]] = list(node) if isinstance(node, tuple) else node

    walk(tree, "")
    if global_batch_size is not None:
        flat[GLOBAL_BATCH_KEY] = global_batch_size
    return flat


def schema_defaults(model_type: str | None) -> dict[str, Any]:
    """Every key's default, flat: the schema's, and model.arch's from the family's hyper-parameters. A key added
    after a checkpoint was written defaults to what that run did (a new knob starts off), so a resume reads the
    checkpoint's missing keys as these."""
    flat = {k: v for k, v in flat_config(dataclasses.asdict(TrainConfig())).items() if v != {}}  # not model.arch
    if model_type is not None:
        args_cls = models.get_spec(model_type).args_cls
        flat.update({f"model.arch.{f.name}": f.default for f in dataclasses.fields(args_cls)})
    return flat


def _covers(prefixes: typing.Iterable[str], key: str) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def check_resume_config(saved: dict[str, Any], current: dict[str, Any], allow: list[str], source: str
                        ) -> list[str]:
    """Lines describing each difference between the checkpoint's flat config and the current one; raises
    ValueError when one changes what is trained and train.allow_changes does not name it."""
    unknown = [a for a in allow if not any(_covers([a], key) for key in current)]
    _check(not unknown, f"train.allow_changes names {unknown}, which are not config keys or groups")
    missing = "<absent>"
    changed = [k for k in sorted(set(saved) | set(current)) if saved.get(k, missing) != current.get(k, missing)]
    lines = [f"{k}: {saved.get(k, missing)!r} -> {current.get(k, missing)!r}" for k in changed]
    free = list(execution_keys(TrainConfig))  # what a resume may change: the fields marked execution
    refused = [k for k in changed if not _covers(free, k) and not _covers(allow, k)]
    _check(not refused, f"resuming from {source} would change what is trained: "
           + "; ".join(line for k, line in zip(changed, lines) if k in refused)
           + f". Keep the checkpoint's values, or make the change deliberate with train.allow_changes=[{','.join(refused)}]")
    return lines
