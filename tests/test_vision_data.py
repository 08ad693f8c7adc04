"""Chats with images for a model with a vision tower (issue 64) and multimodal data refused without one (issue 63
item 7): the image processor, the rendering and the 3-D rotary positions against transformers (its Qwen2-VL PIL
image processor, Qwen3VLProcessor with the exported Qwen3.5 tokenizer and chat template, Qwen3.5-MoE's
get_rope_index), windows that never split an image, exact resume, and each bad image in one line naming the file and
the jsonl line."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from core.constants import IGNORE_INDEX
from training.data.cache import tokenized_corpus
from training.data.config import DataConfig, validate_data_config
from training.data.hf_tokenizer import write_hf_tokenizer
from training.data.loader import build_data_loader
from training.data.packing import context_shard
from training.data.tokenize_shards import tokenize_to_shards
from training.data.tokenizer import special_tokens
from tests.vision_data import image_chat, image_chat_corpus, image_files, save_image
from training.data.vision import (ImageProcessing, read_image_processing, rope_index, vision_for_model)

transformers = pytest.importorskip("transformers")
from transformers.image_utils import load_image  # noqa: E402
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil  # noqa: E402
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeModel  # noqa: E402

TINY = dict(patch_size=4, temporal_patch_size=2, merge_size=2)  # the debug preset's tower (vlm_interface.md)
SPECIALS = special_tokens("qwen3_5")
VISION_IDS = [SPECIALS[t] for t in ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")]
# Qwen3.5's published preprocessor_config.json
PUBLISHED = {"size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16, "temporal_patch_size": 2,
             "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
             "processor_class": "Qwen3VLProcessor", "image_processor_type": "Qwen2VLImageProcessorFast"}


def _vision(min_pixels: int = 64, max_pixels: int = 1024):
    vision = vision_for_model(None, "qwen3_5", **TINY)
    return dataclasses.replace(vision, processing=dataclasses.replace(vision.processing, min_pixels=min_pixels,
                                                                      max_pixels=max_pixels))


def _hf_image_processor(p: ImageProcessing) -> Qwen2VLImageProcessorPil:
    return Qwen2VLImageProcessorPil(patch_size=p.patch_size, temporal_patch_size=p.temporal_patch_size,
                                    merge_size=p.merge_size, size={"shortest_edge": p.min_pixels,
                                                                   "longest_edge": p.max_pixels},
                                    image_mean=list(p.image_mean), image_std=list(p.image_std))


def _cfg(path: Path, **kw) -> DataConfig:
    return DataConfig(**{"name": "jsonl", "path": str(path), "seq_len": 96, "cache_dir": str(path.parent / "cache"),
                         **kw})


def _loader(cfg: DataConfig, vision=..., batch: int = 2, seed: int = 0):
    return build_data_loader(cfg, seed=seed, local_batch_size=batch, dp_rank=0, dp_size=1, tokenizer="qwen3_5",
                             vision=_vision() if vision is ... else vision)


@pytest.fixture(scope="module")
def processor(tmp_path_factory):
    """transformers' Qwen3VLProcessor (what Qwen3.5's processor_config names) over the exported Qwen3.5 tokenizer and
    its chat template, and the PIL image processor; no video processor (it needs torchvision)."""

    class ImageProcessor(transformers.Qwen3VLProcessor):
        def check_argument_for_proper_class(self, name, arg):
            return None if name == "video_processor" and arg is None else super().check_argument_for_proper_class(
                name, arg)

    out = tmp_path_factory.mktemp("qwen35-tokenizer")
    write_hf_tokenizer("qwen3_5", out)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    return lambda processing: ImageProcessor(image_processor=_hf_image_processor(processing), tokenizer=tokenizer,
                                             video_processor=None, chat_template=tokenizer.chat_template)


def _hf_rope(input_ids_1T: torch.Tensor, mm_types_1T: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """transformers' Qwen3.5-MoE get_rope_index on one sequence: [3, 1, T]."""
    fake = SimpleNamespace(config=SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=2)),
                           get_vision_position_ids=lambda *a, **k: Qwen3_5MoeModel.get_vision_position_ids(None, *a,
                                                                                                          **k))
    return Qwen3_5MoeModel.get_rope_index(fake, input_ids_1T, mm_types_1T, image_grid_thw=grid)[0]


# ------------------------------------------------------------------------ the image processor against transformers


def test_pixels_equal_transformers_image_processor(tmp_path: Path) -> None:
    """Every size, mode and EXIF orientation, at the tiny settings and at Qwen3.5's published ones read from a
    preprocessor_config.json: pixel_values bit for bit and image_grid_thw as transformers' PIL processor gives them
    for the image its load_image opens."""
    paths = image_files(tmp_path)
    paths += [save_image(tmp_path / "palette.gif", 9, 5, "P", 3), save_image(tmp_path / "cmyk.jpg", 50, 8, "CMYK", 4),
              save_image(tmp_path / "one.png", 3, 70, "1", 5)]
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated: width and height swap
    paths.append(save_image(tmp_path / "rotated.jpg", 30, 10, seed=6, exif=exif))
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "preprocessor_config.json").write_text(json.dumps(PUBLISHED))
    published = read_image_processing(tmp_path / "model")
    assert published == ImageProcessing() == ImageProcessing.for_tower(16, 2, 2)
    # what transformers loads for that file (its PIL backend: the one without torchvision), the tiny settings by hand
    loaded = transformers.AutoImageProcessor.from_pretrained(tmp_path / "model", backend="pil")
    for processing, hf in ((_vision().processing, _hf_image_processor(_vision().processing)), (published, loaded)):
        for path in paths:
            vision = dataclasses.replace(_vision(), processing=processing)
            record = _inspect(path, vision)
            theirs = hf(images=[load_image(str(path))], return_tensors="np")
            ours = record.pixels(processing)
            assert ours.dtype == np.float32 and ours.tobytes() == theirs["pixel_values"].tobytes(), path.name
            assert [list(record.grid)] == theirs["image_grid_thw"].tolist()
            assert record.tokens == int(np.prod(record.grid)) // 4
    assert _inspect(paths[-1], _vision()).width == 10  # EXIF orientation applied, as transformers' load_image


def _inspect(path: Path, vision):
    from training.data.vision import inspect_image

    return inspect_image(path, path.name, 1, vision)


def test_preprocessor_config_and_the_tower_must_agree(tmp_path: Path) -> None:
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**PUBLISHED, "patch_size": 14}))
    with pytest.raises(ValueError, match=r"preprocessor_config.json: patch_size=14 \(the tower's 16\)"):
        vision_for_model(tmp_path, "qwen3_5", patch_size=16, temporal_patch_size=2, merge_size=2)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"image_processor_type": "SiglipImageProcessor"}))
    with pytest.raises(ValueError, match="'SiglipImageProcessor' is not the Qwen-VL image processor"):
        read_image_processing(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**PUBLISHED, "min_pixels": 1024}))
    assert read_image_processing(tmp_path).min_pixels == 1024  # as transformers: min_pixels overrides size
    (tmp_path / "config.json").write_text(json.dumps({"image_token_id": 151655}))
    with pytest.raises(ValueError, match=r"image_token_id=151655 \(the qwen3_5 tokenizer's 248056\)"):
        vision_for_model(tmp_path, "qwen3_5", patch_size=16, temporal_patch_size=2, merge_size=2)


# ------------------------------------------------------------------- rendering and positions against transformers


def test_chats_render_and_process_like_transformers(tmp_path: Path, processor) -> None:
    """Each chat's ids and images in the tokenized corpus are transformers' Qwen3VLProcessor.apply_chat_template's
    (the exported chat template, images expanded to their tokens), then <|endoftext|>; the image tokens are never
    trained."""
    path = image_chat_corpus(tmp_path)
    vision = _vision()
    corpus = tokenized_corpus(_cfg(path), "qwen3_5", vision)
    hf = processor(vision.processing)
    (ids, mask), records = corpus.stream, corpus.images
    ends = np.flatnonzero(ids == SPECIALS["<|endoftext|>"])
    docs = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(ends) == len(docs)
    k = 0
    for doc, start, end in zip(docs, [0, *(ends[:-1] + 1)], ends):
        if "text" in doc:
            continue
        messages = [{**m, "content": [{**p, "image": str(tmp_path / p["image"])} if p["type"] == "image" else p
                                      for p in m["content"]] if isinstance(m["content"], list) else m["content"]}
                    for m in doc["messages"]]
        out = hf.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="np")
        assert ids[start:end].tolist() == out["input_ids"][0].tolist()
        assert not mask[start:end][np.isin(ids[start:end], VISION_IDS)].any()
        n = 0 if "image_grid_thw" not in out else len(out["image_grid_thw"])
        for j in range(n):
            assert list(records[k + j].grid) == out["image_grid_thw"][j].tolist()
            assert records[k + j].line == docs.index(doc) + 1
        if n:
            ours = np.concatenate([records[k + j].pixels(vision.processing) for j in range(n)])
            assert ours.tobytes() == out["pixel_values"].tobytes()
        k += n
    assert k == len(records) > 0


def test_rope_index_equals_transformers_per_document(processor, tmp_path: Path) -> None:
    """Rows 1..3 of a single document are transformers' Qwen3.5-MoE get_rope_index; packed after another document
    (row 0 restarting), each document keeps its own."""
    paths = image_files(tmp_path)
    hf = processor(_vision().processing)
    messages = [{"role": "user", "content": [{"type": "image", "image": str(paths[0])},
                                             {"type": "text", "text": "and"}, {"type": "image", "image": str(paths[1])},
                                             {"type": "image", "image": str(paths[2])}]},
                {"role": "assistant", "content": "Three."}]
    out = hf.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt")
    input_ids_1T, grid = out["input_ids"], out["image_grid_thw"]
    theirs_31T = _hf_rope(input_ids_1T, out["mm_token_type_ids"], grid)
    T = input_ids_1T.shape[1]
    ours_41T = rope_index(input_ids_1T, torch.arange(T)[None], grid, image_token_id=VISION_IDS[1], merge_size=2)
    assert torch.equal(ours_41T[1:], theirs_31T) and torch.equal(ours_41T[0, 0], torch.arange(T))
    assert not torch.equal(ours_41T[1], ours_41T[0])  # the images moved them
    # Packed: a text document of 5 tokens, then this one, in a row of 5 + T + 3 (a third document cut short).
    packed_1X = torch.cat([torch.tensor([[1, 2, 3, 4, SPECIALS["<|endoftext|>"]]]), input_ids_1T,
                           torch.tensor([[7, 8, 9]])], dim=1)
    row0 = torch.cat([torch.arange(5), torch.arange(T), torch.arange(3)])[None]
    packed_41X = rope_index(packed_1X, row0, grid, image_token_id=VISION_IDS[1], merge_size=2)
    assert torch.equal(packed_41X[1:, :, 5:5 + T], theirs_31T)
    assert torch.equal(packed_41X[1:, 0, :5], torch.arange(5).expand(3, 5))
    assert torch.equal(packed_41X[1:, 0, 5 + T:], torch.arange(3).expand(3, 3))
    with pytest.raises(ValueError, match="image_grid_thw has 4 images and the window's tokens hold 3"):
        rope_index(input_ids_1T, torch.arange(T)[None], torch.cat([grid, grid[:1]]), image_token_id=VISION_IDS[1],
                   merge_size=2)


# --------------------------------------------------------------------------------------- windows and resume


def _windows(loader, n: int) -> list[dict]:
    return [next(loader) for _ in range(n)]


def test_windows_keep_images_whole_and_yield_the_interface(tmp_path: Path) -> None:
    """Every window of an epoch: the interface's keys and shapes, each image's tokens whole (its pad tokens are its
    grid's / merge**2, between its start and end), pixel rows in token order, no image token trained, the padding
    of a window an image cut short untrained and a document of its own; every image of the corpus is seen."""
    cfg = _cfg(image_chat_corpus(tmp_path), seq_len=48)
    loader = _loader(cfg, batch=1)
    vision = loader.vision
    records = tokenized_corpus(cfg, "qwen3_5", vision).images
    seen, shortened = 0, 0
    for batch in _windows(loader, loader.num_windows):
        assert set(batch) == {"input_ids", "labels", "position_ids", "pixel_values", "image_grid_thw"}
        ids = batch["input_ids"][0]
        assert batch["position_ids"].shape == (4, 1, 48) and batch["pixel_values"].dtype == torch.float32
        assert batch["pixel_values"].shape[1] == 3 * 2 * 4 * 4 and batch["image_grid_thw"].shape[1] == 3
        assert int(batch["image_grid_thw"].prod(-1).sum()) == batch["pixel_values"].shape[0]
        starts = torch.nonzero(ids == vision.vision_start_token_id).flatten().tolist()
        ends = torch.nonzero(ids == vision.vision_end_token_id).flatten().tolist()
        assert len(starts) == len(ends) == len(batch["image_grid_thw"])
        for (a, z), grid in zip(zip(starts, ends), batch["image_grid_thw"].tolist()):
            assert z - a - 1 == np.prod(grid) // 4 and bool((ids[a + 1:z] == vision.image_token_id).all())
        assert int((ids == vision.image_token_id).sum()) == int(batch["image_grid_thw"].prod(-1).sum()) // 4
        assert not torch.isin(batch["labels"], torch.tensor(VISION_IDS)).any()
        pad = int((ids == vision.pad_token_id).flip(0).cumprod(0).sum())  # trailing <|endoftext|>s
        if pad > 1:  # a window cut short by an image (its last target is that image's start)
            shortened += 1
            assert (batch["labels"][0, -pad:] == IGNORE_INDEX).all()
            assert batch["position_ids"][0, 0, -pad:].tolist()[-pad + 1:] == list(range(1, pad))
        seen += len(starts)
    assert shortened > 0 and 0 < seen <= len(records)


def test_the_layout_never_cuts_an_image_on_random_streams() -> None:
    """Random streams of images (2 to T tokens each) and text: windows start at 0, each after the last's target or at
    the image its cut would have split; no image starts before a window and ends in it, none is cut at its end, no
    window's last target lies inside one, and without images the windows are text's."""
    from training.data.packing import Images
    from training.data.vision import ImageRecord

    rng = np.random.default_rng(0)
    for _ in range(300):
        T, N = int(rng.integers(4, 20)), int(rng.integers(1, 200))
        starts, records, at = [], [], int(rng.integers(0, 5))
        while (n := int(rng.integers(0, T - 1))) + 2 + at <= N:
            starts.append(at)
            records.append(ImageRecord("p", "p", 1, 0, "", 1, 1, (1, 1, 1), n))
            at += n + 2 + int(rng.integers(0, 8))
        s_W, length_W = (x.tolist() for x in Images(np.array(starts, dtype=np.int64), tuple(records), "x").layout(N, T))
        spans = [(a, a + r.tokens + 1) for a, r in zip(starts, records)]
        assert s_W[:1] in ([], [0])
        for s, length, following in zip(s_W, length_W, [*s_W[1:], None]):
            assert 1 <= length <= T and s + length + 1 <= N
            assert not any(a < s <= z or s <= a < s + length <= z or a < s + length <= z for a, z in spans)
            assert following in (None, s + length, s + length + 1)
            assert (length == T and following != s + length) or s + length in starts
        if not starts:
            assert s_W == [k * (T + 1) for k in range(N // (T + 1))]


def test_a_stream_without_images_is_cut_as_text(tmp_path: Path) -> None:
    """Text-only data under a vision model yields exactly the text windows and keys (no image anywhere: the text
    model runs alone)."""
    path = image_chat_corpus(tmp_path)
    text = tmp_path / "text.jsonl"
    text.write_text("".join(line + "\n" for line in path.read_text().splitlines() if line.startswith('{"text"')) * 3)
    ours, plain = _loader(_cfg(text, seq_len=16)), _loader(_cfg(text, seq_len=16), vision=None)
    assert ours.vision is None
    for a, b in zip(_windows(ours, 6), _windows(plain, 6)):
        assert a.keys() == b.keys() == {"input_ids", "labels", "position_ids"}
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_multimodal_resume_is_exact_and_cp_keeps_images_whole(tmp_path: Path) -> None:
    cfg = _cfg(image_chat_corpus(tmp_path), seq_len=48, val_fraction=0.2)
    loader = _loader(cfg, seed=3)
    _windows(loader, 5)  # past an epoch's end
    state = loader.state_dict()
    fresh = _loader(cfg, seed=3)
    fresh.load_state_dict(state)
    for a, b in zip(_windows(loader, 4), _windows(fresh, 4)):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    val = loader.validation.batches(1)[0]
    assert val["position_ids"].shape == (4, 2, 48) and "pixel_values" in val
    shard = context_shard(val, 1, 2)
    assert shard["input_ids"].shape == (2, 24) and shard["position_ids"].shape == (4, 2, 24)
    assert shard["pixel_values"] is val["pixel_values"] and shard["image_grid_thw"] is val["image_grid_thw"]


def test_an_image_longer_than_a_window_is_refused_by_name(tmp_path: Path) -> None:
    cfg = _cfg(image_chat_corpus(tmp_path), seq_len=11)  # the wide image: 1 x 4 x 10 patches = 10 tokens + start + end
    with pytest.raises(ValueError, match=r"chats\.jsonl line 5: image img/wide\.png \(.*\): the image becomes 12 "
                                         r"tokens .* more than a window of data.seq_len=11: raise data.seq_len, or "
                                         r"lower data.image_max_pixels"):
        _loader(cfg)


# ---------------------------------------------------------------------------------- bad images, one line each


def _one(tmp_path: Path, part: dict, role: str = "user") -> DataConfig:
    row = {"messages": [{"role": role, "content": [part, {"type": "text", "text": "what?"}]},
                        {"role": "assistant", "content": "that"}]}
    good = {"messages": image_chat(0, [])}
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(good) + "\n\n" + json.dumps(row) + "\n" + json.dumps(good) + "\n")
    return _cfg(path, seq_len=16)


@pytest.mark.parametrize("make, expected", [
    (lambda d: "nope.png", r"image nope\.png \(.*nope\.png\): missing: no such file"),
    (lambda d: (d / "junk.png").write_bytes(b"not an image") and "junk.png",
     r"image junk\.png \(.*\): corrupt or not an image: Pillow recognises no image format in it"),
    (lambda d: (d / "cut.png").write_bytes(save_image(d / "whole.png", 30, 30).read_bytes()[:300]) and "cut.png",
     r"image cut\.png \(.*\): corrupt: decoding failed \(image file is truncated"),
    (lambda d: Image.fromarray(np.full((4, 4), 40000, dtype=np.uint16)).save(d / "deep.png") or "deep.png",
     r"image deep\.png \(.*\): has mode I;16 \(high bit depth\), which does not convert faithfully to 8-bit RGB"),
    (lambda d: save_image(d / "big.png", 64, 64).name, r"image big\.png \(.*\): 64x64 = 4,096 pixels, more than "
                                                  r"data.max_image_pixels=4,000; downscale it, or raise"),
    (lambda d: _animated(d / "anim.gif").name, r"image anim\.gif \(.*\): has 2 frames \(an animation"),
    (lambda d: "https://example.com/a.png", r"image https://example.com/a.png: a URL or inline data: images are read "
                                           r"from local files only"),
], ids=["missing", "not_an_image", "truncated", "mode", "too_large", "animated", "url"])
def test_each_bad_image_is_one_line_naming_file_and_line(tmp_path: Path, make, expected: str) -> None:
    cfg = dataclasses.replace(_one(tmp_path, {"type": "image", "image": make(tmp_path)}), max_image_pixels=4000)
    with pytest.raises(ValueError, match=rf"bad\.jsonl line 3: {expected}") as e:
        _loader(cfg)
    assert "\n" not in str(e.value) and e.value.__cause__ is None and e.value.__suppress_context__


def _animated(path: Path) -> Path:
    frames = [Image.new("RGB", (4, 4), c) for c in ("red", "blue")]
    frames[0].save(path, save_all=True, append_images=frames[1:])
    return path


@pytest.mark.parametrize("part, role, expected", [
    ({"type": "video", "video": "v.mp4"}, "user", r"is a video part \('video'\), which is not read \(images only"),
    ({"type": "image_url", "image_url": {"url": "a.png"}}, "user", r"is an OpenAI image_url part"),
    ({"type": "image", "image": "a.png", "min_pixels": 4}, "user", r"has 'min_pixels' beside type and image"),
    ({"type": "image", "image": "a.png"}, "assistant", r"is an image in an assistant turn"),
], ids=["video", "image_url", "extra_key", "assistant_image"])
def test_parts_that_would_be_dropped_are_refused(tmp_path: Path, part: dict, role: str, expected: str) -> None:
    save_image(tmp_path / "a.png", 8, 8)
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": role, "content": [part]}]}))
    with pytest.raises(ValueError, match=rf"p\.jsonl line 1: messages\[1\]\.content\[0\] {expected}"):
        _loader(_cfg(path))


def test_an_image_changed_under_the_run_stops_it_and_a_new_start_retokenizes(tmp_path: Path, caplog) -> None:
    cfg = _cfg(image_chat_corpus(tmp_path), seq_len=48)
    loader = _loader(cfg, batch=4)
    identity = loader.state_dict()["data"]
    save_image(tmp_path / "img" / "gray.jpg", 20, 20, "L", seed=9)  # same size, other pixels
    with pytest.raises(ValueError, match=r"chats\.jsonl line \d+: image img/gray\.jpg \(.*\): changed since the corpus "
                                         r"was tokenized"):
        for _ in range(loader.num_windows):
            next(loader)
    again = _loader(cfg, batch=4)
    assert "changed since it was tokenized" in caplog.text
    assert again.state_dict()["data"] != identity  # a resume onto the changed images is refused (the identity)
    (tmp_path / "img" / "gray.jpg").unlink()
    with pytest.raises(ValueError, match=r"chats\.jsonl line \d+: image img/gray\.jpg \(.*\): missing"):
        _loader(cfg)


# ------------------------------------------------------------------------ issue 63 item 7: never trained as text


def test_image_chats_without_a_vision_tower_are_refused_by_name(tmp_path: Path) -> None:
    cfg = _cfg(image_chat_corpus(tmp_path))
    with pytest.raises(ValueError, match=r"chats\.jsonl line 3: an image part \('img/tall\.png'\): images are trained "
                                         r"only by data=jsonl for a model with a vision tower .*: here the chat would "
                                         r"train as text with the image dropped"):
        _loader(cfg, vision=None)
    with pytest.raises(ValueError, match=r"chats\.jsonl line 3: an image part .* vision tower"):  # pretokenize
        tokenize_to_shards(Path(cfg.path), tmp_path / "shards", "qwen3_5")


def test_an_images_field_in_jsonl_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "sharegpt.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "<image>What?"},
                                             {"role": "assistant", "content": "A cat."}], "images": ["a.png"]}) + "\n")
    for vision in (None, ...):
        with pytest.raises(ValueError, match=r"sharegpt\.jsonl line 1: the object has 'images' beside its document, "
                                             r"which is not read: the images would be dropped; put each image into "
                                             r"the messages as an image part"):
            _loader(_cfg(path), vision=vision)


def test_images_in_datasets_files_are_refused(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    chats = [[{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": "answer"}]
             for i in range(4)]
    pq.write_table(pa.table({"messages": chats, "images": [["a.png"]] * 4}), tmp_path / "columns.parquet")
    cfg = DataConfig(name="hf", path=str(tmp_path / "columns.parquet"), seq_len=16, cache_dir=str(tmp_path / "c"))
    with pytest.raises(ValueError, match=r"data.path=.*columns\.parquet \(.*\) has the column 'images': data=hf reads "
                                         r"one text or messages column, so the images would be dropped"):
        _loader(cfg)
    # image parts in the messages: arrow stores the parts as structs of every field (None where a part has none)
    parts = [[{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in chat] for chat in chats]
    parts[2][0]["content"].insert(0, {"type": "image", "image": "a.png"})
    pq.write_table(pa.table({"messages": parts}), tmp_path / "parts.parquet")
    with pytest.raises(ValueError, match=r"parts\.parquet row 2: an image part \('a\.png'\): images are trained only "
                                         r"by data=jsonl for a model with a vision tower"):
        _loader(dataclasses.replace(cfg, path=str(tmp_path / "parts.parquet")))


def test_image_settings_are_validated_in_one_place(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="data.max_image_pixels=0 must be a positive number of pixels"):
        validate_data_config(DataConfig(name="jsonl", path="x.jsonl", max_image_pixels=0))
    with pytest.raises(ValueError, match="data.image_min_pixels=4096 is above data.image_max_pixels=1024"):
        validate_data_config(DataConfig(name="jsonl", path="x.jsonl", image_min_pixels=4096, image_max_pixels=1024))
    with pytest.raises(ValueError, match="data.image_max_pixels set the images of chats, which only data.name=jsonl"):
        validate_data_config(DataConfig(name="tokens", path="x.npy", image_max_pixels=1024))
    text = tmp_path / "t.jsonl"
    text.write_text(json.dumps({"text": "words " * 400}) + "\n")
    with pytest.raises(ValueError, match="data.image_max_pixels resize the images of chats, and the model has no "
                                         "vision tower"):
        _loader(_cfg(text, image_max_pixels=1024), vision=None)
    with pytest.raises(ValueError, match=r"data.image_min_pixels leave images between 1,000,000 and 1,024 pixels"):
        _loader(_cfg(text, image_min_pixels=10**6))


def test_images_are_recorded_beside_their_shards_and_a_resume_checks_them(tmp_path: Path) -> None:
    """Tokenized over worker processes in shards, the images' records concatenate to the single-shard ones; a shard
    whose records file is gone or changed is tokenized again."""
    from training.data.tokenize_shards import JsonlCorpus, images_file

    path = image_chat_corpus(tmp_path)
    with path.open("a") as f:  # a last shard of text only
        f.write("".join(json.dumps({"text": f"more text {i}"}) + "\n" for i in range(5)))
    corpus = JsonlCorpus(path, _vision())
    whole = tokenize_to_shards(corpus, tmp_path / "one", "qwen3_5")
    sharded = tokenize_to_shards(corpus, tmp_path / "many", "qwen3_5", workers=2, docs_per_shard=5)
    assert np.array_equal(whole.stream(tmp_path / "one"), sharded.stream(tmp_path / "many"))
    assert whole.images(tmp_path / "one") == sharded.images(tmp_path / "many") and len(whole.images(tmp_path / "one"))
    with_images = [s.file for s in sharded.shards if s.images_sha256]
    assert 1 < len(with_images) < len(sharded.shards)  # the text-only shards have no records file
    (tmp_path / "many" / images_file(with_images[0])).write_text("[]")
    again = tokenize_to_shards(corpus, tmp_path / "many", "qwen3_5", docs_per_shard=5)
    assert again.images(tmp_path / "many") == whole.images(tmp_path / "one")
