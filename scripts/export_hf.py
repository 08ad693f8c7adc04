"""Export a training run's weights as a Hugging Face directory.

    python scripts/export_hf.py <run-dir | run-dir/model.safetensors | checkpoint-dir> <out-dir> [--dtype bfloat16]

Reads the final ``model.safetensors`` (our names, fused experts, full tensors; checked against its record,
``model.safetensors.record.json``, as checkpoints are: a damaged byte is refused) with the run's resolved
``config.yaml``, or a DCP checkpoint (``<run-dir>/checkpoints/step_N``, any layout it was saved with, verified
against its file record) with the config recorded in it (``model.model_type``, ``model.arch``); writes what
``transformers.AutoModelForCausalLM.from_pretrained`` loads, with the run's tokenizer (``model.tokenizer``; the
``data.tokenizer`` of older runs) as ``tokenizer.json``, ``tokenizer_config.json`` (chat template) and
``generation_config.json``, so ``AutoTokenizer`` and ``pipeline("text-generation")`` work on it; a model with its
vision tower also with ``preprocessor_config.json`` (the image processor, for ``AutoImageProcessor``). A run without one
of our tokenizers (``none``, or pre-tokenized ids of another vocabulary) exports weights and config.json only, and
says so; ``--tokenizer`` overrides the recorded one. The export replaces ``out-dir`` wholesale, so ``out-dir`` must be
new, empty or an earlier export (its ``.hf_export.json`` lists its files); a run directory or any other folder
is refused, and so is one inside a run's checkpoints or the run's model.init_from. Two exports into one directory at
once: the second is refused. SIGTERM, SIGHUP or Ctrl-C leave nothing of the export (one line says so); a failed write
(a full disk) names its file. It says which step it exported, and warns where the run has trained past its final
weights since.

A run started from a Hugging Face directory (``model.init_from``) is exported in that directory's layout (a
multimodal checkpoint's names), with its config.json, generation, tokenizer and processor files, and every tensor
of it the run did not train (a vision tower, an MTP head not trained) copied byte for byte; ``--source DIR`` names
the directory where it has moved, ``--source none`` exports the trained model alone. A source whose copied files or
untrained tensors differ from what the run loaded (its record) is refused, as is one whose index or files lead out of
it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable as `python scripts/export_hf.py`

import torch  # noqa: E402
import yaml  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from models import build_args, get_spec  # noqa: E402
from models.hf_io import (DEFAULT_MAX_SHARD_BYTES, check_export_apart, check_export_dir,  # noqa: E402
                          check_export_source, export_state_dict_hf)
from training.checkpoint import (TRAIN_STATE, full_state_dict, load_checkpoint, read_train_state,  # noqa: E402
                                 recorded_init_from, verified_weights_step)
from training.data.hf_tokenizer import hf_export_files, identify_hf_tokenizer, tokenizer_mismatch  # noqa: E402
from training.data.tokenizer import TOKENIZERS  # noqa: E402
from training.data.vision import ImageProcessing  # noqa: E402
from training.launch import one_line_errors  # noqa: E402
from training.run_dir import checkpoint_area, read_record  # noqa: E402
from training.startup import model_vision  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def run_config(path: Path) -> tuple[Path, dict, str]:
    """(weights, resolved run config, where the config came from) of a run directory, a .safetensors file inside
    one, or a DCP checkpoint directory (its own recorded config; an older one without: its run's config.yaml)."""
    if is_dcp_checkpoint(path):
        state = read_train_state(path)
        if "config" in state:
            return path, state["config"], str(path / TRAIN_STATE)
        weights, config = path, path.parent.parent / "config.yaml"
    else:
        weights = path / "model.safetensors" if path.is_dir() else path
        config = weights.parent / "config.yaml"
    for file, what in ((weights, "weights"), (config, "resolved run config")):
        if not file.exists():
            raise FileNotFoundError(f"{file} not found ({what}); expected a run directory holding "
                                    "model.safetensors and config.yaml, the path of its .safetensors file, "
                                    "or a checkpoint directory <run>/checkpoints/step_N")
    with config.open() as f:  # a stream: a YAML error names the file (one line: training.launch.one_line_errors)
        return weights, yaml.safe_load(f) or {}, str(config)


def weights_step(weights: Path) -> int | None:
    """The step ``weights`` hold (a checkpoint's, or the final weights' once verified against their record), saying
    so where the run trained past final weights since (resumed with more steps, their own not yet written)."""
    if is_dcp_checkpoint(weights):
        return read_train_state(weights)["step"]
    step = verified_weights_step(weights)
    record = read_record(weights.parent)
    if step is not None and record is not None and record.step > step:
        print(f"warning: {weights} holds step {step}, and its run has trained since, to step {record.step}: to export "
              f"that, export its newest checkpoint ({record.checkpoint})", file=sys.stderr)
    return step


def is_dcp_checkpoint(path: Path) -> bool:
    return (path / TRAIN_STATE).is_file()


def dcp_state_dict(checkpoint: Path, model_type: str, args: object) -> dict[str, torch.Tensor]:
    """Full tensors of a DCP checkpoint, loaded into the unsharded model on the CPU (DCP reshards)."""
    with torch.device("meta"):
        model = get_spec(model_type).model_cls(args)
    model.to_empty(device="cpu")
    load_checkpoint(checkpoint, model, None, read_train_state(checkpoint).get("files"))
    return full_state_dict(model)


def model_type_and_args(config: dict, source: str) -> tuple[str, object]:
    model = config.get("model") or {}
    if not model.get("model_type") or not model.get("arch"):
        raise ValueError(f"{source} lacks model.model_type or model.arch: was it written by train.py?")
    # The architecture the run built: its vision tower where it trained one (model.vision=true)
    return model["model_type"], build_args(model["model_type"], model["arch"], bool(model.get("vision")))


def run_tokenizer(config: dict, vocab_size: int, override: str | None) -> tuple[str | None, str]:
    """(the tokenizer to export or None, what was decided) for a run's recorded config (or ``override``)."""
    model = config.get("model") or {}
    name = override or model.get("tokenizer") or (config.get("data") or {}).get("tokenizer")  # older runs: data.*
    if name == "auto":  # recorded unresolved: the tokenizer of model.init_from, if it is still there
        init_from = model.get("init_from")
        name = identify_hf_tokenizer(init_from) if init_from and Path(init_from).is_dir() else None
        if name is None:
            return None, f"model.tokenizer=auto and model.init_from={init_from} gives no tokenizer of ours"
    if name in (None, "none"):
        return None, "the run has no tokenizer of ours (model.tokenizer=none or unrecorded; see --tokenizer)"
    if name not in TOKENIZERS:
        raise ValueError(f"{name!r}, the run's tokenizer, is unknown: choose one with --tokenizer "
                         f"({', '.join(TOKENIZERS)} or none)")
    problem = tokenizer_mismatch(name, vocab_size)
    if problem is not None and override:
        raise ValueError(f"--tokenizer {override}: {problem}")
    if problem is not None:
        return None, f"{problem} (pre-tokenized ids of another vocabulary?)"
    return name, f"with the {name} tokenizer"


def image_processing(args: object, init_from: str | None, tokenizer: str | None) -> ImageProcessing | None:
    """The image processor of a model with its vision tower, as train.py's export writes it (``RunPlan.vision``):
    model.init_from's where it is still there with one, else Qwen3.5's published settings at the tower's sizes;
    None without a tower or a tokenizer of ours."""
    vision = model_vision(init_from if init_from and Path(init_from).is_dir() else None, args, tokenizer)
    return vision.processing if vision is not None else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="run directory, its model.safetensors, or a checkpoint directory")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="cast to this dtype (default: as saved)")
    parser.add_argument("--max-shard-bytes", type=int, default=DEFAULT_MAX_SHARD_BYTES)
    parser.add_argument("--tokenizer", choices=[*TOKENIZERS, "none"],
                        help="the tokenizer files to write (default: the run's model.tokenizer)")
    parser.add_argument("--source", help="the Hugging Face directory the run started from, whose untrained tensors "
                        "and files the export carries (default: the run's model.init_from; none: the trained model "
                        "alone)")
    opts = parser.parse_args(argv)
    check_export_dir(opts.out_dir)  # before the checkpoint is read: OUT is replaced wholesale
    area = checkpoint_area(opts.out_dir)
    if area is not None:
        raise ValueError(f"export directory {opts.out_dir} is or lies inside {area}, where a run keeps its checkpoints "
                         "(a resume would take the export for a damaged checkpoint, and a save prune it): choose a "
                         "directory outside it")
    weights, config, where = run_config(opts.checkpoint)
    model_type, args = model_type_and_args(config, where)
    tokenizer, decided = run_tokenizer(config, args.vocab_size, opts.tokenizer)
    init_from = (config.get("model") or {}).get("init_from")
    source = None if opts.source == "none" else opts.source or init_from
    check_export_apart(opts.out_dir, [("the run's model.init_from", init_from), ("--source", source)])
    if source is not None:
        check_export_source(source, model_type, args)  # before the checkpoint is read
    step = weights_step(weights)  # the final weights are checked against their record first
    state = dcp_state_dict(weights, model_type, args) if is_dcp_checkpoint(weights) else load_file(weights)
    export_state_dict_hf(state, model_type, args, opts.out_dir, max_shard_bytes=opts.max_shard_bytes,
                         dtype=DTYPES.get(opts.dtype), source=source,
                         extra_files=hf_export_files(tokenizer, image_processing(args, init_from, tokenizer)),
                         loaded=recorded_init_from(weights) if source is not None else None)
    if tokenizer is None and source is None:
        print(f"no tokenizer files written: {decided}; add that tokenizer's files to {opts.out_dir}")
    print(f"exported {weights} ({model_type}, step {'unknown' if step is None else step}) to {opts.out_dir}"
          + (f" {decided}" if tokenizer else "") + (f", with what it did not train of {source}" if source else ""))


if __name__ == "__main__":
    with one_line_errors():  # a refused or damaged checkpoint is one line, not a traceback
        main()
