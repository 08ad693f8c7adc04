"""Qwen3.5 with its vision tower through train.run, one process, on token data with images (tests/vision_data.py):
exact resume (held-out windows with images evaluated too), model.freeze_vision (the tower unchanged, no optimizer
state), optim.vision_lr_scale (the tower's first update scaled), the tower loaded from and exported into a multimodal
checkpoint's layout, and the export of a preset run loading in transformers' AutoModelForImageTextToText and
generating from an image prompt the tokens our model does. And train.py on chats with image files (data=jsonl): the
images reach the tower, whose token ids must be the tokenizer's, and two ep2 ranks train as one process does."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import transformers
from PIL import Image
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

import train
from models import build_args, get_spec
from models.hf_io import export_hf
from models.qwen3_5_moe.vision import vision_inputs
from scripts import export_hf as export_script
from tests.conftest import compose_config, write_tokens
from tests.dist_utils import assert_same_curve, run_distributed, run_train
from tests.vision_data import (END, IMAGE, START, image_chat_corpus, images_in_token_data, rope_index,
                               vision_overrides)
from training.data.vision import ImageProcessing, read_image_processing
from training.startup import resolve_model

TINY = ["model=qwen35_moe_debug", "model.arch.vocab_size=256", "model.arch.hidden_size=32",
        "model.arch.moe_intermediate_size=16", "model.arch.shared_expert_intermediate_size=16", "model.tokenizer=none"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("vision-train")
    write_tokens(tmp / "tokens.npy", 8192)
    return tmp


def config(tmp: Path, run: str, *overrides: str):
    return compose_config([
        *TINY, *vision_overrides(), "data=tokens", f"data.path={tmp / 'tokens.npy'}", "data.seq_len=32",
        f"data.cache_dir={tmp / 'cache'}", f"train.output_dir={tmp / run}", "train.local_batch_size=4",
        "optim.warmup_steps=0", "optim.lr=1e-2", "logging.tensorboard=false", "train.device=cpu",
        "train.mixed_precision=fp32", *overrides])


def run(cfg) -> list[dict]:
    with images_in_token_data(resolve_model(cfg)[1].vision_config):
        return train.run(cfg)


def seeded_source(tmp: Path) -> Path:
    """A multimodal checkpoint (our export of a seeded model with its tower: the published layout)."""
    path = tmp / "source"
    if not (path / "config.json").is_file():
        cfg = config(tmp, "init")
        model = get_spec("qwen3_5_moe").model_cls(build_args("qwen3_5_moe", dict(cfg.model.arch), vision=True))
        model.init_weights(seed=7)
        export_hf(model, "qwen3_5_moe", path)
    return path


@pytest.mark.torch_apis  # DCP's save and load, exactly
def test_resume_with_images_is_exact(data):
    # Held-out windows with images evaluated every 2 steps; the tower at half the learning rate.
    extra = ["train.steps=4", "data.eos_id=0", "data.val_fraction=0.2", "train.eval_every=2", "train.eval_batches=1",
             "optim.vision_lr_scale=0.5"]
    full = run(config(data, "full", *extra, "checkpoint.interval=2"))  # saving changes nothing of the run
    step2 = data / "full" / "checkpoints" / "step_00000002"
    resumed = run(config(data, "resumed", *extra, f"train.resume={step2}"))
    assert [m["step"] for m in resumed] == [3, 4]
    for got, want in zip(resumed, full[2:]):  # bit for bit: the tower's weights and moments restored too
        assert (got["loss"], got["grad_norm"], got["val_loss"] if "val_loss" in got else None) == \
            (want["loss"], want["grad_norm"], want.get("val_loss"))
    assert "val_loss" in full[-1]


def test_freeze_vision_keeps_the_tower_and_no_optimizer_state(data):
    source = seeded_source(data)
    run(config(data, "frozen", f"model.init_from={source}", "model.freeze_vision=true", "train.steps=2",
               "checkpoint.interval=2"))
    start = load_file(data / "frozen" / "model.safetensors")
    exported = {k.removeprefix("model.visual."): v for k, v in load_file(source / "model.safetensors").items()
                if k.startswith("model.visual.")}
    tower = {k.removeprefix("visual."): v for k, v in start.items() if k.startswith("visual.")}
    assert tower.keys() == exported.keys() and all(torch.equal(tower[k], exported[k]) for k in tower)
    text = load_file(data / "frozen" / "model.safetensors")["model.embed_tokens.weight"]
    assert not torch.equal(text, load_file(source / "model.safetensors")["model.language_model.embed_tokens.weight"])
    keys = FileSystemReader(str(data / "frozen" / "checkpoints" / "step_00000002")).read_metadata().state_dict_metadata
    assert any(k.startswith("optim.state.model.") for k in keys)
    assert not any(k.startswith("optim.state.visual.") for k in keys)


def test_vision_lr_scale_scales_the_towers_first_update(data):
    source = seeded_source(data)
    before = load_file(source / "model.safetensors")
    moved = {}
    for scale in (1.0, 0.25):
        cfg = config(data, f"scale-{scale}", f"model.init_from={source}", "train.steps=1", "optim.grad_clip=0",
                     f"optim.vision_lr_scale={scale}")
        run(cfg)
        after = load_file(data / f"scale-{scale}" / "model.safetensors")
        tower = after["visual.blocks.0.attn.qkv.weight"] - before["model.visual.blocks.0.attn.qkv.weight"]
        moved[scale] = {"tower": tower,
                        "text": after["model.layers.0.mlp.shared_expert.up_proj.weight"]
                        - before["model.language_model.layers.0.mlp.shared_expert.up_proj.weight"]}
    # AdamW's first update is lr x (g / (|g| + eps) + weight_decay x p): linear in the lr.
    torch.testing.assert_close(moved[0.25]["tower"], 0.25 * moved[1.0]["tower"], rtol=1e-4, atol=1e-9)
    assert moved[1.0]["tower"].abs().max() > 1e-3
    torch.testing.assert_close(moved[0.25]["text"], moved[1.0]["text"], rtol=0, atol=0)


def exported_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an export (one file, or shards: the tensors trained and those carried are written apart)."""
    return {name: t for file in sorted(path.glob("model*.safetensors")) for name, t in load_file(file).items()}


def hf_run(data: Path, source: Path, name: str, *overrides: str):
    """model=hf from ``source`` with its tower (model.vision=true), exported at the end."""
    return compose_config([
        "model=hf", f"model.init_from={source}", "model.tokenizer=none", "model.vision=true", "data=tokens",
        f"data.path={data / 'tokens.npy'}", "data.seq_len=32", f"data.cache_dir={data / 'cache'}",
        f"train.output_dir={data / name}", "train.local_batch_size=4", "logging.tensorboard=false",
        "train.device=cpu", "train.mixed_precision=fp32", "optim.warmup_steps=0", "optim.lr=1e-2",
        "checkpoint.export_hf_at_end=true", "checkpoint.at_end=false", *overrides])


def test_the_tower_loads_from_a_multimodal_checkpoint_and_exports_into_its_layout(data):
    source = seeded_source(data)
    src = load_file(source / "model.safetensors")
    run(hf_run(data, source, "loaded", "train.steps=0", "checkpoint.export_hf_at_end=false"))
    weights = load_file(data / "loaded" / "model.safetensors")
    tower = [name for name in weights if name.startswith("visual.")]
    assert tower and all(torch.equal(weights[name], src[f"model.{name}"]) for name in tower)
    run(hf_run(data, source, "trained", "train.steps=2"))
    weights = load_file(data / "trained" / "model.safetensors")
    exported = exported_tensors(data / "trained" / "hf")
    assert exported.keys() == src.keys()
    for name in tower:  # the trained tower, in the source's names
        assert torch.equal(exported[f"model.{name}"], weights[name]), name
    assert not torch.equal(exported["model.visual.blocks.0.attn.qkv.weight"],
                           src["model.visual.blocks.0.attn.qkv.weight"])
    assert (data / "trained" / "hf" / "config.json").read_bytes() == (source / "config.json").read_bytes()
    # (Text data, no tower built: the source's tower is carried byte for byte: tests/test_qwen35_export.py.)


def test_the_export_generates_from_an_image_what_our_model_does(data):
    cfg = config(data, "export", "train.steps=2", "checkpoint.export_hf_at_end=true", "checkpoint.at_end=false")
    run(cfg)
    hf_dir = data / "export" / "hf"
    assert json.loads((hf_dir / "config.json").read_text())["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]
    hf = transformers.AutoModelForImageTextToText.from_pretrained(hf_dir, dtype=torch.float32).eval()
    args = resolve_model(cfg)[1]
    ours = get_spec("qwen3_5_moe").model_cls(args).eval()
    ours.load_state_dict(load_file(data / "export" / "model.safetensors"))
    vision = args.vision_config
    grid = torch.tensor([[1, 4, 6]])  # 6 tokens
    pixels = torch.randn(24, vision.patch_dim, generator=torch.Generator().manual_seed(5))
    prompt = torch.tensor([[11, 12, START, *[IMAGE] * 6, END, 13, 14, 15]])
    new = 6
    with torch.no_grad():
        out = hf.generate(input_ids=prompt, pixel_values=pixels, image_grid_thw=grid,
                          mm_token_type_ids=(prompt == IMAGE).int(), max_new_tokens=new, min_new_tokens=new,
                          do_sample=False)[0, prompt.shape[1]:].tolist()
        ids = prompt
        for _ in range(new):  # our greedy decode: the whole sequence again at each token (no cache)
            T = ids.shape[1]
            positions = torch.cat([torch.arange(T)[None, None], rope_index(ids[0], [(1, 4, 6)], 2)[:, None]])
            images = vision_inputs(pixels, grid, vision, torch.device("cpu"), (ids[0] == IMAGE).nonzero().squeeze(1))
            logits = ours(ids, positions, images=images).logits
            ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert ids[0, prompt.shape[1]:].tolist() == out


def jsonl_config(tmp: Path, run: str, *overrides: str, model: str = "model=qwen35_moe_debug"):
    """The debug preset (or ``model``) with its tower on chats with image files (data=jsonl, Qwen3.5's tokenizer),
    images resized to 1 .. 4 merged tokens."""
    return compose_config([
        model, "model.vision=true", "data=jsonl", f"data.path={image_chat_corpus(tmp)}",
        "data.seq_len=64", "data.image_min_pixels=1024", "data.image_max_pixels=4096",
        f"data.cache_dir={tmp / 'cache'}",
        f"train.output_dir={tmp / run}", "train.local_batch_size=2", "optim.warmup_steps=0", "optim.lr=1e-2",
        "optim.weight_decay=0", "logging.tensorboard=false", "train.device=cpu", "train.mixed_precision=fp32",
        *overrides])


def test_train_py_trains_the_tower_on_chats_with_image_files(tmp_path, monkeypatch):
    """train.run hands the loader the model's image processor and ids (``RunPlan.vision``): the chats' images reach
    the tower, whose weights move (no weight decay: only a gradient moves them); the export serves its image
    processor, and a model=hf run from the export reads that processor and the trained tower."""
    run_windows = []
    real = train.build_data_loader

    def recording(*args, **kwargs):
        loader = real(*args, **kwargs)
        run_windows.append(loader)
        return loader

    train.run(jsonl_config(tmp_path, "init", "train.steps=0"))
    monkeypatch.setattr(train, "build_data_loader", recording)
    train.run(jsonl_config(tmp_path, "trained", "train.steps=3", "checkpoint.export_hf_at_end=true"))
    assert run_windows and run_windows[0].vision is not None  # a multimodal corpus: every batch has the images' keys
    before, after = (load_file(tmp_path / run / "model.safetensors") for run in ("init", "trained"))
    tower = [name for name in before if name.startswith("visual.")]
    assert tower and all(not torch.equal(before[name], after[name]) for name in tower), \
        [name for name in tower if torch.equal(before[name], after[name])]
    # The export carries the model's image processor (Qwen3.5's published settings at the tower's sizes): transformers'
    # processor loads it and turns an image into the pixels ours does.
    hf_dir = tmp_path / "trained" / "hf"
    processing = read_image_processing(hf_dir)
    assert processing == ImageProcessing.for_tower(patch_size=16, temporal_patch_size=2, merge_size=2)
    image = Image.open(tmp_path / "img" / "wide.png").convert("RGB").resize((90, 70))
    theirs = Qwen2VLImageProcessorPil.from_pretrained(hf_dir)(images=[image], return_tensors="np")
    ours, grid = processing(image)
    assert grid == tuple(theirs["image_grid_thw"][0]) and ours.tobytes() == theirs["pixel_values"].tobytes()
    # scripts/export_hf.py writes the same processor from the run's record
    export_script.main([str(tmp_path / "trained"), str(tmp_path / "exported")])
    assert (tmp_path / "exported" / "preprocessor_config.json").read_bytes() == \
        (hf_dir / "preprocessor_config.json").read_bytes()
    # The export as the source of a run (the README's model=hf command): its config, tokenizer (auto), image processor
    # (its mean changed here, to tell it from the published default) and trained tower are what that run reads.
    config = json.loads((hf_dir / "preprocessor_config.json").read_text())
    (hf_dir / "preprocessor_config.json").write_text(json.dumps({**config, "image_mean": [0.25, 0.5, 0.75]}))
    train.run(jsonl_config(tmp_path, "from-export", "train.steps=0", f"model.init_from={hf_dir}", model="model=hf"))
    assert run_windows[-1].vision.processing == dataclasses.replace(processing, min_pixels=1024, max_pixels=4096,
                                                                    image_mean=(0.25, 0.5, 0.75))
    loaded = load_file(tmp_path / "from-export" / "model.safetensors")
    assert all(torch.equal(loaded[name], after[name]) for name in tower)


def test_the_tokenizer_ids_must_be_the_towers(tmp_path):
    cfg = jsonl_config(tmp_path, "ids", "model.arch.vision_config.image_token_id=248057")
    with pytest.raises(ValueError, match=r"model\.arch\.vision_config\.image_token_id=248057 \(the qwen3_5 "
                                         r"tokenizer's: 248056\): the model would not find the images"):
        train.run(cfg)
    assert not (tmp_path / "ids").exists()  # refused before anything is written


@pytest.mark.torch_apis  # FSDP2 and EP on gloo ranks
def test_image_chats_under_ep2_train_as_one_process_does(tmp_path):
    """torchrun's path for image chats: two gloo ranks (parallel=ep2: dp 2, the experts split) read the jsonl's
    windows with their images as one process reads the same global batch; the losses and gradient norms agree."""
    one = train.run(jsonl_config(tmp_path, "one", "train.steps=3", "train.local_batch_size=4"))
    two = run_distributed(run_train, 2, jsonl_config(tmp_path, "ep2", "parallel=ep2", "train.steps=3"))
    assert_same_curve(two, one, steps=[1, 2, 3])
