"""Documents from text and chats: ChatML rendering with its loss mask, the checks of a chat's messages and of a
jsonl row, and the chitchat corpus's conversations as chats. A text is encoded and followed by <|endoftext|>, all
trained; a chat is rendered with the ChatML template (only assistant turns trained) and followed by an untrained
<|endoftext|>. A message's content is a string, or a list of parts as Qwen's chat templates take them: text parts,
and image parts for a model with a vision tower (``training.data.vision``): anywhere else an image is refused by
name, never dropped."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np

from training.data.tokenizer import CHAT_ROLES, QwenTokenizer
from training.data.vision import ImageRecord

_JSON_TYPES = {dict: "an object", list: "a list", str: "a string", int: "a number", float: "a number",
               bool: "a boolean", type(None): "null"}
_MESSAGE = '{"role": ..., "content": ...}'
_PARTS = '{"type": "text", "text": ...} or {"type": "image", "image": "<path>"}'
# Row fields and part types of multimodal data in other formats: refused by name, never dropped (issue 63 item 7)
_IMAGE_FIELDS = ("images", "image", "videos", "video")
_OTHER_PARTS = {"image_url": "an OpenAI image_url part", "input_image": "an OpenAI input_image part",
                "video": "a video part", "video_url": "a video part", "input_audio": "an audio part",
                "audio": "an audio part"}
VISION_ONLY = ("images are trained only by data=jsonl for a model with a vision tower (a Qwen3.5 model with its "
               "vision config)")
NO_VISION = f"{VISION_ONLY}: here the chat would train as text with the image dropped; use such a model, or remove it"


class Doc(NamedTuple):
    ids: list[int]
    mask: list[bool]  # True = trained
    images: tuple[ImageRecord, ...] = ()  # the images of the chat, in the order of their tokens


# An image part -> its record (the file read and checked), for a model with a vision tower (training.data.vision)
ImageReader = Callable[[dict], ImageRecord]


def text_doc(tok: QwenTokenizer, text: str) -> Doc:
    ids = tok.encode(text) + [tok.eos_id]
    return Doc(ids, [True] * len(ids))


def chat_doc(tok: QwenTokenizer, messages: list[dict], read_image: ImageReader | None = None) -> Doc:
    """The chat rendered and masked; its image parts read by ``read_image`` (None: a chat with one is refused)."""
    images: list[ImageRecord] = []

    def image_tokens(part: dict) -> int:
        if read_image is None:
            raise ValueError(f"an image part ({part.get('image')!r}): {NO_VISION}")
        images.append(read_image(part))
        return images[-1].tokens

    ids, mask = tok.render_chat(messages, image_tokens)
    return Doc(ids + [tok.eos_id], mask + [False], tuple(images))


def join_docs(docs: Iterable[Doc]) -> np.ndarray:
    """[2, n] uint32: the documents' ids and trained masks, concatenated in order."""
    ids: list[int] = []
    mask: list[bool] = []
    for doc in docs:
        ids += doc[0]
        mask += doc[1]
    return np.array([ids, mask], dtype=np.uint32).reshape(2, -1)


def _check_part(i: int, j: int, role: str, part: object) -> None:
    """Raise ValueError unless ``part`` is a text part or an image part (outside an assistant turn), and nothing else."""
    where = f"messages[{i}].content[{j}]"
    if not isinstance(part, dict) or not isinstance(part.get("type"), str):
        raise ValueError(f"{where} must be an object {_PARTS}, got "
                         f"{_JSON_TYPES.get(type(part), type(part).__name__) if not isinstance(part, dict) else 'no type'}")
    kind = part["type"]
    if kind in _OTHER_PARTS:
        raise ValueError(f"{where} is {_OTHER_PARTS[kind]} ({kind!r}), which is not read (images only, as "
                         '{"type": "image", "image": "<path>"}): it would be dropped; convert it or remove it')
    if kind not in ("text", "image"):
        raise ValueError(f"{where} has type {kind!r}; a part is {_PARTS}")
    extra = sorted(set(part) - {"type", kind})
    if extra:
        raise ValueError(f"{where} has {', '.join(map(repr, extra))} beside type and {kind}, which is not read; "
                         f"a part is {_PARTS}")
    if not isinstance(part.get(kind), str) or (kind == "image" and not part[kind]):
        got = _JSON_TYPES.get(type(part.get(kind)), type(part.get(kind)).__name__) if kind in part else "none"
        raise ValueError(f"{where}.{kind} must be a {'non-empty path' if kind == 'image' else 'string'}, got {got}")
    if kind == "image" and role == "assistant":
        raise ValueError(f"{where} is an image in an assistant turn: the model reads images and writes text; put the "
                         "image in a user turn")


def _check_message(i: int, msg: object) -> None:
    """Raise ValueError unless ``msg`` is {"role": one of CHAT_ROLES, "content": a string or a list of parts}, and
    nothing else."""
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
        if not isinstance(msg[key], str) and not (key == "content" and isinstance(msg[key], list)):
            raise ValueError(f"messages[{i}].{key} must be a string{' or a list of parts' if key == 'content' else ''}"
                             f", got {_JSON_TYPES.get(type(msg[key]), type(msg[key]).__name__)}")
    if msg["role"] not in CHAT_ROLES:
        raise ValueError(f"messages[{i}].role {msg['role']!r} is unknown; use one of {', '.join(CHAT_ROLES)} "
                         "(lowercase, the chat template's roles)")
    if isinstance(msg["content"], list):
        for j, part in enumerate(msg["content"]):
            _check_part(i, j, msg["role"], part)


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
    media = [key for key in _IMAGE_FIELDS if key in row]
    if media:
        raise ValueError(f"the object has {', '.join(map(repr, media))} beside its document, which is not read: "
                         "the images would be dropped; put each image into the messages as an image part of a user "
                         'turn, {"type": "image", "image": "<path>"} (video is not supported)')
    if "text" in row and "messages" in row:
        raise ValueError("the object has both 'text' and 'messages'; give one of them (a document or a chat)")
    if "text" in row:
        if not isinstance(row["text"], str):
            raise ValueError(f"'text' must be a string, got {_JSON_TYPES[type(row['text'])]}")
        return row["text"]
    if "messages" in row:
        return checked_messages(row["messages"])
    raise ValueError(f"expected a 'text' or a 'messages' field, got fields {list(row)}")


def document(tok: QwenTokenizer, row: str | list[dict], read_image: ImageReader | None = None) -> Doc:
    """A text (``jsonl_row``'s str) or a chat (its messages) as one document; ``read_image`` reads its images (None:
    an image is refused)."""
    return text_doc(tok, row) if isinstance(row, str) else chat_doc(tok, row, read_image)


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
