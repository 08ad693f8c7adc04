"""What a config field declares about itself, read by generic code: whether a resume may change it.

Every Hydra group's dataclass (in its component's own module) marks the fields that say *how* a run executes, not
*what* it trains, with ``execution(...)``; a resume compares every other key with the checkpoint's config and
refuses a change that ``train.allow_changes`` does not name (``training.config.check_resume_config``). A field that
holds a whole group (``TrainConfig.parallel``) marks every key under it.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Iterator

_RESUME_MAY_CHANGE = "resume_may_change"


def execution(**field_kwargs: Any) -> Any:
    """``dataclasses.field(**field_kwargs)`` of a setting a resume may change freely: where and how the same
    training runs (the layout, kernels, logging, output places), not the model, data, optimizer or seed."""
    return dataclasses.field(metadata={_RESUME_MAY_CHANGE: True}, **field_kwargs)


def execution_keys(schema: type, prefix: str = "") -> Iterator[str]:
    """The dotted keys of ``schema`` (a dataclass, nested ones walked) that are marked ``execution``."""
    types = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        key = f"{prefix}{f.name}"
        if f.metadata.get(_RESUME_MAY_CHANGE):
            yield key
        elif dataclasses.is_dataclass(types[f.name]):
            yield from execution_keys(types[f.name], key + ".")
