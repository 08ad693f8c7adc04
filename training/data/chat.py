"""Documents from text and chats: ChatML rendering with its loss mask, the checks of a chat's messages and of a
jsonl row, and the chitchat corpus's conversations as chats. A text is encoded and followed by <|endoftext|>, all
trained; a chat is rendered with the ChatML template (only assistant turns trained) and followed by an untrained
<|endoftext|>."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from training.data.tokenizer import CHAT_ROLES, QwenTokenizer

_JSON_TYPES = {dict: "an object", list: "a list", str: "a string", int: "a number", float: "a number",
               bool: "a boolean", type(None): "null"}
_MESSAGE = '{"role": ..., "content": ...}'

Doc = tuple[list[int], list[bool]]  # token ids, loss mask (True = trained)


def text_doc(tok: QwenTokenizer, text: str) -> Doc:
    ids = tok.encode(text) + [tok.eos_id]
    return ids, [True] * len(ids)


def chat_doc(tok: QwenTokenizer, messages: list[dict]) -> Doc:
    ids, mask = tok.render_chat(messages)
    return ids + [tok.eos_id], mask + [False]


def join_docs(docs: Iterable[Doc]) -> np.ndarray:
    """[2, n] uint32: the documents' ids and trained masks, concatenated in order."""
    ids: list[int] = []
    mask: list[bool] = []
    for doc_ids, doc_mask in docs:
        ids += doc_ids
        mask += doc_mask
    return np.array([ids, mask], dtype=np.uint32).reshape(2, -1)


def _check_message(i: int, msg: object) -> None:
    """Raise ValueError unless ``msg`` is {"role": one of CHAT_ROLES, "content": a string}, and nothing else."""
    if not isinstance(msg, dict):
        raise ValueError(f"messages[{i}] must be an object {_MESSAGE}, got "
                         f"{_JSON_TYPES.get(type(msg), type(msg).__name__)}")
    extra = sorted(set(msg) - {"role", "content"})
    if extra:  # the ChatML rendering reads role and content only: the rest would be dropped without a word
        raise ValueError(f"messages[{i}] has {', '.join(map(repr, extra))} beside role and content, which the ChatML "
                         "rendering here does not render (no tool calls, no names); put what the model should see "
                         "into content, or remove the keys")
    for key in ("role", "content"):
        if key not in msg:
            raise ValueError(f"messages[{i}] has no {key!r}; every message is an object {_MESSAGE} of strings")
        if not isinstance(msg[key], str):
            raise ValueError(f"messages[{i}].{key} must be a string, got "
                             f"{_JSON_TYPES.get(type(msg[key]), type(msg[key]).__name__)}")
    if msg["role"] not in CHAT_ROLES:
        raise ValueError(f"messages[{i}].role {msg['role']!r} is unknown; use one of {', '.join(CHAT_ROLES)} "
                         "(lowercase, the chat template's roles)")


def checked_messages(messages: object, name: str = "'messages'") -> list[dict]:
    """``messages`` if it is a non-empty list of {"role", "content"} strings; else ValueError says what is wrong."""
    if not isinstance(messages, list) or not messages:
        got = "an empty list" if messages == [] else _JSON_TYPES.get(type(messages), type(messages).__name__)
        raise ValueError(f"{name} must be a non-empty list of {_MESSAGE} objects, got {got}")
    for i, msg in enumerate(messages):
        _check_message(i, msg)
    return messages


def jsonl_row(row: object) -> str | list[dict]:
    """The text or the chat messages of one parsed jsonl row; ValueError says what is wrong and what is expected."""
    if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object with a 'text' or a 'messages' field, got {_JSON_TYPES[type(row)]}")
    if "text" in row and "messages" in row:
        raise ValueError("the object has both 'text' and 'messages'; give one of them (a document or a chat)")
    if "text" in row:
        if not isinstance(row["text"], str):
            raise ValueError(f"'text' must be a string, got {_JSON_TYPES[type(row['text'])]}")
        return row["text"]
    if "messages" in row:
        return checked_messages(row["messages"])
    raise ValueError(f"expected a 'text' or a 'messages' field, got fields {list(row)}")


def document(tok: QwenTokenizer, row: str | list[dict]) -> Doc:
    """A text (``jsonl_row``'s str) or a chat (its messages) as one document."""
    return text_doc(tok, row) if isinstance(row, str) else chat_doc(tok, row)


def chitchat_docs(path: Path, tok: QwenTokenizer) -> Iterator[Doc]:
    """One ChatML document per conversation: the speakers alternate user / assistant (the first one is
    the user) and a speaker's consecutive messages are joined with newlines."""
    try:
        conversations = json.loads(path.read_bytes())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    except RecursionError:
        raise ValueError(f"{path}: JSON nested deeper than the parser reads (Python's recursion limit)") from None
    for conv in conversations.values():
        utterances = [u for group in conv["messages"] for u in group]
        runs = itertools.groupby(utterances, key=lambda u: u["sender"])
        turns = ["\n".join(u["text"] for u in run) for _, run in runs]
        yield chat_doc(tok, [{"role": ("user", "assistant")[i % 2], "content": t} for i, t in enumerate(turns)])
