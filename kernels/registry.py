"""Device kernel registry: the one place that chooses a device-specific implementation. For each op, the
implementations per device type, each with an availability check, and the torch reference otherwise. ``auto``
takes the best that can run; a plugin named explicitly (flash-linear-attention), or an implementation named by an
op's own key (``kernel_config.attention``), must run, or selection fails.

Two kinds of op, chosen alike: those the models call through a kernel slot (see ``models/layers.py``: norms,
activations, rotary, the cross-entropy step, the delta rule, packed-document attention), and those the dispatch
path's kernel functions call (``kernels.moe.permute``'s K-to-one steps and token permutes, ``kernels.moe.grouped_mm``,
``kernels.optim.adamw``, ``kernels.optim.cast``, ``kernels.comm.link``'s timer), which EP dispatchers, the experts, the
gradient hand-off, the optimizer and the loopback world's link emulation use without ever checking the device.

``select_kernels(cfg, device_type)`` chooses one implementation per op and records why (``Kernels.log``: one line
per op at start-up); ``apply_kernels(model, kernels)`` installs the choices: into every module's kernel slots, and
for the dispatch path's ops into ``kernels.installed`` (per device type).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.metadata
import importlib.util
import logging
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.nn as nn

from core import device
from kernels import installed
from kernels.attention.attention import DenseMaskAttention, FlexAttention, VarlenAttention, varlen_signature_problem
from kernels.comm.link import TORCH_LINK_TIMER
from kernels.config import AUTO, CUDNN_ATTENTION, FLA, FLEX_ATTENTION, VARLEN_ATTN, KernelConfig, plugin_names
from kernels.float8.permute import gather_quantize_rows_torch
from kernels.linear_attention import fla
from kernels.linear_attention.delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule
from kernels.linear_attention.short_conv import causal_conv1d_silu
from kernels.loss.linear_cross_entropy import softmax_cross_entropy_
from kernels.moe.grouped_mm import per_group_mm
from kernels.moe.permute import (gather_sum_torch, moe_token_permute_torch, moe_token_unpermute_torch,
                                 unpermute_backward_torch)
from kernels.optim.adamw import adamw_step_torch
from kernels.optim.cast import cast_gradient_torch
from kernels.tokenwise.norm import gated_rms_norm, offset_rms_norm, rms_norm
from kernels.tokenwise.rotary import apply_rotary
from kernels.tokenwise.swiglu import packed_swiglu, swiglu

DEVICE_TYPES = ("cpu", "cuda", "npu")


@dataclass(frozen=True)
class Env:
    """What the choice depends on besides the config; ``detect`` reads this machine, tests pass their own."""

    device_type: str
    triton_version: str | None = None  # None: triton is not installed
    capability: tuple[int, int] | None = None  # CUDA compute capability
    fla_version: str | None = None  # None: flash-linear-attention is not installed
    has_torch_npu: bool = False
    cudnn_frontend_version: str | None = None  # None: nvidia-cudnn-frontend is not installed
    cudnn_version: int | None = None  # the cuDNN the frontend loads (91900 is 9.19.0); None: absent or not loaded

    @classmethod
    def detect(cls, device_type: str) -> Env:
        triton_version = None
        if importlib.util.find_spec("triton") is not None:
            import triton  # the module's version: the distribution may be triton or pytorch-triton

            triton_version = triton.__version__
        capability = tuple(device.module("cuda").get_device_capability()) if device_type == "cuda" else None
        return cls(device_type, triton_version, capability, _dist_version("flash-linear-attention", "fla-core"),
                   importlib.util.find_spec("torch_npu") is not None,
                   *(_cudnn_frontend() if device_type == "cuda" else (None, None)))

    def describe(self) -> str:
        sm = f" (sm_{self.capability[0]}{self.capability[1]})" if self.capability else ""
        cudnn = (f", cudnn-frontend {self.cudnn_frontend_version or 'absent'} (cuDNN {self.cudnn_version})"
                 if self.device_type == "cuda" else "")
        return (f"{self.device_type}{sm}, triton {self.triton_version or 'absent'}, flash-linear-attention "
                f"{self.fla_version or 'absent'}, torch_npu {'present' if self.has_torch_npu else 'absent'}{cudnn}")


def _cudnn_frontend() -> tuple[str | None, int | None]:
    """nvidia-cudnn-frontend's version and the cuDNN library it loads (not necessarily torch's)."""
    version = _dist_version("nvidia-cudnn-frontend")
    if version is None:
        return None, None
    try:
        import cudnn

        return version, int(cudnn.backend_version())
    except Exception:  # noqa: BLE001 -- a frontend that cannot load cuDNN is reported by the kernel's check
        return version, None


def _dist_version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return None


@dataclass(frozen=True)
class Impl:
    name: str  # as logged: torch, triton, torch_npu, flash-linear-attention, torch._grouped_mm
    device_types: tuple[str, ...]
    build: Callable[[KernelConfig], Callable]  # imports lazily: a device package is loaded only when chosen
    # Why it cannot run in this environment, or None; raises if an explicitly requested package is missing.
    unavailable: Callable[[Env], str | None] = lambda env: None
    note: str = ""  # logged after the device: what the kernel still decides at run time
    plugin: str | None = None  # the kernel_config.name entry that asks for it, where not the op's own (OpSpec)
    opt_in: bool = False  # runs only where named by the op's config key, never as an auto choice


@dataclass(frozen=True)
class OpSpec:
    plugin: str  # the kernel_config.name entry that asks for this op's kernels
    reference: Callable[[KernelConfig], Callable]  # the torch reference: what runs by default
    kernels: tuple[Impl, ...]  # in order of preference
    slot: bool = True  # a model kernel slot; False: called by a kernel function, installed in kernels.installed
    # A KernelConfig field that may name one implementation (or torch); auto: the first that can run.
    config_key: str | None = None
    # On a device type the plugin has no kernel of this op for, its torch reference runs (logged) rather than the
    # selection failing: for a kernel that is a faster equal of the reference and is listed by default.
    reference_elsewhere: bool = False


def _lazy(module: str, attr: str) -> Callable[[KernelConfig], Callable]:
    return lambda cfg: getattr(importlib.import_module(module), attr)


def _lazy_instance(module: str, cls: str) -> Callable[[KernelConfig], Callable]:
    return lambda cfg: getattr(importlib.import_module(module), cls)()


def _needs_triton(env: Env) -> str | None:
    return None if env.triton_version else "triton is not installed"


def _needs_torch_npu(env: Env) -> str | None:
    return None if env.has_torch_npu else "torch_npu is not installed (pip install '.[npu]')"


def _needs_grouped_mm(env: Env) -> str | None:
    return None if hasattr(torch, "_grouped_mm") else f"torch {torch.__version__} has no _grouped_mm"


def _needs_fla(env: Env) -> str | None:
    if env.fla_version is None:
        raise fla.missing_error(env.device_type)
    return None


def _fla_chunk_unavailable(env: Env) -> str | None:
    return _needs_fla(env) or (fla.chunk_backward_broken(env.triton_version, env.capability)
                               if env.device_type == "cuda" else None)


def _fla_chunk_fix_unneeded(env: Env) -> str | None:
    """The #640 handling of chunk_bwd_dqkwg runs only where FLA's own launch is refused (elsewhere it is FLA's)."""
    if _needs_fla(env) or fla.chunk_backward_broken(env.triton_version, env.capability):
        return None
    return "FLA's own chunk_bwd_dqkwg is right on this stack"


_TRITON_MODULES = {"rms_norm": "kernels.tokenwise.triton_norm", "offset_rms_norm": "kernels.tokenwise.triton_norm",
                   "gated_rms_norm": "kernels.tokenwise.triton_norm", "swiglu": "kernels.tokenwise.triton_swiglu",
                   "packed_swiglu": "kernels.tokenwise.triton_swiglu"}


def _auto(op: str, reference: Callable) -> OpSpec:
    """An op with a fused Triton kernel on CUDA and a torch_npu op on NPU."""
    return OpSpec(AUTO, lambda cfg: reference, (
        Impl("triton", ("cuda",), _lazy(_TRITON_MODULES[op], op), _needs_triton),
        Impl("torch_npu", ("npu",), _lazy("kernels.tokenwise.npu", op), _needs_torch_npu),
    ))


def _dispatch(reference: Callable, *impls: Impl) -> OpSpec:
    """An op of the dispatch path (called by ``kernels.moe.permute`` / ``kernels.moe.grouped_mm``, not a model slot)."""
    return OpSpec(AUTO, lambda cfg: reference, impls, slot=False)


def _triton_permute(op: str, group: str = "moe") -> Impl:
    """A dispatch-path gather's Triton kernel, in ``kernels/<group>/triton_permute.py`` beside its reference."""
    return Impl("triton", ("cuda",), _lazy(f"kernels.{group}.triton_permute", op), _needs_triton)


def _npu_moe(op: str, note: str = "") -> Impl:
    return Impl("torch_npu", ("npu",), _lazy("kernels.moe.npu", op), _needs_torch_npu, note)


def _needs_flex(env: Env) -> str | None:
    if importlib.util.find_spec("torch.nn.attention.flex_attention") is None:
        return f"torch {torch.__version__} has no FlexAttention"
    return _needs_triton(env)  # compiled FlexAttention is a Triton kernel


def _needs_varlen(env: Env) -> str | None:
    if env.capability is not None and env.capability < (8, 0):
        return f"flash attention needs sm_80 or newer, this GPU is sm_{env.capability[0]}{env.capability[1]}"
    return varlen_signature_problem()


CUDNN_RAGGED_MIN = 90600  # cuDNN 9.6: the 64-bit ragged offsets the graphs take (measured on: 9.19, torch 2.11's)


def _needs_cudnn_ragged(env: Env) -> str | None:
    if env.capability is not None and env.capability < (9, 0):
        return f"cuDNN's ragged attention needs sm_90 or newer, this GPU is sm_{env.capability[0]}{env.capability[1]}"
    if env.cudnn_frontend_version is None:
        return "nvidia-cudnn-frontend is not installed (pip install '.[gpu]')"
    if env.cudnn_version is None:
        return f"cudnn-frontend {env.cudnn_frontend_version} cannot load cuDNN"
    if env.cudnn_version < CUDNN_RAGGED_MIN:
        return (f"cudnn-frontend loads cuDNN {env.cudnn_version}; its 64-bit ragged offsets need {CUDNN_RAGGED_MIN} "
                "or newer")
    return None


# In order of preference on CUDA: the first that can run is the default (kernel_config.attention=auto); each can be
# named. varlen (torch's flash attention, FA2) measured ahead of FlexAttention end to end on an H200, on 4k chat
# windows and on 32k windows of 2,048-token documents (docs/results.md#packed-documents-and-long-windows, rows 4 and
# 7); flex where varlen cannot run (torch < 2.11). cuDNN's ragged SDPA is opt-in until it is measured end to end: its
# kernels ran faster than varlen's on the H200 (docs/results.md#kernels-alone, row 33), but this module's path has
# not yet trained on a GPU. Rows that are one document each
# take SDPA's causal flash path in every implementation.
_ATTENTION = {
    VARLEN_ATTN: Impl(VARLEN_ATTN, ("cuda",), lambda cfg: VarlenAttention(),
                      _needs_varlen, "flash attention over the documents (cu_seqlens)"),
    FLEX_ATTENTION: Impl(FLEX_ATTENTION, ("cuda",), lambda cfg: FlexAttention(),
                         _needs_flex, "document BlockMask; compiled at the first packed batch"),
    CUDNN_ATTENTION: Impl(CUDNN_ATTENTION, ("cuda",),
                          _lazy_instance("kernels.attention.cudnn_attention", "CudnnAttention"),
                          _needs_cudnn_ragged, "cuDNN's ragged SDPA over the documents; a graph pair per (document "
                          "count, longest document) bucket, built at its first batch", opt_in=True),
}
CUDA_ATTENTION = next(name for name, impl in _ATTENTION.items() if not impl.opt_in)

# FLA's Triton kernels run on CUDA and, through its triton-ascend backends, on NPU.
_FLA_DEVICES = ("cuda", "npu")
FLA_HOPPER_DQKWG = f"{FLA}, #640-safe chunk_bwd_dqkwg"

OPS: dict[str, OpSpec] = {
    "rms_norm": _auto("rms_norm", rms_norm),
    "offset_rms_norm": _auto("offset_rms_norm", offset_rms_norm),
    "gated_rms_norm": _auto("gated_rms_norm", gated_rms_norm),
    "swiglu": _auto("swiglu", swiglu),
    "packed_swiglu": _auto("packed_swiglu", packed_swiglu),
    "softmax_cross_entropy": OpSpec(AUTO, lambda cfg: softmax_cross_entropy_, (
        Impl("triton", ("cuda",), _lazy("kernels.loss.triton_cross_entropy", "softmax_cross_entropy_"),
             _needs_triton),)),
    "apply_rotary": OpSpec(AUTO, lambda cfg: apply_rotary, (
        Impl("triton", ("cuda",), _lazy("kernels.tokenwise.triton_rotary", "apply_rotary"), _needs_triton),
        Impl("torch_npu", ("npu",), _lazy("kernels.tokenwise.npu", "apply_rotary"), _needs_torch_npu),)),
    "chunk_gated_delta_rule": OpSpec(
        FLA, lambda cfg: functools.partial(chunk_gated_delta_rule, chunk_size=cfg.chunk_size),
        (Impl(FLA, _FLA_DEVICES, lambda cfg: fla.chunk_gated_delta_rule(cfg.chunk_size), _fla_chunk_unavailable),
         # Triton 3.4-3.7.0 on Hopper (torch 2.11 / 2.12.0's own): FLA, its one miscompiled step made safe.
         Impl(FLA_HOPPER_DQKWG, ("cuda",), lambda cfg: fla.chunk_gated_delta_rule_hopper_safe(cfg.chunk_size),
              _fla_chunk_fix_unneeded, "FLA #640: its chunk_bwd_dqkwg backward step runs FLA's kernel at 128-wide "
              "tiles where both head dims exceed 64, else in torch (kernels/linear_attention/fla_dqkwg.py); every "
              "other FLA kernel as FLA's"))),
    "document_attention": OpSpec(
        AUTO, lambda cfg: DenseMaskAttention(),
        tuple(_ATTENTION.values()), config_key="attention"),
    "fused_recurrent_gated_delta_rule": OpSpec(
        FLA, lambda cfg: recurrent_gated_delta_rule,
        (Impl(FLA, _FLA_DEVICES, lambda cfg: fla.fused_recurrent_gated_delta_rule(), _needs_fla),)),
    # DeltaNet's short convolution and silu: FLA's Triton kernel where kernel_config asks FLA for it, else ours
    # (kernels/linear_attention/triton_short_conv.py). Both run on CUDA only (FLA's is untried under triton-ascend
    # here), so an NPU run takes the torch one, and says so.
    "causal_conv1d_silu": OpSpec(
        AUTO, lambda cfg: causal_conv1d_silu,
        (Impl(FLA, ("cuda",), lambda cfg: fla.causal_conv1d_silu(), _needs_fla, plugin=FLA),
         Impl("triton", ("cuda",), _lazy("kernels.linear_attention.triton_short_conv", "causal_conv1d_silu"),
              _needs_triton)),
        reference_elsewhere=True),
    # The dispatch path. The K-to-one steps of the torch permutes (the EP dispatchers' gathers):
    "gather_sum": _dispatch(gather_sum_torch, _triton_permute("gather_sum")),
    "unpermute_backward": _dispatch(unpermute_backward_torch, _triton_permute("unpermute_backward")),
    # train.float8's experts: the dispatch gather writing e4m3 rows and their scales (kernels/float8/permute.py)
    "gather_quantize_rows": _dispatch(gather_quantize_rows_torch, _triton_permute("gather_quantize_rows", "float8")),
    # A dispatcher's whole token permute and unpermute; chosen together (the unpermute reads the permute's state).
    "moe_token_permute": _dispatch(moe_token_permute_torch, _npu_moe("moe_token_permute")),
    "moe_token_unpermute": _dispatch(moe_token_unpermute_torch, _npu_moe("moe_token_unpermute")),
    # The experts' GEMMs; the reference is the exact per-expert loop (on CPU, torch's _grouped_mm is that loop).
    "grouped_mm": _dispatch(
        per_group_mm,
        Impl("torch._grouped_mm", ("cuda",), _lazy("kernels.moe.grouped_mm", "native_grouped_mm"), _needs_grouped_mm,
             "where it supports the dtype (probed at the first call), else the per-expert loop"),
        _npu_moe("grouped_mm", "the per-expert loop where an expert gets no rows or is the only one")),
    # One process's gradient hand-off (parallelisms/compute_copy.py): bf16 to fp32 in the parameter's layout.
    "cast_gradient": _dispatch(cast_gradient_torch, Impl("triton", ("cuda",), _lazy("kernels.optim.triton_cast",
                                                                                     "cast_gradient"), _needs_triton)),
    # The optimizer's update (training.optim.AdamW, the CUDA default), one pass per parameter.
    "adamw_step": _dispatch(adamw_step_torch, Impl("triton", ("cuda",), _lazy("kernels.optim.triton_adamw",
                                                                               "adamw_step"), _needs_triton)),
    # The loopback world's link time (launch.links.emulate, parallelisms/loopback.py): the clock a collective starts
    # at, and the hold of its stream until its link time has passed (the reference: the host's clock and a sleep).
    "link_timer": _dispatch(TORCH_LINK_TIMER, Impl("triton", ("cuda",), _lazy_instance("kernels.comm.triton_link",
                                                                                        "LinkTimer"), _needs_triton,
                                                   "%globaltimer spin on launch.links.comm_sms programs")),
}
SLOT_OPS = tuple(op for op, spec in OPS.items() if spec.slot)  # what models call through their kernel slots
INSTALLED_OPS = tuple(op for op, spec in OPS.items() if not spec.slot)  # what kernel functions call


@dataclass(frozen=True)
class Choice:
    op: str
    impl: str  # Impl.name, or "torch" for the reference
    reason: str
    build: Callable[[], Callable]


@dataclass(frozen=True)
class Kernels:
    """The chosen implementation of every op, and why; ``lines()`` is what train.py logs."""

    env: Env
    choices: dict[str, Choice]

    def get(self, op: str) -> Callable:
        return self.choices[op].build()

    def lines(self) -> list[str]:
        return [f"{c.op}: {c.impl}: {c.reason}" for c in self.choices.values()]

    def log(self, logger: logging.Logger) -> None:
        logger.info("kernels for %s", self.env.describe())
        for line in self.lines():
            logger.info("kernel %s", line)
        if any(choice.impl.startswith(FLA) for choice in self.choices.values()):
            logger.info("kernel note: %s", fla.first_call_note())


def _not_asked(op: str, plugin: str, cfg: KernelConfig) -> str | None:
    """Why ``cfg`` does not ask for ``plugin``'s kernel of ``op`` (None: it does)."""
    if plugin not in plugin_names(cfg):
        return f"kernel_config.name does not include {plugin}"
    if plugin == FLA and op not in cfg.include_kernels:
        return "not in kernel_config.include_kernels"
    return None


def _choose(op: str, spec: OpSpec, cfg: KernelConfig, env: Env) -> Choice:
    def reference(reason: str) -> Choice:
        return Choice(op, "torch", reason, lambda: spec.reference(cfg))

    named = getattr(cfg, spec.config_key) if spec.config_key else AUTO
    if named == "torch":
        return reference(f"kernel_config.{spec.config_key}=torch")
    # An op's kernels may come from more than one plugin (DeltaNet's short convolution: FLA's where FLA is asked
    # for it, else ours): each plugin's in turn, in the order listed, skipping the plugins not asked for.
    plugins = list(dict.fromkeys(impl.plugin or spec.plugin for impl in spec.kernels))
    why_not_asked = [why for why in (_not_asked(op, plugin, cfg) for plugin in plugins) if why]
    if len(why_not_asked) == len(plugins):
        return reference(why_not_asked[0])
    whys = []
    for plugin in plugins:
        if _not_asked(op, plugin, cfg):
            continue
        impls = tuple(impl for impl in spec.kernels if (impl.plugin or spec.plugin) == plugin
                      and (named == impl.name or (named == AUTO and not impl.opt_in)))
        skipped = []
        for impl in impls:
            if env.device_type not in impl.device_types:
                continue
            why_not = impl.unavailable(env)
            if why_not is None:  # the reason names the preferred kernels that cannot run here, and why
                reason = "; ".join([f"on {env.device_type}", *([impl.note] if impl.note else []),
                                    *(f"not {skip}" for skip in skipped)])
                return Choice(op, impl.name, reason, lambda impl=impl: impl.build(cfg))
            skipped.append(f"{impl.name}: {why_not}")
        devices = sorted({d for impl in impls for d in impl.device_types})
        why = "; ".join(skipped) or f"{plugin if named == AUTO else named} has kernels for {', '.join(devices)} only"
        if named != AUTO:
            raise ValueError(f"kernel_config.{spec.config_key}={named} cannot run on {env.describe()}: {why}; fix: "
                             f"kernel_config.{spec.config_key}={AUTO}")
        # auto means "the best available"; a reference_elsewhere op has no kernel of this plugin for this device:
        # the next plugin's, or the reference.
        if plugin == AUTO or (spec.reference_elsewhere and not skipped):
            whys.append(why)
            continue
        # A kernel asked for by name never silently becomes something else.
        raise ValueError(f"kernel_config.name={cfg.name!r} asks for {plugin}'s {op}, which cannot run on "
                         f"{env.describe()}: {why}; fix: kernel_config=auto (the torch {op}), or make the kernel "
                         "runnable")
    return reference("; ".join(whys))


def select_kernels(cfg: KernelConfig, device_type: str, env: Env | None = None) -> Kernels:
    """One implementation per op for ``device_type`` (cpu, cuda or npu). Raises ``ImportError`` naming the pip
    extra when a requested plugin's package is missing on a device it supports."""
    if device_type not in DEVICE_TYPES:
        raise ValueError(f"device type {device_type!r} is not one of {', '.join(DEVICE_TYPES)}")
    env = env or Env.detect(device_type)
    if env.device_type != device_type:
        raise ValueError(f"env is for {env.device_type}, not {device_type}")
    return Kernels(env, {op: _choose(op, spec, cfg, env) for op, spec in OPS.items()})


def apply_kernels(model: nn.Module, kernels: Kernels) -> dict[str, int]:
    """Set every kernel slot in ``model`` to the chosen implementation, and ``install`` the dispatch path's
    choices; returns how many slots each op filled."""
    built: dict[str, Callable] = {}
    counts: dict[str, int] = {}
    for module in model.modules():
        for attr, op in getattr(module, "kernel_slots", {}).items():
            if op not in built:
                built[op] = kernels.get(op)
            setattr(module, attr, built[op])
            counts[op] = counts.get(op, 0) + 1
    install(kernels)
    return counts


def install(kernels: Kernels, device_type: str | None = None) -> None:
    """Make the dispatch path's kernel functions run the chosen implementations for tensors on ``device_type``
    (default: the device they were chosen for; tests run NPU choices on CPU tensors with a fake torch_npu)."""
    for op in INSTALLED_OPS:
        installed.put(device_type or kernels.env.device_type, op, kernels.get(op))


@contextlib.contextmanager
def installed_kernels(kernels: Kernels | None = None, device_type: str | None = None) -> Iterator[None]:
    """For a block (tests): only ``kernels``' dispatch-path choices installed (``install``; None: none, every
    kernel function runs its torch reference), then what was installed before."""
    saved = installed.snapshot()
    installed.restore({})
    try:
        if kernels is not None:
            install(kernels, device_type)
        yield
    finally:
        installed.restore(saved)
