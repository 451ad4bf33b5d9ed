"""Python API in the shape of vLLM's offline inference:

    from moelight import LLM, SamplingParams
    llm = LLM("tiny", load_format="dummy")
    for out in llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0)):
        print(out.outputs[0].text)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from moelight.cpu_linear import pack_model
from moelight.engine import Engine, GenerationStats
from moelight.errors import PromptError
from moelight.loader import load_model, resolve_model
from moelight.memory import available_bytes, check_fits, weight_bytes
from moelight.outputs import CompletionOutput, RequestOutput
from moelight.sampling import SamplingParams
from moelight.tokenizer import ByteTokenizer, load_tokenizer


class LLM:
    def __init__(
        self,
        model: str,
        *,
        load_format: str = "auto",
        dtype: str = "auto",
        seed: int = 0,
        batch_size: int = 256,
        micro_batch_size: int | None = None,
        max_prefill_tokens: int = 4096,
        refill: bool = True,
    ) -> None:
        self.source = resolve_model(model, load_format, dtype)
        self.config = self.source.config
        self.seed = seed
        self.batch_size = batch_size
        self.micro_batch_size = micro_batch_size or batch_size
        check_fits(self.config, self.source.dtype, 0)
        if self.source.model_dir is not None and (self.source.model_dir / "tokenizer.json").is_file():
            self.tokenizer = load_tokenizer(self.source.model_dir)
        else:
            self.tokenizer = ByteTokenizer(self.config.vocab_size)
        self.model = load_model(self.source, seed)
        pack_model(self.model)  # CPU executor: oneDNN pre-packed weights
        # a real tokenizer may add end-of-turn ids; the byte fallback's ids mean nothing to a checkpoint
        tok_eos = () if isinstance(self.tokenizer, ByteTokenizer) and self.source.model_dir else self.tokenizer.eos_ids
        eos = tuple(self.config.eos_token_ids) + tuple(sorted(tok_eos))
        self.engine = Engine(self.model, tuple(dict.fromkeys(eos)), max_prefill_tokens, refill=refill)
        self.last_stats: GenerationStats | None = None

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for text prompts or pre-tokenized prompts (lists of token ids)."""
        if isinstance(prompts, str):
            prompts = [prompts]
        blank = [i for i, p in enumerate(prompts) if isinstance(p, str) and not p.strip()]
        if blank:
            more = f" (and {len(blank) - 1} more)" if len(blank) > 1 else ""
            raise PromptError(f"prompt {blank[0]} is empty{more}; every prompt needs some text")
        token_lists = [p if isinstance(p, list) else self.tokenizer.encode(p) for p in prompts]
        texts = [p if isinstance(p, str) else None for p in prompts]
        return self._run(token_lists, texts, sampling_params)

    def chat(
        self,
        conversations: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Each conversation is a list of {role, content} messages; the chat template applies."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        token_lists = [self.tokenizer.apply_chat_template(c) for c in conversations]
        return self._run(token_lists, [None] * len(token_lists), sampling_params)

    def _run(self, token_lists, texts, sampling_params) -> list[RequestOutput]:
        n = len(token_lists)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = list(sampling_params) if isinstance(sampling_params, Sequence) else [sampling_params] * n
        if len(params) != n:
            raise ValueError(f"{len(params)} SamplingParams for {n} prompts")
        params = [self._fit_context(i, t, p) for i, (t, p) in enumerate(zip(token_lists, params, strict=False))]
        # the model is loaded: what is left to check is the KV cache of the largest batch
        slots = sorted((len(t) + p.max_tokens for t, p in zip(token_lists, params, strict=True)), reverse=True)
        check_fits(self.config, self.source.dtype, sum(slots[: self.batch_size]),
                   available=available_bytes() + weight_bytes(self.config, self.source.dtype))
        stats = GenerationStats()
        results = self.engine.generate(
            token_lists, params, [self.seed + i for i in range(n)],
            self.batch_size, self.micro_batch_size, stats=stats,
        )
        self.last_stats = stats
        return [
            RequestOutput(str(i), texts[i], token_lists[i],
                          [CompletionOutput(0, self.tokenizer.decode(r.token_ids), r.token_ids, r.finish_reason)])
            for i, r in enumerate(results)
        ]

    def _fit_context(self, i: int, tokens: list[int], p: SamplingParams) -> SamplingParams:
        limit = self.config.max_position_embeddings
        if not tokens:
            raise PromptError(f"prompt {i} is empty")
        if len(tokens) >= limit:
            raise PromptError(f"prompt {i} has {len(tokens)} tokens; the model's context is {limit}")
        if len(tokens) + p.max_tokens > limit:
            return replace(p, max_tokens=limit - len(tokens))
        return p
