"""Images for a model with a vision tower (Qwen3.5): the image processor of transformers' Qwen2-VL family, offline and
exact; the checks of an image file; what the data layer needs of the model's vision side (``VisionData``); and the
3-D multimodal rotary positions of a packed window (``rope_index``).

The processor is transformers' ``Qwen2VLImageProcessorPil`` (what ``AutoImageProcessor`` gives Qwen2-VL, Qwen3-VL and
Qwen3.5 without torchvision), on an image as transformers' processor loads it (``load_image``: EXIF orientation
applied, then ``convert("RGB")``): resize with ``smart_resize`` (both sides multiples of patch_size * merge_size, the
pixels within [min_pixels, max_pixels]) by PIL, rescale, normalise, then patches of temporal_patch_size x patch_size
x patch_size (the still image repeated in time), ordered by merge_size x merge_size groups: the same bytes of
pixel_values and the same image_grid_thw (tests/test_vision_data.py compares them).

Image files are checked once, when the corpus is tokenized (``inspect_image``: read whole, hashed, decoded), and read
again for each window that holds them (``ImageRecord.pixels``: the bytes must still hash to what was tokenized). A
bad image is one line naming the file (``ImageError``; the caller adds the jsonl line). No torch at module level: the
tokenizing worker processes import this.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import math
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

# Modes that PIL's convert("RGB") maps faithfully (transformers' load_image converts every image so). Alpha is dropped
# as transformers drops it (convert("RGB"), no compositing). Deeper modes (16- and 32-bit integers, floats) would be
# clipped to 0..255 and LAB / HSV are not RGB: refused.
RGB_MODES = ("1", "L", "LA", "P", "PA", "RGB", "RGBA", "RGBX", "CMYK", "YCbCr")
DEFAULT_MAX_IMAGE_PIXELS = 1 << 25  # data.max_image_pixels: a source image above this is refused (8192 x 4096)
_EXIF_ORIENTATION = 0x0112
_TRANSPOSED = (5, 6, 7, 8)  # EXIF orientations that swap width and height
# transformers' Qwen2VLImageProcessor class defaults: what a preprocessor_config.json that omits a key means
_HF_DEFAULTS = {"patch_size": 14, "temporal_patch_size": 2, "merge_size": 2, "min_pixels": 56 * 56,
                "max_pixels": 28 * 28 * 1280, "image_mean": (0.48145466, 0.4578275, 0.40821073),
                "image_std": (0.26862954, 0.26130258, 0.27577711), "rescale_factor": 1 / 255, "resample": 3}
_PROCESSORS = ("Qwen2VLImageProcessor", "Qwen2VLImageProcessorFast", "Qwen2VLImageProcessorPil")
# Qwen3.5's published processor, in merged tokens per image: 65,536 .. 16,777,216 pixels at patch 16, merge 2
_PUBLISHED_TOKENS = (64, 16384)


class ImageError(ValueError):
    """An image file that cannot be trained on, in one line naming it."""


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' ``smart_resize`` (Qwen2-VL): the (height, width) closest to the image's, both multiples of
    ``factor``, with height x width within [min_pixels, max_pixels]."""
    if max(height, width) / min(height, width) > 200:
        raise ImageError(f"{width}x{height} has an aspect ratio above 200, which the Qwen-VL image processor refuses")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True)
class ImageProcessing:
    """The settings of transformers' Qwen2-VL image processor (a preprocessor_config.json); the defaults are Qwen3.5's
    published ones."""
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 65_536  # preprocessor_config.json: size.shortest_edge (or min_pixels)
    max_pixels: int = 16_777_216  # size.longest_edge (or max_pixels)
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    resample: int = 3  # PIL's resampling filter (3: bicubic)

    @classmethod
    def for_tower(cls, patch_size: int, temporal_patch_size: int, merge_size: int) -> ImageProcessing:
        """Qwen3.5's published settings for a tower of these sizes: mean and std 0.5, 64 .. 16,384 merged tokens per
        image (exactly Qwen3.5's 65,536 .. 16,777,216 pixels at patch 16, merge 2)."""
        factor = patch_size * merge_size
        return cls(patch_size, temporal_patch_size, merge_size, _PUBLISHED_TOKENS[0] * factor**2,
                   _PUBLISHED_TOKENS[1] * factor**2)

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        """The width of a row of pixel_values: channels x temporal_patch_size x patch_size**2."""
        return 3 * self.temporal_patch_size * self.patch_size**2

    def resized(self, height: int, width: int) -> tuple[int, int]:
        return smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)

    def grid(self, height: int, width: int) -> tuple[int, int, int]:
        """image_grid_thw of an image of this size: (1, patches down, patches across)."""
        h, w = self.resized(height, width)
        return 1, h // self.patch_size, w // self.patch_size

    def tokens(self, grid: tuple[int, int, int] | list[int]) -> int:
        """The image's <|image_pad|> tokens: its patches / merge_size**2."""
        return int(np.prod(grid)) // self.merge_size**2

    def key(self) -> str:
        """The settings as one string (a cache key)."""
        return json.dumps(asdict(self), sort_keys=True)

    def preprocessor_config(self) -> dict[str, Any]:
        """The preprocessor_config.json that ``read_image_processing`` reads back as these settings and transformers'
        Qwen2-VL image processor loads (Qwen3.5's published file's keys), for an export to be served."""
        return {"size": {"longest_edge": self.max_pixels, "shortest_edge": self.min_pixels},
                "patch_size": self.patch_size, "temporal_patch_size": self.temporal_patch_size,
                "merge_size": self.merge_size, "image_mean": list(self.image_mean), "image_std": list(self.image_std),
                "rescale_factor": self.rescale_factor, "resample": self.resample,
                "processor_class": "Qwen3VLProcessor", "image_processor_type": "Qwen2VLImageProcessorFast"}

    @functools.cached_property
    def _normalized(self) -> np.ndarray:
        """[3, 256] float32: each channel's 8-bit value rescaled (in float64, then float32) and normalised (in
        float32), the operations transformers applies to each pixel, tabulated."""
        scaled = (np.arange(256, dtype=np.float64) * self.rescale_factor).astype(np.float32)
        mean, std = np.array(self.image_mean, dtype=np.float32), np.array(self.image_std, dtype=np.float32)
        return (scaled[None, :] - mean[:, None]) / std[:, None]

    def __call__(self, image, out: np.ndarray | None = None) -> tuple[np.ndarray, tuple[int, int, int]]:
        """(pixel_values [P, patch_dim] float32, (1, gh, gw)) of an RGB PIL image, as transformers computes them:
        the 8-bit pixels put in patch order first, then each one's value looked up (``_normalized``): the same
        floats, 7x faster than normalising the image in float64 then copying it into patches. ``out``: where to
        write them (P rows), else a new array."""
        from PIL import Image

        width, height = image.size
        h, w = self.resized(height, width)
        resized = np.asarray(image.resize((w, h), resample=Image.Resampling(self.resample)))  # [h, w, 3] uint8
        p, m, tp = self.patch_size, self.merge_size, self.temporal_patch_size
        gh, gw = h // p, w // p
        # (gh/m, m, p, gw/m, m, p, C) -> (gh/m, gw/m, m, m, C, p, p): merge groups, then channels, then the patch
        patches = resized.reshape(gh // m, m, p, gw // m, m, p, 3).transpose(0, 3, 1, 4, 6, 2, 5)
        patches = patches.reshape(gh * gw, 3, 1, p * p)
        if out is None:
            out = np.empty((gh * gw, self.patch_dim), dtype=np.float32)
        if out.shape != (gh * gw, self.patch_dim):
            raise ValueError(f"{out.shape} rows given for {gh * gw} patches of {self.patch_dim}")
        view = out.reshape(gh * gw, 3, tp, p * p)  # the still image repeated in time
        for c in range(3):
            view[:, c] = self._normalized[c][patches[:, c]]
        return out, (1, gh, gw)


def _read_json(path: Path) -> dict:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not readable JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return config


def read_image_processing(model_dir: str | Path) -> ImageProcessing:
    """The image processor of ``model_dir``'s preprocessor_config.json, read as transformers reads it (size's
    shortest_edge / longest_edge, overridden by min_pixels / max_pixels; a missing key is the class default)."""
    path = Path(model_dir) / "preprocessor_config.json"
    config = _read_json(path)
    kind = config.get("image_processor_type")
    if kind is not None and kind not in _PROCESSORS:
        raise ValueError(f"{path}: image_processor_type {kind!r} is not the Qwen-VL image processor this trainer "
                         f"reproduces ({', '.join(_PROCESSORS)})")
    off = [k for k in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb") if config.get(k) is False]
    if off:
        raise ValueError(f"{path}: {', '.join(f'{k}=false' for k in off)} is not supported (the Qwen-VL processor "
                         "resizes, rescales, normalises and converts to RGB); remove the key")
    size = config.get("size") or {}
    values = {**_HF_DEFAULTS, **{k: config[k] for k in _HF_DEFAULTS if k in config}}
    for key, edge in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
        if key not in config and edge in size:
            values[key] = size[edge]
    try:
        processing = ImageProcessing(**{k: int(values[k]) for k in ("patch_size", "temporal_patch_size", "merge_size",
                                                                    "min_pixels", "max_pixels", "resample")},
                                     image_mean=tuple(float(x) for x in values["image_mean"]),
                                     image_std=tuple(float(x) for x in values["image_std"]),
                                     rescale_factor=float(values["rescale_factor"]))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: a value is not a number or a list of numbers ({e})") from None
    if len(processing.image_mean) != 3 or len(processing.image_std) != 3 or not all(processing.image_std):
        raise ValueError(f"{path}: image_mean and image_std must be 3 numbers each (std non-zero)")
    if min(processing.patch_size, processing.temporal_patch_size, processing.merge_size, processing.min_pixels) <= 0 \
            or processing.min_pixels > processing.max_pixels:
        raise ValueError(f"{path}: patch sizes must be positive and 0 < min_pixels <= max_pixels")
    return processing


@dataclass(frozen=True)
class VisionData:
    """What the data layer needs of a model's vision tower: its image processing, the ids of the tokens an image
    becomes and of the padding of a window an image cut short (<|endoftext|>), and (from data.max_image_pixels) the
    largest source image taken."""
    processing: ImageProcessing
    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    pad_token_id: int
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS

    @property
    def token_ids(self) -> tuple[int, int, int]:
        """The ids never trained: vision start, image pad, vision end."""
        return self.vision_start_token_id, self.image_token_id, self.vision_end_token_id

    def key(self) -> str:
        """Everything that decides an image's tokens (a cache key)."""
        return f"{self.processing.key()}|{self.token_ids}|max_image_pixels={self.max_image_pixels}"


def tower_processing(init_from: str | Path | None, *, patch_size: int, temporal_patch_size: int,
                     merge_size: int) -> ImageProcessing:
    """The image processor of a model whose vision tower has these sizes: ``init_from``'s preprocessor_config.json
    where the directory has one (its sizes must be the tower's), else ``ImageProcessing.for_tower``."""
    tower = {"patch_size": patch_size, "temporal_patch_size": temporal_patch_size, "merge_size": merge_size}
    path = Path(init_from) / "preprocessor_config.json" if init_from is not None else None
    if path is None or not path.is_file():
        return ImageProcessing.for_tower(**tower)
    processing = read_image_processing(path.parent)
    wrong = [f"{k}={getattr(processing, k)} (the tower's {v})" for k, v in tower.items() if getattr(processing, k) != v]
    if wrong:
        raise ValueError(f"{path}: {', '.join(wrong)}: the image processor does not fit the model's vision tower "
                         "(config.json's vision_config); fix one of the two")
    return processing


def write_preprocessor_config(processing: ImageProcessing, out_dir: Path) -> None:
    """``out_dir``/preprocessor_config.json of ``processing`` (an export's, for AutoImageProcessor)."""
    (out_dir / "preprocessor_config.json").write_text(json.dumps(processing.preprocessor_config(), indent=2) + "\n")


def vision_for_model(init_from: str | Path | None, tokenizer: str, *, patch_size: int, temporal_patch_size: int,
                     merge_size: int) -> VisionData:
    """The ``VisionData`` of a model whose vision tower has these sizes: ``init_from``'s preprocessor_config.json
    where the directory has one (its sizes must be the tower's), else ``ImageProcessing.for_tower``; the token ids
    of ``tokenizer`` (config.json's image_token_id, vision_start_token_id and vision_end_token_id must agree)."""
    from training.data.tokenizer import special_tokens

    processing = tower_processing(init_from, patch_size=patch_size, temporal_patch_size=temporal_patch_size,
                                  merge_size=merge_size)
    ids = special_tokens(tokenizer)
    vision = VisionData(processing, ids["<|image_pad|>"], ids["<|vision_start|>"], ids["<|vision_end|>"],
                        ids["<|endoftext|>"])
    d = Path(init_from) if init_from is not None else None
    if d is not None and (d / "config.json").is_file():
        config = _read_json(d / "config.json")
        ours = {"image_token_id": vision.image_token_id, "vision_start_token_id": vision.vision_start_token_id,
                "vision_end_token_id": vision.vision_end_token_id}
        wrong = [f"{k}={config[k]} (the {tokenizer} tokenizer's {v})" for k, v in ours.items()
                 if isinstance(config.get(k), int) and config[k] != v]
        if wrong:
            raise ValueError(f"{d / 'config.json'}: {', '.join(wrong)}: the model's image tokens are not the "
                             "tokenizer's")
    return vision


# ------------------------------------------------------------------------------------------------ image files


@dataclass(frozen=True)
class ImageRecord:
    """One image of the corpus as it was tokenized: the file (``path`` resolved, ``source`` as the data names it), the
    jsonl line naming it, its bytes' size and sha256, its size as transformers loads it (EXIF orientation applied)
    and its patch grid, and the <|image_pad|> tokens it becomes."""
    path: str
    source: str
    line: int
    bytes: int
    sha256: str
    width: int
    height: int
    grid: tuple[int, int, int] = field(default=(1, 0, 0))
    tokens: int = 0
    mtime_ns: int = 0  # the file's as read (a later start re-hashes a file whose mtime differs)

    @property
    def where(self) -> str:
        shown = self.source if self.source == self.path else f"{self.source} ({self.path})"
        return f"line {self.line}: image {shown}"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, entry: dict[str, Any]) -> ImageRecord:
        return cls(**{**entry, "grid": tuple(entry["grid"])})

    def pixels(self, processing: ImageProcessing, out: np.ndarray | None = None) -> np.ndarray:
        """The image's pixel_values [P, patch_dim] float32 (into ``out`` where given), read again; ImageError (one
        line, naming the file and the line) if it is gone, unreadable or not the bytes tokenized."""
        data = _read_bytes(Path(self.path))
        if len(data) != self.bytes or hashlib.sha256(data).hexdigest() != self.sha256:
            raise ImageError(f"changed since the corpus was tokenized ({len(data)} bytes, sha256 "
                             f"{hashlib.sha256(data).hexdigest()[:12]}..., tokenized: {self.bytes} bytes, "
                             f"{self.sha256[:12]}...); put the image back, or start a new run on the changed data")
        image = _rgb(_decoded(data, self.width * self.height))  # the bytes tokenized: within the limit then
        grid = processing.grid(image.height, image.width)
        if grid != self.grid:  # another processing than the corpus was tokenized with
            raise ImageError(f"its patch grid is {grid} and was {self.grid} when tokenized")
        return processing(image, out)[0]


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise ImageError("missing: no such file") from None
    except IsADirectoryError:
        raise ImageError("is a directory, not an image file") from None
    except OSError as e:
        raise ImageError(f"unreadable: {e.strerror or e}") from None


def _decoded(data: bytes, max_pixels: int, limit_key: str = "data.max_image_pixels"):
    """The PIL image of ``data``, decoded whole (a truncated or corrupt file fails here), as opened: the checks of
    ``inspect_image`` in order (format, frames, mode, size)."""
    from PIL import Image, UnidentifiedImageError

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # our own limit, below, is the one applied
        try:
            image = Image.open(io.BytesIO(data))
        except UnidentifiedImageError:
            raise ImageError("corrupt or not an image: Pillow recognises no image format in it") from None
        except Image.DecompressionBombError as e:
            raise ImageError(f"larger than Pillow's decompression-bomb limit ({e})") from None
        except (OSError, SyntaxError, ValueError) as e:
            raise ImageError(f"corrupt: {e}") from None
        frames = getattr(image, "n_frames", 1)
        if frames > 1 and image.format != "MPO":  # a camera's MPO: the picture, then previews or a depth map
            raise ImageError(f"has {frames} frames (an animation or a multi-page file): only its first would be seen; "
                             "give a still image (video is not supported)")
        if image.mode not in RGB_MODES:
            raise ImageError(f"has mode {image.mode} ({'high bit depth' if image.mode[0] in 'IF' else 'not RGB'}), "
                             f"which does not convert faithfully to 8-bit RGB (modes taken: {', '.join(RGB_MODES)}); "
                             "save it as 8-bit RGB or grayscale")
        width, height = image.size
        if width * height > max_pixels:
            raise ImageError(f"{width}x{height} = {width * height:,} pixels, more than {limit_key}={max_pixels:,}; "
                             f"downscale it, or raise {limit_key}")
        try:
            image.load()
        except (OSError, SyntaxError, ValueError) as e:
            raise ImageError(f"corrupt: decoding failed ({e})") from None
    return image


def _rgb(image):
    """The image as transformers' load_image makes it: EXIF orientation applied, converted to RGB."""
    from PIL import ImageOps

    return ImageOps.exif_transpose(image).convert("RGB")


def inspect_image(path: Path, source: str, line: int, vision: VisionData) -> ImageRecord:
    """Read, hash and decode the image at ``path`` (``source``: as the data names it) and check it: ImageError in one
    line (the caller adds the file of the data and the line) if it is missing, unreadable, corrupt, animated, of a
    mode that does not convert faithfully to RGB, or above ``vision.max_image_pixels``."""
    mtime_ns = path.stat().st_mtime_ns if path.is_file() else 0
    data = _read_bytes(path)
    image = _decoded(data, vision.max_image_pixels)
    width, height = image.size
    if image.getexif().get(_EXIF_ORIENTATION) in _TRANSPOSED:
        width, height = height, width
    grid = vision.processing.grid(height, width)
    return ImageRecord(str(path), source, line, len(data), hashlib.sha256(data).hexdigest(), width, height, grid,
                       vision.processing.tokens(grid), mtime_ns)


# ------------------------------------------------------------------------------------- multimodal rotary positions


def rope_index(input_ids_BT, position_ids_BT, image_grid_thw_I3, *, image_token_id: int, merge_size: int):
    """[4, B, T] int64 position ids of a packed window: row 0 ``position_ids_BT`` (text positions, restarting at each
    document: where a position is not its predecessor's + 1), rows 1..3 the (t, h, w) rotary positions of each
    document as transformers' Qwen3.5 ``get_rope_index`` builds them for it alone: text tokens advance all three by
    one; an image's <|image_pad|> tokens take t = p, h = p + row, w = p + column of its merged grid, and the text after
    it continues from p + max(h, w) / merge_size. ``image_grid_thw_I3`` holds the window's images in the order their
    tokens appear (row after row); each image's tokens lie whole in one document."""
    import torch

    B, T = input_ids_BT.shape
    out_4BT = torch.empty(4, B, T, dtype=torch.long)
    out_4BT[0] = position_ids_BT
    ids_BT, pos_BT = input_ids_BT.numpy(), position_ids_BT.numpy()
    grids = image_grid_thw_I3.tolist()
    k = 0
    for b in range(B):
        rows = np.empty((3, T), dtype=np.int64)
        image = ids_BT[b] == image_token_id
        starts = [0, *(np.flatnonzero(np.diff(pos_BT[b]) != 1) + 1).tolist(), T]
        for d0, d1 in zip(starts[:-1], starts[1:]):
            flags = image[d0:d1]
            edges = np.flatnonzero(np.diff(flags.astype(np.int8), prepend=0, append=0)) + d0
            current, i = 0, d0
            for a, z in zip(edges[0::2].tolist(), edges[1::2].tolist()):  # image runs [a, z)
                rows[:, i:a] = current + np.arange(a - i)
                current += a - i
                while a < z:  # one run may hold images back to back
                    if k >= len(grids):
                        raise ValueError(f"row {b} holds more <|image_pad|> tokens than image_grid_thw's images")
                    t, gh, gw = grids[k][0], grids[k][1] // merge_size, grids[k][2] // merge_size
                    n = t * gh * gw
                    if a + n > z:
                        raise ValueError(f"image {k} has {n} tokens (grid {grids[k]}) and row {b} holds {z - a} of "
                                         "them: an image's tokens were split")
                    tt, hh, ww = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
                    rows[:, a:a + n] = current + np.stack([tt.ravel(), hh.ravel(), ww.ravel()])
                    current += max(gh, gw)
                    a, k = a + n, k + 1
                i = z
            rows[:, i:d1] = current + np.arange(d1 - i)
        out_4BT[1:, b] = torch.from_numpy(rows)
    if k != len(grids):
        raise ValueError(f"image_grid_thw has {len(grids)} images and the window's tokens hold {k}")
    return out_4BT
