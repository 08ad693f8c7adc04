"""Parallel layout config: top-level topology fields plus a strictly parsed backend config.

Both are structured dataclasses in the Hydra schema, so overriding an unknown key (say ``cp_size`` put
inside ``backend``) fails at composition. Hydra's append syntax (``+parallel.backend.cp_size=2``) bypasses
the schema, though, and ``OmegaConf.to_object`` would drop the key silently: ``training.config.to_train_config``
rejects it by name, for this group as for every other. Derived sizes (-1 fields) are computed in one place, ``parallelisms.dims.resolve_sizes``;
the cross-field checks live in ``parallelisms.validate``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

BACKENDS = ("none", "ddp", "fsdp2")
ACTIVATION_CHECKPOINT_MODES = ("none", "full", "selective")
CP_MODES = ("ulysses",)


@dataclass
class BackendConfig:
    """Backend-private settings. Topology (dp/cp/mp sizes) never goes here: unknown keys are errors."""

    name: str = "fsdp2"  # fsdp2 | ddp | none (none: a single process, no wrapping)
    ep_size: int = 1
    efsdp_size: int = -1  # -1: dp // ep (no expert replication); smaller: expert HSDP with edp = dp // (ep * efsdp)
    ep_dispatcher: str = "eager"  # usually ${dispatcher.name}
    reshard_after_forward: bool = True
    fsdp_ignored_modules: list[str] = field(default_factory=list)  # FQN globs left unsharded by the outer FSDP2


@dataclass
class ParallelConfig:
    name: str = "single"
    dp_size: int = -1  # -1: world // cp_size
    cp_size: int = 1
    cp_mode: str = "ulysses"
    mp_replicate_size: int = 1  # > 1: HSDP for the non-expert parameters
    mp_shard_size: int = -1  # -1: world // mp_replicate_size
    dist_timeout: int = 1800  # seconds, for every collective
    activation_checkpoint: str = "none"  # none | full | selective
    backend: BackendConfig = field(default_factory=BackendConfig)

