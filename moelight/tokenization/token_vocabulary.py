"""A tokenizer's tokens as transformers names them (vocabulary strings such as '▁Hello' or '<s>', not decoded
text) and its special tokens: what `LLM.get_tokenizer()`'s transformers interface is built on.

A tokenizer.json model's come from its `tokenizers` backend and tokenizer_config.json, as transformers 5's
PreTrainedTokenizerFast reads them. The byte-level tokenizer has no vocabulary file: its tokens follow
transformers' byte tokenizer (ByT5): a byte's token is the character of that code point, and its three
specials are named <pad>, <s> and </s>."""

from __future__ import annotations

from abc import ABC, abstractmethod

from moelight.tokenization.byte_tokenizer import ByteTokenizer
from moelight.tokenization.tokenizer import HFTokenizer, _token_str
from moelight.tokenization.tokenizer_base import Tokenizer

VERY_LARGE_INTEGER = int(1e30)  # transformers' model_max_length when the tokenizer's config sets none
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class TokenVocabulary(ABC):
    """Token strings <-> ids and the special tokens, as transformers gives them."""

    special_tokens: dict[str, str]  # transformers' special_tokens_map: bos_token, ..., model-specific *_token
    extra_special_tokens: list[str]  # the unnamed ones (tokenizer_config.json's extra / additional lists)
    base_size: int  # transformers' vocab_size: without added tokens
    size: int  # len(tokenizer): with them
    model_max_length: int

    @abstractmethod
    def token_to_id(self, token: str) -> int | None:
        """The id of a vocabulary string (None where there is none)."""

    @abstractmethod
    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary string of an id (None past the vocabulary)."""

    @abstractmethod
    def vocab(self) -> dict[str, int]:
        """Every token string with its id, added tokens included."""


class BackendVocabulary(TokenVocabulary):
    """A tokenizer.json model's: its backend's vocabulary, tokenizer_config.json's special tokens."""

    def __init__(self, tokenizer: HFTokenizer) -> None:
        self.backend = tokenizer.backend
        self.special_tokens = dict(tokenizer.special_tokens)
        extra = tokenizer.config.get("extra_special_tokens") or tokenizer.config.get("additional_special_tokens")
        self.extra_special_tokens = ([t for t in map(_token_str, extra) if t is not None]
                                     if isinstance(extra, list) else [])
        self.base_size = self.backend.get_vocab_size(with_added_tokens=False)
        self.size = self.backend.get_vocab_size(with_added_tokens=True)
        length = tokenizer.config.get("model_max_length")
        self.model_max_length = int(length) if isinstance(length, (int, float)) else VERY_LARGE_INTEGER

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)


class ByteVocabulary(TokenVocabulary):
    """The byte-level tokenizer's, in ByT5's convention: byte b is id b + 3 and the token chr(b)."""

    SPECIALS = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>"}

    def __init__(self) -> None:
        ids = {"pad_token": ByteTokenizer.PAD, "bos_token": ByteTokenizer.BOS, "eos_token": ByteTokenizer.EOS}
        self.special_tokens = {k: self.SPECIALS[k] for k in NAMED_SPECIAL_TOKENS if k in self.SPECIALS}
        self._special_ids = {self.SPECIALS[k]: i for k, i in ids.items()}
        self._special_names = {i: t for t, i in self._special_ids.items()}
        self.extra_special_tokens = []
        self.base_size = ByteTokenizer.SIZE - ByteTokenizer.OFFSET  # 256 bytes; the specials are its added tokens
        self.size = ByteTokenizer.SIZE
        self.model_max_length = VERY_LARGE_INTEGER

    def token_to_id(self, token: str) -> int | None:
        if token in self._special_ids:
            return self._special_ids[token]
        return ord(token) + ByteTokenizer.OFFSET if len(token) == 1 and ord(token) < 256 else None

    def id_to_token(self, token_id: int) -> str | None:
        if token_id in self._special_names:
            return self._special_names[token_id]
        return chr(token_id - ByteTokenizer.OFFSET) if ByteTokenizer.OFFSET <= token_id < ByteTokenizer.SIZE else None

    def vocab(self) -> dict[str, int]:
        return {self.id_to_token(i): i for i in range(self.size)}  # type: ignore[misc] - every id has a token


def token_vocabulary(tokenizer: Tokenizer) -> TokenVocabulary:
    """The token-level view of one of moelight's tokenizers."""
    if isinstance(tokenizer, HFTokenizer):
        return BackendVocabulary(tokenizer)
    if isinstance(tokenizer, ByteTokenizer):
        return ByteVocabulary()
    raise TypeError(f"{type(tokenizer).__name__} has no token vocabulary moelight knows how to read")
