"""Qwen3.5's vision tower in plain PyTorch, numerically transformers' ``Qwen3_5MoeVisionModel`` (checked in fp32 on
CPU: tests/test_qwen35_vision.py), and the index arithmetic its forward needs, done on the host.

The tower: a patch embedding (transformers' Conv3d with kernel = stride, here the same weight applied as one matmul
over each flattened patch), plus learned positions (a square grid of ``num_position_embeddings``, bilinearly
resampled to each image's patch grid), then ``depth`` pre-norm ViT blocks (LayerNorm, attention with a 2-D rotary
within each image, LayerNorm, a GELU-tanh MLP), then the merger: LayerNorm, and each spatial_merge_size^2 patches
concatenated through a two-layer GELU MLP into one token of the text model's width. No deepstack (Qwen3-VL's extra
mergers): Qwen3.5's tower has none. Parameter names are transformers' under ``model.visual``.

What depends on the images' grids only (each patch's rotary (h, w), its resampling taps, the attention segments,
where the merged tokens go) is ``vision_inputs``, computed on the host from the grid the loader gives: the forward
asks the device nothing (no ``.tolist()`` as transformers' has), and under context parallelism each rank takes the
image tokens of its own 1/cp of the sequence (``token_positions_n`` / ``token_rows_n``).

Letters as in DEVELOPERS.md: J the patches of a micro-batch's images, U their merged tokens (J / merge^2, one per
image pad token), Y the values of one patch (in_channels x temporal_patch_size x patch_size^2), A the attention
segments (one per image frame); in the tower D is its own width and H, d its heads; its output [U, out_hidden_size]
has the text model's D.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from core.device import queued_copy
from models.footprint import LayerActivations
from models.init import ShardedInit, constant, normal
from models.layers import rotate_half
from models.qwen3_5_moe.args import VisionArgs

Tensor = torch.Tensor


class VisionInputs(NamedTuple):
    """A micro-batch's images as the tower and the decoder take them (``vision_inputs``): tensors on the device,
    segment lengths on the host."""

    pixel_values_JY: Tensor  # the patches, as transformers' Qwen2-VL image processor flattens them
    positions_J2: Tensor  # each patch's (row, column) in its image, for the 2-D rotary
    interp_index_J4: Tensor  # the four learned positions each patch's position embedding is resampled from
    interp_weight_J4: Tensor  # and their bilinear weights (fp32)
    lengths_A: tuple[int, ...]  # patches of each attention segment (an image's frame), in order
    token_positions_n: Tensor  # where merged tokens go: flat indices into this rank's [B * t] tokens
    token_rows_n: Tensor | None  # which merged tokens go there (rows of the tower's output); None: all, in order
    grid_thw_A3: Tensor  # each image's patch grid (t, h, w), on the host, as the loader gave it
    dummy: bool = False  # no image: a stand-in the tower runs on so that every rank runs it, contributing zero


def vision_inputs(pixel_values_JY: Tensor, grid_thw_A3: Tensor, args: VisionArgs, dev: torch.device,
                  token_positions_n: Tensor, token_rows_n: Tensor | None = None) -> VisionInputs:
    """The tower's inputs for images ``pixel_values_JY`` of patch grids ``grid_thw_A3`` [images, 3] (host tensors,
    as the loader yields them), queued to ``dev``. ``token_positions_n``: the flat positions (into [B * t]) of the
    image pad tokens this rank holds; ``token_rows_n``: which of the window's merged tokens they are (None: all of
    them, in order). No image (zero rows): a one-token dummy image of zeros, run for its (zero) gradient only."""
    given, dummy = grid_thw_A3, grid_thw_A3.shape[0] == 0
    if dummy:
        grid_thw_A3 = torch.tensor([[1, args.spatial_merge_size, args.spatial_merge_size]])
        pixel_values_JY = torch.zeros(args.merge_unit, args.patch_dim)
        token_rows_n = torch.zeros(0, dtype=torch.long)
    patches = int(grid_thw_A3.prod(dim=1).sum())
    if pixel_values_JY.shape != (patches, args.patch_dim):
        raise ValueError(f"pixel_values {tuple(pixel_values_JY.shape)} do not fit image_grid_thw "
                         f"{grid_thw_A3.tolist()}: expected [{patches}, {args.patch_dim}] (in_channels x "
                         "temporal_patch_size x patch_size^2 values per patch)")
    index_J4, weight_J4 = interpolation_taps(grid_thw_A3, round(args.num_position_embeddings**0.5),
                                             args.spatial_merge_size)
    lengths_A = tuple(int(h * w) for t, h, w in grid_thw_A3.tolist() for _ in range(int(t)))
    queued = [queued_copy(x, dev) for x in (pixel_values_JY, rotary_positions(grid_thw_A3, args.spatial_merge_size),
                                            index_J4, weight_J4, token_positions_n)]
    rows = None if token_rows_n is None else queued_copy(token_rows_n, dev)
    return VisionInputs(*queued[:4], lengths_A, queued[4], rows, given, dummy)


def rotary_positions(grid_thw_A3: Tensor, merge: int) -> Tensor:
    """[J, 2]: each patch's (row, column) in its image, in the processor's patch order (each merge x merge block's
    patches together, blocks row by row), repeated for every frame; transformers' ``get_vision_position_ids``."""
    out = []
    for t, h, w in grid_thw_A3.tolist():
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        block = (h // merge, merge, w // merge, merge)
        rc = torch.stack([rows.reshape(block).transpose(1, 2).flatten(), cols.reshape(block).transpose(1, 2).flatten()],
                         dim=-1)
        out.append(rc.repeat(t, 1))
    return torch.cat(out)


def interpolation_taps(grid_thw_A3: Tensor, side: int, merge: int) -> tuple[Tensor, Tensor]:
    """[J, 4] indices into the ``side`` x ``side`` learned positions and their weights: each patch's embedding
    bilinearly resampled (corners aligned) from the grid to its image's h x w, in the processor's patch order;
    transformers' ``get_vision_interpolation_indices_and_weights`` (bilinear, align_corners=True)."""
    index, weight = [], []
    for t, h, w in grid_thw_A3.tolist():
        rows, cols = rotary_positions(torch.tensor([[1, h, w]]), merge).unbind(1)
        (r0, r1), (wr0, wr1) = _taps(rows, h, side)
        (c0, c1), (wc0, wc1) = _taps(cols, w, side)
        index.append(torch.stack([r0 * side + c0, r0 * side + c1, r1 * side + c0, r1 * side + c1], -1).repeat(t, 1))
        weight.append(torch.stack([wr0 * wc0, wr0 * wc1, wr1 * wc0, wr1 * wc1], -1).repeat(t, 1))
    return torch.cat(index), torch.cat(weight)


def _taps(index: Tensor, size: int, side: int) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """The two grid rows (or columns) a position between 0 and side - 1 falls between, and their weights."""
    src = index.float() * (side - 1) / max(size - 1, 1)
    floor = src.floor()
    frac = src - floor
    lo = floor.long()
    return (lo.clamp(0, side - 1), (lo + 1).clamp(0, side - 1)), (1 - frac, frac)


class PatchEmbed(nn.Module):
    """transformers' Conv3d (kernel = stride = temporal_patch_size x patch_size^2) as what it is on flattened patches:
    one matmul with its weight [D, in_channels, temporal, patch, patch] seen as [D, Y]."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        kernel = (args.temporal_patch_size, args.patch_size, args.patch_size)
        self.proj = nn.Conv3d(args.in_channels, args.hidden_size, kernel_size=kernel, stride=kernel, bias=True)

    def forward(self, pixel_values_JY: Tensor) -> Tensor:
        weight_DY = self.proj.weight.flatten(1)
        return F.linear(pixel_values_JY.to(weight_DY.dtype), weight_DY, self.proj.bias)


def vision_rotary(positions_J2: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos/sin [J, d] (fp32) of the 2-D rotary: head_dim / 4 frequencies over the row, the same over the column,
    the two halves of the rotated channels each [row | column] (transformers' axial
    ``Qwen3_5MoeVisionRotaryEmbedding``)."""
    quarter = head_dim // 2
    inv_freq = 1.0 / theta ** (torch.arange(0, quarter, 2, device=positions_J2.device, dtype=torch.float32) / quarter)
    freqs_J2f = positions_J2.float()[..., None] * inv_freq
    half_Jh = freqs_J2f.flatten(1)  # [row freqs | column freqs]
    emb_Jd = torch.cat((half_Jh, half_Jh), dim=-1)
    return emb_Jd.cos(), emb_Jd.sin()


class VisionAttention(nn.Module):
    """Bidirectional attention within each image frame (``lengths_A``), the 2-D rotary on q and k in fp32."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.num_heads, self.head_dim = args.num_heads, args.head_dim
        self.qkv = nn.Linear(args.hidden_size, 3 * args.hidden_size, bias=True)
        self.proj = nn.Linear(args.hidden_size, args.hidden_size, bias=True)

    def forward(self, x_JD: Tensor, cos_Jd: Tensor, sin_Jd: Tensor, lengths_A: tuple[int, ...]) -> Tensor:
        J = x_JD.shape[0]
        q_JHd, k_JHd, v_JHd = self.qkv(x_JD).view(J, 3, self.num_heads, self.head_dim).unbind(1)
        cos_J1d, sin_J1d = cos_Jd[:, None], sin_Jd[:, None]
        q_JHd, k_JHd = ((t.float() * cos_J1d + rotate_half(t.float()) * sin_J1d).to(t.dtype) for t in (q_JHd, k_JHd))
        # One SDPA per frame (lengths known on the host: no device read), as transformers' sdpa path runs them.
        outs = [F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
                for q, k, v in zip(*(t.split(lengths_A) for t in (q_JHd, k_JHd, v_JHd)))]
        o_HJd = torch.cat(outs, dim=1)
        return self.proj(o_HJd.transpose(0, 1).reshape(J, -1))


class VisionMLP(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(args.hidden_size, args.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(args.intermediate_size, args.hidden_size, bias=True)

    def forward(self, x_JD: Tensor) -> Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x_JD), approximate="tanh"))


class VisionBlock(nn.Module):
    """``x + attn(norm1(x))``, then ``x + mlp(norm2(x))``: an FSDP unit and a checkpointed block of the plan."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(args.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(args.hidden_size, eps=1e-6)
        self.attn = VisionAttention(args)
        self.mlp = VisionMLP(args)

    def forward(self, x_JD: Tensor, cos_Jd: Tensor, sin_Jd: Tensor, lengths_A: tuple[int, ...]) -> Tensor:
        x_JD = x_JD + self.attn(self.norm1(x_JD), cos_Jd, sin_Jd, lengths_A)
        return x_JD + self.mlp(self.norm2(x_JD))

    def saved_activations(self) -> LayerActivations:
        """Per patch, without checkpointing: the two LayerNorms' inputs and outputs (+ mean and rstd, fp32), qkv,
        q and k rotated (their fp32 copies are recomputed in the rotary's backward), the attention output (+
        logsumexp per head), the proj output, the MLP's fc1 output and its GELU; selective: the matmuls' and the
        attention's outputs."""
        D, I, H = self.attn.proj.out_features, self.mlp.linear_fc1.out_features, self.attn.num_heads
        return LayerActivations(none=4 * D + 3 * D + 2 * D + D + D + 2 * I, none_fp32=4 + H,
                                selective=3 * D + D + D + I + D, selective_fp32=H)


class PatchMerger(nn.Module):
    """LayerNorm on each patch, then each spatial_merge_size^2 consecutive patches (one merge block) concatenated,
    through fc1, the exact GELU and fc2 to the text model's width."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.merged = args.hidden_size * args.merge_unit
        self.norm = nn.LayerNorm(args.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.merged, self.merged, bias=True)
        self.linear_fc2 = nn.Linear(self.merged, args.out_hidden_size, bias=True)

    def forward(self, x_JD: Tensor) -> Tensor:
        x_UM = self.norm(x_JD).view(-1, self.merged)
        return self.linear_fc2(F.gelu(self.linear_fc1(x_UM)))


class VisionModel(nn.Module):
    """The tower (transformers' ``model.visual``): patches in, one token per merge block out."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.args = args
        self.patch_embed = PatchEmbed(args)
        self.pos_embed = nn.Embedding(args.num_position_embeddings, args.hidden_size)
        self.blocks = nn.ModuleList([VisionBlock(args) for _ in range(args.depth)])
        self.merger = PatchMerger(args)

    def forward(self, images: VisionInputs) -> Tensor:
        """[U, out_hidden_size]: the merged tokens of every image, in order."""
        x_JD = self.patch_embed(images.pixel_values_JY)
        pos_J4D = self.pos_embed(images.interp_index_J4)
        x_JD = x_JD + (pos_J4D * images.interp_weight_J4[..., None]).sum(1).to(x_JD.dtype)  # fp32 weights
        cos_Jd, sin_Jd = vision_rotary(images.positions_J2, self.args.head_dim, self.args.rope_theta)
        for block in self.blocks:
            x_JD = block(x_JD, cos_Jd, sin_Jd, images.lengths_A)
        return self.merger(x_JD)

    def saved_activations(self) -> LayerActivations:
        """Per patch, outside the blocks (never checkpointed): the patch embedding's input and output, the position
        embedding's taps, the merger's LayerNorm input and output (+ fp32 mean and rstd) and, per merged token
        (a 1 / merge^2 share of a patch), fc1's output and its GELU and fc2's output."""
        a, D = self.args, self.args.hidden_size
        merged = (2 * D * a.merge_unit + a.out_hidden_size) // a.merge_unit
        per_patch = a.patch_dim + D + 4 * D + 2 * D + merged
        return LayerActivations(none=per_patch, none_fp32=2 + 4, selective=per_patch, selective_fp32=2 + 4)

    @torch.no_grad()
    def init_weights(self, init: ShardedInit) -> None:
        """transformers' init for the tower: N(0, initializer_range) for matrices, the patch embedding and the
        positions, zero biases, LayerNorms at weight 1 and bias 0."""
        std = normal(self.args.initializer_range)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Conv3d, nn.Embedding)):
                init(module.weight, std)
                if getattr(module, "bias", None) is not None:
                    init(module.bias, constant(0.0))
            elif isinstance(module, nn.LayerNorm):
                init(module.weight, constant(1.0))
                init(module.bias, constant(0.0))


def insert_images(h_BTD: Tensor, tokens_UD: Tensor, images: VisionInputs) -> Tensor:
    """The decoder's input with the merged image tokens in place of the image pad tokens this rank holds. A dummy
    image's tokens are added times zero, so that the tower's parameters get a (zero) gradient on every rank."""
    if images.dummy:
        return h_BTD + 0.0 * tokens_UD.sum().to(h_BTD.dtype)
    rows_nD = tokens_UD if images.token_rows_n is None else tokens_UD.index_select(0, images.token_rows_n)
    return h_BTD.flatten(0, 1).index_copy(0, images.token_positions_n, rows_nD.to(h_BTD.dtype)).view_as(h_BTD)
