"""Validation loss: the model in eval mode over fixed held-out batches (``training.data.validation.ValidationSet``)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from core.constants import IGNORE_INDEX
from core.device import to_device
from models.causal_lm import trained_rows
from training.batch import window_images


@torch.no_grad()
def validation_loss(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]], device: torch.device,
                    autocast: torch.autocast, group: dist.ProcessGroup | None) -> float:
    """Mean token cross-entropy of ``batches`` (this rank's rows, cp-sharded as for training, with their images
    where the data has some: ``training.batch.validation_shard``) over the data-parallel ``group``: summed losses and
    trained-token counts are all-reduced before the division, so every layout of the same global batch gets the same
    value. The router statistics (aux and z losses) are not part of it. As in
    training, the LM head computes logits for the trained labels only (``trained_rows``, from the host labels)."""
    was_training = model.training
    model.eval()
    totals = torch.zeros(2, device=device, dtype=torch.float64)  # loss sum, trained tokens
    for batch in batches:
        rows_N = trained_rows(batch["labels"], device)
        ids, pixels, grid, cp_rank, cp = batch.get("images") or (None,) * 5
        images = {} if ids is None else {"images": window_images(ids, pixels, grid, model.args, cp_rank, cp, device)}
        batch = to_device({k: v for k, v in batch.items() if k != "images"}, device)
        with autocast:
            out = model(batch["input_ids"], batch["position_ids"], batch["labels"], trained_rows=rows_N, **images)
        totals += torch.stack([out.loss_sum.double(), (batch["labels"] != IGNORE_INDEX).sum().double()])
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(totals, group=group)
    model.train(was_training)
    return (totals[0] / totals[1].clamp(min=1)).item()
