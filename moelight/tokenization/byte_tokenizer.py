"""A byte-level tokenizer for dummy models: any text, no files."""

from __future__ import annotations

from collections.abc import Sequence

from moelight.errors import TokenizerError
from moelight.tokenization.tokenizer_base import Tokenizer

BYTE_NAMES = ("byte", "bytes", "ByteTokenizer")  # --tokenizer values and tokenizer_class names that pick it


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes shifted past three specials (pad 0, bos 1, eos 2): any text, no files.

    Dummy models use it so benchmarks and tests run without a real tokenizer; a prompt
    of L ASCII characters is L tokens (+ BOS).
    """

    PAD, BOS, EOS = 0, 1, 2
    OFFSET = 3
    SIZE = 256 + OFFSET

    def __init__(self, model_vocab_size: int | None = None):
        if model_vocab_size is not None and model_vocab_size < self.SIZE:
            raise TokenizerError(
                f"the byte-level tokenizer needs a vocabulary of at least {self.SIZE} ids "
                f"(256 bytes + pad/bos/eos), but the model's vocab_size is {model_vocab_size}"
            )
        self.bos_id, self.eos_id, self.pad_id = self.BOS, self.EOS, self.PAD
        self.eos_ids = frozenset({self.EOS})
        self.vocab_size = self.SIZE
        self.model_vocab_size = model_vocab_size

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = [b + self.OFFSET for b in text.encode("utf-8")]
        return [self.BOS, *ids] if add_bos else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True, context: Sequence[int] = ()) -> str:
        # Bytes read the same after any context. BOS / EOS / PAD have no bytes: they never show, whatever
        # skip_special_tokens says.
        # Ids past the byte range (a dummy model with a larger vocab) show as U+FFFD, not silently vanish.
        out = bytearray()
        for i in ids:
            if i >= self.SIZE:
                out += "\ufffd".encode()
            elif i >= self.OFFSET:
                out.append(i - self.OFFSET)
        return out.decode("utf-8", errors="replace")

    @staticmethod
    def render_chat(messages: list[dict], add_generation_prompt: bool = True) -> str:
        """A minimal chat format: ``<|role|>\\ncontent\\n`` per turn, then ``<|assistant|>\\n``."""
        text = "".join(f"<|{m['role']}|>\n{m['content'] or ''}\n" for m in messages)
        return text + ("<|assistant|>\n" if add_generation_prompt else "")

    def apply_chat_template(self, messages: list[dict], *, tools: list[dict] | None = None,
                            add_generation_prompt: bool = True, tokenize: bool = True,
                            **template_kwargs) -> list[int] | str:
        if tools:
            raise TokenizerError("the byte-level tokenizer's minimal chat format has no place for tools; "
                                 "use a model folder with a chat template that renders them")
        unsupported = [k for k in ("chat_template", "continue_final_message") if template_kwargs.get(k)]
        if unsupported:
            raise TokenizerError(f"the byte-level tokenizer has no chat template, so {', '.join(unsupported)} "
                                 "cannot apply; use a model folder with a chat template")
        text = self.render_chat(messages, add_generation_prompt)
        return self.encode(text) if tokenize else text
