"""ParallelDims: the one owner of the process groups and device meshes, built once from the config.

Rank layout. World = dp x cp with cp innermost, so the cp ranks of one batch slice are neighbours:
``dp_rank = rank // cp``. Every mesh below is an unflattening of one world mesh, so they share a root
and FSDP2 can combine the expert FSDP mesh with the EP mesh into one layout for the expert DTensors.

- data   (dp, cp):                        who reads which batch slice; loss shares add up over all of it
- model  (mp_replicate, mp_shard):        the outer FSDP2 (HSDP when mp_replicate > 1)
- expert (edp, efsdp, ep, expert_cp):     EP splits experts over ep; expert FSDP shards them over efsdp
                                          and replicates them over edp and expert_cp (dp = edp*efsdp*ep)
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Mapping

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from core.device import dist_backend, local_device
from core.torch_compat import concatenate_meshes, flatten_mesh, unflatten_mesh
from parallelisms.config import ParallelConfig
from parallelisms.validate import ONE_PROCESS, validate_sizes


@dataclass(frozen=True)
class ParallelSizes:
    """The degree of every parallel dimension; ``world_size = dp * cp = mp_replicate * mp_shard``."""

    world_size: int
    dp: int
    cp: int
    ep: int
    efsdp: int
    edp: int
    mp_replicate: int
    mp_shard: int

    @property
    def expert_mesh_shape(self) -> tuple[int, int, int, int]:
        """(edp, efsdp, ep, expert_cp), e.g. world 16, ep 8 -> (1, 2, 8, 1)."""
        return self.edp, self.efsdp, self.ep, self.cp


def resolve_sizes(cfg: ParallelConfig, world_size: int) -> ParallelSizes:
    """The derived sizes (dp, mp_shard, edp, and efsdp when -1): the one place they are computed. No checks
    here: ``validate_parallel_config`` runs first and names the key of anything that does not divide."""
    cp = cfg.cp_size
    dp = world_size // cp
    ep = cfg.ep_size
    efsdp = dp // ep if cfg.efsdp_size == -1 else cfg.efsdp_size
    mp_replicate = cfg.mp_replicate_size
    return ParallelSizes(world_size=world_size, dp=dp, cp=cp, ep=ep, efsdp=efsdp, edp=dp // (ep * efsdp),
                         mp_replicate=mp_replicate, mp_shard=world_size // mp_replicate)


@dataclass(frozen=True)
class ParallelDims(ParallelSizes):
    rank: int = 0
    meshes: Mapping[str, DeviceMesh] = field(default_factory=dict, repr=False)  # empty for one process
    simulated: bool = False  # the loopback world (parallelisms.loopback): this process is the job's only one

    @property
    def writer(self) -> bool:
        """Whether this process writes the run's shared files (log, record, metrics): rank 0, or a simulated
        rank, which has no peer process to do it."""
        return self.rank == 0 or self.simulated

    def mesh(self, name: str) -> DeviceMesh:
        """A named mesh: a dimension (dp, cp, mp_shard, efsdp, ep, ...), a whole layout (data, model,
        expert) or what a fully_shard call takes (fsdp, expert_fsdp)."""
        if name not in self.meshes:
            raise KeyError(f"no mesh {name!r}" + (f"; have {sorted(self.meshes)}" if self.meshes else
                                                  ": a single process has no meshes"))
        return self.meshes[name]

    @property
    def dp_rank(self) -> int:
        """Index of this rank's slice of the global batch (the cp ranks of a slice share it)."""
        return self.rank // self.cp

    @property
    def cp_rank(self) -> int:
        """Which contiguous 1/cp of each sequence this rank holds (cp is innermost)."""
        return self.rank % self.cp

    @property
    def data_group(self) -> dist.ProcessGroup | None:
        """Ranks whose loss shares add up to the global loss (all dp x cp ranks); None for one process."""
        return self.mesh("world").get_group() if self.meshes else None

    @property
    def grad_scale(self) -> float:
        """Factor on each rank's loss share before backward. Every gradient reduction divides the sum over
        ranks by dp x cp (DDP and FSDP average over the world; the expert FSDP divide factor is set to
        dp x cp too, see ``parallelize``), while the gradient of the global loss is the plain *sum* of the
        shares' gradients."""
        return float(self.dp * self.cp)


def init_distributed(device_type: str, cfg: ParallelConfig) -> None:
    """Join the default process group when launched with WORLD_SIZE > 1 (torchrun); a no-op for one
    process or when a group already exists (a test harness or a caller that owns it)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return
    # device_id binds the communicator to this rank's accelerator at once (NCCL/HCCL) instead of
    # guessing it at the first collective.
    device_id = None if device_type == "cpu" else local_device(device_type)
    dist.init_process_group(backend=dist_backend(device_type), timeout=timedelta(seconds=cfg.dist_timeout),
                            device_id=device_id)


def build_parallel_dims(cfg: ParallelConfig, world_size: int, rank: int, device_type: str,
                        simulated: bool = False) -> ParallelDims:
    """Sizes from the config, and every mesh when there is more than one rank. ``simulated``: the ranks are the
    loopback world's. The sizes are checked first: a layout for more processes than were started (a multi-process
    preset without torchrun) is one line."""
    validate_sizes(cfg, world_size, ONE_PROCESS if world_size == 1 else "")
    sizes = resolve_sizes(cfg, world_size)
    meshes = _build_meshes(sizes, device_type) if world_size > 1 else {}
    return ParallelDims(**vars(sizes), rank=rank, meshes=meshes, simulated=simulated)


def _build_meshes(s: ParallelSizes, device_type: str) -> dict[str, DeviceMesh]:
    # DeviceMesh's private layout API (core.torch_compat); the tests build every layout.
    world = init_device_mesh(device_type, (s.world_size,), mesh_dim_names=("world",))
    data = unflatten_mesh(world, 0, (s.dp, s.cp), ("dp", "cp"))
    model = unflatten_mesh(world, 0, (s.mp_replicate, s.mp_shard), ("mp_replicate", "mp_shard"))
    expert = unflatten_mesh(world, 0, s.expert_mesh_shape, ("edp", "efsdp", "ep", "expert_cp"))
    meshes = {"world": world, "data": data, "model": model, "expert": expert}
    for layout in (data, model, expert):
        meshes.update({name: layout[name] for name in layout.mesh_dim_names})
    # fully_shard takes a 1-D mesh (FSDP) or a 2-D (replicate, shard) one (HSDP); a replicate dim of
    # size 1 would only add an all-reduce over one rank.
    meshes["fsdp"] = model if s.mp_replicate > 1 else meshes["mp_shard"]
    if s.edp * s.cp > 1:
        # Experts are replicated over edp and expert_cp: one replicate dim made of both. They are not
        # adjacent in the expert mesh, so the HSDP mesh is a concatenation rather than a slice.
        meshes["edp_cp"] = flatten_mesh(expert["edp", "expert_cp"], "edp_cp")
        meshes["expert_fsdp"] = concatenate_meshes([meshes["edp_cp"], meshes["efsdp"]])
    else:
        meshes["expert_fsdp"] = meshes["efsdp"]
    return meshes
