"""Qwen3.5-MoE hyper-parameters, named as in transformers' ``Qwen3_5MoeTextConfig`` (config.json ``text_config``;
``rope_parameters`` flattened into ``rope_theta``, ``partial_rotary_factor`` and ``mrope_section``), and the vision
tower's, named as in ``Qwen3_5MoeVisionConfig`` (config.json ``vision_config``, with the image token ids of the
top level)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from models.args import MoeArgs, knob

FULL_ATTENTION, LINEAR_ATTENTION = "full_attention", "linear_attention"
VISION_ACTIVATIONS = ("gelu_pytorch_tanh",)  # the blocks' MLP activation (the merger's is the exact GELU)


@dataclass
class VisionArgs:
    """The vision tower (``models/qwen3_5_moe/vision.py``): a patch embedding (Conv3d over temporal_patch_size x
    patch_size^2 pixels of in_channels), learned positions resampled to each image's grid, ``depth`` pre-norm ViT
    blocks of ``num_heads`` heads with a 2-D rotary, and a merger of spatial_merge_size^2 patches into one token of
    out_hidden_size (the text model's hidden size). Defaults: transformers' ``Qwen3_5MoeVisionConfig`` and
    ``Qwen3_5MoeConfig`` (the token ids)."""

    depth: int = 27
    hidden_size: int = 1152
    hidden_act: str = "gelu_pytorch_tanh"
    intermediate_size: int = 4304
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    out_hidden_size: int = 3584
    num_position_embeddings: int = 2304
    initializer_range: float = 0.02
    rope_theta: float = 10000.0  # rope_parameters (axial)
    # config.json's top level: the tokens the chat template puts around and in place of an image
    image_token_id: int = 248056
    video_token_id: int = 248057
    vision_start_token_id: int = 248053
    vision_end_token_id: int = 248054

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values per patch in ``pixel_values``: in_channels x temporal_patch_size x patch_size^2."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merge_unit(self) -> int:
        """Patches merged into one token: spatial_merge_size^2."""
        return self.spatial_merge_size**2

    def validate(self, hidden_size: int, vocab_size: int) -> None:
        key = "model.arch.vision_config"
        for name in ("depth", "hidden_size", "intermediate_size", "num_heads", "in_channels", "patch_size",
                     "spatial_merge_size", "temporal_patch_size", "num_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{key}.{name}={getattr(self, name)} must be positive")
        if self.hidden_size % self.num_heads or self.head_dim % 4:
            raise ValueError(f"{key}.hidden_size={self.hidden_size} / num_heads={self.num_heads} must be a head dim "
                             "divisible by 4 (the 2-D rotary gives a quarter of it to each of h and w, twice)")
        side = round(self.num_position_embeddings**0.5)
        if side * side != self.num_position_embeddings:
            raise ValueError(f"{key}.num_position_embeddings={self.num_position_embeddings} must be a square (the "
                             "learned positions are a square grid)")
        if self.hidden_act not in VISION_ACTIVATIONS:
            raise ValueError(f"{key}.hidden_act={self.hidden_act!r} is not implemented; supported: "
                             f"{', '.join(VISION_ACTIVATIONS)}")
        if self.out_hidden_size != hidden_size:
            raise ValueError(f"{key}.out_hidden_size={self.out_hidden_size} must be the text model's "
                             f"model.arch.hidden_size={hidden_size}: its tokens take the place of image pad tokens")
        for name in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
            if not 0 <= getattr(self, name) < vocab_size:
                raise ValueError(f"{key}.{name}={getattr(self, name)} is not an id of the vocabulary "
                                 f"(model.arch.vocab_size={vocab_size})")

    def param_count(self) -> int:
        """The tower's parameters: patch embedding, positions, blocks, merger."""
        D, I, M = self.hidden_size, self.intermediate_size, self.hidden_size * self.merge_unit
        block = 4 * D + (3 * D * D + 3 * D) + (D * D + D) + (D * I + I) + (I * D + D)  # 2 LayerNorms, qkv, proj, mlp
        merger = 2 * D + (M * M + M) + (M * self.out_hidden_size + self.out_hidden_size)
        return self.patch_dim * D + D + self.num_position_embeddings * D + self.depth * block + merger

    def flops_per_patch(self, image_patches: int) -> float:
        """Training FLOPs per patch: 6 x the matmul parameters each patch passes (forward, and backward's input and
        weight gradients) in the blocks and the merger (once per merged token), 4 x the patch embedding's (the pixels
        need no gradient), plus attention over an image of ``image_patches`` patches, 12 x hidden x image_patches per
        block (scores and values, no causal halving). What torch's FlopCounterMode counts for the tower's forward
        and backward (tests/test_qwen35_vision.py)."""
        D, I, M = self.hidden_size, self.intermediate_size, self.hidden_size * self.merge_unit
        matmuls = self.depth * (4 * D * D + 2 * D * I) + (M * M + M * self.out_hidden_size) // self.merge_unit
        return 6 * matmuls + 4 * self.patch_dim * D + 12 * self.depth * D * image_patches


@dataclass
class Qwen3_5MoeArgs(MoeArgs):
    vocab_size: int = 248320
    num_hidden_layers: int = 40
    # Layer kinds; None: layer i is full attention iff (i + 1) % full_attention_interval == 0 (as transformers).
    layer_types: list[str] | None = None
    full_attention_interval: int = 4
    # Gated full attention.
    num_attention_heads: int = 16
    num_key_value_heads: int = 2
    head_dim: int = 256
    partial_rotary_factor: float = 0.25
    rope_theta: float = 10_000_000.0
    mrope_section: list[int] = field(default_factory=lambda: [11, 11, 10])  # rotary frequencies per t/h/w stream
    # Gated DeltaNet (linear attention).
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    # MoE on every layer: routed experts (top-k, always renormalised) plus one gated shared expert.
    num_experts: int = 256
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    max_position_embeddings: int = 262144
    # The multi-token-prediction head of the published checkpoints (``mtp.*``: one full-attention block predicting
    # token t+2): trained with its cross-entropy added at this weight; 0: the model has no head (a checkpoint's is
    # carried to the export untouched). Training-only: not in config.json.
    mtp_loss_weight: float = knob(0.0)
    # The vision tower, where the model has one (None: the text model alone). A run builds it only with
    # model.vision=true (training.startup); its parameters are not counted in param_counts / flops_per_token, which
    # are per text token.
    vision_config: VisionArgs | None = None

    def __post_init__(self) -> None:
        if isinstance(self.vision_config, dict):  # from a preset's yaml or config.json's vision_config
            known = {f.name for f in dataclasses.fields(VisionArgs)}
            unknown = sorted(set(self.vision_config) - known)
            if unknown:
                raise ValueError(f"model.arch.vision_config has keys {unknown} that the vision tower does not know; "
                                 f"known: {sorted(known)}")
            self.vision_config = VisionArgs(**self.vision_config)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)  # int() as transformers: 256 * 0.25 -> 64

    def resolved_layer_types(self) -> list[str]:
        if self.layer_types is not None:
            return list(self.layer_types)
        return [FULL_ATTENTION if (i + 1) % self.full_attention_interval == 0 else LINEAR_ATTENTION
                for i in range(self.num_hidden_layers)]

    def validate(self) -> None:
        super().validate()
        for name in ("full_attention_interval", "linear_conv_kernel_dim", "linear_key_head_dim",
                     "linear_value_head_dim", "shared_expert_intermediate_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model.arch.{name}={getattr(self, name)} must be positive")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers:
                raise ValueError(f"model.arch.layer_types has {len(self.layer_types)} entries but "
                                 f"model.arch.num_hidden_layers={self.num_hidden_layers}")
            bad = sorted(set(self.layer_types) - {FULL_ATTENTION, LINEAR_ATTENTION})
            if bad:
                raise ValueError(f"model.arch.layer_types has {bad}; allowed: {FULL_ATTENTION}, {LINEAR_ATTENTION}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"model.arch.linear_num_value_heads={self.linear_num_value_heads} must be a multiple of "
                             f"model.arch.linear_num_key_heads={self.linear_num_key_heads}")
        if self.rotary_dim <= 0 or self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ValueError(f"model.arch.head_dim={self.head_dim} x model.arch.partial_rotary_factor="
                             f"{self.partial_rotary_factor} = {self.rotary_dim} rotary channels: must be even, "
                             "positive and at most head_dim")
        if self.mtp_loss_weight < 0:
            raise ValueError(f"model.arch.mtp_loss_weight={self.mtp_loss_weight} must be >= 0 (0: no MTP head)")
        if len(self.mrope_section) != 3 or min(self.mrope_section) < 0:
            raise ValueError(f"model.arch.mrope_section={self.mrope_section} must be 3 non-negative counts (t, h, w)")

    def validate_vision(self) -> None:
        """The vision tower's checks, for a model built with it (``models.with_vision``: a preset's tower is checked
        against the text model only where a run builds it)."""
        if self.vision_config is not None:
            self.vision_config.validate(self.hidden_size, self.vocab_size)

    def _layer_params(self) -> tuple[int, int, int]:
        """(full-attention mixer, DeltaNet mixer, MoE block excluding routed experts) parameter counts."""
        D, d = self.hidden_size, self.head_dim
        H, h = self.num_attention_heads, self.num_key_value_heads
        attention = D * 2 * H * d + 2 * D * h * d + H * d * D + 2 * d  # q_proj emits [q | gate]; q/k norms
        key_dim = self.linear_num_key_heads * self.linear_key_head_dim
        value_dim = self.linear_num_value_heads * self.linear_value_head_dim
        conv_dim = 2 * key_dim + value_dim
        deltanet = (D * conv_dim + D * value_dim + 2 * D * self.linear_num_value_heads  # in_proj_{qkv,z,b,a}
                    + conv_dim * self.linear_conv_kernel_dim + 2 * self.linear_num_value_heads  # conv1d, A_log, dt_bias
                    + self.linear_value_head_dim + value_dim * D)  # gated norm, out_proj
        moe_dense = self.num_experts * D + 3 * D * self.shared_expert_intermediate_size + D  # router, shared, its gate
        return attention, deltanet, moe_dense

    def _block_types(self) -> list[str]:
        """Every decoder block's mixer: the model's layers, then the MTP head's full-attention block, if built."""
        return self.resolved_layer_types() + ([FULL_ATTENTION] if self.mtp_loss_weight > 0 else [])

    def param_counts(self) -> tuple[int, int, int]:
        """(total, active per token, embedding) parameter counts (the MTP head's included, where built)."""
        D, E, K = self.hidden_size, self.num_experts, self.num_experts_per_tok
        attention, deltanet, moe_dense = self._layer_params()
        types = self._block_types()
        n_full = types.count(FULL_ATTENTION)
        mixers = n_full * attention + (len(types) - n_full) * deltanet
        expert = 3 * D * self.moe_intermediate_size
        mtp = 2 * D * D + 3 * D if self.mtp_loss_weight > 0 else 0  # its fc and three norms, beside its block
        dense = mixers + len(types) * (moe_dense + 2 * D) + D + mtp  # + two norms per layer, final norm
        embed = self.vocab_size * D
        head = self.lm_head_params()
        total = embed + head + dense + len(types) * E * expert
        active = embed + head + dense + len(types) * K * expert
        return total, active, embed

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 x active non-embedding params (LM head included), plus

        - full-attention layers: 12 x heads x head_dim x seq_len (scores and values, forward + backward, no causal
          halving), as torchtitan counts softmax attention;
        - DeltaNet layers: 18 x value heads x key dim x value dim, the same 3 x forward convention applied to the
          recurrence's three state products per token (read S^T k, write k delta^T, read S^T q; 2 FLOPs each per
          state entry). Independent of seq_len; the chunked form's extra intra-chunk products are not counted,
          like the masked half of causal attention.

        The MTP head, where built, counts as its parameters, its full-attention block, and a second pass of the LM
        head over its rows.
        """
        _, active, embed = self.param_counts()
        types = self._block_types()
        n_full = types.count(FULL_ATTENTION)
        attention = 12 * n_full * self.num_attention_heads * self.head_dim * seq_len
        linear = 18 * (len(types) - n_full) * (self.linear_num_value_heads * self.linear_key_head_dim
                                               * self.linear_value_head_dim)
        mtp_head = 6 * self.lm_head_params() if self.mtp_loss_weight > 0 else 0
        return 6 * (active - embed) + mtp_head + attention + linear
