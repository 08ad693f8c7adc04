"""Packing: windows of seq_len + 1 tokens cut from a source's stream into batches of input ids, labels and
position ids that restart at every document (``data.document_mask``), the held-out tail of a source, and a cp rank's
share of a batch. Letters as in DEVELOPERS.md: B the local batch, T seq_len, T1 = seq_len + 1."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from core.constants import IGNORE_INDEX
from training.data.token_shards import ShardFiles, TokenStream


class Span:
    """Tokens [start, stop) of a 1-D id or mask sequence (an array or a TokenStream), indexable like it."""

    def __init__(self, seq: np.ndarray | TokenStream | Span, start: int, stop: int) -> None:
        self._seq, self._start, self._len = seq, start, stop - start

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: np.ndarray) -> np.ndarray:
        return self._seq[np.asarray(index) + self._start]


@dataclass
class Source:
    """One stream of windows for PackedLoader."""
    name: str
    ids: np.ndarray | TokenStream | Span  # 1-D ids
    mask: np.ndarray | TokenStream | Span | None = None  # 1-D loss mask of the targets; None: every target trained
    weight: float = 1.0
    identity: str = ""  # a digest of the data's contents, compared on resume (PackedLoader.load_state_dict)
    files: ShardFiles | None = None  # token shards: the files as opened, checked for changes during the run


_SEARCH_BLOCK = 1 << 20  # ids read at a time looking for a document start


def hold_out(src: Source, fraction: float, eos_id: int) -> tuple[Source, Source]:
    """(training, validation) parts of ``src``: validation from the first document start (the token after an
    ``eos_id``) at or after ``(1 - fraction)`` of its tokens, so it holds whole documents only."""
    n = len(src.ids)
    cut = int(n * (1 - fraction))
    while cut < n:
        block = src.ids[np.arange(max(cut - 1, 0), min(cut - 1 + _SEARCH_BLOCK, n))]
        ends = np.flatnonzero(block == eos_id)
        if ends.size:
            cut = max(cut - 1, 0) + int(ends[0]) + 1
            break
        cut += _SEARCH_BLOCK
    if cut >= n:
        raise ValueError(f"data.val_fraction={fraction}: no document starts in the last {fraction:.1%} of "
                         f"{src.name!r} ({n} tokens); raise data.val_fraction or check data.eos_id")

    def part(start: int, stop: int) -> Source:
        mask = None if src.mask is None else Span(src.mask, start, stop)
        return dataclasses.replace(src, ids=Span(src.ids, start, stop), mask=mask)

    return part(0, cut), part(cut, n)


def position_ids(input_ids_BT: torch.Tensor, eos_id: int | None) -> torch.Tensor:
    """Distance of each token from its document's start: the window start, or the token after an eos (None: the
    window is one document)."""
    t_BT = torch.arange(input_ids_BT.shape[1]).expand_as(input_ids_BT)
    if eos_id is None:
        return t_BT.contiguous()
    start_BT = torch.zeros_like(input_ids_BT, dtype=torch.bool)
    start_BT[:, 0] = True
    start_BT[:, 1:] = input_ids_BT[:, :-1] == eos_id
    return t_BT - torch.where(start_BT, t_BT, 0).cummax(dim=1).values


def packed_batch(sources: list[Source], source_B: np.ndarray, windows_B: np.ndarray, seq_len: int,
                 eos_id: int | None) -> dict[str, torch.Tensor]:
    """input_ids, labels (IGNORE_INDEX where the mask says untrained) and position_ids of window ``windows_B[b]``
    of source ``source_B[b]`` for each row b."""
    index_BT1 = windows_B[:, None] * (seq_len + 1) + np.arange(seq_len + 1)
    tokens_BT1 = np.empty(index_BT1.shape, dtype=np.int64)
    trained_BT = np.ones((len(windows_B), seq_len), dtype=bool)
    for s in np.unique(source_B):
        at_B, src = source_B == s, sources[s]
        tokens_BT1[at_B] = src.ids[index_BT1[at_B]]
        if src.mask is not None:
            trained_BT[at_B] = src.mask[index_BT1[at_B][:, 1:]].astype(bool)
    tokens_BT1 = torch.from_numpy(tokens_BT1)
    labels_BT = tokens_BT1[:, 1:].clone()
    labels_BT[~torch.from_numpy(trained_BT)] = IGNORE_INDEX
    input_ids_BT = tokens_BT1[:, :-1].contiguous()
    return {"input_ids": input_ids_BT, "labels": labels_BT, "position_ids": position_ids(input_ids_BT, eos_id)}


def context_shard(batch: dict[str, torch.Tensor], cp_rank: int, cp: int) -> dict[str, torch.Tensor]:
    """This cp rank's contiguous 1/cp of every sequence of ``batch`` (tensors [..., T]; T divisible by cp)."""
    if cp == 1:
        return batch
    return {name: x.chunk(cp, dim=-1)[cp_rank].contiguous() for name, x in batch.items()}
