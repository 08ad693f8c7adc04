"""What a checkpoint holds beside the model and the optimizer (DCP holds those): ``train_state.json``, one mapping of
components, each giving and taking its own state (``Stateful``, as torch.distributed.checkpoint's). A save writes
``TrainState.state_dict()``; a resume loads it back through the same mapping. The run's config and global batch
ride along to be compared at start-up (``training.startup``), never loaded.

Checkpoints written by older versions of this trainer lack some keys; ``upgrade_state`` and ``upgrade_config`` fill
them in, in this one place, with what those runs did.
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol

from training.checkpoint import rng_state, set_rng_state
from training.optim import Schedule


class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


class RngState:
    """The host's and the device's random generators."""

    def __init__(self, dev_type: str) -> None:
        self.dev_type = dev_type

    def state_dict(self) -> dict[str, str]:
        return rng_state(self.dev_type)

    def load_state_dict(self, state: dict[str, str]) -> None:
        set_rng_state(state, self.dev_type)


class LoaderState:
    """The data loader's position and its data's identity: a resume refuses data that changed since the checkpoint
    unless ``allow_changes`` (train.allow_changes) names it; ``source`` names the checkpoint in that refusal."""

    def __init__(self, loader: Any, allow_changes: list[str], source: str) -> None:
        self.loader, self.allow_changes, self.source = loader, allow_changes, source

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state, self.allow_changes, checkpoint=self.source)


class Progress:
    """The tokens trained so far (the metric lines' tokens_total)."""

    def __init__(self) -> None:
        self.tokens_total = 0

    def state_dict(self) -> int:
        return self.tokens_total

    def load_state_dict(self, state: int) -> None:
        self.tokens_total = state


class InitFrom:
    """What the run loaded from model.init_from (``models.hf_io.record_source``: a digest of the files and untrained
    tensors its export carries from there), kept from the first start through every checkpoint, so that an export
    refuses a source changed since. None: no model.init_from, or a checkpoint written before it was recorded."""

    def __init__(self, loaded: dict[str, Any] | None) -> None:
        self.loaded = loaded

    def state_dict(self) -> dict[str, Any] | None:
        return self.loaded

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        self.loaded = state


class TrainState:
    """``components``: key in train_state.json -> its Stateful; ``recorded``: what is saved for start-up to compare
    (the run's config and global batch), not loaded."""

    def __init__(self, components: Mapping[str, Stateful], recorded: Mapping[str, Any]) -> None:
        self.components, self.recorded = dict(components), dict(recorded)

    def state_dict(self) -> dict[str, Any]:
        return {**{key: c.state_dict() for key, c in self.components.items()}, **self.recorded}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Each component's state, in the mapping's order (the loader's before the generators')."""
        for key, component in self.components.items():
            component.load_state_dict(state[key])


def run_state(schedule: Schedule, loader: Any, progress: Progress, dev_type: str, allow_changes: list[str],
              source: str, run_config: dict[str, Any], global_batch: int, init_from: InitFrom | None = None
              ) -> TrainState:
    """The trainer's state: the schedule, the data position, the random generators, the tokens trained and what the
    run loaded from model.init_from; ``source``: the checkpoint a resume loads (named in its refusals)."""
    return TrainState({"scheduler": schedule, "loader": LoaderState(loader, allow_changes, source),
                       "rng": RngState(dev_type), "tokens_total": progress, "init_from": init_from or InitFrom(None)},
                      {"config": run_config, "global_batch_size": global_batch})


# ------------------------------------------------------------------------------------------ older checkpoints
def upgrade_state(state: dict[str, Any], tokens_per_step: int) -> dict[str, Any]:
    """A checkpoint's train state with the keys added since older versions wrote it: tokens_total (recorded since
    issue 21; those runs trained every step at this batch), init_from (since issue 63: not recorded)."""
    return {"tokens_total": state["step"] * tokens_per_step, "init_from": None, **state}


def upgrade_config(saved: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's flat config with the keys moved since: data.tokenizer became model.tokenizer (pre-tokenized
    data had none)."""
    saved = dict(saved)
    if "data.tokenizer" in saved:
        tokenizer = saved.pop("data.tokenizer")
        saved.setdefault("model.tokenizer", "none" if saved.get("data.name") == "tokens" else tokenizer)
    return saved
