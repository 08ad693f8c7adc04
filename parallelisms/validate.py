"""Every check of the parallel config that needs no process group: arithmetic on the world size, the model's head
counts and the sequence length.

Errors name the dotted key, the numbers and a fix. Features that are designed but not built yet raise
NotImplementedError saying so, never a silent fallback.
"""

from __future__ import annotations

from collections.abc import Sequence

from parallelisms.config import ACTIVATION_CHECKPOINT_MODES, BACKENDS, CP_MODES, ParallelConfig


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


HeadCounts = Sequence[tuple[str, int, str, int]]  # per token mixer: (model.arch key, heads split over cp, key, shared)


def _cp_fits(cp: int, heads: HeadCounts, seq_len: int) -> bool:
    return seq_len % cp == 0 and all(n % cp == 0 and (m % cp == 0 or cp % m == 0) for _, n, _, m in heads)


def _check_context_parallel(cp: int, world_size: int, heads: HeadCounts | None, seq_len: int | None) -> None:
    """Ulysses splits each mixer's heads over the cp ranks, and the heads they share too or, when fewer than cp,
    repeats them (``ModelSpec.cp_heads`` declares which: e.g. attention's query and key/value heads)."""
    _check(heads is not None and seq_len is not None,
           f"parallel.cp_size={cp}: checking context parallelism needs the model's head counts and data.seq_len "
           "(validate_parallel_config(..., heads=..., seq_len=...))")
    fix = f"fix: parallel.cp_size one of {[d for d in _divisors(world_size) if _cp_fits(d, heads, seq_len)]}"
    _check(seq_len % cp == 0, f"data.seq_len={seq_len} must be divisible by parallel.cp_size={cp} (each cp rank "
                              f"holds seq_len / cp tokens); {fix}, or data.seq_len a multiple of {cp}")
    for split, n, shared, m in heads:
        _check(n % cp == 0, f"model.arch.{split}={n} must be divisible by parallel.cp_size={cp} (Ulysses gives each "
                            f"cp rank {n} / cp heads); {fix}")
        _check(m % cp == 0 or cp % m == 0,
               f"model.arch.{shared}={m} and parallel.cp_size={cp}: one must divide the other (each cp rank takes "
               f"{shared} / cp heads, or one head repeated); {fix}")


# Where the layout's sizes do not fit one process, that is what to change.
ONE_PROCESS = ("; this is one process (WORLD_SIZE=1): start several with launch.nproc_per_node=N, or torchrun "
               "--nproc-per-node N")


def validate_sizes(cfg: ParallelConfig, world_size: int, alone: str = "") -> None:
    """The layout's sizes against the world size: what building the meshes divides by (``build_parallel_dims`` runs
    it first, so a layout for more processes than were started is this one line, not a ZeroDivisionError).
    ``alone``: added to the message (how to start more processes)."""
    # Topology: world = dp x cp = mp_replicate x mp_shard.
    cp = cfg.cp_size
    _check(cp >= 1 and world_size % cp == 0,
           f"parallel.cp_size={cp} must divide the world size {world_size}; fix: one of {_divisors(world_size)}{alone}")
    dp = world_size // cp  # derived, as mp_shard below: dims.resolve_sizes
    rep = cfg.mp_replicate_size
    _check(rep >= 1 and world_size % rep == 0, f"parallel.mp_replicate_size={rep} must divide the world size "
                                               f"{world_size}; fix: one of {_divisors(world_size)}{alone}")
    # Experts: dp = edp x efsdp x ep.
    ep = cfg.ep_size
    _check(ep >= 1 and dp % ep == 0, f"parallel.ep_size={ep} must divide dp={dp} (world {world_size} / "
                                     f"cp {cp}); fix: parallel.ep_size one of {_divisors(dp)}{alone}")
    efsdp = cfg.efsdp_size
    _check(efsdp == -1 or (efsdp >= 1 and (dp // ep) % efsdp == 0),
           f"parallel.efsdp_size={efsdp} must divide dp/ep={dp // ep} (dp {dp} / ep {ep}); fix: "
           f"parallel.efsdp_size one of {_divisors(dp // ep)}, or -1 for dp/ep (no expert replication){alone}")


def validate_parallel_config(cfg: ParallelConfig, world_size: int, num_experts: int,
                             heads: HeadCounts | None = None, seq_len: int | None = None) -> None:
    """``heads``: the model's head counts that context parallelism splits (``ModelSpec.cp_head_counts``) and
    ``seq_len``: data.seq_len; needed when parallel.cp_size > 1."""
    b = cfg.backend
    _check(b.name in BACKENDS, f"parallel.backend.name={b.name!r} is unknown; choose one of {', '.join(BACKENDS)}")
    _check(cfg.activation_checkpoint in ACTIVATION_CHECKPOINT_MODES,
           f"parallel.activation_checkpoint={cfg.activation_checkpoint!r} must be one of "
           f"{', '.join(ACTIVATION_CHECKPOINT_MODES)}")
    _check(cfg.dist_timeout > 0, f"parallel.dist_timeout={cfg.dist_timeout} must be a positive number of seconds")
    _check(cfg.cp_mode in CP_MODES, f"parallel.cp_mode={cfg.cp_mode!r} must be one of {', '.join(CP_MODES)}")

    validate_sizes(cfg, world_size, ONE_PROCESS if world_size == 1 else "")
    if cfg.cp_size > 1:
        _check_context_parallel(cfg.cp_size, world_size, heads, seq_len)
    dp, ep, rep = world_size // cfg.cp_size, cfg.ep_size, cfg.mp_replicate_size  # dp derived: dims.resolve_sizes
    _check(num_experts % ep == 0,
           f"parallel.ep_size={ep} must divide model.arch.num_experts={num_experts} (each EP rank holds "
           f"num_experts / ep experts); fix: parallel.ep_size one of "
           f"{[d for d in _divisors(dp) if num_experts % d == 0]}")

    # What each backend can do.
    if b.name == "none":
        _check(world_size == 1, f"parallel.backend.name=none runs one process but WORLD_SIZE={world_size}; "
                                "fix: a multi-process preset such as parallel=fsdp2, ddp or ep2")
        return
    _check(world_size > 1, f"parallel.backend.name={b.name} needs more than one process (WORLD_SIZE=1); fix: "
                           "launch with torchrun --nproc-per-node N, or use parallel=single")
    if b.name == "ddp":
        sharded = {"parallel.ep_size": (ep, 1), "parallel.mp_replicate_size": (rep, 1),
                   "parallel.backend.fsdp_ignored_modules": (list(b.fsdp_ignored_modules), [])}
        for key, (value, plain) in sharded.items():
            _check(value == plain, f"{key}={value}: parallel.backend.name=ddp replicates every parameter and "
                                   f"shards nothing; fix: parallel.backend.name=fsdp2 (or {key}={plain})")
