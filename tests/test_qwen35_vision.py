"""Qwen3.5 with its vision tower against transformers' Qwen3_5MoeForConditionalGeneration in fp32 on CPU: three images
of different sizes in two rows, the weights copied through the hf name map (``ModelSpec.hf_prefixes``); logits, the
loss with the router aux loss, and the gradient of every parameter, the tower's included. Also: the tower's index
tables against transformers' ``vision_utils``, its initialisation, the config.json round trip, and a micro-batch
without images (the dummy the tower runs on so that every rank runs it) changing nothing but giving the tower a zero
gradient."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers
from omegaconf import OmegaConf
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeVisionConfig

from models import build_args, get_spec
from models.hf_io import _to_disk
from models.qwen3_5_moe import hf_names
from models.qwen3_5_moe.args import VisionArgs
from models.qwen3_5_moe.vision import interpolation_taps, rotary_positions, vision_inputs
from tests.test_qwen35_parity import ARCH, CONF_MODEL, _hf_config, _rel_err
from training.loss import router_loss_shares

IMAGE, VIDEO, START, END = 120, 121, 122, 123  # within ARCH's 128-token vocabulary
TOKENS = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)
# Two blocks of 32 (2 heads of 16: 4 rotary frequencies for each of h and w), 4 x 4 patches over 2 frames, merged
# 2 x 2, a 4 x 4 grid of learned positions that every image resamples (a 4 x 6 grid stretches, a 2 x 2 shrinks).
VISION = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=ARCH["hidden_size"],
              patch_size=4, temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16,
              initializer_range=0.1)
GRIDS = torch.tensor([[1, 4, 6], [1, 2, 2], [1, 6, 4]])  # 6, 1 and 6 image tokens
SPEC = get_spec("qwen3_5_moe")


def _hf_model_config() -> transformers.Qwen3_5MoeConfig:
    vision = {k: v for k, v in VISION.items()}
    return transformers.Qwen3_5MoeConfig(text_config=_hf_config(ARCH, output_router_logits=True).to_dict(),
                                         vision_config=Qwen3_5MoeVisionConfig(**vision).to_dict(), **TOKENS)


def _models() -> tuple[torch.nn.Module, torch.nn.Module]:
    args = build_args("qwen3_5_moe", {**ARCH, "vision_config": {**VISION, **TOKENS}}, vision=True)
    torch.manual_seed(0)
    ours = SPEC.model_cls(args)
    ours.init_weights()
    with torch.no_grad():  # norms away from their init, so a misplaced (1 + w) or LayerNorm bias shows
        for name, p in ours.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    hf = transformers.Qwen3_5MoeForConditionalGeneration(_hf_model_config()).float()
    # Our names on disk are transformers' in-memory ones (fused experts aside, the same in both).
    hf.load_state_dict({_to_disk(SPEC, name): t for name, t in ours.state_dict().items()}, strict=True)
    hf.set_experts_implementation("eager")
    return ours, hf


def _batch() -> dict[str, torch.Tensor]:
    """Two rows of 40: row 0 text, image 0 (6 tokens), text, image 1 (1 token), text; row 1 text, image 2, text."""
    g = torch.Generator().manual_seed(3)

    def text(n: int) -> list[int]:
        return torch.randint(0, 100, (n,), generator=g).tolist()

    def image(n: int) -> list[int]:
        return [START] + [IMAGE] * n + [END]

    rows = [text(5) + image(6) + text(4) + image(1) + text(20), text(3) + image(6) + text(29)]
    ids_BT = torch.tensor(rows)
    pixel_values = torch.randn(int(GRIDS.prod(1).sum()), 3 * 2 * 4 * 4, generator=g)
    vision_BT = torch.isin(ids_BT, torch.tensor([IMAGE, START, END]))
    labels_BT = torch.cat([ids_BT[:, 1:], torch.full((2, 1), -100)], 1)  # shifted: the target of each position
    labels_BT[torch.cat([vision_BT[:, 1:], torch.ones(2, 1, dtype=torch.bool)], 1)] = -100  # never a vision target
    return {"input_ids": ids_BT, "labels": labels_BT, "pixel_values": pixel_values}


def test_forward_loss_and_grads_match_transformers() -> None:
    ours, hf = _models()
    batch = _batch()
    ids_BT, labels_BT, pixel_values = batch["input_ids"], batch["labels"], batch["pixel_values"]
    mm_BT = (ids_BT == IMAGE).int()
    rope_3BT, _ = hf.model.get_rope_index(ids_BT, mm_BT, image_grid_thw=GRIDS)
    position_ids = torch.cat([torch.arange(ids_BT.shape[1]).expand(1, *ids_BT.shape), rope_3BT])  # [4, B, T]
    images = vision_inputs(pixel_values, GRIDS, ours.args.vision_config, torch.device("cpu"),
                           (ids_BT.flatten() == IMAGE).nonzero().squeeze(1))
    with torch.no_grad():
        logits = ours(ids_BT, position_ids, images=images).logits
    out = ours(ids_BT, position_ids, labels_BT, images=images)
    aux = router_loss_shares(out.router_stats, ARCH["num_experts"])[0]
    loss = out.loss_sum / (labels_BT != -100).sum() + ARCH["router_aux_loss_coef"] * aux
    loss.backward()
    # transformers builds the 3-D positions itself from mm_token_type_ids, and shifts the labels itself.
    hf_labels = torch.where(torch.isin(ids_BT, torch.tensor([IMAGE, START, END])), -100, ids_BT)
    ref = hf(input_ids=ids_BT, pixel_values=pixel_values, image_grid_thw=GRIDS, mm_token_type_ids=mm_BT,
             labels=hf_labels)
    ref.loss.backward()

    # As the text model's test (tests/test_qwen35_parity.py): the same ops in another layout, fp32 round-off. The
    # tower's gradients, which reach it through 13 tokens only, differ by up to 3.5e-5 relative.
    assert _rel_err(logits, ref.logits) < 1e-5
    torch.testing.assert_close(aux, ref.aux_loss, rtol=0, atol=1e-5)
    torch.testing.assert_close(loss, ref.loss, rtol=0, atol=1e-5)
    hf_params = dict(hf.named_parameters())
    ours_params = {_to_disk(SPEC, name): p for name, p in ours.named_parameters()}
    assert set(hf_params) == set(ours_params)
    assert any(name.startswith("model.visual.") for name in ours_params)
    errors = {name: _rel_err(p.grad, hf_params[name].grad) for name, p in ours_params.items()}
    decay = {name for name in errors if name.endswith(("linear_attn.A_log", "linear_attn.dt_bias"))}
    assert max(v for k, v in errors.items() if k not in decay) < 1e-4, sorted(errors.items(), key=lambda kv: -kv[1])[:5]
    assert max(errors[k] for k in decay) < 3e-4
    # The images matter: other pixels, other logits at the text after them.
    other = vision_inputs(pixel_values + 1, GRIDS, ours.args.vision_config, torch.device("cpu"),
                          images.token_positions_n)
    with torch.no_grad():
        assert not torch.allclose(ours(ids_BT, position_ids, images=other).logits[:, -1], logits[:, -1], atol=1e-4)


def test_a_batch_without_images_runs_the_tower_for_a_zero_gradient() -> None:
    ours, _ = _models()
    ids_BT = _batch()["input_ids"].clamp(max=100)  # text only
    labels_BT = ids_BT.roll(-1, 1)
    dummy = vision_inputs(torch.zeros(0, 96), torch.zeros(0, 3, dtype=torch.long), ours.args.vision_config,
                          torch.device("cpu"), torch.zeros(0, dtype=torch.long))
    assert dummy.dummy and dummy.lengths_A == (4,)
    text = ours(ids_BT, labels_BT=labels_BT).loss_sum
    out = ours(ids_BT, torch.arange(40).expand(4, 2, 40), labels_BT, images=dummy).loss_sum
    assert torch.equal(out, text)
    out.backward()
    tower = list(ours.visual.parameters())
    assert all(p.grad is not None and not p.grad.any() for p in tower)


def test_index_tables_match_transformers() -> None:
    from transformers.vision_utils import get_vision_interpolation_indices_and_weights, get_vision_position_ids

    grids = torch.tensor([[1, 4, 6], [2, 2, 2], [1, 6, 4], [1, 2, 8]])  # a two-frame one; wider than the grid
    assert torch.equal(rotary_positions(grids, 2), get_vision_position_ids(grids, 2))
    index, weight = interpolation_taps(grids, 4, 2)
    ref_index, ref_weight = get_vision_interpolation_indices_and_weights(grids, 4, mode="bilinear",
                                                                         align_corners=True, spatial_merge_size=2)
    assert torch.equal(index, ref_index)
    torch.testing.assert_close(weight, ref_weight, rtol=0, atol=1e-7)


def test_tower_init_matches_transformers() -> None:
    args = build_args("qwen3_5_moe", {**ARCH, "vision_config": {**VISION, **TOKENS}}, vision=True)
    model = SPEC.model_cls(args)
    model.init_weights()
    hf = transformers.Qwen3_5MoeForConditionalGeneration(_hf_model_config())
    ref = dict(hf.model.visual.named_parameters())
    for name, p in model.visual.named_parameters():
        r = ref[name].detach()
        if r.std() == 0:  # LayerNorm weights 1, biases 0
            assert torch.equal(p, r), name
        else:  # N(0, initializer_range) for both; 25%: the estimate over the smallest tensor (64 entries)
            std = VISION["initializer_range"]
            assert abs(p.std().item() / std - 1) < 0.25 and abs(r.std().item() / std - 1) < 0.25, name


def test_config_json_round_trip_and_the_published_preset() -> None:
    config = _hf_model_config().to_dict()
    args = build_args("qwen3_5_moe", hf_names.arch_from_config(config), vision=True)
    assert args.vision_config == VisionArgs(**VISION, **TOKENS)
    written = hf_names.config_from_arch(args)
    again = transformers.Qwen3_5MoeConfig(**written)
    assert again.vision_config.to_dict() | {"transformers_version": None} == \
        transformers.Qwen3_5MoeConfig(**config).vision_config.to_dict() | {"transformers_version": None}
    assert again.image_token_id == IMAGE and again.vision_start_token_id == START

@pytest.mark.parametrize("preset", ["qwen35_moe", "qwen35_moe_debug"])
def test_presets_build_their_tower_only_with_model_vision(preset) -> None:
    cfg = OmegaConf.to_object(OmegaConf.load(CONF_MODEL / f"{preset}.yaml"))
    assert build_args("qwen3_5_moe", cfg["arch"]).vision_config is None  # model.vision=false: the text model alone
    args = build_args("qwen3_5_moe", cfg["arch"], vision=True)
    with torch.device("meta"):
        model = SPEC.model_cls(args)
    tower = sum(p.numel() for p in model.visual.parameters())
    assert tower == args.vision_config.param_count()
    total, active = SPEC.parameter_counts(model)
    assert (total, active) == tuple(n + tower for n in args.param_counts()[:2])  # every tower parameter active
    if preset == "qwen35_moe":  # the published tower: transformers' default one, out to the text model's 2048
        defaults = VisionArgs(**hf_names.arch_from_config(transformers.Qwen3_5MoeConfig().to_dict())["vision_config"])
        assert args.vision_config == dataclasses.replace(defaults, out_hidden_size=2048)
        assert 0.44e9 < tower < 0.45e9 and 35.0e9 < total < 35.2e9  # "35B" counts the tower (and the MTP head)


@pytest.mark.parametrize("key, value, match", [
    ("out_hidden_size", 48, "must be the text model's model.arch.hidden_size=64"),
    ("num_position_embeddings", 15, "must be a square"),
    ("hidden_act", "quick_gelu", "not implemented"),
    ("image_token_id", 999, "not an id of the vocabulary"),
])
def test_vision_config_checks_name_the_key(key, value, match) -> None:
    arch = {**ARCH, "vision_config": {**VISION, **TOKENS, key: value}}
    with pytest.raises(ValueError, match=f"model.arch.vision_config.{key}.*{match}"):
        build_args("qwen3_5_moe", arch, vision=True)
    assert build_args("qwen3_5_moe", arch).vision_config is None  # not built (model.vision=false): not checked


def test_flops_per_patch_is_what_torch_counts_and_the_attended_flops_add_it() -> None:
    """The tower's training FLOPs (``VisionArgs.flops_per_patch``, what the planner's time and the attended MFU use)
    equal torch's FlopCounterMode over its forward and backward on two images of different sizes; a window's
    attended FLOPs per token grow by them over its tokens, and a window without images adds none."""
    from torch.utils.flop_counter import FlopCounterMode

    from models.qwen3_5_moe.vision import VisionModel
    from training.batch import prepare_batches

    args = build_args("qwen3_5_moe", {**ARCH, "vision_config": {**VISION, **TOKENS}}, vision=True)
    tower = VisionModel(args.vision_config)
    for p in tower.parameters():
        torch.nn.init.normal_(p, std=0.02)
    grid = torch.tensor([[1, 8, 12], [1, 4, 4]])
    J = int(grid.prod(1).sum())
    pixels = torch.randn(J, args.vision_config.patch_dim)
    images = vision_inputs(pixels, grid, args.vision_config, torch.device("cpu"), torch.arange(J // 4))
    with FlopCounterMode(display=False) as counter:
        tower(images).sum().backward()
    per_image = [int(g.prod()) * args.vision_config.flops_per_patch(int(g.prod())) for g in grid]
    assert sum(per_image) == counter.get_total_flops()

    B, T = 2, 64
    ids = torch.randint(0, 100, (B, T))
    ids[0, 3:3 + J // 4] = args.vision_config.image_token_id
    window = {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(T).expand(B, T).contiguous()}
    window["position_ids"] = torch.cat([window["position_ids"][None]] * 4)
    with_images = {**window, "pixel_values": pixels, "image_grid_thw": grid}
    without = {**window, "input_ids": torch.randint(0, 100, (B, T)), "pixel_values": pixels[:0],
               "image_grid_thw": grid[:0]}
    text = {k: window[k] for k in ("input_ids", "labels")} | {"position_ids": window["position_ids"][0]}
    cpu = torch.device("cpu")
    (a,), (b,), (c,) = (prepare_batches([w], args, 0, 1, cpu, mtp=False) for w in (with_images, without, text))
    assert a.attended_flops - c.attended_flops == pytest.approx(sum(per_image) / (B * T), rel=1e-12)
    assert b.attended_flops == c.attended_flops


def test_the_planner_counts_the_towers_units_activations_and_time() -> None:
    from tests.conftest import compose_config
    from training.planner import PlanConfig, build_meta_model, plan

    base = ["model=qwen35_moe", "model.arch.num_hidden_layers=4", "parallel=ep2", "data.seq_len=4096",
            "train.local_batch_size=2", "train.mixed_precision=bf16", "parallel.activation_checkpoint=selective"]
    machine = PlanConfig(gpus=2)
    text, vision = plan(compose_config(base), machine), plan(compose_config([*base, "model.vision=true"]), machine)
    tower = build_meta_model(compose_config([*base, "model.vision=true"]))[1].visual
    units = {u.name: u for u in vision.units}
    assert {u.name for u in vision.units} - {u.name for u in text.units} == {"vision", *(f"vision block {i}"
                                                                                       for i in range(27))}
    assert sum(u.numel for name, u in units.items() if name.startswith("vision")) == \
        sum(p.numel() for p in tower.parameters())
    assert any(c.what == "vision" and c.kind == "all_gather" for c in vision.collectives)  # sharded over fsdp 2
    # A window's 8,192 tokens, a quarter of them image tokens of 4 patches: 8,192 patches through the tower.
    patches = 8192
    block = tower.blocks[0].saved_activations()
    grown = vision.memory.activations["selective"] - text.memory.activations["selective"]
    assert grown >= patches * 27 * (2 * block.selective + 4 * block.selective_fp32)
    assert vision.compute_s > text.compute_s


def test_the_tests_rope_index_is_transformers_get_rope_index() -> None:
    """tests/vision_data.py's rope_index (the windows of the layout and training tests) against transformers'."""
    from tests.vision_data import rope_index

    hf = transformers.Qwen3_5MoeForConditionalGeneration(_hf_model_config())
    grids = [(1, 4, 6), (1, 2, 2), (2, 6, 4)]  # the last of two frames
    ids_T = torch.tensor([1, 2, START, *[IMAGE] * 6, END, 3, START, IMAGE, END, 4, START, *[IMAGE] * 12, END, 5, 6])
    want, _ = hf.model.get_rope_index(ids_T[None], (ids_T[None] == IMAGE).int(), image_grid_thw=torch.tensor(grids))
    assert torch.equal(rope_index(ids_T, grids, 2, image_token_id=IMAGE), want[:, 0])
