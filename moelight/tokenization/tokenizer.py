"""Tokenizers: Hugging Face ``tokenizer.json`` models and a byte-level one for dummy models.

The HF path reproduces what transformers' ``PreTrainedTokenizerFast`` gives for
``encode(text)``, ``decode(ids, skip_special_tokens=True)`` and
``apply_chat_template(..., add_generation_prompt=True)`` on the same folder, without
importing transformers (it is a test-only dependency). Chat templates see what transformers 5
gives them: messages (None-valued keys dropped, reasoning copied under ``reasoning_content`` and
``thinking``), ``tools`` / ``documents`` (None when not given), ``add_generation_prompt``, the
special tokens and any extra keyword arguments, in a jinja environment set up as transformers'.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jinja2
from tokenizers import Tokenizer as HFBackend

from moelight.errors import TokenizerError, broken_download_link  # noqa: F401 - TokenizerError re-exported
from moelight.tokenization.byte_tokenizer import BYTE_NAMES, ByteTokenizer
from moelight.tokenization.chat_template import (  # noqa: F401 - compile_chat_template stays importable from here
    CONTINUE_TAG,
    NOT_TEMPLATE_ARGS,
    REASONING_FIELDS,
    compile_chat_template,
    plain,
    template_documents,
    template_messages,
    template_tools,
)
from moelight.tokenization.tokenizer_base import Tokenizer

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


def _strips_start(decoder: dict) -> bool:
    """Whether tokenizer.json's decoder strips characters off the start of a text: Strip with start > 0,
    or Metaspace adding its prefix space (prepend_scheme always / first; add_prefix_space in older files),
    which drops the first token's space."""
    parts = decoder.get("decoders", []) if decoder.get("type") == "Sequence" else [decoder]

    def strips(d: dict) -> bool:
        if d.get("type") == "Strip":
            return d.get("start", 0) > 0
        if d.get("type") == "Metaspace":
            return d.get("prepend_scheme", "always" if d.get("add_prefix_space", True) else "never") != "never"
        return False

    return any(isinstance(d, dict) and strips(d) for d in parts)


def _clean_up_tokenization(text: str) -> str:
    """transformers' clean_up_tokenization (only applied to non-BPE models, as transformers does)."""
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                 (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text


_NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _is_token(v: Any) -> bool:
    return isinstance(v, str) or (isinstance(v, dict) and v.get("__type") == "AddedToken")


def _special_tokens_map(cfg: dict) -> dict[str, str]:
    """transformers 5's ``special_tokens_map`` (what templates get as variables): the named tokens, model-specific
    ``*_token`` entries (e.g. ``image_token``) and an ``extra_special_tokens`` dict; not the extra-token lists."""
    tokens = {k: _token_str(cfg.get(k)) for k in _NAMED_SPECIAL_TOKENS}
    tokens |= {k: _token_str(v) for k, v in cfg.items()
               if k.endswith("_token") and k not in _NAMED_SPECIAL_TOKENS and _is_token(v)}
    extra = cfg.get("extra_special_tokens") or cfg.get("additional_special_tokens")
    if isinstance(extra, dict):
        tokens |= {k: _token_str(v) for k, v in extra.items()}
    return {k: v for k, v in tokens.items() if v is not None}


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError as e:
        raise TokenizerError(f"{path}: cannot read ({e})") from None


def _find_chat_templates(model_dir: Path, config: dict) -> str | dict[str, str] | None:
    """The chat template(s) as transformers 5 loads them: ``chat_template.jinja`` (the default) and
    ``additional_chat_templates/*.jinja`` (named) win over ``tokenizer_config.json``'s ``chat_template``
    (a string, or a list of ``{"name", "template"}``). One template is a string, several a dict."""
    files = {}
    if (model_dir / "chat_template.jinja").is_file():
        files["default"] = _read_text(model_dir / "chat_template.jinja")
    extra_dir = model_dir / "additional_chat_templates"
    if extra_dir.is_dir():
        files |= {f.name.removesuffix(".jinja"): _read_text(f) for f in sorted(extra_dir.glob("*.jinja"))}
    if files:
        return files["default"] if list(files) == ["default"] else files
    tpl = config.get("chat_template")
    if isinstance(tpl, (list, tuple)):
        tpl = {t["name"]: t["template"] for t in tpl if isinstance(t, dict) and "name" in t and "template" in t}
    return tpl if isinstance(tpl, (str, dict)) and tpl else None


class HFTokenizer(Tokenizer):
    """A ``tokenizer.json`` model with ``tokenizer_config.json`` / ``generation_config.json`` settings.

    BOS/EOS placement: tokenizer.json's post-processor when it has one (as transformers 5
    does); otherwise ``add_bos_token``/``add_eos_token`` from the config, with BOS on by
    default for Llama-style tokenizers (Mixtral, Mistral).
    """

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        path = self.model_dir / "tokenizer.json"
        try:
            self.backend = HFBackend.from_file(str(path))
        except Exception as e:  # noqa: BLE001 - the tokenizers library raises a bare Exception for bad files
            raise TokenizerError(f"{path}: not a readable tokenizer.json ({e}); replace it with the model's own "
                                 "file, or pass --tokenizer byte to run without it") from None
        cfg_path = self.model_dir / "tokenizer_config.json"
        cfg = _read_json(cfg_path) if cfg_path.exists() else {}
        stm = self.model_dir / "special_tokens_map.json"
        if stm.exists() and "added_tokens_decoder" not in cfg:
            # transformers 5 reads the legacy special_tokens_map.json only for a config without
            # added_tokens_decoder, and then its entries win over the config's
            smap = _read_json(stm)
            extra = {**(e if isinstance(e := cfg.get("extra_special_tokens"), dict) else {}),
                     **(e if isinstance(e := smap.get("extra_special_tokens"), dict) else {})}
            cfg = {**cfg, **smap} | ({"extra_special_tokens": extra} if extra else {})
        self.config = cfg
        self.special_tokens = _special_tokens_map(cfg)
        self.bos_id = self._id(self.special_tokens.get("bos_token"))
        self.eos_id = self._id(self.special_tokens.get("eos_token"))
        self.pad_id = self._id(self.special_tokens.get("pad_token"))
        gen_eos = self._generation_eos()
        if self.eos_id is None and gen_eos:
            self.eos_id = gen_eos[0]
        self.eos_ids = frozenset(gen_eos + ([self.eos_id] if self.eos_id is not None else []))
        self.vocab_size = self.backend.get_vocab_size(with_added_tokens=True)
        # one template (str) or named ones (dict), as transformers holds them; chat_template is the default one
        self.chat_templates = _find_chat_templates(self.model_dir, cfg)
        self.chat_template = (self.chat_templates.get("default") if isinstance(self.chat_templates, dict)
                              else self.chat_templates)
        self._compiled: dict[str, jinja2.Template] = {}  # compiled on first use, as transformers does

        # transformers 5 lets tokenizer.json's post-processor decide (it ignores the config flags then);
        # without one it adds nothing, where transformers 4 honoured add_bos_token. We honour the
        # flags in that case (Llama-style default: BOS on) since a model trained with BOS needs it.
        self._use_post_processor = self.backend.post_processor is not None
        llama_style = "llama" in str(cfg.get("tokenizer_class", "")).lower()
        self.add_bos_token = bool(cfg.get("add_bos_token", llama_style))
        self.add_eos_token = bool(cfg.get("add_eos_token", False))
        spec = json.loads(self.backend.to_str())
        model_type = spec.get("model", {}).get("type")
        self._clean_up = bool(cfg.get("clean_up_tokenization_spaces", False)) and model_type != "BPE"
        self._strips_start = _strips_start(spec.get("decoder") or {})
        self._anchor = self.encode("a", add_bos=False)[-1:] if self._strips_start else []

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

    def decode(self, ids: list[int], skip_special_tokens: bool = True, context: Sequence[int] = ()) -> str:
        """`context`: the tokens before `ids` (a prompt). A decoder that strips the text's first space
        (SentencePiece's Strip: Llama, Mistral, Mixtral) strips it at the start of the whole text only, so
        an output reads as it does after its prompt: decode(context + ids) less decode(context), the
        context the prompt's last 4..24 tokens that decode whole (vLLM's incremental detokenizer)."""
        text = self._decode(ids, skip_special_tokens)
        if not (self._strips_start and ids and context):
            return text
        context = list(context)
        tail = context[-4:]
        for n in range(4, min(len(context), 24) + 1):
            if "\ufffd" not in self._decode(context[-n:], skip_special_tokens):
                tail = context[-n:]
                break
        head, full = self._decode(tail, skip_special_tokens), self._decode(tail + list(ids), skip_special_tokens)
        return full[len(head):] if full.startswith(head) else text

    def piece(self, token: int) -> str:
        """One token's text as it reads inside a text (a logprob's decoded token): the space a Strip
        decoder drops at a text's start is kept, as vLLM's convert_ids_list_to_tokens restores it."""
        return self.decode([token], False, self._anchor)

    def _decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        text = self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self._clean_up else text

    @property
    def has_chat_template(self) -> bool:
        return self.chat_templates is not None

    def _template_source(self, chat_template: str | None, tools: Any) -> str:
        """transformers' get_chat_template: a template name or a template; else, of named templates,
        ``tool_use`` when tools are given (even an empty list), then ``default``."""
        templates = self.chat_templates
        if isinstance(templates, dict):
            if chat_template is not None:
                return templates.get(chat_template, chat_template)
            if tools is not None and "tool_use" in templates:
                return templates["tool_use"]
            if "default" in templates:
                return templates["default"]
            raise TokenizerError(f"{self.model_dir}: the tokenizer has several chat templates and no default; "
                                 f"name one with chat_template= (one of {', '.join(sorted(templates))})")
        if chat_template is not None:
            return chat_template
        if templates is None:
            raise TokenizerError(f"{self.model_dir}: the tokenizer has no chat_template")
        return templates

    def _compile(self, source: str) -> jinja2.Template:
        if source not in self._compiled:
            try:
                self._compiled[source] = compile_chat_template(source)
            except jinja2.exceptions.TemplateError as e:
                raise TokenizerError(f"{self.model_dir}: the chat template does not parse: {e}") from None
        return self._compiled[source]

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, *,
                    tools: list[dict] | None = None, documents: list[dict] | None = None,
                    chat_template: str | None = None, continue_final_message: bool | str = False,
                    **template_kwargs) -> str:
        """The chat template's text (what transformers' ``apply_chat_template(tokenize=False)`` gives).

        As transformers renders: ``messages`` (None-valued keys dropped; a message's reasoning under
        ``reasoning_content`` and ``thinking``), ``tools`` and ``documents`` (None when not given, so a
        template's ``tools is not none`` sees None, not undefined), ``add_generation_prompt``, the special
        tokens, then the caller's extra keyword arguments (which win over the tokens). ``chat_template``
        picks a named template or gives one; ``continue_final_message`` (True, or the field to continue,
        e.g. "reasoning_content") leaves the last message open for the model to continue."""
        if not messages:
            raise TokenizerError("cannot apply a chat template to an empty conversation; give at least one message")
        not_template = sorted(set(template_kwargs) & set(NOT_TEMPLATE_ARGS))
        if not_template:
            raise TokenizerError(f"{', '.join(not_template)}: transformers' apply_chat_template options that "
                                 "moelight does not take (render_chat gives the text, apply_chat_template the ids)")
        if continue_final_message and add_generation_prompt:
            raise TokenizerError("continue_final_message and add_generation_prompt do not go together (as in "
                                 "transformers): pass add_generation_prompt=False to continue the final message")
        source = self._template_source(chat_template, tools)
        template = self._compile(source)
        chat = template_messages(messages)
        tools, documents = template_tools(tools), template_documents(documents)
        context = plain(self.special_tokens | template_kwargs)
        final = None
        if continue_final_message:
            final = self._mark_final_message(chat, continue_final_message, source)
        try:
            text = template.render(messages=chat, tools=tools, documents=documents,
                                   add_generation_prompt=add_generation_prompt, **context)
        except jinja2.exceptions.TemplateError as e:
            raise TokenizerError(f"{self.model_dir}: chat template rejected the conversation: {e}") from None
        if final is not None:
            text = self._cut_at_final_message(text, final)
        return text

    def _mark_final_message(self, chat: list[dict], field: bool | str, source: str) -> str:
        """Tag the field of the last message to continue (transformers' continue_final_message); its text."""
        field = field if isinstance(field, str) else "content"
        final = chat[-1].get(field)
        if final is None:
            raise TokenizerError(f'continue_final_message: the final message has no "{field}" to continue')
        fields = [field]
        if field in REASONING_FIELDS:  # reasoning is copied under several names: tag each copy
            fields = [f for f in REASONING_FIELDS if chat[-1].get(f) == final]
        if not any(f in source for f in fields):
            raise TokenizerError(f'continue_final_message: "{field}" is not a field the chat template uses')
        if isinstance(final, (list, tuple)):  # content blocks: continue the last text block
            for block in reversed(final):
                if isinstance(block, dict) and "text" in block:
                    final = block["text"]
                    block["text"] = block["text"] + CONTINUE_TAG
                    return final
            raise TokenizerError("continue_final_message: the final message has no text to continue")
        for f in fields:
            chat[-1][f] = chat[-1][f] + CONTINUE_TAG
        return final

    def _cut_at_final_message(self, text: str, final: str) -> str:
        tag = CONTINUE_TAG.strip()
        if final.strip() not in text or tag not in text:
            raise TokenizerError(f"{self.model_dir}: continue_final_message: the chat template drops part of the "
                                 "final message, so it cannot be continued")
        at = text.rindex(tag)
        if text[at:at + len(CONTINUE_TAG)] == CONTINUE_TAG:
            return text[:at]
        return text[:at].rstrip()  # the template trimmed the message's trailing space

    def apply_chat_template(self, messages: list[dict], *, tools: list[dict] | None = None,
                            add_generation_prompt: bool = True, tokenize: bool = True,
                            **template_kwargs) -> list[int] | str:
        if not self.has_chat_template and template_kwargs.get("chat_template") is None:
            msgs = template_messages(messages)
            if len(msgs) == 1 and msgs[0].get("role") == "user" and isinstance(msgs[0].get("content"), str) \
                    and not tools:  # a lone user turn is just its text
                return self.encode(msgs[0]["content"]) if tokenize else msgs[0]["content"]
            roles = ", ".join(str(m.get("role")) for m in msgs)
            raise TokenizerError(
                f"{self.model_dir}: the tokenizer has no chat_template (tokenizer_config.json or "
                f"chat_template.jinja), so a conversation of {len(messages)} messages ({roles}) cannot be "
                f"formatted; add a chat_template, or give single-turn prompts"
            )
        # The template writes BOS itself, so no special tokens are added here (as in transformers).
        text = self.render_chat(messages, add_generation_prompt, tools=tools, **template_kwargs)
        return self.backend.encode(text, add_special_tokens=False).ids if tokenize else text


# ----------------------------------------------------------------------------- loading



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
    if broken_download_link(folder / "tokenizer.json"):
        raise TokenizerError(broken_download_link(folder / "tokenizer.json"))
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

