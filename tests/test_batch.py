"""``prepare_batches`` keeps its order (training/batch.py): documents and the MTP shift from the whole window, then the
cp split. Each check builds the batches in the documented order by hand and also in the order a change would
bring, and shows that the two differ on this data, so that the test fails if the order changes. Windows with images
(the loader's for data with images: [4, B, T] position ids, ``pixel_values``, ``image_grid_thw``): documents from the
text row, the images whole on every cp rank, each rank's image tokens its shard's."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from models import build_args
from models.causal_lm import mtp_batch
from models.layers import known_documents
from training.batch import prepare_batches
from training.data.packing import context_shard

CPU = torch.device("cpu")
ARGS = build_args("qwen3_moe", {"vocab_size": 256, "hidden_size": 32, "num_attention_heads": 4,
                                "num_key_value_heads": 2, "head_dim": 8, "moe_intermediate_size": 16})


def _window() -> dict[str, torch.Tensor]:
    """Two rows of 8 tokens: the first packs documents of 3 and 5 tokens (one starts in the second cp half), the
    second is one document with a masked prompt."""
    ids = torch.arange(16).reshape(2, 8) + 10
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], list(range(8))])
    labels = ids.clone()
    labels[1, :3] = -100
    return {"input_ids": ids, "position_ids": positions, "labels": labels}


def test_the_mtp_shift_is_taken_on_the_whole_window_before_the_cp_split() -> None:
    window = _window()
    whole = {**window, **mtp_batch(window["input_ids"], window["labels"], window["position_ids"])}
    for rank in range(2):
        batch, = prepare_batches([window], ARGS, cp_rank=rank, cp=2, dev=CPU, mtp=True)
        expected = context_shard(whole, rank, 2)
        assert torch.equal(batch.mtp.input_ids_BT, expected["mtp_input_ids"])
        assert torch.equal(batch.mtp.labels_BT, expected["mtp_labels"])
        assert torch.equal(batch.input_ids, expected["input_ids"])
    # Shifting a shard instead would lose the label of rank 0's last position, whose token t+2 is rank 1's first.
    shard = context_shard(window, 0, 2)
    first, = prepare_batches([window], ARGS, cp_rank=0, cp=2, dev=CPU, mtp=True)
    assert not torch.equal(first.mtp.labels_BT, mtp_batch(shard["input_ids"], shard["labels"],
                                                           shard["position_ids"])["mtp_labels"])


def test_documents_and_attended_flops_come_from_the_whole_window_before_the_split() -> None:
    window = _window()
    whole = known_documents(window["position_ids"], CPU)
    for rank in range(2):
        batch, = prepare_batches([window], ARGS, cp_rank=rank, cp=2, dev=CPU, mtp=False)
        assert torch.equal(batch.packed.lengths_n, whole.lengths_n)  # 3, 5 and 8: the whole rows' documents
        assert batch.mtp is None
        late = known_documents(context_shard(window, rank, 2)["position_ids"], CPU)
        assert late is False or not torch.equal(late.lengths_n, whole.lengths_n)
    assert batch.attended_flops < ARGS.flops_per_token(8)  # the packed row and the masked labels attend less


def test_trained_rows_are_each_shards_own() -> None:
    window = _window()
    firsts = [prepare_batches([window], ARGS, cp_rank=r, cp=2, dev=CPU, mtp=False)[0] for r in range(2)]
    # rank 0 holds the masked prompt (row 1, tokens 0-2); rank 1 trains every label it holds
    assert firsts[0].trained_rows.tolist() == [0, 1, 2, 3, 7]
    assert firsts[1].trained_rows is None


VISION_ARGS = build_args("qwen3_5_moe", {
    "vocab_size": 256, "hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 8, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16, "linear_key_head_dim": 8,
    "linear_value_head_dim": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "vision_config": {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "patch_size": 2,
                      "out_hidden_size": 32, "num_position_embeddings": 16, "image_token_id": 252,
                      "video_token_id": 253, "vision_start_token_id": 250, "vision_end_token_id": 251}},
    vision=True)


def _image_window() -> dict[str, torch.Tensor]:
    """Two rows of 12 packing two documents each, as the loader yields data with images: [4, B, T] position ids,
    images of 2 x 4 and 4 x 4 patches (2 and 4 tokens); the second image's tokens cross the cp2 border at 6."""
    ids = torch.arange(24).reshape(2, 12) + 10
    ids[0, 2:6] = torch.tensor([250, 252, 252, 251])
    ids[1, 3:9] = torch.tensor([250, 252, 252, 252, 252, 251])
    text = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1]])
    rope = text.expand(3, 2, 12).clone()  # the 3-D rows: any values (the data side's), distinct from the text row
    rope[1:, :, 3:5] += 5
    patch_dim = VISION_ARGS.vision_config.patch_dim
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.cat([text[None], rope]),
            "pixel_values": torch.randn(8 + 16, patch_dim), "image_grid_thw": torch.tensor([[1, 2, 4], [1, 4, 4]])}


def test_multimodal_windows_documents_from_the_text_row_and_images_whole_on_every_cp_rank() -> None:
    from models.qwen3_5_moe.vision import insert_images

    window = _image_window()
    text = {k: v for k, v in window.items() if k not in ("pixel_values", "image_grid_thw")}
    text["position_ids"] = window["position_ids"][0]
    whole, = prepare_batches([window], VISION_ARGS, cp_rank=0, cp=1, dev=CPU, mtp=True)
    plain, = prepare_batches([text], VISION_ARGS, cp_rank=0, cp=1, dev=CPU, mtp=True)
    assert torch.equal(whole.packed.lengths_n, plain.packed.lengths_n)  # [7, 5, 10, 2]: row 0 of [4, B, T]
    assert torch.equal(whole.mtp.labels_BT, plain.mtp.labels_BT)  # the MTP shift's document ends likewise
    # the same documents; the tower's FLOPs on the images added, over the window's tokens
    tower = sum(n * VISION_ARGS.vision_config.flops_per_patch(n) for n in (8, 16))
    assert whole.attended_flops == pytest.approx(plain.attended_flops + tower / 24, rel=1e-12)
    assert plain.images is None  # text data: no images
    tokens_UD = torch.arange(1, 7, dtype=torch.float)[:, None]  # the window's 6 merged tokens, told apart
    # The decoder embeds the ids and the MTP head's in one [2B, T] call: an image token goes where its pad is in the
    # ids, and one position earlier in the MTP head's (token t+1's input embedding at t).
    want_2BT1 = insert_images(torch.zeros(4, 12, 1), tokens_UD, whole.images)
    assert want_2BT1[:2].flatten().tolist().count(0) == 24 - 6
    assert torch.equal(want_2BT1[2:], want_2BT1[:2].roll(-1, dims=1))
    shards = []
    for rank in range(2):
        batch, = prepare_batches([window], VISION_ARGS, cp_rank=rank, cp=2, dev=CPU, mtp=True)
        assert torch.equal(batch.pixel_values, window["pixel_values"])  # unsplit: every cp rank runs every image
        assert torch.equal(batch.image_grid_thw, window["image_grid_thw"])
        assert batch.position_ids.shape == (4, 2, 6)
        shards.append(insert_images(torch.zeros(4, 6, 1), tokens_UD, batch.images))
    # each rank keeps its shard's image tokens, the MTP head's across the shards' border too
    assert torch.equal(torch.cat(shards, dim=1), want_2BT1)
    without_mtp, = prepare_batches([window], VISION_ARGS, cp_rank=0, cp=1, dev=CPU, mtp=False)
    assert without_mtp.images.token_rows_n is None  # one rank, no MTP head: every merged token, in order
    assert torch.equal(insert_images(torch.zeros(2, 12, 1), tokens_UD, without_mtp.images), want_2BT1[:2])


def test_a_window_whose_pad_tokens_do_not_count_its_images_or_a_model_without_a_tower_is_refused() -> None:
    window = _image_window()
    window["image_grid_thw"] = torch.tensor([[1, 2, 4], [1, 2, 4]])
    window["pixel_values"] = window["pixel_values"][:16]
    with pytest.raises(ValueError, match="6 image pad tokens .* images of 4 merged patches"):
        prepare_batches([window], VISION_ARGS, cp_rank=0, cp=1, dev=CPU, mtp=False)
    empty = {**_image_window(), "pixel_values": torch.zeros(0, 24), "image_grid_thw": torch.zeros(0, 3)}
    with pytest.raises(ValueError, match="no vision tower: train with model.vision=true"):
        prepare_batches([empty], ARGS, cp_rank=0, cp=1, dev=CPU, mtp=False)


def test_the_mtp_head_reads_the_image_tokens_embeddings() -> None:
    """With images and the MTP head, the head's input embedding at t is the decoder's at t+1 after the images went
    in (vLLM's Qwen3_5MTP merges the multimodal embeddings into its own): an image token's where token t+1 is one."""
    from models import get_spec

    args = build_args("qwen3_5_moe", {**dataclasses.asdict(VISION_ARGS), "mtp_loss_weight": 0.3}, vision=True)
    torch.manual_seed(0)
    model = get_spec("qwen3_5_moe").model_cls(args)
    model.init_weights()
    batch, = prepare_batches([_image_window()], args, cp_rank=0, cp=1, dev=CPU, mtp=True)
    seen = {}
    model.model.layers[0].register_forward_pre_hook(lambda m, a: seen.update(decoder=a[0]))
    model.mtp.register_forward_pre_hook(lambda m, a: seen.update(mtp=a[0]))
    with torch.no_grad():
        model(batch.input_ids, batch.position_ids, batch.labels, **batch.forward_kwargs())
    image_t = batch.input_ids.roll(-1, dims=1) == args.vision_config.image_token_id
    assert image_t.any() and torch.equal(seen["mtp"][:, :-1], seen["decoder"][:, 1:])
    text = model.model.embed_tokens(batch.input_ids.roll(-1, dims=1))
    assert not torch.allclose(seen["mtp"][image_t], text[image_t])  # not the pad token's embedding


@pytest.fixture
def copies(monkeypatch) -> list[torch.Tensor]:
    """Every module's ``queued_copy`` replaced by one that refuses what the real one refuses on an accelerator
    (a tensor it copied already: on the device, pinning it fails) and records what it returns. On the CPU the real
    one returns its input, which hid a double copy that only an H100 run showed."""
    import sys

    from core import device

    original, made = device.queued_copy, []

    def queued_copy(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
        assert not any(t is m for m in made), "a tensor queued to the device twice"
        made.append(t.clone())
        return made[-1]

    for module in list(sys.modules.values()):
        if getattr(module, "queued_copy", None) is original:
            monkeypatch.setattr(module, "queued_copy", queued_copy)
    return made


@pytest.mark.parametrize("mtp", [False, True])
@pytest.mark.parametrize("cp", [1, 2])
def test_every_tensor_of_a_batch_is_queued_to_the_device_once(copies, cp: int, mtp: bool) -> None:
    args = build_args("qwen3_5_moe", {**dataclasses.asdict(VISION_ARGS), "mtp_loss_weight": 0.3}, vision=True)
    batch, = prepare_batches([_image_window()], args, cp_rank=cp - 1, cp=cp, dev=CPU, mtp=mtp)
    images = batch.images
    assert any(images.token_positions_n is m for m in copies)
    assert images.token_rows_n is None or any(images.token_rows_n is m for m in copies)


def test_a_queued_copy_takes_host_tensors_of_any_layout() -> None:
    from core.device import queued_copy

    with pytest.raises(ValueError, match="takes a host tensor; this one is on meta already"):
        queued_copy(torch.empty(3, device="meta"), CPU)
    expanded = torch.arange(4).expand(2, 4)  # position ids made with expand (scripts/bench_vlm.py's text row)
    assert torch.equal(queued_copy(expanded, CPU), expanded)
