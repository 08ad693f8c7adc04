"""Packing: windows of seq_len + 1 tokens cut from a source's stream into batches of input ids, labels and
position ids that restart at every document (``data.document_mask``), the held-out tail of a source, and a cp rank's
share of a batch. Letters as in DEVELOPERS.md: B the local batch, T seq_len, T1 = seq_len + 1.

A source with images (chats for a model with a vision tower, ``Images``) is cut so that no image's tokens
(<|vision_start|> <|image_pad|>... <|vision_end|>) are split: a window whose cut would fall inside an image ends
before its <|vision_start|> (its inputs padded, the pad untrained and a document of its own) and the next window
starts there; elsewhere the cut is the text windows' (a stream without images is cut exactly as text). A
multimodal batch adds pixel_values [P, patch_dim] and image_grid_thw [I, 3] (its images in the order of their
tokens, row after row; P = I = 0 in a window without one) and has [4, B, T] position ids: row 0 the text positions,
rows 1..3 the multimodal rotary positions (``training.data.vision.rope_index``); image and vision start / end tokens
are never trained. An image is read and processed when a window holding it is made."""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from core.constants import IGNORE_INDEX
from training.data.token_shards import ShardFiles, TokenStream
from training.data.vision import ImageError, ImageRecord, VisionData, rope_index


class Span:
    """Tokens [start, stop) of a 1-D id or mask sequence (an array or a TokenStream), indexable like it."""

    def __init__(self, seq: np.ndarray | TokenStream | Span, start: int, stop: int) -> None:
        self._seq, self._start, self._len = seq, start, stop - start

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: np.ndarray) -> np.ndarray:
        return self._seq[np.asarray(index) + self._start]


@dataclass(eq=False)
class Images:
    """The images of a source's stream: where each one's tokens start (its <|vision_start|>), what it is, and the
    data file naming them (for errors)."""
    starts: np.ndarray  # [I] int64, increasing
    records: tuple[ImageRecord, ...]
    data_path: str
    _layouts: dict = dataclasses.field(default_factory=dict, repr=False)  # (num_tokens, seq_len) -> layout

    @classmethod
    def of(cls, ids: np.ndarray, records: tuple[ImageRecord, ...], vision: VisionData, data_path: str) -> Images:
        """The images of the stream ``ids``, whose <|vision_start|> tokens are theirs in order (text cannot forge a
        special token); ValueError if the stream and the records disagree (a damaged cache)."""
        starts = np.flatnonzero(ids == vision.vision_start_token_id)
        ends = starts + np.array([r.tokens for r in records], dtype=np.int64) + 1 if len(starts) == len(records) \
            else None
        if ends is None or (len(ends) and (ends[-1] >= len(ids) or (ids[ends] != vision.vision_end_token_id).any())):
            raise ValueError(f"the tokenized corpus of {data_path} holds {len(starts)} images' tokens and records "
                             f"{len(records)} images: a damaged cache; delete it (data.cache_dir) and start again")
        return cls(starts.astype(np.int64), records, data_path)

    def part(self, start: int, stop: int) -> Images:
        """The images of tokens [start, stop), their starts counted from ``start``."""
        lo, hi = np.searchsorted(self.starts, [start, stop])
        return Images(self.starts[lo:hi] - start, self.records[lo:hi], self.data_path)

    def error(self, record: ImageRecord, e: Exception) -> ImageError:
        return ImageError(f"{self.data_path} {record.where}: {e}")

    def layout(self, num_tokens: int, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
        """(start, input length) of each window of a stream of ``num_tokens``: T = seq_len inputs and one more
        target, the next window after it, except where that cut would split an image: then the window's inputs end
        before the image (its <|vision_start|> the last target) and the next window starts at the image. The tail
        that makes no full window is dropped, as text's. ValueError names an image longer than a window."""
        if (num_tokens, seq_len) not in self._layouts:
            self._layouts[num_tokens, seq_len] = self._layout(num_tokens, seq_len)
        return self._layouts[num_tokens, seq_len]

    def _layout(self, num_tokens: int, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
        sizes = np.array([r.tokens + 2 for r in self.records], dtype=np.int64)
        if len(sizes) and sizes.max() > seq_len:
            record = self.records[int(sizes.argmax())]
            raise ValueError(f"{self.data_path} {record.where}: the image becomes {record.tokens + 2} tokens (patch grid "
                             f"{list(record.grid)} of its {record.width}x{record.height} pixels resized), more than a "
                             f"window of data.seq_len={seq_len}: raise data.seq_len, or lower data.image_max_pixels")
        starts, lengths = [], []
        span_a, span_z = self.starts.tolist(), (self.starts + sizes - 1).tolist()
        s = 0
        while s + seq_len + 1 <= num_tokens:
            k = bisect.bisect_right(span_a, s + seq_len) - 1  # the last image starting at or before the last target
            if k >= 0 and span_z[k] >= s + seq_len:  # the cut falls inside it: end the window before it
                starts.append(s), lengths.append(span_a[k] - s)
                s = span_a[k]
            else:
                starts.append(s), lengths.append(seq_len)
                s += seq_len + 1
        return np.array(starts, dtype=np.int64), np.array(lengths, dtype=np.int64)


@dataclass
class Source:
    """One stream of windows for PackedLoader."""
    name: str
    ids: np.ndarray | TokenStream | Span  # 1-D ids
    mask: np.ndarray | TokenStream | Span | None = None  # 1-D loss mask of the targets; None: every target trained
    weight: float = 1.0
    identity: str = ""  # a digest of the data's contents, compared on resume (PackedLoader.load_state_dict)
    files: ShardFiles | None = None  # token shards: the files as opened, checked for changes during the run
    images: Images | None = None  # chats with images: never split by a window

    def num_windows(self, seq_len: int) -> int:
        if self.images is None:
            return len(self.ids) // (seq_len + 1)
        return len(self.images.layout(len(self.ids), seq_len)[0])


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
        images = None if src.images is None else src.images.part(start, stop)
        return dataclasses.replace(src, ids=Span(src.ids, start, stop), mask=mask, images=images)

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
                 eos_id: int | None, vision: VisionData | None = None) -> dict[str, torch.Tensor]:
    """input_ids, labels (IGNORE_INDEX where the mask says untrained) and position_ids of window ``windows_B[b]``
    of source ``source_B[b]`` for each row b; with ``vision`` (a multimodal run), the multimodal batch of the module
    docstring."""
    if vision is not None:
        return _multimodal_batch(sources, source_B, windows_B, seq_len, eos_id, vision)
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


def _multimodal_batch(sources: list[Source], source_B: np.ndarray, windows_B: np.ndarray, seq_len: int,
                      eos_id: int | None, vision: VisionData) -> dict[str, torch.Tensor]:
    B, T = len(windows_B), seq_len
    input_BT = np.full((B, T), vision.pad_token_id, dtype=np.int64)
    labels_BT = np.full((B, T), IGNORE_INDEX, dtype=np.int64)
    start_BT = np.zeros((B, T), dtype=bool)  # where a document starts (row 0 of the position ids)
    start_BT[:, 0] = True
    images: list[tuple[Images, ImageRecord]] = []  # the window's images, in the order of their tokens
    for b, (s_index, w) in enumerate(zip(source_B.tolist(), windows_B.tolist())):
        src = sources[s_index]
        if src.images is None:
            start, length = w * (T + 1), T
        else:
            starts, lengths = src.images.layout(len(src.ids), T)
            start, length = int(starts[w]), int(lengths[w])
        tokens = src.ids[np.arange(start, start + length + 1)].astype(np.int64)
        input_BT[b, :length], labels_BT[b, :length] = tokens[:-1], tokens[1:]
        if src.mask is not None:
            trained = src.mask[np.arange(start + 1, start + length + 1)].astype(bool)
            labels_BT[b, :length][~trained] = IGNORE_INDEX
        if eos_id is not None:
            start_BT[b, 1:length] = tokens[:length - 1] == eos_id
            start_BT[b, length:length + 1] = True  # the padding: a document of its own
        if src.images is not None:
            lo, hi = np.searchsorted(src.images.starts, [start, start + length])
            images += [(src.images, record) for record in src.images.records[lo:hi]]
    labels_BT[np.isin(labels_BT, vision.token_ids)] = IGNORE_INDEX
    rows = [int(np.prod(record.grid)) for _, record in images]
    pixel_values_PD = torch.empty(sum(rows), vision.processing.patch_dim)  # filled in place: no copy of a concat
    offsets = np.cumsum([0, *rows]).tolist()
    for (owner, record), a, z in zip(images, offsets[:-1], offsets[1:]):
        try:
            record.pixels(vision.processing, pixel_values_PD[a:z].numpy())
        except ImageError as e:
            raise owner.error(record, e) from None
    t_BT = np.broadcast_to(np.arange(T), (B, T))
    position_BT = t_BT - np.maximum.accumulate(np.where(start_BT, t_BT, 0), axis=1)
    input_ids_BT = torch.from_numpy(input_BT)
    image_grid_thw_I3 = torch.tensor([record.grid for _, record in images], dtype=torch.long).reshape(-1, 3)
    position_ids_4BT = rope_index(input_ids_BT, torch.from_numpy(position_BT), image_grid_thw_I3,
                                  image_token_id=vision.image_token_id, merge_size=vision.processing.merge_size)
    return {"input_ids": input_ids_BT, "labels": torch.from_numpy(labels_BT), "position_ids": position_ids_4BT,
            "pixel_values": pixel_values_PD, "image_grid_thw": image_grid_thw_I3}


# The keys of a multimodal batch that hold the window's images, not its tokens: every cp rank takes them whole
IMAGE_KEYS = ("pixel_values", "image_grid_thw")


def context_shard(batch: dict[str, torch.Tensor], cp_rank: int, cp: int) -> dict[str, torch.Tensor]:
    """This cp rank's contiguous 1/cp of every sequence of ``batch`` (tensors [..., T]; T divisible by cp); the
    images of a multimodal batch (``IMAGE_KEYS``) whole."""
    if cp == 1:
        return batch
    return {name: x if name in IMAGE_KEYS else x.chunk(cp, dim=-1)[cp_rank].contiguous() for name, x in batch.items()}
