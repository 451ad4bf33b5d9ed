"""The tokenizer `LLM.get_tokenizer()` returns: moelight's own behind the transformers interface a vLLM
script calls (vLLM hands out the transformers tokenizer), so such a script ports over unchanged:
transformers' defaults (`add_generation_prompt=False`, `skip_special_tokens=False`), `tok(text)`,
`len(tok)`, `eos_token_id`, `convert_ids_to_tokens`. Anything else reaches moelight's tokenizer
(`render_chat`, `eos_ids`, ...)."""

from __future__ import annotations

from typing import Any

from moelight.tokenization.tokenizer_base import Tokenizer


class HFStyleTokenizer:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tokenizer, name)

    @property
    def eos_token_id(self) -> int | None:
        return self.tokenizer.eos_id

    @property
    def bos_token_id(self) -> int | None:
        return self.tokenizer.bos_id

    @property
    def pad_token_id(self) -> int | None:
        return self.tokenizer.pad_id

    def __len__(self) -> int:
        return self.tokenizer.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_bos=add_special_tokens)

    def __call__(self, text: str | list[str], add_special_tokens: bool = True) -> dict:
        """transformers' BatchEncoding as a dict: input_ids and attention_mask, one list per text."""
        ids = ([self.encode(t, add_special_tokens) for t in text] if isinstance(text, list)
               else self.encode(text, add_special_tokens))
        mask = [[1] * len(i) for i in ids] if isinstance(text, list) else [1] * len(ids)
        return {"input_ids": ids, "attention_mask": mask}

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def batch_decode(self, seqs: list[list[int]], skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in seqs]

    def convert_ids_to_tokens(self, ids: int | list[int], skip_special_tokens: bool = False) -> str | list[str]:
        """transformers': the vocabulary's token strings ('▁Hello', '<s>'), not decoded text; the byte-level
        tokenizer has no vocabulary strings, so its tokens are their decoded text."""
        backend = getattr(self.tokenizer, "backend", None)  # tokenizer.json's (HFTokenizer)
        if isinstance(ids, int):
            return backend.id_to_token(ids) if backend is not None else self.tokenizer.decode([ids], False)
        special = ({i for i, t in backend.get_added_tokens_decoder().items() if t.special}
                   if backend is not None and skip_special_tokens else set())
        return [self.convert_ids_to_tokens(i) for i in ids if i not in special]

    def apply_chat_template(self, conversation: list[dict], tools: list[dict] | None = None, *,
                            add_generation_prompt: bool = False, tokenize: bool = True,
                            **kwargs) -> list[int] | str:
        """transformers' call: no generation prompt unless asked; the text with tokenize=False, else the
        ids (a list, as transformers 4 gives them)."""
        return self.tokenizer.apply_chat_template(conversation, tools=tools, tokenize=tokenize,
                                                  add_generation_prompt=add_generation_prompt, **kwargs)
