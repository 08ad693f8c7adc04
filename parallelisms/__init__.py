"""Everything that shards: meshes (``dims``), the parallel plan (``parallelize``), EP dispatchers and
cross-mesh gradient clipping. ``train.py`` calls, in order: validate_parallel_config -> init_distributed ->
build_parallel_dims -> parallelize_qwen3_moe (the plan of both Qwen MoE families, from the model's ModelSpec) ->
(materialise) -> clip_grad_norm_ each step."""

from parallelisms.config import BackendConfig, ParallelConfig
from parallelisms.dims import ParallelDims, ParallelSizes, build_parallel_dims, init_distributed, resolve_sizes
from parallelisms.dispatchers import DispatcherConfig
from parallelisms.expert_parallel import may_drop_rows, raise_if_dispatch_overflowed
from parallelisms.loopback import init_loopback_world
from parallelisms.grad_norm import clip_coefficient, clip_grad_norm_, grad_norm, scale_grads_
from parallelisms.parallelize import expert_shard_dim, parallelize_qwen3_moe
from parallelisms.validate import validate_parallel_config

__all__ = [
    "BackendConfig", "DispatcherConfig", "ParallelConfig", "ParallelDims", "ParallelSizes", "build_parallel_dims",
    "clip_coefficient", "clip_grad_norm_", "expert_shard_dim", "grad_norm", "init_distributed", "init_loopback_world", "may_drop_rows",
    "parallelize_qwen3_moe", "raise_if_dispatch_overflowed", "resolve_sizes", "scale_grads_",
    "validate_parallel_config",
]
