"""Parallel layout config: the topology sizes together at the top, then the strictly parsed backend config.

Both are structured dataclasses in the Hydra schema, so overriding an unknown key (say ``cp_size`` put
inside ``backend``) fails at composition. Hydra's append syntax (``+parallel.backend.cp_size=2``) bypasses
the schema, though, and ``OmegaConf.to_object`` would drop the key silently: ``training.config.to_train_config``
rejects it by name, for this group as for every other. Only sizes a user chooses are keys: dp = world / cp,
mp_shard = world / mp_replicate and edp = dp / (ep x efsdp) follow from them and are computed in one place,
``parallelisms.dims.resolve_sizes``; the cross-field checks live in ``parallelisms.validate``. The EP dispatcher
is its own group (``dispatcher``, ``parallelisms.dispatchers.config``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

BACKENDS = ("none", "ddp", "fsdp2")
ACTIVATION_CHECKPOINT_MODES = ("none", "full", "selective", "full_keep_exchange")
CP_MODES = ("ulysses",)


@dataclass
class BackendConfig:
    """Backend-private settings. Topology (cp/ep/efsdp/mp sizes) never goes here: unknown keys are errors."""

    name: str = "fsdp2"  # fsdp2 | ddp | none (none: a single process, no wrapping)
    reshard_after_forward: bool = True
    fsdp_ignored_modules: list[str] = field(default_factory=list)  # FQN globs left unsharded by the outer FSDP2


@dataclass
class ParallelConfig:
    name: str = "single"
    # Topology: world = dp x cp = mp_replicate x mp_shard and dp = edp x efsdp x ep (dp, mp_shard, edp derived).
    cp_size: int = 1  # context parallelism: each sequence split over cp ranks
    ep_size: int = 1  # expert parallelism: each ep rank holds num_experts / ep experts
    efsdp_size: int = -1  # -1: dp // ep (no expert replication); smaller: expert HSDP with edp = dp // (ep * efsdp)
    mp_replicate_size: int = 1  # > 1: HSDP for the non-expert parameters, sharded over world // mp_replicate
    cp_mode: str = "ulysses"
    dist_timeout: int = 1800  # seconds, for every collective
    # none | full | selective | full_keep_exchange (full, but what the all-to-alls received is kept: no exchange is
    # sent again in the recompute; parallelisms/activation_checkpoint.py)
    activation_checkpoint: str = "none"
    backend: BackendConfig = field(default_factory=BackendConfig)
