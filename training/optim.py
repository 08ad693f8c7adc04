"""AdamW (torch's, or with bf16 moments) and the learning-rate schedules: warmup, then cosine, warmup-stable-decay
or constant."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from kernels.optim.adamw import adamw_step_
from parallelisms import may_drop_rows
from parallelisms.compute_copy import copies_to_write, copies_written
from parallelisms.grad_norm import clip_coefficient, scale_grads_
from training.config import OptimConfig


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (norm weights and other vectors are not decayed): ``AdamW`` below
    with bf16 moments, and by default on CUDA with fp32 ones too (its Triton pass takes the clip in); otherwise
    torch's, fused (``optim.fused=true``) or foreach. Frozen parameters (model.freeze_vision) are left out: no
    state. A vision tower's parameters (``model.visual``, where trained) have groups of their own, at optim.lr x
    optim.vision_lr_scale (the groups' ``lr_scale``, which the schedule keeps)."""
    params = [p for p in model.parameters() if p.requires_grad]
    visual = getattr(model, "visual", None)
    vision = {id(p) for p in visual.parameters()} if visual is not None else set()
    text = [p for p in params if id(p) not in vision]
    tower = [p for p in params if id(p) in vision]
    scaled = {"lr": cfg.lr * cfg.vision_lr_scale, "lr_scale": cfg.vision_lr_scale}
    groups = [
        {"params": [p for p in text if p.ndim >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in text if p.ndim < 2], "weight_decay": 0.0},
        *([{"params": [p for p in tower if p.ndim >= 2], "weight_decay": cfg.weight_decay, **scaled},
           {"params": [p for p in tower if p.ndim < 2], "weight_decay": 0.0, **scaled}] if tower else []),
    ]
    kind = adamw_kind(cfg, params[0].device.type)
    if kind == "project":
        return AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                     state_dtype=getattr(torch, cfg.state_dtype))
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=kind == "torch_fused")


def adamw_kind(cfg: OptimConfig, device_type: str) -> str:
    """Which AdamW: ``project`` (``AdamW`` below: bf16 moments, and fp32 ones on CUDA unless ``optim.fused`` is
    set, where one Triton pass per parameter also applies the clip: no pass over the gradients; measured faster
    than torch's fused AdamW, docs/results.md#one-gpu-qwen3-30b-a3b-shapes, its row), ``torch_fused``
    (``optim.fused=true``) or ``torch_foreach`` (``optim.fused=false``, and elsewhere by default: the reference's
    several passes are slower than foreach's on a CPU)."""
    if cfg.state_dtype == "bfloat16" or (cfg.fused is None and device_type == "cuda"):
        return "project"
    return "torch_fused" if cfg.fused else "torch_foreach"


class GatedOptimizer(torch.optim.Optimizer):
    """The interface of an optimizer that takes a step's decisions on the device: ``step(gate=...)`` applies the clip
    coefficient and whether the update applies from device tensors (so the update is queued before the step's host
    read: ``QueuedUpdate``), ``step(grad_scale=...)`` the clip alone, and ``rewind`` takes back the host state of a
    gated step that did not apply."""

    def step(self, closure=None, grad_scale: float = 1.0, gate: torch.Tensor | None = None):
        raise NotImplementedError

    def rewind(self) -> None:
        raise NotImplementedError


class AdamW(GatedOptimizer):
    """Decoupled-weight-decay Adam with the moments (exp_avg, exp_avg_sq) stored in ``state_dtype``, the update in
    fp32 on the parameters' own dtype (fp32 master weights): ``kernels.optim.adamw.adamw_step_``, one parameter at a
    time (one Triton pass on CUDA). State keys and step counters as torch.optim.AdamW's (a host tensor per parameter,
    read without a device sync), so the checkpoints of the two load into each other; the moments load converted to
    the dtype of the optimizer that reads them.

    Rounding the moments to nearest, not stochastically: each step moves exp_avg by (1 - beta1) and exp_avg_sq by
    (1 - beta2) of their gap to g and g^2, which must stay above bf16's half ulp (2^-9 to 2^-8 relative) or the
    update rounds away; training.config refuses betas closer to 1 than 1 - 2^-8, and the default 0.95 moves
    exp_avg_sq by 5%, 13 to 26 times that. Stochastic rounding would make the result depend on a random stream
    that a resume would have to restore, for no gain at those betas."""

    def __init__(self, params, lr: float, betas: tuple[float, float], eps: float, weight_decay: float = 0.0,
                 state_dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.state_dtype = state_dtype

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's, which casts every floating-point state to its parameter's dtype, then the moments back to
        ``state_dtype`` (a float32-state checkpoint's rounded to nearest)."""
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    state[key] = state[key].to(self.state_dtype)

    @torch.no_grad()
    def step(self, closure=None, grad_scale: float = 1.0, gate: torch.Tensor | None = None):
        """One update of every parameter with a gradient, on the gradients times ``grad_scale`` (the clip
        coefficient: applied inside the update, the ``.grad`` tensors are left as they are). ``gate``: instead, the
        coefficient and whether the update applies, on the device (``queue_step``); where it does not, the
        parameters and moments stay as they were and the caller calls ``rewind``."""
        if closure is not None:
            raise NotImplementedError("AdamW.step takes no closure")
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            updated = [p for p in group["params"] if p.grad is not None]
            copies = copies_to_write(updated)  # written beside the update: the next forward casts none of them
            for p in updated:
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, dtype=self.state_dtype)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=self.state_dtype)
                state["step"] += 1
                adamw_step_(_local(p), _local(p.grad), _local(state["exp_avg"]), _local(state["exp_avg_sq"]),
                            lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                            weight_decay=group["weight_decay"], step=float(state["step"]), grad_scale=grad_scale,
                            p_copy=copies.get(p), gate=gate)
            copies_written(list(copies))
        return None

    def rewind(self) -> None:
        """After a gated step the device did not apply: the host step counters of the parameters it would have
        updated (those with a gradient still) back by one, so the next update's bias correction is the same."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.state[p]["step"] -= 1


def clipped_step(optimizer: torch.optim.Optimizer, model: nn.Module, max_norm: float, norm: float) -> None:
    """The optimizer's step on the gradients (of total norm ``norm``) clipped to ``max_norm`` (<= 0: not clipped).
    ``AdamW`` above takes the clip coefficient into its update (no pass over the gradients); torch's optimizers get
    the gradients scaled in place first, by one ``_foreach_mul_``, which a step within the norm skips."""
    coef = clip_coefficient(max_norm, norm) if max_norm > 0 else 1.0
    if isinstance(optimizer, GatedOptimizer):
        optimizer.step(grad_scale=coef)
        return
    if coef < 1:
        scale_grads_(model, coef)
    optimizer.step()


def queue_step(optimizer: torch.optim.Optimizer, max_norm: float, norm: torch.Tensor, losses: torch.Tensor) -> bool:
    """Queue the optimizer's step before the host has read the step's gradient norm and losses, where the
    optimizer can take the decision on the device (``AdamW`` above): clipped to ``max_norm`` (<= 0: not clipped)
    and applied only if ``norm`` and every one of ``losses`` are finite. The device then goes from backward to the
    update without waiting for the host to read, decide and launch. False, nothing queued, for an optimizer that is
    not a ``GatedOptimizer`` (torch's): ``clipped_step`` after the read. After the read, a step that was not finite
    calls ``optimizer.rewind()``."""
    if not isinstance(optimizer, GatedOptimizer):
        return False
    coef = clip_coefficient(max_norm, norm) if max_norm > 0 else torch.ones_like(norm)
    applies = torch.isfinite(losses).all() & torch.isfinite(norm)
    optimizer.step(gate=torch.stack([coef, applies.to(coef.dtype)]))
    return True


class Update:
    """A train step's update, in the two phases around the step's one host read (train.py): ``queue`` before the
    read, ``resolve`` after it with what the read found. This one decides on the host: after the read, the step is
    clipped with the norm it read and applied where finite (``clipped_step``). ``build_update`` picks, once."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: nn.Module, max_norm: float) -> None:
        self.optimizer, self.model, self.max_norm = optimizer, model, max_norm

    def queue(self, norm: torch.Tensor, losses: torch.Tensor) -> None:
        """Before the read, with the step's gradient norm and losses on the device."""

    def resolve(self, finite: bool, norm: float) -> None:
        """After the read: whether the losses and the norm were finite, and the norm."""
        if finite:
            clipped_step(self.optimizer, self.model, self.max_norm, norm)


class QueuedUpdate(Update):
    """Queued before the read, clipped and gated on the device (``queue_step``): the device goes from backward to the
    update, and on to the next forward, without waiting for the host to read, decide and launch. A step the device
    did not apply (not finite) is rewound after the read."""

    def queue(self, norm: torch.Tensor, losses: torch.Tensor) -> None:
        queue_step(self.optimizer, self.max_norm, norm, losses)

    def resolve(self, finite: bool, norm: float) -> None:
        if not finite:
            self.optimizer.rewind()


def build_update(optimizer: torch.optim.Optimizer, model: nn.Module, max_norm: float) -> Update:
    """``QueuedUpdate`` for a ``GatedOptimizer`` (training.optim.AdamW, the CUDA default), unless the model's
    dispatcher may drop rows (dispatcher=capacity): the host learns of that only after the read, and such a step must
    not be applied. Else the host's ``Update``."""
    if isinstance(optimizer, GatedOptimizer) and not may_drop_rows(model):
        return QueuedUpdate(optimizer, model, max_norm)
    return Update(optimizer, model, max_norm)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard (a view: in-place updates reach the DTensor)."""
    return t.to_local() if isinstance(t, DTensor) else t


# train.nonfinite=skip stops at this many skipped steps in a row (a run of fewer steps: when all of them are). A
# skipped step changes neither the weights nor the optimizer state, so a step that fails because of them (a weight
# holding an Inf, moments overflowed by a huge update) fails again at every later step, whatever the data: a run
# would skip to its end and be recorded as finished. A bad batch or two in a row is what skipping is for; five is past
# that, and costs five steps' time.
MAX_SKIPPED_IN_A_ROW = 5


class SkippedSteps:
    """Counts train.nonfinite=skip's skipped steps in a row; past the bound (``MAX_SKIPPED_IN_A_ROW``) the run
    stops, naming the first non-finite tensor (``first_nonfinite``) or the loss."""

    def __init__(self, total_steps: int) -> None:
        self.limit = max(1, min(MAX_SKIPPED_IN_A_ROW, total_steps))
        self.in_a_row = 0

    def count(self, step: int, skipped: bool, model: nn.Module, optimizer: torch.optim.Optimizer, loss: float,
              grad_norm: float) -> None:
        """After each step (collective when the bound is reached: every rank skips the same steps)."""
        self.in_a_row = self.in_a_row + 1 if skipped else 0
        if self.in_a_row < self.limit:
            return
        raise FloatingPointError(f"{self.in_a_row} steps in a row skipped (steps {step - self.in_a_row + 1} to "
                                 f"{step}; train.nonfinite=skip stops at {self.limit}): "
                                 f"{nonfinite_report(model, optimizer, loss, grad_norm)}; a skipped step changes "
                                 "nothing, so every later step would be skipped too. Resume from a checkpoint before "
                                 "the first skipped step (train.resume=<it> train.discard_newer=true), with a lower "
                                 "optim.lr or optim.grad_clip")


def nonfinite_report(model: nn.Module, optimizer: torch.optim.Optimizer, loss: float, grad_norm: float) -> str:
    """What is non-finite, the first of: a weight, an optimizer state, a gradient (by name; collective), else the
    loss or the gradient norm."""
    found = first_nonfinite(model, optimizer)
    if found is not None:
        return found
    if not math.isfinite(loss):
        return f"the loss is {loss} with every weight, optimizer state and gradient finite (the data or the forward)"
    return f"the gradient norm is {grad_norm} with every weight and the loss finite (an overflow in backward)"


def first_nonfinite(model: nn.Module, optimizer: torch.optim.Optimizer) -> str | None:
    """``parameter <name> holds inf`` for the first parameter (in the model's order) holding a NaN or Inf, else the
    first one's optimizer state, else its gradient (where gradients are kept); None: all finite. Collective under a
    process group: a rank holds a shard of each, and every rank names the same one."""
    named = list(model.named_parameters())
    if not named:
        return None

    def flags(tensors: list[torch.Tensor]) -> torch.Tensor:  # (holds a NaN, holds an Inf) of this rank's shards
        local = [_local(t) for t in tensors]
        return torch.stack([torch.stack([t.isnan().any() for t in local]).any(),
                            torch.stack([t.isinf().any() for t in local]).any()]) if local else \
            torch.zeros(2, dtype=torch.bool, device=_local(named[0][1]).device)

    def states(p: nn.Parameter) -> dict[str, torch.Tensor]:
        return {k: v for k, v in optimizer.state.get(p, {}).items()
                if isinstance(v, torch.Tensor) and v.is_floating_point() and v.ndim}

    # [3, P, 2]: weights, optimizer states, gradients; (nan, inf). The same shape on every rank, whatever it holds.
    found_3P2 = torch.stack([torch.stack([flags([p]) for _, p in named]),
                             torch.stack([flags(list(states(p).values())) for _, p in named]),
                             torch.stack([flags([p.grad] if p.grad is not None else []) for _, p in named])]).float()
    if dist.is_initialized():
        dist.all_reduce(found_3P2, op=dist.ReduceOp.MAX)
    bad = found_3P2.amax(dim=2).flatten().nonzero().flatten().tolist()
    if not bad:
        return None
    kind, i = divmod(bad[0], len(named))
    name, p = named[i]
    keys = [k for k, v in states(p).items() if not torch.isfinite(_local(v)).all()]  # this rank's view
    what = (f"parameter {name}", f"optimizer state {'/'.join(keys) + ' ' if keys else ''}of {name}",
            f"gradient of {name}")[kind]
    values = " and ".join(v for v, flag in zip(("nan", "inf"), found_3P2[kind, i].tolist()) if flag)
    return f"{what} holds {values}" + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else "")


# Decay shapes: the multiplier's fraction of (1 - min_lr_ratio) left at decay progress p in [0, 1].
DECAY = {
    "linear": lambda p: 1 - p,
    "cosine": lambda p: 0.5 * (1 + math.cos(math.pi * p)),
    "sqrt": lambda p: 1 - math.sqrt(p),  # "1-sqrt" cooldown of Hägele et al. 2024 (arXiv:2405.18392)
}


def lr_multiplier(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Multiplier of the peak lr after ``step`` updates, a pure function of the step (so a resume follows it
    exactly): linear warmup over ``warmup_steps``, then ``cfg.schedule``: cosine decays over the remaining steps;
    wsd holds the peak, then decays with ``decay_shape`` over the last ``decay_fraction`` of ``total_steps``
    (MiniCPM's warmup-stable-decay); constant holds the peak. Both decays reach min_lr_ratio at ``total_steps``."""
    if step < cfg.warmup_steps:
        return (step + 1) / (cfg.warmup_steps + 1)
    if cfg.schedule == "constant":
        return 1.0
    if cfg.schedule == "cosine":
        shape, start, length = "cosine", cfg.warmup_steps, max(total_steps - cfg.warmup_steps, 1)
    else:  # wsd
        shape, length = cfg.decay_shape, cfg.decay_fraction * total_steps
        start = total_steps - length
    progress = min(max((step - start) / length, 0.0), 1.0)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * DECAY[shape](progress)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int, position: int = 0
                    ) -> LambdaLR:
    """The schedule at ``position`` (updates taken so far; a resume passes the checkpoint's), always from the
    current config: a resume with a deliberately changed optim.lr or train.steps follows the new schedule from its
    first step, lr = optim.lr x lr_multiplier(position) with the new schedule keys and total."""
    for group in optimizer.param_groups:
        group["initial_lr"] = cfg.lr * group.get("lr_scale", 1.0)  # the vision tower's: optim.vision_lr_scale
    return LambdaLR(optimizer, lambda step: lr_multiplier(step, cfg, total_steps), last_epoch=position - 1)


class Schedule:
    """The lr schedule as a checkpoint component (``training.train_state``): its state is its position, the updates
    taken so far; a resume rebuilds it there from the current config (``build_scheduler``)."""

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int) -> None:
        self._build = lambda position: build_scheduler(optimizer, cfg, total_steps, position)
        self.scheduler = self._build(0)

    @property
    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def step(self) -> None:
        self.scheduler.step()

    def state_dict(self) -> dict[str, int]:
        return {"last_epoch": self.scheduler.last_epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.scheduler = self._build(state["last_epoch"])
