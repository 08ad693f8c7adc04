"""Images for the tests. Chats with image files (``image_chat_corpus``: what ``data=jsonl`` reads for a model with
its tower). And windows with images built by hand as the loader yields them (``docs/data.md``), for the models on the
synthetic 256-token vocabulary, whose ``data=tokens`` holds no image: ``WithImages`` wraps that token loader and puts
an image into some rows of each window, with ``pixel_values``, ``image_grid_thw`` and [4, B, T] position ids whose
rows 1..3 are the 3-D rope positions (``rope_index``, checked against transformers' ``get_rope_index``).

Each row's image (whether it has one, its grid, its pixels, where it goes) follows from the row's tokens alone, so
every layout and a resume see the same images in the same rows whatever rank reads them.
"""

from __future__ import annotations

import contextlib
import json
import types
import zlib
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from PIL import Image

from core.constants import IGNORE_INDEX

# The synthetic 256-token vocabulary's top ids serve as the vision tokens (corpus ids there are moved below).
START, END, IMAGE, VIDEO = 250, 251, 252, 253
TOKEN_IDS = {"vision_start_token_id": START, "vision_end_token_id": END, "image_token_id": IMAGE,
             "video_token_id": VIDEO}
# Images of 2 x 4, 4 x 2, 2 x 2 and 4 x 4 patches (one frame: temporal_patch_size frames of a still image).
GRIDS = [(1, 2, 4), (1, 4, 2), (1, 2, 2), (1, 4, 4)]


def vision_overrides(hidden_size: int = 32) -> list[str]:
    """The overrides that give ``model=qwen35_moe_debug`` (cut to ``hidden_size``) its tower with these token ids."""
    return ["model.vision=true", f"model.arch.vision_config.out_hidden_size={hidden_size}",
            *(f"model.arch.vision_config.{key}={value}" for key, value in TOKEN_IDS.items())]


def rope_index(input_ids_T: torch.Tensor, grids: list[tuple[int, int, int]], merge: int,
               image_token_id: int = IMAGE) -> torch.Tensor:
    """[3, T]: the 3-D rope positions of one document with images of ``grids`` (in order), as transformers'
    ``Qwen3_5MoeModel.get_rope_index`` builds them (tests/test_qwen35_vision.py compares): a text token at the next
    position; an image's merged tokens at (start + frame, start + row, start + column), after which the next position
    is start + max(rows, columns). Until the data side's ``training.data.vision.rope_index`` (pure arithmetic too)."""
    out = torch.empty(3, len(input_ids_T), dtype=torch.long)
    images, pos, t = iter(grids), 0, 0
    while t < len(input_ids_T):
        if input_ids_T[t] != image_token_id:
            out[:, t], pos, t = pos, pos + 1, t + 1
            continue
        frames, rows, cols = next(images)
        rows, cols = rows // merge, cols // merge
        f, r, c = torch.meshgrid(torch.arange(frames), torch.arange(rows), torch.arange(cols), indexing="ij")
        n = frames * rows * cols
        out[:, t:t + n] = torch.stack([f.flatten(), r.flatten(), c.flatten()]) + pos
        pos, t = pos + max(rows, cols), t + n
    return out


def add_images(window: dict[str, torch.Tensor], vision: Any, seed: int = 0) -> dict[str, torch.Tensor]:
    """``window`` (a token loader's: ids, labels and document position ids [B, T]) with an image in some rows:
    ``<vision_start> <image_pad> x tokens <vision_end>`` inside one document, labels -100 where the target is one
    of them, the images' patches and grids, and [4, B, T] position ids (text row, then the document's 3-D rope)."""
    ids_BT, labels_BT, text_BT = (window[k].clone() for k in ("input_ids", "labels", "position_ids"))
    ids_BT[ids_BT >= START] -= 8  # the corpus keeps out of the vision ids
    labels_BT[labels_BT >= START] -= 8
    rope_3BT = text_BT.expand(3, *text_BT.shape).clone()
    pixels, grids = [], []
    for b in range(ids_BT.shape[0]):
        rng = np.random.default_rng([seed, zlib.crc32(ids_BT[b].numpy().tobytes())])
        if rng.random() < 0.3:
            continue  # no image in this row
        t, h, w = GRIDS[rng.integers(len(GRIDS))]
        span = t * h * w // vision.merge_unit + 2
        starts = (text_BT[b] == 0).nonzero().squeeze(1).tolist() + [ids_BT.shape[1]]
        docs = [(s, e) for s, e in zip(starts, starts[1:]) if e - s >= span + 2]
        if not docs:
            continue
        s, e = docs[rng.integers(len(docs))]
        at = s + 1 + int(rng.integers(e - s - span - 1))
        ids_BT[b, at:at + span] = torch.tensor([START] + [IMAGE] * (span - 2) + [END])
        labels_BT[b, at - 1:at + span - 1] = IGNORE_INDEX  # targets: the start, the pads, the end
        rope_3BT[:, b, s:e] = rope_index(ids_BT[b, s:e], [(t, h, w)], vision.spatial_merge_size)
        grids.append((t, h, w))
        gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
        pixels.append(torch.randn(t * h * w, vision.patch_dim, generator=gen))
    return {"input_ids": ids_BT, "labels": labels_BT, "position_ids": torch.cat([text_BT[None], rope_3BT]),
            "pixel_values": torch.cat(pixels) if pixels else torch.zeros(0, vision.patch_dim),
            "image_grid_thw": torch.tensor(grids, dtype=torch.long).reshape(-1, 3)}


class WithImages:
    """A token loader whose windows (training and held out) carry images (``add_images``); the rest is the
    loader's (its position and state: a resume continues it)."""

    def __init__(self, loader: Any, vision: Any) -> None:
        self._loader, self._vision = loader, vision
        if loader.validation is not None:
            validation = loader.validation
            self.validation = types.SimpleNamespace(
                batches=lambda n: [add_images(w, vision, seed=1) for w in validation.batches(n)])

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)

    def __iter__(self) -> WithImages:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        return add_images(next(self._loader), self._vision)


@contextlib.contextmanager
def images_in_token_data(vision: Any) -> Iterator[None]:
    """train.run's loaders, while inside, wrapped in ``WithImages`` for the tower of ``vision``."""
    import train

    real = train.build_data_loader
    train.build_data_loader = lambda *args, **kwargs: WithImages(real(*args, **kwargs), vision)
    try:
        yield
    finally:
        train.build_data_loader = real


def save_image(path: Path, w: int, h: int, mode: str = "RGB", seed: int = 0, **kw) -> Path:
    rng = np.random.default_rng(seed)
    bands = len(Image.new(mode, (1, 1)).getbands())
    array = rng.integers(0, 256, (h, w, bands) if bands > 1 else (h, w), dtype=np.uint8)
    image = Image.fromarray(array, "RGBA" if mode == "RGBA" else None).convert(mode)
    image.save(path, **kw)
    return path


def image_files(folder: Path) -> list[Path]:
    """Three images of different sizes and modes: a wide RGB png, a tall RGBA png, a grayscale jpeg."""
    folder.mkdir(parents=True, exist_ok=True)
    return [save_image(folder / "wide.png", 37, 13), save_image(folder / "tall.png", 12, 29, "RGBA", 1),
            save_image(folder / "gray.jpg", 20, 20, "L", 2)]


def image_chat(i: int, images: list[str]) -> list[dict]:
    parts = [{"type": "image", "image": image} for image in images]
    return [{"role": "user", "content": [*parts[:1], {"type": "text", "text": f"What is in picture {i}?"},
                                         *parts[1:]]},
            {"role": "assistant", "content": "A pattern of dots " * (1 + i % 3)}]


def image_chat_corpus(folder: Path, rows: int = 12) -> Path:
    """Chats with zero to two images (paths relative to the file) between text documents."""
    names = [p.name for p in image_files(folder / "img")]
    lines = []
    for i in range(rows):
        images = [f"img/{names[j % 3]}" for j in range(i, i + i % 3)]
        lines.append(json.dumps({"messages": image_chat(i, images)}))
        lines.append(json.dumps({"text": f"A text document {i}, " + "words " * (i % 5)}))
    path = folder / "chats.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path
