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
from training.data.packing import context_shard
from training.metrics import attended_flops_per_token


@dataclass(frozen=True)
class Batch:
    """One micro-batch on this rank's device: this cp rank's 1/cp of each of its sequences ([B, t]), and what the
    trainer read on the host so that the forward reads nothing back from the device."""
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    packed: KnownDocuments | bool  # the whole rows' documents (models.layers.known_documents), or False: one a row
    trained_rows: torch.Tensor | None  # the labels the LM head computes (models.causal_lm.trained_rows)
    mtp: MtpBatch | None  # what the MTP head reads and predicts, where it trains
    attended_flops: float  # FLOPs per token over the attention pairs and LM-head rows computed (training.metrics)

    def forward_kwargs(self) -> dict[str, Any]:
        return {"packed": self.packed, "trained_rows": self.trained_rows, "mtp": self.mtp}


def prepare_batches(windows: list[dict[str, torch.Tensor]], model_args: Any, cp_rank: int, cp: int,
                    dev: torch.device, mtp: bool) -> list[Batch]:
    """The step's micro-batches from the loader's windows (host tensors [B, T] of this dp rank's whole sequences;
    the cp ranks of a dp slice read the same ones). The order is the rule:

    1. Documents, from each whole window's position ids, on the host: the forward asks the device nothing (a read
       that would wait for the step before to finish), and the attended FLOPs count the same documents.
    2. The MTP head's shifted ids and labels (``mtp``), on the whole window: the shift by one crosses the cp
       shards' borders as in one process's rows. Shifting after the split would lose one label per shard.
    3. The cp split: this rank's contiguous 1/cp of every tensor (``training.data.packing.context_shard``).
    4. To the device (queued copies), with each shard's trained rows, from the host copy of its labels.
    """
    batches = []
    for window in windows:
        packed = known_documents(window["position_ids"], dev)  # 1
        trained_share = (window["labels"] != IGNORE_INDEX).double().mean().item()  # host data: no device read
        attended = attended_flops_per_token(model_args, packed, tuple(window["input_ids"].shape), trained_share)
        if mtp:  # 2
            window = {**window, **mtp_batch(window["input_ids"], window["labels"], window["position_ids"])}
        shard = context_shard(window, cp_rank, cp)  # 3
        on_dev = to_device(shard, dev)  # 4
        batches.append(Batch(
            on_dev["input_ids"], on_dev["position_ids"], on_dev["labels"], packed,
            trained_rows(shard["labels"], dev),
            MtpBatch(on_dev["mtp_input_ids"], on_dev["mtp_labels"], trained_rows(shard["mtp_labels"], dev))
            if mtp else None, attended))
    return batches
