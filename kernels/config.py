"""The ``kernel_config`` Hydra group: which kernel plugins replace the model's torch ops.

Kept apart from the registry (which imports the models) so that the config schema stays import-light.
"""

from __future__ import annotations

from dataclasses import dataclass, field

AUTO = "auto"  # the accelerator's best available kernels for norms, activations and rotary
FLA = "flash-linear-attention"  # only the listed flash-linear-attention ops (``include_kernels``)
PLUGINS = (AUTO, FLA)
FLA_OPS = ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "causal_conv1d_silu")
# What kernel_config.include_kernels lists unless told: the delta rule's two. The short convolution is ours
# (kernels/linear_attention/triton_short_conv.py, an auto kernel) unless FLA's is listed: ours measured faster than
# FLA's on an H200, on rows of one sequence and on packed documents (docs/results.md#kernels-alone, row 31).
DEFAULT_FLA_OPS = ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule")
CHUNK_SIZES = (16, 32, 64)  # what FLA's chunked kernels support
# Packed-document attention (kernels/attention/attention.py): auto = the registry's CUDA default; torch = the
# dense-mask SDPA.
CUDNN_ATTENTION, FLEX_ATTENTION, VARLEN_ATTN = "cudnn_attention", "flex_attention", "varlen_attn"
ATTENTION_IMPLS = (AUTO, CUDNN_ATTENTION, FLEX_ATTENTION, VARLEN_ATTN, "torch")


@dataclass
class KernelConfig:
    name: str = AUTO  # auto | flash-linear-attention | both, comma-separated: "auto,flash-linear-attention"
    include_kernels: list[str] = field(default_factory=lambda: list(DEFAULT_FLA_OPS))  # FLA ops to install
    chunk_size: int = 64  # chunk length of the chunked gated delta rule (FLA's and the torch reference)
    attention: str = AUTO  # packed documents: auto | cudnn_attention | flex_attention | varlen_attn | torch


def plugin_names(cfg: KernelConfig) -> list[str]:
    return [name.strip() for name in cfg.name.split(",")]


def validate_kernel_config(cfg: KernelConfig) -> None:
    """Raise ``ValueError`` naming the ``kernel_config`` key at fault and the valid values."""
    names = plugin_names(cfg)
    unknown = [name for name in names if name not in PLUGINS]
    if unknown or len(set(names)) != len(names):
        raise ValueError(f"kernel_config.name={cfg.name!r}: expected one of {', '.join(PLUGINS)}, or both "
                         f"comma-separated ({AUTO},{FLA}), each once")
    unknown = [op for op in cfg.include_kernels if op not in FLA_OPS]
    if unknown:
        raise ValueError(f"kernel_config.include_kernels has {unknown}; valid: {', '.join(FLA_OPS)}")
    if FLA in names and not cfg.include_kernels:
        raise ValueError(f"kernel_config.name includes {FLA} but kernel_config.include_kernels is empty; "
                         f"list some of {', '.join(FLA_OPS)} or drop {FLA}")
    if cfg.attention not in ATTENTION_IMPLS:
        raise ValueError(f"kernel_config.attention={cfg.attention!r}: expected one of {', '.join(ATTENTION_IMPLS)}")
    if cfg.attention != AUTO and AUTO not in names:
        raise ValueError(f"kernel_config.attention={cfg.attention} is one of the {AUTO} kernels, but "
                         f"kernel_config.name={cfg.name!r} leaves them out; add {AUTO} to kernel_config.name or set "
                         f"kernel_config.attention={AUTO}")
    if cfg.chunk_size not in CHUNK_SIZES:
        raise ValueError(f"kernel_config.chunk_size={cfg.chunk_size} must be one of "
                         f"{', '.join(map(str, CHUNK_SIZES))}")
