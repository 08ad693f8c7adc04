"""A step's micro-batches as the forward takes them (``Batch``), made from the loader's windows on the host by
``prepare_batches``, whose docstring holds the order they are made in and why."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from core.constants import IGNORE_INDEX
from core.device import to_device
from models.causal_lm import MtpBatch, mtp_batch, trained_rows
from models.layers import KnownDocuments, known_documents
from models.qwen3_5_moe.vision import VisionInputs, vision_inputs
from training.data.packing import context_shard
from training.metrics import attended_flops_per_token, tower_flops_per_token


@dataclass(frozen=True)
class Batch:
    """One micro-batch on this rank's device: this cp rank's 1/cp of each of its sequences ([B, t]; position ids
    [B, t], or [4, B, t] for data with images), and what the trainer read on the host so that the forward reads
    nothing back from the device."""
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    packed: KnownDocuments | bool  # the whole rows' documents (models.layers.known_documents), or False: one a row
    trained_rows: torch.Tensor | None  # the labels the LM head computes (models.causal_lm.trained_rows)
    mtp: MtpBatch | None  # what the MTP head reads and predicts, where it trains
    # FLOPs per token over the attention pairs and LM-head rows computed, and the vision tower's (training.metrics)
    attended_flops: float
    # The window's images (all of them, on every cp rank: models.qwen3_5_moe.vision.vision_inputs), a dummy where a
    # window of data with images has none; None for data without images (the text model runs alone)
    images: VisionInputs | None = None

    @property
    def pixel_values(self) -> torch.Tensor | None:
        """The window's image patches [J, Y], unsplit, on the device (None: text-only data)."""
        return None if self.images is None or self.images.dummy else self.images.pixel_values_JY

    @property
    def image_grid_thw(self) -> torch.Tensor | None:
        """The window's images' patch grids [images, 3], on the host (None: text-only data)."""
        return None if self.images is None else self.images.grid_thw_A3

    def forward_kwargs(self) -> dict[str, Any]:
        images = {} if self.images is None else {"images": self.images}
        return {"packed": self.packed, "trained_rows": self.trained_rows, "mtp": self.mtp, **images}


def prepare_batches(windows: list[dict[str, torch.Tensor]], model_args: Any, cp_rank: int, cp: int,
                    dev: torch.device, mtp: bool) -> list[Batch]:
    """The step's micro-batches from the loader's windows (host tensors [B, T] of this dp rank's whole sequences;
    the cp ranks of a dp slice read the same ones). The order is the rule:

    1. Documents, from each whole window's position ids, on the host: the forward asks the device nothing (a read
       that would wait for the step before to finish), and the attended FLOPs count the same documents.
    2. The MTP head's shifted ids and labels (``mtp``), on the whole window: the shift by one crosses the cp
       shards' borders as in one process's rows. Shifting after the split would lose one label per shard.
    3. The cp split: this rank's contiguous 1/cp of every tensor (``training.data.packing.context_shard``), but the
       images (``pixel_values``, ``image_grid_thw``), which every cp rank runs whole; each keeps the image tokens of
       its own shard (``image_tokens``, from the whole window's ids, where the window's tokens are in order).
    4. To the device (queued copies), with each shard's trained rows, from the host copy of its labels.
    """
    batches = []
    for window in windows:
        window, pixels = split_images(window)
        packed = known_documents(window["position_ids"], dev)  # 1
        trained_share = (window["labels"] != IGNORE_INDEX).double().mean().item()  # host data: no device read
        attended = attended_flops_per_token(model_args, packed, tuple(window["input_ids"].shape), trained_share)
        if mtp:  # 2
            window = {**window, **mtp_batch(window["input_ids"], window["labels"], window["position_ids"])}
        shard = context_shard(window, cp_rank, cp)  # 3
        images = None
        if pixels is not None:  # the attended FLOPs gain the tower's (it runs whole on every cp rank: counted once)
            images = window_images(window["input_ids"], *pixels, model_args, cp_rank, cp, dev, mtp)
            attended += tower_flops_per_token(model_args.vision_config, pixels[1], window["input_ids"].numel())
        on_dev = to_device(shard, dev)  # 4
        batches.append(Batch(
            on_dev["input_ids"], on_dev["position_ids"], on_dev["labels"], packed,
            trained_rows(shard["labels"], dev),
            MtpBatch(on_dev["mtp_input_ids"], on_dev["mtp_labels"], trained_rows(shard["mtp_labels"], dev))
            if mtp else None, attended, images))
    return batches


IMAGE_KEYS = ("pixel_values", "image_grid_thw")  # a window's images (docs/data.md): never split over cp


def split_images(window: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor],
                                                           tuple[torch.Tensor, torch.Tensor] | None]:
    """A window's token tensors, and its (pixel_values, image_grid_thw) where the data has images (else None)."""
    if "pixel_values" not in window:
        return window, None
    return ({k: v for k, v in window.items() if k not in IMAGE_KEYS},
            (window["pixel_values"], window["image_grid_thw"]))


def window_images(input_ids_BT: torch.Tensor, pixel_values_JY: torch.Tensor, grid_thw_A3: torch.Tensor,
                  model_args: Any, cp_rank: int, cp: int, dev: torch.device, mtp: bool = False) -> VisionInputs:
    """The tower's inputs for a whole window's images (host tensors), with where this cp rank's image pad tokens
    are in its shard and which of the window's merged tokens they take (``image_tokens``). With ``mtp``, also the pad
    tokens of the MTP head's ids (the window's shifted by one: ``models.causal_lm.mtp_batch``), after the shard's:
    the decoder embeds both in one [2B, t] call and the head reads token t+1's input embedding, an image's merged
    token where it is one, as the published inference code's MTP does (vLLM's ``Qwen3_5MTP.embed_input_ids`` merges
    the multimodal embeddings)."""
    vision = getattr(model_args, "vision_config", None)
    if vision is None:  # a window of such data without an image too: the next one may have some
        raise ValueError("the data has images (its windows carry pixel_values) and the model has no vision tower: "
                         "train with model.vision=true (model.arch.vision_config set: model=hf reads it from "
                         "config.json)")
    positions_n, rows_n = image_tokens(input_ids_BT, grid_thw_A3, vision, cp_rank, cp)
    if mtp:
        shifted_n, shifted_rows_n = image_tokens(input_ids_BT, grid_thw_A3, vision, cp_rank, cp, shift=1)
        merged = torch.arange(int(grid_thw_A3.prod(dim=1).sum()) // vision.merge_unit)
        positions_n = torch.cat([positions_n, shifted_n + input_ids_BT.numel() // cp])
        rows_n = torch.cat([merged if rows_n is None else rows_n, shifted_rows_n])
    return vision_inputs(pixel_values_JY, grid_thw_A3, vision, dev, positions_n, rows_n)  # host tensors: it queues


def image_tokens(input_ids_BT: torch.Tensor, grid_thw_A3: torch.Tensor, vision: Any, cp_rank: int, cp: int,
                 shift: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(flat positions in this cp rank's [B, T / cp] shard of the image pad tokens it holds, which of the window's
    merged image tokens they are: None for all, in order, as without cp). The window's tokens are its images' in
    order, row by row; a window whose pad tokens do not count its images' merged patches is refused. ``shift``: of
    the window's ids rolled left by that many (the MTP head's: the pad tokens keep their merged tokens)."""
    is_image_BT = input_ids_BT == vision.image_token_id
    tokens = int(grid_thw_A3.prod(dim=1).sum()) // vision.merge_unit
    if int(is_image_BT.sum()) != tokens:
        raise ValueError(f"a window holds {int(is_image_BT.sum())} image pad tokens (id {vision.image_token_id}) "
                         f"for images of {tokens} merged patches (image_grid_thw {grid_thw_A3.tolist()}, "
                         f"spatial_merge_size {vision.spatial_merge_size}): an image's tokens split from it?")
    if cp == 1 and shift == 0:
        return is_image_BT.flatten().nonzero().squeeze(1), None
    order_BT = is_image_BT.flatten().cumsum(0).view_as(is_image_BT) - 1  # each pad token's merged token
    rolled = {"image": is_image_BT.roll(-shift, dims=1), "order": order_BT.roll(-shift, dims=1)}
    shard = context_shard(rolled, cp_rank, cp)
    return shard["image"].flatten().nonzero().squeeze(1), shard["order"][shard["image"]]


def validation_shard(window: dict[str, torch.Tensor], cp_rank: int, cp: int) -> dict[str, Any]:
    """A held-out window as ``training.evaluate.validation_loss`` takes it: this cp rank's shard of its tokens, and
    where the data has images, ``images``: what ``window_images`` makes of the whole window's, at each evaluation
    (the model's vision hyper-parameters and the device are the evaluation's)."""
    window, pixels = split_images(window)
    shard = context_shard(window, cp_rank, cp)
    return shard if pixels is None else {**shard, "images": (window["input_ids"], *pixels, cp_rank, cp)}
