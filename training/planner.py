"""Plan a run without running it: per-GPU memory, the bytes of every collective of a step, a predicted step time.

Pure arithmetic on a model built on the meta device (its parameter shapes and the per-token sizes its modules
declare, ``models/footprint.py``) and the layout's sizes (``parallelisms.resolve_sizes``), for any number of GPUs.
``scripts/plan.py`` prints it; ``docs/scaling.md`` says what it assumes and where it was checked.

Collective bytes are each call's input buffer, the part a rank keeps included, summed over all ranks and calls of a
step; so for the EP all-to-all they do not depend on routing (every routed row travels once each way, and the
rows one rank receives are rows another sent). What crosses a link does depend on it: the step time assumes
balanced routing, (P - 1) / P of an all-to-all's input leaving the GPU.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

import models
from kernels.loss.linear_cross_entropy import default_chunk_rows
from models.footprint import NO_ACTIVATIONS, LayerActivations
from parallelisms import ParallelSizes, expert_shard_dim, resolve_sizes, validate_parallel_config
from parallelisms.dispatchers import DISPATCHERS, DispatcherConfig, dispatcher_class
from parallelisms.dispatchers.base import LayerShape, Traffic, token_ranks
from parallelisms.links import (GPUS_PER_NODE, INTERNODE_GB_S, NVLINK_GB_S, LinkConfig, all_to_all_seconds,
                                ring_seconds)
from training.config import TrainConfig, validate

GiB = 2**30
FP32, INT64 = 4, 8


@dataclass
class PlanConfig:
    """``plan.*`` overrides of scripts/plan.py: the machine planned for."""

    gpus: int = 0  # world size planned for; 0: launch.nproc_per_node if set above 1, else the smallest world
    gpus_per_node: int = GPUS_PER_NODE
    nvlink_gb_s: float = NVLINK_GB_S  # per GPU and direction inside a node (H200: NVLink 4, 900 GB/s both ways)
    internode_gb_s: float = INTERNODE_GB_S  # per GPU and direction between nodes: one 400 Gb/s NIC per GPU
    # The all-to-all inside a node; 0: nvlink_gb_s, the link's rate (scripts/simulate.py's sim.a2a_gb_s is NCCL's
    # calibrated rate, parallelisms/links.py)
    a2a_gb_s: float = 0.0
    # Achievable bf16 rate on causal FLOPs: 4 layers of Qwen3-30B-A3B on one H200 (350 TFLOP/s as MFU counts them:
    # docs/results.md#other-measured-costs) without its optimizer time, and with the masked half of attention not
    # counted.
    tflops: float = 350.0
    # Device memory copy rate (the optimizer's time), measured on an H200: docs/results.md#other-measured-costs.
    hbm_gb_s: float = 4260.0
    capacity_gib: float = 80.0  # per GPU: what "fits" means
    # A model with its vision tower (model.vision=true): the share of a window's tokens that are image tokens (each
    # spatial_merge_size^2 patches the tower runs) and the patches of one image (attention within it): what the
    # tower's memory and time are planned for. The data decides both; these are a 1024 x 1024 image (64 x 64
    # patches of 16) per 4,096 tokens of chat.
    image_token_share: float = 0.25
    image_patches: int = 4096
    sweep: bool = False  # scripts/plan.py: try every candidate layout (candidate_layouts) instead of the configured one


@dataclass(frozen=True)
class Unit:
    """One FSDP unit's parameters on one rank: ``numel`` unsharded (under EP: this ep rank's experts), ``shard``
    the padded share this rank stores. Sharded over ``shard_mesh`` (size ``shard_size``), gradients all-reduced over
    ``replicate_mesh`` (HSDP; nothing when it has one rank)."""

    name: str
    numel: int
    shard: int
    shard_mesh: str
    shard_size: int
    replicate_mesh: str
    reshard_after_forward: bool


@dataclass(frozen=True)
class Collective:
    """One kind of collective on one mesh over a step: ``calls`` per rank, ``bytes`` summed over all ranks (each
    call's input), ``seconds`` on the links as stated, ``exposed``: not hidden behind compute."""

    kind: str  # all_gather | reduce_scatter | all_reduce | all_to_all
    mesh: str  # fsdp | mp_replicate | efsdp | edp_cp | ep | cp
    what: str
    calls: int
    bytes: int
    seconds: float
    exposed: bool


@dataclass
class Memory:
    """Per GPU, bytes; ``activations`` per checkpointing mode, ``peak`` for the configured one."""

    params: int
    grads: int
    optimizer: int
    activations: dict[str, int]
    recompute: dict[str, int]  # one layer's activations rebuilt in its backward
    routed_buffers: int  # a layer's routed-row gradients and their all-to-all copies in flight
    lm_head: int  # chunk logits in forward; the input and weight gradients it keeps for backward
    fsdp_buffers: int  # gathered units (current and prefetched), unsharded gradients, reduce-scatter input
    peak: int
    peak_phase: str


@dataclass
class Plan:
    sizes: ParallelSizes
    tokens_per_gpu: int  # per step
    units: list[Unit]
    collectives: list[Collective]
    memory: Memory
    compute_s: float
    optimizer_s: float
    step_s: float

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_gpu / self.step_s


# ----------------------------------------------------------------------------- parameters: FSDP units and shards

def _padded_shard(shape: tuple[int, ...], dim: int, ranks: int) -> int:
    """FSDP2's share of one rank: dim 0 padded up to a multiple of the ranks (other dims must divide evenly)."""
    rows = math.ceil(shape[dim] / ranks) if dim == 0 else shape[dim] // ranks
    return rows * math.prod(shape) // shape[dim]


def fsdp_units(model: nn.Module, spec: models.ModelSpec, s: ParallelSizes, backend: str = "fsdp2") -> list[Unit]:
    """The units of the fsdp2 plan (``parallelisms.parallelize``): embeddings, each block without its experts, the
    block's experts (split over ep, then sharded over efsdp), final norm + LM head (kept gathered after forward).
    ``backend`` none or ddp: the same parameters unsharded on every rank (ddp: all-reduced over the world)."""
    if backend != "fsdp2":
        return _whole_units(model, spec, s)
    outer = dict(shard_mesh="fsdp", shard_size=s.mp_shard, replicate_mesh="mp_replicate")

    def unit(name: str, params: list[torch.Tensor], **kw: Any) -> Unit:
        return Unit(name, numel=sum(p.numel() for p in params),
                    shard=sum(_padded_shard(tuple(p.shape), 0, s.mp_shard) for p in params), **{**outer, **kw})

    units = [unit("embeddings", list(model.get_submodule(spec.embeddings).parameters()), reshard_after_forward=True)]
    for i, (_, block) in enumerate(spec.named_blocks(model)):  # an MTP head's block last
        experts = block.get_submodule(spec.experts)
        expert_ids = {id(p) for p in experts.parameters()}
        units.append(unit(f"block {i}", [p for p in block.parameters() if id(p) not in expert_ids],
                          reshard_after_forward=True))
        local = [(p.shape[0] // s.ep, *p.shape[1:]) for p in experts.parameters()]
        dim = expert_shard_dim(s.efsdp, s.ep, experts.num_experts)
        units.append(Unit(f"block {i} experts", numel=sum(math.prod(shape) for shape in local),
                          shard=sum(_padded_shard(shape, dim, s.efsdp) for shape in local), shard_mesh="efsdp",
                          shard_size=s.efsdp, replicate_mesh="edp_cp", reshard_after_forward=True))
    final = [p for name in spec.final for p in model.get_submodule(name).parameters()]
    units.append(unit("final", final, reshard_after_forward=False))
    held = {id(p) for name in (spec.embeddings, *spec.final) for p in model.get_submodule(name).parameters()}
    held |= {id(p) for _, block in spec.named_blocks(model) for p in block.parameters()}
    units += vision_units(model, spec, unit)
    tower = spec.vision_tower(model)
    held |= {id(p) for p in tower.parameters()} if tower is not None else set()
    rest = [p for p in model.parameters() if id(p) not in held]  # the root's own: an MTP head's fc and norms
    if rest:  # gathered for forward and again for backward, as the blocks
        units.append(unit("root", rest, reshard_after_forward=True))
    return units


def vision_units(model: nn.Module, spec: models.ModelSpec, unit: Any) -> list[Unit]:
    """A vision tower's units (``parallelisms.parallelize.vision_units``): each block, and the rest of the tower
    (patch embedding, positions, merger), sharded like the decoder's blocks; none without a tower."""
    tower = spec.vision_tower(model)
    if tower is None:
        return []
    blocks = spec.named_vision_blocks(model)
    inner = {id(p) for _, block in blocks for p in block.parameters()}
    return [unit(f"vision block {i}", list(block.parameters()), reshard_after_forward=True)
            for i, (_, block) in enumerate(blocks)] + [
        unit("vision", [p for p in tower.parameters() if id(p) not in inner], reshard_after_forward=True)]


def _whole_units(model: nn.Module, spec: models.ModelSpec, s: ParallelSizes) -> list[Unit]:
    """parallel.backend none (one process) or ddp: the fsdp2 plan's units, each whole on every rank; under ddp
    its gradients all-reduced over the world (``replicate_mesh`` world; one rank: none)."""
    units = []
    for u in fsdp_units(model, spec, ParallelSizes(1, 1, 1, 1, 1, 1, 1, 1)):
        units.append(dataclasses.replace(u, shard=u.numel, shard_mesh="none", shard_size=1, replicate_mesh="world"))
    return units


# ----------------------------------------------------------------------------- the machine: which links a group uses

MESH_DIMS = {  # mesh -> (layout, its dims): the unflattenings of parallelisms.dims
    "fsdp": ("model", ("mp_shard",)), "mp_replicate": ("model", ("mp_replicate",)),
    "efsdp": ("expert", ("efsdp",)), "ep": ("expert", ("ep",)), "edp_cp": ("expert", ("edp", "expert_cp")),
    "cp": ("data", ("cp",)), "world": ("data", ("dp", "cp")), "none": ("data", ()),
}


def group_ranks(s: ParallelSizes, mesh: str) -> list[int]:
    """Rank 0's group on ``mesh``: every rank layout is row-major over its dims (``parallelisms.dims``)."""
    layout, dims = MESH_DIMS[mesh]
    shape = {"model": {"mp_replicate": s.mp_replicate, "mp_shard": s.mp_shard},
             "data": {"dp": s.dp, "cp": s.cp},
             "expert": dict(zip(("edp", "efsdp", "ep", "expert_cp"), s.expert_mesh_shape))}[layout]
    strides, stride = {}, 1
    for name in reversed(shape):
        strides[name], stride = stride, stride * shape[name]
    ranks = [0]
    for name in dims:
        ranks = [r + i * strides[name] for r in ranks for i in range(shape[name])]
    return ranks


def machine_links(machine: PlanConfig) -> LinkConfig:
    """The planner's machine as ``parallelisms.links`` takes it: the all-to-all inside a node at
    ``plan.a2a_gb_s`` (0: NVLink's rate)."""
    return LinkConfig(a2a_gb_s=machine.a2a_gb_s or machine.nvlink_gb_s, nvlink_gb_s=machine.nvlink_gb_s,
                      internode_gb_s=machine.internode_gb_s, gpus_per_node=machine.gpus_per_node)


def _link_seconds(kind: str, input_bytes: float, ranks: list[int], machine: PlanConfig) -> float:
    """One call on rank 0 of its group (``parallelisms.links``): a ring all-gather / reduce-scatter / all-reduce, or
    an all-to-all with balanced splits (the part bound for other nodes at the NIC's rate)."""
    links = machine_links(machine)
    if kind == "all_to_all":
        return all_to_all_seconds([input_bytes / len(ranks)] * len(ranks), ranks, 0, links)
    return ring_seconds(kind, input_bytes, ranks, links)


# ----------------------------------------------------------------------------- communication of one step

@dataclass(frozen=True)
class StepShape:
    """What one step runs on each rank."""

    tokens: int  # N: tokens of one micro-batch on this rank (local batch x seq_len / cp)
    micro_batches: int
    compute_bytes: int  # 2 for bf16 compute, 4 for fp32
    checkpoint: str  # none | full | selective | full_keep_exchange
    dispatcher: str
    moment_bytes: int = FP32  # AdamW's two moments, each (optim.state_dtype)
    backend: str = "fsdp2"  # fsdp2 | ddp | none
    patches: int = 0  # image patches a micro-batch's vision tower runs on this rank (every cp rank: the window's)
    dispatcher_cfg: DispatcherConfig | None = None  # the dispatcher group's keys (None: the defaults)
    row_len: int = 0  # positions of a sequence on this rank (seq_len / cp; 0: tokens)
    round_robin: bool = False  # model.arch.router_force_balance: the routing the simulation runs

    @property
    def exchange_forwards(self) -> int:
        """How often each block's forward exchanges run: twice under full checkpointing (the recompute sends
        again); once where the exchanges' outputs are kept (none, selective, full_keep_exchange)."""
        return 2 if self.checkpoint == "full" else 1


def layer_traffic(model: nn.Module, s: ParallelSizes, step: StepShape) -> list[Traffic]:
    """What one rank's dispatcher sends in one MoE layer of one micro-batch (``Dispatcher.traffic``); none without
    EP. A dispatcher that cannot count its traffic (``uncounted_traffic``) is refused by name."""
    if s.ep == 1:
        return []
    dispatcher = dispatcher_class(step.dispatcher)
    if dispatcher.uncounted_traffic:
        counted = ", ".join(name for name, cls in sorted(DISPATCHERS.items()) if not cls.uncounted_traffic)
        raise ValueError(f"dispatcher.name={step.dispatcher!r}: the planner counts the traffic of {counted} only "
                         f"({step.dispatcher}'s {dispatcher.uncounted_traffic})")
    args = model.args
    return dispatcher.traffic(LayerShape(
        tokens=step.tokens, top_k=args.num_experts_per_tok, num_experts=args.num_experts, ep=s.ep,
        hidden=args.hidden_size, element_bytes=step.compute_bytes, row_len=step.row_len or step.tokens,
        round_robin=step.round_robin, cfg=step.dispatcher_cfg or DispatcherConfig(step.dispatcher)))


def collectives(model: nn.Module, spec: models.ModelSpec, units: list[Unit], s: ParallelSizes, step: StepShape,
                machine: PlanConfig) -> list[Collective]:
    """Every collective of one step that moves parameters, gradients or activations: FSDP's per unit (as
    ``_apply_fsdp2_plan`` sets them: gathered for forward and again for backward unless kept, reduced once per
    micro-batch, all-reduced over the replicas under HSDP), the EP all-to-alls per MoE layer and the CP ones per
    sequence op. The loss, gradient-norm and stop-signal all-reduces (scalars) are left out."""
    out: list[Collective] = []

    def add(kind: str, mesh: str, what: str, calls: int, rank_bytes: int, exposed: bool) -> None:
        """``calls`` per micro-batch on every rank, carrying ``rank_bytes`` of input together."""
        ranks = group_ranks(s, mesh)
        if len(ranks) == 1 or calls == 0:
            return
        m = step.micro_batches
        out.append(Collective(kind, mesh, what, calls * m, rank_bytes * m * s.world_size,
                              m * _link_seconds(kind, rank_bytes, ranks, machine), exposed))

    b = step.compute_bytes
    for u in units:  # FSDP: gather before forward (and again before backward if resharded), reduce once
        gathers = (2 if u.reshard_after_forward else 1) if u.shard_size > 1 else 0
        add("all_gather", u.shard_mesh, u.name, gathers, gathers * u.shard * b, False)
        reduces = 1 if u.shard_size > 1 else 0
        add("reduce_scatter", u.shard_mesh, u.name, reduces, reduces * u.shard * u.shard_size * FP32, False)
        add("all_reduce", u.replicate_mesh, u.name, 1, u.shard * FP32, False)
    _merge_units(out)

    layers = len(spec.named_blocks(model))  # every MoE block: an MTP head's too
    forwards = step.exchange_forwards
    # What the dispatcher declares it sends per layer (parallelisms/dispatchers/base.py: traffic), in each forward
    # and in the backward; summed over the ep ranks, the rows received equal the rows sent.
    for t in layer_traffic(model, s, step):
        add("all_to_all", "ep", t.what, layers * (forwards * t.forward_calls + t.backward_calls),
            layers * (forwards * t.forward_bytes + t.backward_bytes), True)
    if s.cp > 1:
        ops = [m.cp_exchange(s.cp) for m in model.modules() if hasattr(m, "cp_exchange")]
        passes = forwards + 1  # each forward, and the backward's mirror image
        per_token = sum(x.into * b + x.into_fp32 * FP32 + x.out * b for x in ops)
        calls = sum((2 if x.into_fp32 and b != FP32 else 1) + 1 for x in ops)  # in: one per dtype; out: one
        add("all_to_all", "cp", "heads", calls * passes, passes * step.tokens * per_token, True)
        add("all_gather", "cp", "position ids", 1, step.tokens * INT64, True)  # documents: once per forward
    return out


def _merge_units(out: list[Collective]) -> None:
    """One row per kind, mesh and kind of unit: the blocks together, their experts together."""
    merged: dict[tuple[str, str, str], Collective] = {}
    for c in out:
        what = ("experts" if c.what.endswith("experts") else "blocks") if c.what.startswith("block ") else \
        "vision" if c.what.startswith("vision") else c.what
        prev = merged.get((c.kind, c.mesh, what))
        merged[c.kind, c.mesh, what] = dataclasses.replace(c, what=what) if prev is None else dataclasses.replace(
            prev, calls=prev.calls + c.calls, bytes=prev.bytes + c.bytes, seconds=prev.seconds + c.seconds)
    out[:] = merged.values()


# ----------------------------------------------------------------------------- memory of one GPU

def _routed_activations(args: Any, ep: int, dispatcher: str) -> LayerActivations:
    """Per token, the routed experts' rows (K per token) through the dispatcher. Without checkpointing: the rows in
    expert order (the first grouped GEMM's input), its [gate | up] output, the SwiGLU output and the expert outputs
    the weighted sum keeps, and under EP the dispatcher's ``extra_saved_rows`` (eager's rows in arrival order).
    Selective: the all-to-alls' outputs (under EP) and the grouped GEMMs' outputs, and the weighted sum."""
    D, I, K = args.hidden_size, args.moe_intermediate_size, args.num_experts_per_tok
    none = K * (2 * D + 3 * I) + (K * D * dispatcher_class(dispatcher).extra_saved_rows if ep > 1 else 0)
    return LayerActivations(none=none, none_fp32=0, selective=K * (2 * I + D) + (2 * K * D if ep > 1 else 0) + D,
                            selective_fp32=0)


def layer_activations(block: nn.Module, args: Any, ep: int, dispatcher: str) -> LayerActivations:
    """Per token, what one block keeps for backward without checkpointing and under selective checkpointing (plus
    the block's input, which checkpointing keeps)."""
    declared = sum((m.saved_activations() for m in block.modules() if hasattr(m, "saved_activations")),
                   NO_ACTIVATIONS)
    block_input = LayerActivations(0, 0, args.hidden_size, 0)
    return declared + _routed_activations(args, ep, dispatcher) + block_input


def memory(model: nn.Module, spec: models.ModelSpec, units: list[Unit], s: ParallelSizes, step: StepShape
           ) -> Memory:
    """The peak is the largest of four moments of a steady-state step (AdamW's state exists):

    - the LM head's forward: every block's activations, one chunk of logits, the head's kept gradients;
    - the last block's backward: every block's activations, the head's gradients, the gathered final unit, this
      block's and the prefetched block's gathered parameters, its unsharded gradients and reduce-scatter input,
      the routed rows' gradients in flight, and under checkpointing the block's rebuilt activations;
    - the embeddings' backward: every gradient, the embedding gathered, its unsharded gradient and reduce input;
    - the optimizer step: parameters, gradients and AdamW's two moments, all sharded fp32.
    """
    args, b, N = model.args, step.compute_bytes, step.tokens
    shard = sum(u.shard for u in units)
    params, grads, optimizer = shard * FP32, shard * FP32, 2 * shard * step.moment_bytes
    blocks = [block for _, block in spec.named_blocks(model)]
    per_layer = [layer_activations(block, args, s.ep, step.dispatcher) for block in blocks]

    def nbytes(elements: int, fp32: int) -> int:
        return N * (elements * b + fp32 * FP32)

    full = [nbytes(a.none, a.none_fp32) for a in per_layer]
    # full_keep_exchange: full's block input and what the layer's forward all-to-alls received (their outputs, the
    # size of what it sent)
    exchanged = sum(t.forward_bytes for t in layer_traffic(model, s, step))
    kept = {"none": full, "selective": [nbytes(a.selective, a.selective_fp32) for a in per_layer],
            "full": [N * args.hidden_size * b for _ in per_layer],
            "full_keep_exchange": [N * args.hidden_size * b + exchanged for _ in per_layer]}
    recompute = {mode: max(max(f - k, 0) for f, k in zip(full, layers)) for mode, layers in kept.items()}
    # An MTP head's own parts outside its block are never checkpointed; its rows double the LM head's.
    mtp = model.mtp.saved_activations() if model.mtp is not None else NO_ACTIVATIONS
    tower = vision_activations(model, spec, step.patches, b)  # kept from the tower's forward to its backward
    activations = {mode: sum(layers) + nbytes(mtp.none, mtp.none_fp32) + tower[mode] for mode, layers in kept.items()}
    routed_buffers = 2 * N * args.num_experts_per_tok * args.hidden_size * b

    V, D = args.vocab_size, args.hidden_size
    head_rows = N * (2 if model.mtp is not None else 1)
    head_grads = head_rows * D * b + V * D * b  # kept from forward (kernels.loss.linear_cross_entropy)
    chunk_logits = min(head_rows, default_chunk_rows(V)) * V * b
    by_name = {u.name: u for u in units}
    final, embeddings = by_name["final"], by_name["embeddings"]

    def gathered_with_grads(u: Unit) -> int:
        """A unit's gathered parameters, unsharded compute-dtype gradients and fp32 reduce-scatter input."""
        return u.numel * b * 2 + u.shard * u.shard_size * FP32

    # The last block (with its experts) gathered with its gradients, and the block before it prefetched.
    last_block = [by_name[f"block {len(blocks) - 1}"], by_name[f"block {len(blocks) - 1} experts"]]
    last = sum(gathered_with_grads(u) + u.numel * b for u in last_block)
    mode = step.checkpoint
    if step.backend != "fsdp2":
        return _unsharded_memory(params, grads, optimizer, activations[mode], recompute[mode], routed_buffers,
                                 chunk_logits + head_grads, sum(u.numel for u in [*last_block, final]) * FP32,
                                 shard * b if b != FP32 else 0, step.backend)
    # Over a one-rank expert mesh the experts are no FSDP unit: each keeps its compute copy for the whole step
    # (``expert_parallel.replace_single_rank_fsdp``), which the last block reads in place of a gather.
    expert_copies = 0
    if s.efsdp == 1 and b != FP32:
        expert_copies = sum(u.numel for u in units if u.shard_mesh == "efsdp") * b
        last -= 2 * last_block[1].numel * b
    static = params + optimizer + expert_copies
    moments = {
        "LM head forward": static + activations[mode] + final.numel * b + chunk_logits + head_grads,
        "last block backward": static + activations[mode] + head_grads + final.numel * b + final.shard * FP32
        + last + routed_buffers + recompute[mode],
        "embeddings backward": static + grads + gathered_with_grads(embeddings),
        "optimizer step": static + grads,
    }
    phase = max(moments, key=moments.get)
    return Memory(params=params, grads=grads, optimizer=optimizer, activations=activations, recompute=recompute,
                  routed_buffers=routed_buffers, lm_head=chunk_logits + head_grads, fsdp_buffers=last + expert_copies,
                  peak=moments[phase], peak_phase=phase)


def vision_activations(model: nn.Module, spec: models.ModelSpec, patches: int, b: int) -> dict[str, int]:
    """Bytes a vision tower keeps for backward over ``patches`` patches, per checkpointing mode (its blocks are
    checkpointed as the decoder's: under full, and full_keep_exchange (no exchange in the tower), each keeps its
    input); its parts outside the blocks are never checkpointed."""
    tower = spec.vision_tower(model)
    if tower is None or not patches:
        return {"none": 0, "selective": 0, "full": 0, "full_keep_exchange": 0}
    blocks = [block.saved_activations() for _, block in spec.named_vision_blocks(model)]
    own = tower.saved_activations()

    def nbytes(elements: int, fp32: int) -> int:
        return patches * (elements * b + fp32 * FP32)

    rest = nbytes(own.none, own.none_fp32)
    return {"none": rest + sum(nbytes(a.none, a.none_fp32) for a in blocks),
            "selective": rest + sum(nbytes(a.selective, a.selective_fp32) for a in blocks),
            "full": rest + len(blocks) * nbytes(tower.args.hidden_size, 0),
            "full_keep_exchange": rest + len(blocks) * nbytes(tower.args.hidden_size, 0)}


def vision_patches(args: Any, window_tokens: int, machine: PlanConfig) -> int:
    """Patches a rank's vision tower runs per micro-batch: those of a whole window of ``window_tokens`` (under CP
    every cp rank runs them all), at ``machine.image_token_share`` image tokens; 0 without a tower."""
    vision = getattr(args, "vision_config", None)
    return 0 if vision is None else round(machine.image_token_share * window_tokens) * vision.merge_unit


def _unsharded_memory(params: int, grads: int, optimizer: int, activations: int, recompute: int, routed: int,
                      lm_head: int, tail_grads: int, compute_copies: int, backend: str) -> Memory:
    """parallel.backend none or ddp: every parameter whole on each rank. Under bf16 each parameter is also held in
    bf16 for the step (none: ``parallelisms.compute_copy``'s casts, once per step; ddp: autocast's, kept for
    backward); ddp's gradient buckets are a second copy of the gradients."""
    buckets = grads if backend == "ddp" else 0
    static = params + optimizer + compute_copies
    moments = {
        "LM head forward": static + activations + lm_head,
        "last block backward": static + activations + lm_head + tail_grads + routed + recompute + buckets,
        "embeddings backward": static + grads + buckets,
        "optimizer step": params + optimizer + grads + buckets,
    }
    phase = max(moments, key=moments.get)
    return Memory(params=params, grads=grads + buckets, optimizer=optimizer, activations={"configured": activations},
                  recompute={"configured": recompute}, routed_buffers=routed, lm_head=lm_head,
                  fsdp_buffers=compute_copies, peak=moments[phase], peak_phase=phase)


# ----------------------------------------------------------------------------- the whole plan

def causal_flops_per_token(args: Any, seq_len: int) -> float:
    """The model's ``flops_per_token`` with the masked half of causal attention left out (what a flash kernel
    skips): its attention term is the part that grows with seq_len."""
    base = args.flops_per_token(0)
    return base + (args.flops_per_token(seq_len) - base) / 2


def build_meta_model(cfg: TrainConfig) -> tuple[models.ModelSpec, nn.Module]:
    """The configured model on the meta device (its vision tower where model.vision=true): shapes only, no memory."""
    spec = models.get_spec(cfg.model.model_type)
    args = models.build_args(cfg.model.model_type, dict(cfg.model.arch), cfg.model.vision)
    with torch.device("meta"):
        return spec, spec.model_cls(args)


# Full checkpointing runs the forward (1 of a step's 3 parts) again: what it executes over the FLOPs it counts.
FULL_CHECKPOINT_RECOMPUTE = 4 / 3
RECOMPUTING_MODES = ("full", "full_keep_exchange")  # the checkpointing modes that run every block's forward again

_MAX_WORLD = 1 << 16  # the largest world smallest_world tries


def smallest_world(cfg: TrainConfig, built: tuple[models.ModelSpec, nn.Module] | None = None) -> int:
    """The fewest GPUs on which ``cfg.parallel`` validates (parallel.ep_size=16 needs dp >= 16, cp2 doubles it, ...):
    what a plan without ``plan.gpus`` is for. A layout that no world allows raises its own error."""
    spec, model = built or build_meta_model(cfg)
    checks = dict(num_experts=model.args.num_experts, heads=spec.cp_head_counts(model.args), seq_len=cfg.data.seq_len)
    for world in range(cfg.parallel.cp_size, _MAX_WORLD + 1, cfg.parallel.cp_size):
        try:
            validate_parallel_config(cfg.parallel, world, **checks)
            return world
        except ValueError:
            continue
    validate_parallel_config(cfg.parallel, cfg.parallel.cp_size, **checks)  # raises what is wrong
    raise AssertionError("unreachable: a layout that validates nowhere raised above")


def default_world(cfg: TrainConfig, built: tuple[models.ModelSpec, nn.Module] | None = None) -> tuple[int, str]:
    """The world a plan without ``plan.gpus`` is for, and why: the processes train.py would start
    (launch.nproc_per_node, where set above 1), else the smallest world the layout needs."""
    if cfg.launch.nproc_per_node > 1:
        return cfg.launch.nproc_per_node, f"launch.nproc_per_node={cfg.launch.nproc_per_node}"
    return smallest_world(cfg, built), f"the smallest world parallel={cfg.parallel.name} needs"


def plan(cfg: TrainConfig, machine: PlanConfig, built: tuple[models.ModelSpec, nn.Module] | None = None) -> Plan:
    """The plan of ``cfg`` (train.py's config, checked as train.py checks it) on ``machine.gpus`` GPUs (0:
    ``default_world``). ``built``: ``build_meta_model(cfg)``, to reuse over many layouts."""
    validate(cfg)
    world = machine.gpus or default_world(cfg, built)[0]
    spec, model = built or build_meta_model(cfg)
    args = model.args
    validate_parallel_config(cfg.parallel, world, args.num_experts, heads=spec.cp_head_counts(args),
                             seq_len=cfg.data.seq_len)
    s = resolve_sizes(cfg.parallel, world)
    step = StepShape(tokens=cfg.train.local_batch_size * cfg.data.seq_len // s.cp,
                     micro_batches=cfg.train.grad_accum_steps,
                     compute_bytes=FP32 if cfg.train.mixed_precision == "fp32" else 2,
                     checkpoint=cfg.parallel.activation_checkpoint, dispatcher=cfg.dispatcher.name,
                     moment_bytes=2 if cfg.optim.state_dtype == "bfloat16" else FP32,
                     backend=cfg.parallel.backend.name, dispatcher_cfg=cfg.dispatcher,
                     row_len=cfg.data.seq_len // s.cp, round_robin=bool(args.router_force_balance),
                     patches=vision_patches(args, cfg.train.local_batch_size * cfg.data.seq_len, machine))
    units = fsdp_units(model, spec, s, step.backend)
    comms = collectives(model, spec, units, s, step, machine)
    tokens = step.tokens * step.micro_batches
    recompute = FULL_CHECKPOINT_RECOMPUTE if step.checkpoint in RECOMPUTING_MODES else 1.0
    compute_s = tokens * causal_flops_per_token(args, cfg.data.seq_len) * recompute / (machine.tflops * 1e12)
    if step.patches:  # the vision tower: per patch, with attention within its image
        compute_s += (step.patches * step.micro_batches * args.vision_config.flops_per_patch(machine.image_patches)
                      * recompute / (machine.tflops * 1e12))
    # AdamW reads parameter (fp32), gradient (fp32) and both moments and writes parameter and moments back.
    optimizer_s = sum(u.shard for u in units) * (3 * FP32 + 4 * step.moment_bytes) / (machine.hbm_gb_s * 1e9)
    exposed = sum(c.seconds for c in comms if c.exposed)
    hidden = sum(c.seconds for c in comms if not c.exposed)  # FSDP's, behind the prefetch chain
    step_s = compute_s + exposed + max(0.0, hidden - compute_s) + optimizer_s
    return Plan(sizes=s, tokens_per_gpu=tokens, units=units, collectives=comms,
                memory=memory(model, spec, units, s, step), compute_s=compute_s, optimizer_s=optimizer_s,
                step_s=step_s)


def candidate_layouts(cfg: TrainConfig, world: int) -> list[TrainConfig]:
    """What a sweep tries on ``world`` GPUs: ep a power of two up to the experts, cp up to 8 (with the local batch
    times cp, so every layout trains the same tokens per GPU and the same global batch), each checkpointing mode, and
    beside plain FSDP, HSDP of the non-expert parameters replicated across nodes (sharded within a node)."""
    num_experts = cfg.model.arch["num_experts"]
    powers = [2**i for i in range(int(math.log2(world)) + 1)]
    layouts = []
    for cp in (c for c in powers if c <= 8):
        for ep in (e for e in powers if e <= num_experts and world // cp % e == 0):
            for replicate in sorted({1, max(1, world // 8)}):
                for mode in ("none", "selective", "full"):
                    name = f"cp{cp}_ep{ep}" + (f"_hsdp{replicate}" if replicate > 1 else "") + f"_{mode}"
                    parallel = dataclasses.replace(cfg.parallel, name=name, cp_size=cp, ep_size=ep, efsdp_size=-1,
                                                   mp_replicate_size=replicate, activation_checkpoint=mode,
                                                   backend=dataclasses.replace(cfg.parallel.backend, name="fsdp2"))
                    train = dataclasses.replace(cfg.train, local_batch_size=cfg.train.local_batch_size * cp)
                    layouts.append(dataclasses.replace(cfg, parallel=parallel, train=train))
    return layouts


def fits(p: Plan, machine: PlanConfig) -> bool:
    return p.memory.peak <= machine.capacity_gib * GiB


def sweep(cfg: TrainConfig, machine: PlanConfig) -> list[tuple[TrainConfig, Plan]]:
    """Every candidate layout that validates for the model and sequence length: those that fit first, fastest
    first."""
    built = build_meta_model(cfg)
    plans = []
    for candidate in candidate_layouts(cfg, machine.gpus or default_world(cfg, built)[0]):
        try:
            plans.append((candidate, plan(candidate, machine, built)))
        except ValueError:
            continue  # a layout this model or sequence length does not allow (heads, experts)
    return sorted(plans, key=lambda c_p: (not fits(c_p[1], machine), -c_p[1].tokens_per_s_per_gpu))


# ----------------------------------------------------------------------------- the exchange's levers

def exchange_variants(cfg: TrainConfig) -> list[tuple[str, TrainConfig]]:
    """The settings of ``cfg``'s job that change what its EP exchange sends (the layout, batch and everything else
    kept): dispatcher fused or dedup, the dispatch in e4m3 or not, and under full checkpointing the recompute with
    or without sending the exchanges again; each with the overrides that select it."""
    modes = [cfg.parallel.activation_checkpoint]
    if cfg.parallel.activation_checkpoint in RECOMPUTING_MODES:
        modes = list(RECOMPUTING_MODES)
    variants = []
    for name in ("fused", "dedup"):
        for fp8 in (False, True):
            for mode in modes:
                overrides = [f"dispatcher={name}", *(["dispatcher.fp8_dispatch=true"] if fp8 else []),
                             f"parallel.activation_checkpoint={mode}"]
                variants.append((" ".join(overrides), dataclasses.replace(
                    cfg, dispatcher=DispatcherConfig(name, fp8_dispatch=fp8),
                    parallel=dataclasses.replace(cfg.parallel, activation_checkpoint=mode))))
    return variants


# Settings of the exchange that the emulated links measured slower than the paper counts them: the advice lists them
# and never chooses them. One H100, Qwen3-30B-A3B ep8 rank, full checkpointing, all-to-all at the fitted 160 GB/s,
# 2026-12-07 (docs/scaling.md#the-levers-measured-with-the-links-emulated).
MEASURED_SLOWER: tuple[tuple[Callable[[TrainConfig], bool], str], ...] = (
    (lambda c: c.dispatcher.name == "fused" and c.dispatcher.fp8_dispatch,
     "fused's e4m3 dispatch quantises all 8 rows of a token: its casts cost more than its bytes save (7,119 "
     "tokens/s/GPU against fused's 8,004)"),
    (lambda c: c.parallel.activation_checkpoint == "full_keep_exchange",
     "keeping the exchanges takes the selective checkpoint path, which is host-bound (the GPU idle 1.04 s a step: "
     "9,004 tokens/s/GPU against 10,452 with full)"),
    # round robin sends a token's 8 experts to 1-2 ranks, the router's own routing to about 5.3 of 8: dedup's gathers
    # and casts grow with the rows, and at 5.3 they cost more than the bytes save
    (lambda c: c.dispatcher.name == "dedup" and not c.model.arch.get("router_force_balance"),
     "under learned routing a token reaches about 5.3 of 8 ranks: dedup's index, permute and cast kernels cost "
     "800 ms a step more than fused's and its bytes save 140 ms (dedup + e4m3 5,741 tokens/s/GPU against "
     "fused's 7,481)"),
)


def measured_slower(cfg: TrainConfig) -> str | None:
    """Why ``cfg``'s exchange setting is never chosen (``MEASURED_SLOWER``), or None."""
    return next((why for slower, why in MEASURED_SLOWER if slower(cfg)), None)


def advise(cfg: TrainConfig, machine: PlanConfig) -> list[str]:
    """Which setting of the exchange the planner would choose for this job, and why: each of
    ``exchange_variants`` planned on ``machine`` (its all-to-all at plan.a2a_gb_s), the fastest that fits and was
    not measured slower (``MEASURED_SLOWER``) first, beside the configured one. What the paper cannot count is
    said: domino's overlap (the emulated links measure it: scripts/simulate.py), and which routing dedup's rows
    assume."""
    built = build_meta_model(cfg)
    world = machine.gpus or default_world(cfg, built)[0]
    machine = dataclasses.replace(machine, gpus=world)
    s = resolve_sizes(cfg.parallel, world)
    if s.ep == 1:
        return ["choice: no expert parallelism (parallel.ep_size=1), so no EP exchange to choose a setting for"]
    planned = []
    for overrides, variant in exchange_variants(cfg):
        p = plan(variant, machine, built)
        ep_bytes = sum(c.bytes for c in p.collectives if c.mesh == "ep") / p.sizes.world_size
        exposed = sum(c.seconds for c in p.collectives if c.exposed)
        planned.append((overrides, p, ep_bytes, exposed, measured_slower(variant)))
    current = plan(cfg, machine, built)
    best = max((v for v in planned if fits(v[1], machine) and v[4] is None), key=lambda v: v[1].tokens_per_s_per_gpu,
               default=None)
    args = built[1].args
    rate = machine.a2a_gb_s or machine.nvlink_gb_s
    lines = [f"choice for the exchange (the planner's numbers: {world} GPUs, the all-to-all at {rate:g} GB/s inside a "
             f"node, {'round-robin' if args.router_force_balance else 'learned (uniform on average)'} routing):"]
    if best is None:
        return [*lines, f"  none of the exchange's settings fits {machine.capacity_gib:g} GiB at this layout: "
                        "python scripts/plan.py <these overrides> plan.sweep=true"]
    ranked = sorted(planned, key=lambda v: -v[1].tokens_per_s_per_gpu)
    for overrides, p, ep_bytes, exposed, slower in ranked[:4] + ([best] if best not in ranked[:4] else []):
        mark = "->" if overrides == best[0] else "  "
        lines.append(f"{mark} {overrides}: {p.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, EP exchange "
                     f"{ep_bytes / GiB:,.1f} GiB per GPU per step, {exposed:.2f} s exposed, peak "
                     f"{p.memory.peak / GiB:.1f} GiB{'' if fits(p, machine) else ' (does NOT fit)'}"
                     f"{f' (measured slower, not chosen: {slower})' if slower else ''}")
    lines.append(f"   configured ({cfg.dispatcher.name}{', fp8 dispatch' if cfg.dispatcher.fp8_dispatch else ''}, "
                 f"{cfg.parallel.activation_checkpoint} checkpointing): {current.tokens_per_s_per_gpu:,.0f} "
                 f"tokens/s/GPU, peak {current.memory.peak / GiB:.1f} GiB")
    shape = LayerShape(tokens=1, top_k=args.num_experts_per_tok, num_experts=args.num_experts, ep=s.ep,
                       hidden=args.hidden_size, element_bytes=2, row_len=cfg.data.seq_len // s.cp,
                       round_robin=bool(args.router_force_balance), cfg=DispatcherConfig("dedup"))
    lines.append(f"   why: dedup sends {token_ranks(shape):.2f} rows per token, fused {args.num_experts_per_tok} (one "
                 "per routed slot); the e4m3 dispatch sends D + 4 bytes a row for 2 D; full_keep_exchange sends no "
                 "exchange again in the recompute and keeps what they received. Not on paper: domino's overlap of "
                 "its halves (scripts/simulate.py sim.links=on dispatcher=domino measures it). Measured with the "
                 "links emulated (docs/scaling.md, Qwen3-30B-A3B ep8, round-robin routing): dedup + e4m3 10,452 "
                 "tokens/s/GPU, dedup 9,387, domino 8,560, fused 8,004; learned routing: fused 7,481, dedup + e4m3 "
                 "5,741. Each stays opt-in")
    return lines


# The share of a device's memory a run's allocated peak can reach: the rest goes to the CUDA context and the caching
# allocator's fragmentation (Qwen3.5-35B-A3B shapes, 4 layers: 74.5 GiB allocated ran out of memory on an 80 GB H100:
# docs/results.md#one-h100).
FIT_SHARE = 0.9


def fit_warnings(cfg: TrainConfig, world: int, capacity_gib: float | None) -> list[str]:
    """train.py's start-up line when the plan of this run puts a rank's peak over FIT_SHARE of its accelerator's
    memory (none on CPU, or where the planner does not model the run: dispatcher dedup's traffic, say)."""
    if capacity_gib is None:
        return []
    try:
        p = plan(cfg, PlanConfig(gpus=world, capacity_gib=capacity_gib))
    except (ValueError, NotImplementedError):
        return []
    if p.memory.peak <= FIT_SHARE * capacity_gib * GiB:
        return []
    return [f"the plan puts this rank's peak memory at {p.memory.peak / GiB:.1f} GiB ({p.memory.peak_phase}), over "
            f"{FIT_SHARE:.0%} of this device's {capacity_gib:.1f} GiB (the rest goes to the CUDA context and "
            "fragmentation): expect out of memory. What fits: python scripts/plan.py <these overrides> "
            "plan.sweep=true (activation checkpointing, optim.state_dtype=bfloat16, a smaller "
            "train.local_batch_size, more ep / fsdp ranks)"]
