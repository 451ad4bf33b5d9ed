"""A model resolved but not loaded: its source (config, weights' whereabouts, dtype), tokenizer and
stop ids. Cheap (no weights), so a job can check prompts and memory before anything heavy, and a
process that only tokenizes (a Ray prompt checker, the Ray driver) needs nothing more.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from moelight.errors import TokenizerError
from moelight.loading.generation_config import generation_eos
from moelight.loading.model_source import ModelSource, resolve_model
from moelight.loading.weights import check_not_truncated, checkpoint_files
from moelight.models.config import ModelConfig
from moelight.tokenization.byte_tokenizer import ByteTokenizer
from moelight.tokenization.tokenizer import load_tokenizer
from moelight.tokenization.tokenizer_base import Tokenizer


@dataclass
class ResolvedModel:
    source: ModelSource
    tokenizer: Tokenizer | None  # None: skip_tokenizer_init (token ids only)
    eos: tuple[int, ...]  # the config's end ids and the tokenizer's (end-of-turn ids of chat models)

    @property
    def config(self) -> ModelConfig:
        return self.source.config

    @property
    def listed_eos(self) -> tuple[int, ...]:
        """The end ids besides the tokenizer's EOS (generation_config.json's, config.json's, end-of-turn ids):
        vLLM puts them among a request's stop_token_ids, so ending on one reports it as stop_reason, where
        the tokenizer's own EOS reports None (and with no tokenizer, every end id is such a stop token)."""
        eos_id = self.tokenizer.eos_id if self.tokenizer is not None else None
        return tuple(i for i in self.eos if i != eos_id)

    @property
    def dtype_name(self) -> str:
        return str(self.source.dtype).replace("torch.", "")


def resolve(model: str, load_format: str = "auto", dtype: str = "auto", tokenizer: str = "auto") -> ResolvedModel:
    """`--model`, `--load-format`, `--dtype` and `--tokenizer` (auto, hf, byte, none or a folder to load it
    from) made concrete, without loading weights."""
    source = resolve_model(model, load_format, dtype)
    if source.model_dir is not None and source.load_format == "safetensors":
        for path in checkpoint_files(source.model_dir):  # a missing shard or a cut file: said before planning
            check_not_truncated(path)
    # generation_config.json's end ids end generation whatever the tokenizer, as in vLLM
    model_eos = tuple(source.config.eos_token_ids) + generation_eos(source.model_dir)
    if tokenizer == "none":  # token ids in and out: the model's end ids only
        return ResolvedModel(source, None, tuple(dict.fromkeys(model_eos)))
    kind = tokenizer if tokenizer in ("auto", "hf", "byte") else "auto"  # else a folder (vLLM's tokenizer path)
    tok_dir = source.model_dir if tokenizer in ("auto", "hf") else None if tokenizer == "byte" else Path(tokenizer)
    if tokenizer == "hf" and tok_dir is None:
        raise TokenizerError(f"--tokenizer hf: {model} is a preset with no tokenizer.json; a preset uses the "
                             "byte-level tokenizer (--tokenizer auto or byte), or give a model folder that has one")
    tok = load_tokenizer(None if tok_dir is None else tok_dir.expanduser(), kind="byte" if tok_dir is None else kind,
                         model_vocab_size=source.config.vocab_size)
    # a real tokenizer may add end-of-turn ids; the byte fallback's ids mean nothing to a checkpoint
    tok_eos = () if isinstance(tok, ByteTokenizer) and source.model_dir else tok.eos_ids
    eos = tuple(dict.fromkeys(model_eos + tuple(sorted(tok_eos))))
    return ResolvedModel(source, tok, eos)
