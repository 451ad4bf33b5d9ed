"""Tokenizers: Hugging Face ``tokenizer.json`` models and a byte-level one for dummy models.

The HF path reproduces what transformers' ``PreTrainedTokenizerFast`` gives for
``encode(text)``, ``decode(ids, skip_special_tokens=True)`` and
``apply_chat_template(..., add_generation_prompt=True)`` on the same folder, without
importing transformers (it is a test-only dependency).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFBackend


class TokenizerError(ValueError):
    """A tokenizer cannot be loaded or cannot format a request; the message says what to do."""


class Tokenizer(ABC):
    """What the engine needs from any tokenizer."""

    bos_id: int | None
    eos_id: int | None
    eos_ids: frozenset[int]  # every id that ends generation (generation_config may list several)
    pad_id: int | None
    vocab_size: int

    @abstractmethod
    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_bos`` adds the special tokens the model expects around a prompt."""

    @abstractmethod
    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` with special tokens left out."""

    @abstractmethod
    def apply_chat_template(self, messages: list[dict], *, tools: list[dict] | None = None,
                            add_generation_prompt: bool = True, **template_kwargs) -> list[int]:
        """Token ids of a conversation, ending with the prompt for the assistant's answer.

        `tools` (JSON-schema tool dicts) and `template_kwargs` (e.g. Qwen3's `enable_thinking`,
        GPT-OSS's `reasoning_effort`) reach the template as transformers passes them."""

    def encode_request(self, request: Any) -> list[int]:
        """Prompt ids for a ``workloads.Request``: the chat template for messages, else the raw prompt."""
        if getattr(request, "messages", None) is not None:
            return self.apply_chat_template(request.messages, tools=getattr(request, "tools", None))
        return self.encode(request.prompt)


# ----------------------------------------------------------------------------- byte level


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

    def decode(self, ids: list[int]) -> str:
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
        text = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
        return text + ("<|assistant|>\n" if add_generation_prompt else "")

    def apply_chat_template(self, messages: list[dict], *, tools: list[dict] | None = None,
                            add_generation_prompt: bool = True, **template_kwargs) -> list[int]:
        if tools:
            raise TokenizerError("the byte-level tokenizer's minimal chat format has no place for tools; "
                                 "use a model folder with a chat template that renders them")
        return self.encode(self.render_chat(messages, add_generation_prompt))


# ----------------------------------------------------------------------------- chat templates


class _GenerationTag(Extension):
    """Accept ``{% generation %}...{% endgeneration %}`` (assistant-mask templates) and render the body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Like transformers: jinja's own tojson HTML-escapes, which chat templates do not want.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def compile_chat_template(source: str) -> jinja2.Template:
    """A sandboxed template with the globals Hub chat templates expect (as transformers sets them)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


# ----------------------------------------------------------------------------- tokenizer.json


def _token_str(v: Any) -> str | None:
    """Special tokens in tokenizer_config.json are strings or serialised AddedToken dicts."""
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise TokenizerError(f"{path}: cannot read ({e})") from None


def _clean_up_tokenization(text: str) -> str:
    """transformers' clean_up_tokenization (only applied to non-BPE models, as transformers does)."""
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                 (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text


def _find_chat_template(model_dir: Path, config: dict) -> str | None:
    """``chat_template.jinja`` (transformers 5 layout) or ``tokenizer_config.json``'s ``chat_template``."""
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.exists():
        return jinja_file.read_text(encoding="utf-8")
    tpl = config.get("chat_template")
    if isinstance(tpl, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        tpl = named.get("default")
    return tpl if isinstance(tpl, str) else None


class HFTokenizer(Tokenizer):
    """A ``tokenizer.json`` model with ``tokenizer_config.json`` / ``generation_config.json`` settings.

    BOS/EOS placement: tokenizer.json's post-processor when it has one (as transformers 5
    does); otherwise ``add_bos_token``/``add_eos_token`` from the config, with BOS on by
    default for Llama-style tokenizers (Mixtral, Mistral).
    """

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        self.backend = HFBackend.from_file(str(self.model_dir / "tokenizer.json"))
        cfg_path = self.model_dir / "tokenizer_config.json"
        cfg = _read_json(cfg_path) if cfg_path.exists() else {}
        stm = self.model_dir / "special_tokens_map.json"
        if stm.exists():
            cfg = {**_read_json(stm), **cfg}
        self.config = cfg
        self.special_tokens = {k: _token_str(cfg.get(k)) for k in
                               ("bos_token", "eos_token", "unk_token", "pad_token")}
        self.bos_id = self._id(self.special_tokens["bos_token"])
        self.eos_id = self._id(self.special_tokens["eos_token"])
        self.pad_id = self._id(self.special_tokens["pad_token"])
        gen_eos = self._generation_eos()
        if self.eos_id is None and gen_eos:
            self.eos_id = gen_eos[0]
        self.eos_ids = frozenset(gen_eos + ([self.eos_id] if self.eos_id is not None else []))
        self.vocab_size = self.backend.get_vocab_size(with_added_tokens=True)
        self.chat_template = _find_chat_template(self.model_dir, cfg)
        self._template = compile_chat_template(self.chat_template) if self.chat_template else None

        # transformers 5 lets tokenizer.json's post-processor decide (it ignores the config flags then);
        # without one it adds nothing, where transformers 4 honoured add_bos_token. We honour the
        # flags in that case (Llama-style default: BOS on) since a model trained with BOS needs it.
        self._use_post_processor = self.backend.post_processor is not None
        llama_style = "llama" in str(cfg.get("tokenizer_class", "")).lower()
        self.add_bos_token = bool(cfg.get("add_bos_token", llama_style))
        self.add_eos_token = bool(cfg.get("add_eos_token", False))
        model_type = json.loads(self.backend.to_str()).get("model", {}).get("type")
        self._clean_up = bool(cfg.get("clean_up_tokenization_spaces", False)) and model_type != "BPE"

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    def _generation_eos(self) -> list[int]:
        """generation_config.json's eos_token_id: one id or a list (Llama 3 style)."""
        path = self.model_dir / "generation_config.json"
        if not path.exists():
            return []
        eos = _read_json(path).get("eos_token_id")
        if isinstance(eos, int):
            return [eos]
        if isinstance(eos, list):
            return [i for i in eos if isinstance(i, int)]
        return []

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        if not add_bos:
            return self.backend.encode(text, add_special_tokens=False).ids
        if self._use_post_processor:
            return self.backend.encode(text, add_special_tokens=True).ids
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if self.add_bos_token and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        if self.add_eos_token and self.eos_id is not None:
            ids = [*ids, self.eos_id]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        text = self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self._clean_up else text

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, *,
                    tools: list[dict] | None = None, documents: list[dict] | None = None,
                    **template_kwargs) -> str:
        """The chat template's text (what transformers' ``apply_chat_template(tokenize=False)`` gives).

        As transformers renders: ``messages``, ``tools`` and ``documents`` (None when not given, so a
        template's ``tools is not none`` sees None, not undefined), ``add_generation_prompt``, the
        special tokens, then the caller's extra keyword arguments (which win over the tokens)."""
        if self._template is None:
            raise TokenizerError(f"{self.model_dir}: the tokenizer has no chat_template")
        context = {k: v for k, v in self.special_tokens.items() if v is not None} | template_kwargs
        try:
            return self._template.render(messages=messages, tools=tools, documents=documents,
                                         add_generation_prompt=add_generation_prompt, **context)
        except jinja2.exceptions.TemplateError as e:
            raise TokenizerError(f"{self.model_dir}: chat template rejected the conversation: {e}") from None

    def apply_chat_template(self, messages: list[dict], *, tools: list[dict] | None = None,
                            add_generation_prompt: bool = True, **template_kwargs) -> list[int]:
        if self._template is None:
            if len(messages) == 1 and messages[0].get("role") == "user" and not tools:
                return self.encode(messages[0]["content"])  # a lone user turn is just its text
            roles = ", ".join(str(m.get("role")) for m in messages)
            raise TokenizerError(
                f"{self.model_dir}: the tokenizer has no chat_template (tokenizer_config.json or "
                f"chat_template.jinja), so a conversation of {len(messages)} messages ({roles}) cannot be "
                f"formatted; add a chat_template, or give single-turn prompts"
            )
        # The template writes BOS itself, so no special tokens are added here (as in transformers).
        text = self.render_chat(messages, add_generation_prompt, tools=tools, **template_kwargs)
        return self.backend.encode(text, add_special_tokens=False).ids


# ----------------------------------------------------------------------------- loading

BYTE_NAMES = ("byte", "bytes", "ByteTokenizer")


def _model_vocab_size(model_dir: Path) -> int | None:
    cfg = model_dir / "config.json"
    if not cfg.exists():
        return None
    data = _read_json(cfg)
    v = data.get("vocab_size", (data.get("text_config") or {}).get("vocab_size"))
    return v if isinstance(v, int) else None


def load_tokenizer(model_dir: str | Path | None, kind: str = "auto",
                   model_vocab_size: int | None = None) -> Tokenizer:
    """The tokenizer for a model folder.

    ``kind``: ``auto`` (tokenizer.json, or a byte tokenizer when tokenizer_config.json says
    ``"tokenizer_class": "ByteTokenizer"``), ``hf``, or ``byte``. The byte tokenizer checks
    that its 259 ids fit ``model_vocab_size`` (default: config.json's vocab_size).
    """
    if kind not in ("auto", "hf", *BYTE_NAMES):
        raise TokenizerError(f"unknown tokenizer kind {kind!r}; choose auto, hf or byte")
    folder = Path(model_dir) if model_dir is not None else None
    if folder is not None and model_vocab_size is None and folder.is_dir():
        model_vocab_size = _model_vocab_size(folder)
    if kind in BYTE_NAMES:
        return ByteTokenizer(model_vocab_size)
    if folder is None:
        raise TokenizerError("no model folder given to load a tokenizer from")
    if not folder.is_dir():
        raise TokenizerError(f"{folder}: model folder does not exist")
    if (folder / "tokenizer.json").exists():
        return HFTokenizer(folder)
    cfg_path = folder / "tokenizer_config.json"
    if kind == "auto" and cfg_path.exists() and _read_json(cfg_path).get("tokenizer_class") in BYTE_NAMES:
        return ByteTokenizer(model_vocab_size)
    extra = ""
    if (folder / "tokenizer.model").exists():
        extra = (" It has a sentencepiece tokenizer.model only: convert it once with transformers "
                 "(AutoTokenizer.from_pretrained(folder).save_pretrained(folder)).")
    raise TokenizerError(
        f"{folder}: no tokenizer.json.{extra} Copy tokenizer.json and tokenizer_config.json from the "
        f"model's Hugging Face repository into this folder, or use the byte-level tokenizer for dummy "
        f"models (--tokenizer byte)."
    )

