"""Tokenize a corpus into shards over worker processes, resumably, with a manifest.

    python scripts/pretokenize.py INPUT OUT_DIR [--tokenizer qwen3] [--workers N] [--docs-per-shard K]
        [--column NAME] [--cache-dir DIR]

INPUT is a .jsonl file (one document per line, as data=jsonl reads them: {"text": ...} or {"messages": [...]}) or
local Hugging Face datasets files as data=hf reads them (.parquet / .arrow / .jsonl files, a directory or a glob of
them, or a save_to_disk directory; --column picks the text or messages column; needs `datasets`). Writes
``OUT_DIR/shard_00000.npy``, ... ([2, n] uint32: token ids, trained mask) and ``OUT_DIR/manifest.json`` (source
sha256, reader, tokenizer, per shard its range, documents, tokens, trained tokens, sha256 and record: size and block
CRCs, checked when training reads the shard; totals). Re-running the same command after an interruption redoes only
the shards that are missing or do not match the manifest. OUT_DIR must hold no .npy/.bin file that its manifest does
not plan (a foreign or stale shard is refused, never overwritten); training reads exactly the manifest's shards. A
progress line on stderr shows shards, tokens, tokens/s and the ETA. Train on the result with data=tokens
data.path=OUT_DIR (data.mask_non_assistant=true trains only assistant turns). See ``training.data.tokenize_shards``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable as `python scripts/pretokenize.py`

from training.data.hf_datasets import hf_corpus  # noqa: E402
from training.data.tokenize_shards import Corpus, JsonlCorpus, tokenize_to_shards  # noqa: E402
from training.data.tokenizer import TOKENIZERS  # noqa: E402


def corpus(args: argparse.Namespace) -> Corpus:
    """A .jsonl file is read line by line (as data=jsonl); anything else, or --column, through ``datasets``."""
    if args.input.suffix == ".jsonl" and args.input.is_file() and args.column is None:
        return JsonlCorpus(args.input)
    return hf_corpus(str(args.input), args.column, str(args.cache_dir), key="INPUT")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("input", type=Path, help="a .jsonl file, or datasets files (.parquet, .arrow, ...)")
    parser.add_argument("out_dir", type=Path, help="the directory of the shards and manifest.json")
    parser.add_argument("--tokenizer", default="qwen3", choices=TOKENIZERS, help="the model's tokenizer")
    parser.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1),
                        help="tokenizing processes (default: min(4, CPUs))")
    parser.add_argument("--docs-per-shard", type=int, default=10_000, help="documents (lines or rows) per shard")
    parser.add_argument("--column", help="datasets files: the text or messages column (default: messages, else text)")
    parser.add_argument("--cache-dir", type=Path, default=Path(".cache/data"),
                        help="datasets files: where datasets converts parquet/json to arrow (under hf/)")
    parser.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    args = parser.parse_args()
    from training.launch import one_line_errors  # here: spawned workers re-import this file and need no torch

    with one_line_errors():
        start = time.monotonic()
        manifest = tokenize_to_shards(corpus(args), args.out_dir, args.tokenizer, workers=args.workers,
                                      docs_per_shard=args.docs_per_shard, progress=not args.no_progress)
        seconds = time.monotonic() - start
        totals = manifest.totals
        print(f"{len(manifest.shards)} shards, {totals['documents']:,} documents, {totals['tokens']:,} tokens "
              f"({totals['trained_tokens']:,} trained) in {args.out_dir}; {seconds:.1f}s")


if __name__ == "__main__":
    main()
