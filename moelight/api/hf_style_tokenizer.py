"""The tokenizer `LLM.get_tokenizer()` returns: moelight's own behind the transformers interface a vLLM
script calls (vLLM hands out the transformers tokenizer), so such a script ports over unchanged:
transformers' defaults (`add_generation_prompt=False`, `skip_special_tokens=False`), `tok(text)`,
`len(tok)`, the special tokens and their ids (`eos_token`, `eos_token_id`, `all_special_ids`, ...), token
strings (`convert_tokens_to_ids('<|eot_id|>')`, `convert_ids_to_tokens`, `tokenize`, `get_vocab`),
`vocab_size`, `name_or_path`, `model_max_length`, with PreTrainedTokenizerFast's semantics
(token_vocabulary.py). Anything else reaches moelight's tokenizer (`render_chat`, `eos_ids`, ...)."""

from __future__ import annotations

from typing import Any

from moelight.tokenization.token_vocabulary import NAMED_SPECIAL_TOKENS, token_vocabulary
from moelight.tokenization.tokenizer_base import Tokenizer

OFFERS = ("encode", "decode", "batch_decode", "__call__", "apply_chat_template", "tokenize", "convert_tokens_to_ids",
          "convert_ids_to_tokens", "get_vocab", "vocab_size", "len()", "all_special_tokens", "all_special_ids",
          "special_tokens_map", *NAMED_SPECIAL_TOKENS, "bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id",
          "chat_template", "name_or_path", "model_max_length")


class HFStyleTokenizer:
    def __init__(self, tokenizer: Tokenizer, name_or_path: str = "") -> None:
        self.tokenizer = tokenizer
        self.vocabulary = token_vocabulary(tokenizer)
        self.name_or_path = name_or_path  # what the tokenizer was loaded by: the model (or tokenizer) given
        self.model_max_length = self.vocabulary.model_max_length

    def __getattr__(self, name: str) -> Any:
        """A special token by transformers' name (`unk_token`, `sep_token_id`, a model's `image_token`), else
        moelight's tokenizer's attribute; anything else is an AttributeError that says what there is."""
        if name.startswith("__") or name in ("tokenizer", "vocabulary"):  # copy / pickle probes, half-built object
            raise AttributeError(name)
        base = name.removesuffix("_id")
        if base in NAMED_SPECIAL_TOKENS or base in self.vocabulary.special_tokens:
            token = self.vocabulary.special_tokens.get(base)
            return token if name == base or token is None else self.convert_tokens_to_ids(token)
        try:
            return getattr(self.tokenizer, name)
        except AttributeError:
            raise AttributeError(
                f"{name!r}: moelight's tokenizer (HFStyleTokenizer over {type(self.tokenizer).__name__}) has no such "
                f"attribute; it offers transformers' {', '.join(OFFERS)}, and its own through .tokenizer") from None

    @property
    def eos_token_id(self) -> int | None:
        return self.tokenizer.eos_id

    @property
    def bos_token_id(self) -> int | None:
        return self.tokenizer.bos_id

    @property
    def pad_token_id(self) -> int | None:
        return self.tokenizer.pad_id

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """transformers 5's: the named special tokens (a model's own *_token too), not the extra ones."""
        return dict(self.vocabulary.special_tokens)

    @property
    def all_special_tokens(self) -> list[str]:
        """The named special tokens, then the extra ones, each once (transformers' order)."""
        return list(dict.fromkeys([*self.vocabulary.special_tokens.values(), *self.vocabulary.extra_special_tokens]))

    @property
    def all_special_ids(self) -> list[int]:
        return self.convert_tokens_to_ids(self.all_special_tokens)

    @property
    def vocab_size(self) -> int:
        """transformers': the base vocabulary, without added tokens (`len(tok)` counts them)."""
        return self.vocabulary.base_size

    def __len__(self) -> int:
        return self.vocabulary.size

    def get_vocab(self) -> dict[str, int]:
        return self.vocabulary.vocab()

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | None | list[int | None]:
        """A token string's id (a list's, one by one); one not in the vocabulary is the unk token's id (None
        without one), as in transformers."""
        if isinstance(tokens, str):
            found = self.vocabulary.token_to_id(tokens)
            if found is not None:
                return found
            unk = self.vocabulary.special_tokens.get("unk_token")
            return None if unk is None else self.vocabulary.token_to_id(unk)
        return [self.convert_tokens_to_ids(t) for t in tokens]  # type: ignore[misc]

    def convert_ids_to_tokens(self, ids: int | list[int], skip_special_tokens: bool = False) -> str | None | list:
        """transformers': the vocabulary's token strings ('▁Hello', '<s>'), not decoded text (None past the
        vocabulary); skip_special_tokens leaves out all_special_ids."""
        if isinstance(ids, int):
            return self.vocabulary.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self.vocabulary.id_to_token(int(i)) for i in _plain(ids) if int(i) not in skip]

    def tokenize(self, text: str, add_special_tokens: bool = False) -> list[str]:
        """The token strings of `text` (transformers' default: no special tokens added)."""
        return self.convert_ids_to_tokens(self.encode(text, add_special_tokens))  # type: ignore[return-value]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_bos=add_special_tokens)

    def __call__(self, text: str | list[str], add_special_tokens: bool = True) -> dict:
        """transformers' BatchEncoding as a dict: input_ids and attention_mask, one list per text."""
        ids = ([self.encode(t, add_special_tokens) for t in text] if isinstance(text, list)
               else self.encode(text, add_special_tokens))
        mask = [[1] * len(i) for i in ids] if isinstance(text, list) else [1] * len(ids)
        return {"input_ids": ids, "attention_mask": mask}

    def decode(self, ids: Any, skip_special_tokens: bool = False) -> str | list[str]:
        """transformers': one id, a list of ids (a numpy array or tensor too), or a batch of lists (a list of
        texts)."""
        ids = _plain(ids)
        if isinstance(ids, int):
            ids = [ids]
        if ids and isinstance(ids[0], (list, tuple)):
            return self.batch_decode(ids, skip_special_tokens)
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def batch_decode(self, seqs: list[list[int]], skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(list(ids), skip_special_tokens) for ids in _plain(seqs)]  # type: ignore[misc]

    def apply_chat_template(self, conversation: list[dict], tools: list[dict] | None = None, *,
                            add_generation_prompt: bool = False, tokenize: bool = True,
                            **kwargs) -> list[int] | str:
        """transformers' call: no generation prompt unless asked; the text with tokenize=False, else the
        ids (a list, as transformers 4 gives them)."""
        return self.tokenizer.apply_chat_template(conversation, tools=tools, tokenize=tokenize,
                                                  add_generation_prompt=add_generation_prompt, **kwargs)


def _plain(ids: Any) -> Any:
    """A numpy array or torch tensor of ids as Python ints and lists (transformers' to_py_obj)."""
    return ids.tolist() if hasattr(ids, "tolist") else ids
