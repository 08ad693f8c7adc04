"""``prepare_batches`` keeps its order (training/batch.py): documents and the MTP shift from the whole window, then the
cp split. Each check builds the batches in the documented order by hand and also in the order a change would
bring, and shows that the two differ on this data, so that the test fails if the order changes."""

from __future__ import annotations

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
