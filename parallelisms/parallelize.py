"""Apply a model's parallel plan, declared by its ``ModelSpec``, for the configured backend.

fsdp2, inside-out as fully_shard requires: EP -> expert FSDP -> block FSDP -> root -> prefetch chains.
ddp: one replica per rank, gradients all-reduced. none: the model as it is, or under bf16 the one-rank stand-in
for FSDP2's units and mixed precision (``parallelisms.compute_copy``). Activation checkpointing and (cp > 1)
Ulysses context parallelism apply to all three.
"""

from __future__ import annotations

import fnmatch

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from core.device import local_device
from core.torch_compat import replicate
from models import ModelSpec
from models.moe import GroupedExperts
from parallelisms.activation_checkpoint import apply_activation_checkpointing
from parallelisms.compute_copy import ComputeCopies, install_compute_copies, unit_slots
from parallelisms.compile import apply_compile
from parallelisms.config import BackendConfig, ParallelConfig
from parallelisms.context_parallel import apply_context_parallel
from parallelisms.dims import ParallelDims
from parallelisms.dispatchers import DispatcherConfig, dispatcher_class
from parallelisms.expert_parallel import apply_expert_parallel, replace_single_rank_fsdp
from parallelisms.loopback import BACKEND as LOOPBACK


def parallelize_qwen3_moe(model: nn.Module, spec: ModelSpec, dims: ParallelDims, cfg: ParallelConfig,
                          param_dtype: torch.dtype, reduce_dtype: torch.dtype,
                          dispatcher: DispatcherConfig | None = None, compile_blocks: bool = False) -> nn.Module:
    """Shard or replicate ``model`` (usually still on the meta device) in place and return it: the one plan for
    both Qwen MoE families, Qwen3-MoE and Qwen3.5-MoE, read from ``spec`` (the family's ``ModelSpec``: its blocks,
    experts, embeddings, final modules, MTP head), so nothing here names a family's modules. ``dispatcher``:
    the ``dispatcher`` group, which EP (parallel.ep_size > 1) installs on every experts module; None: the group's
    default. ``compile_blocks``: train.compile."""
    apply_activation_checkpointing([block for _, block in spec.named_blocks(model) + spec.named_vision_blocks(model)],
                                   cfg.activation_checkpoint)
    if dims.cp > 1:
        apply_context_parallel(model, dims.mesh("cp"))
    if compile_blocks:  # AC -> compile -> FSDP (torchtitan's order); hook-free pieces: every backend's hooks stay eager
        apply_compile(model, spec)
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    if cfg.backend.name == "none":
        if param_dtype != torch.float32:  # fp32: the reference, untouched
            _apply_one_rank_plan(model, spec, mp_policy)
        return model
    if cfg.backend.name == "ddp":
        # The composable DDP: parameter names stay unchanged (no "module." prefix), and DDP itself is built
        # lazily at the first forward, after the meta model has been materialised and initialised. Parameters
        # stay in their dtype: bf16 compute under DDP is the caller's autocast.
        return replicate(model, device_id=local_device(dims.mesh("world").device_type))
    return _apply_fsdp2_plan(model, spec, dims, cfg.backend, dispatcher or DispatcherConfig(), mp_policy)


def expert_shard_dim(efsdp: int, ep: int, num_experts: int) -> int:
    """Dim the expert FSDP shards: the experts (0) unless efsdp x ep exceeds them, when some ranks would
    hold no expert at all; then the rows of each expert (1)."""
    return 1 if efsdp * ep > num_experts else 0


def _units(model: nn.Module, spec: ModelSpec) -> list[nn.Module]:
    """The fsdp2 plan's units, without the prefetch chains: embeddings, each block, each block's experts, the
    final norm and LM head, a vision tower's blocks and the rest of it, the root (whatever the others do not hold)."""
    blocks = [block for _, block in spec.named_blocks(model)]
    return [model.get_submodule(spec.embeddings), *blocks, *(b.get_submodule(spec.experts) for b in blocks),
            *(model.get_submodule(name) for name in spec.final), *vision_units(model, spec), model]


def vision_units(model: nn.Module, spec: ModelSpec) -> list[nn.Module]:
    """A vision tower's FSDP units, in the order its forward runs them: the tower (its patch embedding, positions
    and merger: gathered for its whole forward), then each of its blocks; none for a model without one."""
    tower = spec.vision_tower(model)
    return [] if tower is None else [tower, *(block for _, block in spec.named_vision_blocks(model))]


def _apply_one_rank_plan(model: nn.Module, spec: ModelSpec, mp_policy: MixedPrecisionPolicy) -> None:
    """One process under bf16: the numerics of ``_apply_fsdp2_plan`` over one rank (each unit's parameters read
    in param_dtype, its floating inputs cast, gradients in reduce_dtype; no divide: the world is one rank), with
    each compute copy cast once per optimizer step and no FSDP copies. Parameters stay plain fp32 tensors, as
    without it: checkpoints load across both, and across layouts as before. A tied LM head is cast once."""
    units = _units(model, spec)
    copies = ComputeCopies(mp_policy.param_dtype)
    for unit in units:
        install_compute_copies(unit, unit_slots(unit, set(units) - {unit}), copies, mp_policy, divide_factor=1.0)


def _apply_fsdp2_plan(model: nn.Module, spec: ModelSpec, dims: ParallelDims, backend: BackendConfig,
                      dispatcher: DispatcherConfig, mp_policy: MixedPrecisionPolicy) -> nn.Module:
    blocks = [block for _, block in spec.named_blocks(model)]  # an MTP head's last: it runs after the model's
    experts = [block.get_submodule(spec.experts) for block in blocks]
    embeddings = model.get_submodule(spec.embeddings)
    final = [model.get_submodule(name) for name in spec.final]
    # A tied LM head is the embedding's parameter: one unit holds both (a parameter belongs to one unit), gathered
    # from the embedding's forward through the head's backward.
    tied = bool({id(p) for p in embeddings.parameters()} & {id(p) for m in final for p in m.parameters()})
    fsdp_kwargs = dict(mp_policy=mp_policy, reshard_after_forward=backend.reshard_after_forward)

    if dims.ep > 1:  # a dispatcher's limits (mc2's) fail now, naming the fix, not deep inside its first op
        dispatcher_class(dispatcher.name).check_layout(dims.ep, experts[0].num_experts, model.args.num_experts_per_tok)
    shard_experts(experts, dims, backend, mp_policy, dispatcher)  # 1. EP, 2. expert FSDP

    # 3. Outer FSDP units over the model mesh, whose default average over dp x cp ranks matches grad_scale.
    # fully_shard skips parameters that a nested fully_shard already manages: the experts keep theirs. Experts
    # left out of FSDP (one-rank expert mesh) must be skipped by name, or the blocks would shard them.
    bare = {p for e in experts if not isinstance(e, FSDPModule) for p in e.parameters()}
    outer = dict(mesh=dims.mesh("fsdp"), ignored_params=_ignored_params(model, backend.fsdp_ignored_modules) | bare,
                 **fsdp_kwargs)
    # The final norm and LM head run last in forward and first in backward: resharding them in between
    # would only all-gather them again at once.
    last = {**outer, "reshard_after_forward": False}
    if tied:
        fully_shard([embeddings, *final], **last)
    else:
        fully_shard(embeddings, **outer)
    for block in blocks:
        fully_shard(block, **outer)
    # A vision tower (its blocks, then the rest of it), sharded like the blocks; under CP every cp rank runs it whole.
    tower = vision_units(model, spec)
    for unit in tower[1:] + tower[:1]:
        fully_shard(unit, **outer)
    head = spec.mtp_head(model)
    if head is not None:
        # An MTP head's own fc and norms (its block is a unit above) are a unit of their own, not the root's: the
        # root's output is a dataclass, in which torch 2.11's FSDP finds no tensor to hang its pre-backward hook
        # on, so the root's parameters, resharded after forward, would stay freed for the head's backward.
        fully_shard(head, **outer)
    if not tied:
        fully_shard(final, **last)
    # 4. Root: whatever no unit holds, and the one place FSDP coordinates the lazy init and streams from.
    fully_shard(model, **outer)

    # 5. Explicit prefetch: the host sync before each EP all-to-all (split sizes) stalls the CPU, so FSDP's
    # implicit prefetch, issued as the CPU reaches each unit, would come too late. Each unit starts the
    # all-gather of the next one, a MoE block's together with its experts (if FSDP holds them); backward is the
    # mirror image.
    units: list[list[FSDPModule]] = [[embeddings], *([b, e] if isinstance(e, FSDPModule) else [b]
                                                     for b, e in zip(blocks, experts)),
                                [embeddings if tied else final[0]]]
    for unit, after in zip(units, units[1:]):
        unit[0].set_modules_to_forward_prefetch(after)
    for unit, before in zip(units[::-1], units[::-1][1:]):
        unit[0].set_modules_to_backward_prefetch(before)
    # The tower runs first (its tokens go into the embeddings' output): in forward each of its units gathers the next,
    # its last block the embeddings. Backward is left to FSDP's own order: a frozen tower runs none.
    for unit, after in zip(tower, tower[1:] + [embeddings]):
        unit.set_modules_to_forward_prefetch([after])
    return model


def shard_experts(experts: list[GroupedExperts], dims: ParallelDims, backend: BackendConfig,
                  mp_policy: MixedPrecisionPolicy, dispatcher: DispatcherConfig | None = None) -> None:
    """Steps 1 and 2 of the plan for the experts of every block: EP (``dispatcher``, None: the group's default), then
    expert FSDP (or, over a one-rank expert mesh, ``replace_single_rank_fsdp``: the experts are no FSDP unit,
    and an outer fully_shard must ignore their parameters)."""
    num_experts = experts[0].num_experts
    # 1. EP: each ep rank keeps E/ep experts; the dispatcher all-to-alls the tokens to them.
    if dims.ep > 1:
        for module in experts:
            apply_expert_parallel(module, dims.mesh("ep"), dispatcher or DispatcherConfig())

    # 2. Expert FSDP over efsdp (replicated over edp and expert_cp). Expert gradients are not averaged over
    # this mesh alone: each rank's expert gradient already sums, through the all-to-all backward, the
    # contributions of all ep ranks' tokens, so the sum over the expert FSDP mesh covers all dp x cp ranks
    # and must be divided by dp x cp = grad_scale (the default would divide by edp x efsdp x cp).
    if expert_fsdp_is_one_rank(dims):
        # One rank in the expert FSDP mesh (world = ep: ep2 on 2, ep8 on 8): FSDP would only cast, copy and
        # divide each step. Do its cast and divide by hand, with its numerics and its parameter layout
        # (checkpoints load across both), casting each weight once per optimizer step. Safe under grad
        # accumulation (each backward divides its own gradient, as FSDP's reduce-scatter does), AC (the
        # recompute reads the same copy) and compile (the experts stay eager); cp > 1 never gets here (the
        # experts are replicated over expert_cp).
        copies = ComputeCopies(mp_policy.param_dtype)
        for module in experts:
            replace_single_rank_fsdp(module, dims.mesh("expert_fsdp"), mp_policy, dims.grad_scale, copies)
        return
    shard_dim = expert_shard_dim(dims.efsdp, dims.ep, num_experts)
    if shard_dim:
        _check_even(experts[0], shard_dim, dims.efsdp)
    # gloo has no PREMUL_SUM (how FSDP applies a custom divide factor), nor has the loopback world where torch's
    # ReduceOp does not give its factor to Python (torch 2.11: core.torch_compat.premul_sum_factor): sum, then
    # divide. Only where a reduce-scatter runs: with efsdp = 1 FSDP already divides in its copy, and forcing the sum
    # as well would divide twice (2.11-2.13).
    force_sum = dims.efsdp > 1 and dist.get_backend(dims.mesh("world").get_group()) in ("gloo", LOOPBACK)
    for module in experts:
        fully_shard(module, mesh=dims.mesh("expert_fsdp"), shard_placement_fn=lambda _: Shard(shard_dim),
                    mp_policy=mp_policy, reshard_after_forward=backend.reshard_after_forward)
        module.set_gradient_divide_factor(dims.grad_scale)
        module.set_force_sum_reduction_for_comms(force_sum)


def expert_fsdp_is_one_rank(dims: ParallelDims) -> bool:
    """Whether the expert FSDP mesh (edp x efsdp x expert_cp) has one rank, as when EP spans the world: then
    ``shard_experts`` leaves the experts out of FSDP."""
    return dims.ep > 1 and dims.edp * dims.efsdp * dims.cp == 1


def _check_even(experts: nn.Module, dim: int, efsdp: int) -> None:
    """FSDP2 shards a dim other than 0 only evenly."""
    for name, param in experts.named_parameters(recurse=False):
        if param.shape[dim] % efsdp:
            raise ValueError(f"experts.{name} {tuple(param.shape)}: efsdp={efsdp} > experts per ep rank, so FSDP "
                             f"shards dim {dim}, which must be divisible by efsdp; fix: parallel.efsdp_size "
                             f"dividing {param.shape[dim]}")


def _ignored_params(model: nn.Module, globs: list[str]) -> set[nn.Parameter]:
    """Parameters of the modules matching ``parallel.backend.fsdp_ignored_modules`` (FQN globs). They stay
    whole on every rank and no collective touches their gradients, so they must be frozen."""
    ignored: set[nn.Parameter] = set()
    for glob in globs:
        matched = [(name, m) for name, m in model.named_modules() if fnmatch.fnmatchcase(name, glob)]
        if not matched:
            raise ValueError(f"parallel.backend.fsdp_ignored_modules: {glob!r} matches no module of the model")
        for name, module in matched:
            trainable = [n for n, p in module.named_parameters() if p.requires_grad]
            if trainable:
                raise NotImplementedError(
                    f"parallel.backend.fsdp_ignored_modules: {name} has trainable parameters {trainable}; "
                    "gradient synchronisation of FSDP-ignored parameters is not implemented: freeze them")
            ignored.update(module.parameters())
    return ignored
