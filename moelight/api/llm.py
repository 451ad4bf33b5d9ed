"""Python API in the shape of vLLM's offline inference:

    from moelight import LLM, SamplingParams
    llm = LLM("tiny", load_format="dummy")
    for out in llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0)):
        print(out.outputs[0].text)

`LLM` takes every option `moelight run` takes (`EngineOptions`) and runs the same job path
(`EngineSession`): plan -> memory check -> load -> generate; `last_report` holds the figures
the CLI prints and saves. Calls from several threads run one at a time (they share the session's
executor). `close()`, leaving a `with LLM(...) as llm:` block, or dropping the LLM frees the runtime.
"""

from __future__ import annotations

import itertools
import threading
import warnings
import weakref
from collections.abc import Callable, Sequence

from tqdm import tqdm

from moelight.api.hf_style_tokenizer import HFStyleTokenizer
from moelight.api.outputs import CompletionOutput, RequestOutput
from moelight.api.vllm_arguments import engine_option_values, without_vllm_defaults
from moelight.engine.generation import GenerationStats
from moelight.engine.options import TOKENIZERS, EngineOptions, OptionError
from moelight.engine.session_start import open_session
from moelight.errors import ConfigError, PromptError
from moelight.jobs.job_warnings import JobWarnings
from moelight.jobs.prompts import expand_samples, fit_to_context, out_of_vocab, seeded
from moelight.jobs.report import RunReport
from moelight.jobs.serving import generate_planned
from moelight.loading.generation_config import sampling_defaults
from moelight.sampling.params import SamplingParams
from workloads.readers.fields import RecordError, parse_messages, parse_tools

PROMPT_KEYS = {"prompt", "prompt_token_ids", "cache_salt"}  # vLLM's TextPrompt / TokensPrompt
# vLLM constructor arguments: what moelight calls them (refused with the hint: the meaning differs a little)
VLLM_NAMES = {"tensor_parallel_size": "gpus (tensor-parallel ranks)", "max_num_seqs": "batch_size",
              "quantization": "quantize (int8 / int4 at load; a quantized checkpoint is read as it ships)",
              "gpu_memory_utilization": "hardware (the plan keeps 10% of each memory free)",
              "max_num_batched_tokens": "max_prefill_tokens (prompt tokens per prefill pass; vLLM's budget also "
                                        "counts decode tokens and splits a long prompt, moelight's does neither)"}
VLLM_NO_OPS = ("enforce_eager", "disable_log_stats")  # moelight captures no CUDA graphs, logs no stats


class LLM:
    """Loads the model once; each `generate` plans its own job (batch, micro-batch, placement). In latency
    mode each call also starts a cold expert cache of its own plan (its hits, in `last_report`, are that
    call's): requests given to one call share one warm cache, requests split over calls do not."""

    def __init__(self, model: str, skip_tokenizer_init: bool = False, max_model_len: int | None = None,
                 trust_remote_code: bool = False, generation_config: str = "auto", **options) -> None:
        """`options` are EngineOptions' fields: load_format, dtype, tokenizer, seed, policy, hardware,
        gpus, device, schedule, refill, enable_prefix_caching, batch_size, micro_batch_size, max_prefill_tokens,
        mode, cache_policy, cache_size, eamc, prefetch_per_layer, predictor, quantize. vLLM's own:
        `skip_tokenizer_init` (no tokenizer at all (a folder without one): prompts are token ids, outputs
        carry token ids and empty text), `max_model_len` (prompt + output at most this many tokens, at most the
        model's context), `trust_remote_code` (moelight runs no model code of a checkpoint's: its own
        architectures only), `generation_config` ("auto": generation_config.json's temperature, top_k, top_p,
        min_p, repetition_penalty and max_new_tokens are the defaults of get_default_sampling_params(), which
        generate / chat use without SamplingParams; "vllm": none; a folder: its file's) and `enforce_eager`
        (no CUDA graphs either way) are taken, as are vLLM's defaults `quantization=None` and
        `tensor_parallel_size=1` (vllm_arguments.py)."""
        for name in VLLM_NO_OPS:
            options.pop(name, None)
        options = without_vllm_defaults(options)
        renamed = sorted(n for n in options if n in VLLM_NAMES)
        if renamed:
            raise OptionError("LLM(): " + "; ".join(f"vLLM's {n} is moelight's {VLLM_NAMES[n]}" for n in renamed))
        unknown = sorted(set(options) - set(EngineOptions.names()))
        if unknown:
            raise OptionError(f"LLM(): unknown option(s) {', '.join(unknown)}; valid: skip_tokenizer_init, "
                              "max_model_len, trust_remote_code, generation_config, "
                              f"{', '.join(n for n in EngineOptions.names() if n != 'model')}")
        if max_model_len is not None and (not isinstance(max_model_len, int) or max_model_len < 2):
            raise OptionError(f"LLM(): max_model_len {max_model_len!r}: a number of tokens >= 2")
        if not isinstance(generation_config, str):
            raise OptionError(f"LLM(): generation_config {generation_config!r}: auto, vllm or a folder")
        options = engine_option_values(options)
        if skip_tokenizer_init:
            options["tokenizer"] = "none"
        self.options = EngineOptions(model=model, **options)
        session = open_session(self.options)
        if session is None:  # torchrun rank > 0: served rank 0's engine until it closed
            raise SystemExit(0)
        self.session = session
        # one job at a time: jobs share the session's executor, which a job may rebuild (vLLM's LLM is not
        # thread-safe either; here a second thread's call waits its turn)
        self._job_lock = threading.Lock()
        # a dropped LLM frees its runtime (executor threads, device, other ranks); the finalizer holds the
        # session, never the LLM, so it does not keep the LLM alive
        self._finalizer = weakref.finalize(self, session.close)
        # but not at interpreter exit: closing the emulated device's lanes while the interpreter tears down
        # aborts the process (a C++ thread destroyed while joinable); the process ends with them anyway
        self._finalizer.atexit = False
        try:
            self._sampling_defaults = sampling_defaults(generation_config, session.resolved.source.model_dir)
        except ConfigError:
            self._finalizer()
            raise
        context = session.config.context_length
        if max_model_len is not None and max_model_len > context:  # as vLLM: the model cannot see further
            self._finalizer()
            raise OptionError(f"LLM(): max_model_len {max_model_len} is above the model's context, "
                              f"{context} tokens ({session.config.context_origin}); give at most {context}")
        self.session.load()
        self.config = self.session.config
        self.tokenizer = self.session.tokenizer
        self.max_model_len = context if max_model_len is None else max_model_len
        self.last_report: RunReport | None = None
        self.last_stats: GenerationStats | None = None
        self._request_counter = itertools.count()  # vLLM's request ids: 0, 1, ... on from call to call

    @property
    def model(self):
        return self.session.model

    @property
    def llm_engine(self):
        """vLLM's engine object has no counterpart here: say what a script reaches through it for."""
        raise AttributeError("LLM.llm_engine: moelight has no separate engine object; use llm.get_tokenizer() for "
                             "the tokenizer, llm.config (the model's ModelConfig) and llm.max_model_len for the "
                             "model's settings, llm.last_report for the last call's figures")

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: SamplingParams with generation_config.json's defaults (see `generation_config`); what
        generate and chat use when given none."""
        return SamplingParams(**self._sampling_defaults)

    def get_tokenizer(self) -> HFStyleTokenizer:
        """The model's tokenizer behind transformers' interface, as vLLM's accessor hands one out
        (hf_style_tokenizer.py); `self.tokenizer` is moelight's own. Its name_or_path is the tokenizer folder
        given, else the model, as transformers names a tokenizer by what it was loaded from."""
        if self.tokenizer is None:  # as vLLM's
            raise ValueError("get_tokenizer(): this LLM was built with skip_tokenizer_init=True, so it has no "
                             "tokenizer; build it without skip_tokenizer_init to have one")
        tok = self.options.tokenizer
        return HFStyleTokenizer(self.tokenizer, tok if tok not in TOKENIZERS else self.options.model)

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = False,
    ) -> list[RequestOutput]:
        """Prompts: a str, a list of token ids, a {"prompt": str} or {"prompt_token_ids": [...]} dict (its
        `cache_salt` taken: the prefix cache lives for this call only, so no other call reads its KV),
        or a list of any of these. Outputs come back in input order ([] for no prompts). `use_tqdm`: a
        progress bar, or vLLM's tqdm factory (called with total= and desc=)."""
        if not isinstance(prompts, (str, dict, list, tuple)):
            raise TypeError("prompts must be a str, a list of token ids, a {'prompt': ...} or "
                            f"{{'prompt_token_ids': [...]}} dict, or a list of these; got {type(prompts).__name__}")
        texts, token_lists = [], []
        for i, p in enumerate(_as_list(prompts)):
            text, ids = self._one_prompt(i, p)
            texts.append(text)
            token_lists.append(ids)
        with self._job_lock:
            return self._run(token_lists, texts, sampling_params, use_tqdm)

    def chat(
        self,
        conversations: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = False,
        *,
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
        continue_final_message: bool = False,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """A conversation (a list of {role, content} messages) or a list of conversations, each rendered by
        the model's chat template as vLLM's `LLM.chat` has it rendered: with `tools` (JSON-schema dicts),
        `add_generation_prompt`, `continue_final_message` (prefill: the model continues the last message;
        needs add_generation_prompt=False), `chat_template` (a template, or the name of one of the model's)
        and `chat_template_kwargs`, the template's own variables (e.g. {"enable_thinking": False},
        {"reasoning_effort": "high"}), which, as in vLLM, may also set the arguments before them."""
        if not isinstance(conversations, (list, tuple)):
            raise TypeError("conversations must be a list of {'role': ..., 'content': ...} messages, or a list of "
                            f"such lists; got {type(conversations).__name__}")
        if conversations and not isinstance(conversations[0], (list, tuple)):
            conversations = [conversations]  # type: ignore[list-item]
        conversations = [_read_conversation(i, c) for i, c in enumerate(conversations)]
        tools = _read_tools(tools)
        render: dict = {"tools": tools, "add_generation_prompt": add_generation_prompt}
        if continue_final_message:
            render["continue_final_message"] = continue_final_message
        if chat_template is not None:
            render["chat_template"] = chat_template
        render |= chat_template_kwargs or {}
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer (its chat template); this LLM was built with "
                             "skip_tokenizer_init=True: give prompt_token_ids to generate() instead")
        token_lists = [self.tokenizer.apply_chat_template(c, **render) for c in conversations]
        for i, ids in enumerate(token_lists):  # a tokenizer larger than the model's vocabulary
            beyond = out_of_vocab(ids, self.config.vocab_size)
            if beyond:
                raise PromptError(f"conversation {i}: {beyond}")
        texts = [self.tokenizer.decode(ids, skip_special_tokens=False) for ids in token_lists]  # vLLM's prompt
        with self._job_lock:
            return self._run(token_lists, texts, sampling_params, use_tqdm)

    def _one_prompt(self, i: int, p) -> tuple[str | None, list[int]]:
        if isinstance(p, dict):
            extra = sorted(set(p) - PROMPT_KEYS)
            if extra or not (set(p) & {"prompt", "prompt_token_ids"}):
                raise PromptError(f"prompt {i}: a dict prompt holds 'prompt' (text) or 'prompt_token_ids', and may "
                                  f"hold 'cache_salt'; got keys {sorted(p)}" + (
                                      f" ({', '.join(extra)}: multi-modal and other inputs are not supported)"
                                      if extra else ""))
            salt = p.get("cache_salt")
            if salt is not None and (not isinstance(salt, str) or not salt):
                raise PromptError(f"prompt {i}: cache_salt must be a non-empty string (as in vLLM), got {salt!r}")
            text = p.get("prompt")
            ids = p.get("prompt_token_ids")
            if ids is None:
                return self._one_prompt(i, text)
            return (text if isinstance(text, str) else None), self._token_ids(i, ids)
        if isinstance(p, str):  # blank text is a prompt, as in vLLM: only one of no tokens is refused (_run)
            if self.tokenizer is None:
                raise ValueError(f"prompt {i} is text, but this LLM was built with skip_tokenizer_init=True: give "
                                 "token ids ({'prompt_token_ids': [...]} or a list of ints)")
            ids = self.tokenizer.encode(p)
            beyond = out_of_vocab(ids, self.config.vocab_size)
            if beyond:
                raise PromptError(f"prompt {i}: {beyond}")
            return p, ids
        if isinstance(p, (list, tuple)):
            return None, self._token_ids(i, p)
        raise PromptError(f"prompt {i}: {type(p).__name__} is not a prompt; give a str, a list of token ids, "
                          "or a {'prompt': ...} / {'prompt_token_ids': [...]} dict")

    def _token_ids(self, i: int, ids) -> list[int]:
        vocab = self.config.vocab_size
        where = f"prompt {i}: prompt_token_ids must be a list of ints in 0..{vocab - 1} (the model's vocabulary)"
        if not isinstance(ids, (list, tuple)):
            raise PromptError(f"{where}; got {type(ids).__name__}")
        # True is an int in Python, not a token id
        bad = next((t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise PromptError(f"{where}; got {bad!r}")
        return list(ids)

    def _run(self, token_lists, texts, sampling_params, use_tqdm) -> list[RequestOutput]:
        n = len(token_lists)
        if n == 0:
            return []
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = list(sampling_params) if isinstance(sampling_params, Sequence) else [sampling_params] * n
        bad = next((p for p in params if not isinstance(p, SamplingParams)), None)
        if bad is not None:
            raise TypeError(f"sampling_params must be a SamplingParams or a list of them, got {type(bad).__name__}")
        if len(params) != n:
            raise ValueError(f"{len(params)} SamplingParams for {n} prompts")
        token_lists = [_truncated(t, p.truncate_prompt_tokens, self.max_model_len)
                       for t, p in zip(token_lists, params, strict=True)]
        # as `moelight run` does: request r is fitted to the context and samples with seed + crc32(id); ids
        # go on from call to call as vLLM's do, so a second call's unseeded samples are new ones
        ids = [str(next(self._request_counter)) for _ in range(n)]
        context = self.max_model_len
        changed = JobWarnings()  # a max_tokens cut to the context: in last_report and said once
        params = [seeded(fit_to_context(f"prompt {i}", t, p, context, changed), self.options.seed, ids[i])
                  for i, (t, p) in enumerate(zip(token_lists, params, strict=True))]
        for line in changed.lines():
            warnings.warn(line, UserWarning, stacklevel=3)
        seq_prompts, seq_params, owners = expand_samples(token_lists, params)  # n samples: n sequences
        self.session.check_sampling(seq_params)
        plan = self.session.plan(seq_prompts, seq_params)
        if plan.info.get("warning"):  # e.g. cache options --mode auto left unused
            warnings.warn(plan.info["warning"], UserWarning, stacklevel=3)
        report = RunReport.for_plan(self.options.model, self.session.dtype_name, plan, n)
        report.load_seconds = self.session.load_seconds  # the model loaded with the LLM
        report.warnings = changed.to_dict() if changed.counts else {}
        stats = GenerationStats()
        bar = (use_tqdm(total=len(seq_prompts), desc="generating") if callable(use_tqdm)  # vLLM's tqdm factory
               else tqdm(total=len(seq_prompts), unit="seq", disable=not use_tqdm, desc="generating"))
        with bar:
            results = generate_planned(self.session, plan, seq_prompts, seq_params, report,
                                       on_finish=lambda _: bar.update(1), stats=stats, owners=owners)
        report.close(self.session)
        self.last_stats, self.last_report = stats, report
        outputs: list[RequestOutput] = [RequestOutput(ids[i], texts[i], token_lists[i], []) for i in range(n)]
        for (i, k), r, p in zip(owners, results, seq_params, strict=True):
            outputs[i].outputs.append(self._completion(k, r, p))
            if k == 0:
                outputs[i].prompt_logprobs = r.prompt_logprobs
                outputs[i].num_cached_tokens = r.num_cached_tokens
        return outputs

    def _completion(self, k: int, r, p: SamplingParams) -> CompletionOutput:
        if not p.detokenize or self.tokenizer is None:  # skip_tokenizer_init: token ids in, token ids out
            text = ""
        elif r.text is not None:
            text = r.text
        else:
            text = self.tokenizer.decode(r.text_token_ids(p), p.skip_special_tokens)
        return CompletionOutput(k, text, r.token_ids, r.finish_reason, r.cumulative_logprob, r.logprobs,
                                r.stop_reason)

    def close(self) -> None:
        """Free the runtime (cuda / emulated: the executor, its threads and device memory; other ranks);
        the LLM is not usable afterwards. Waits for a job another thread is running; closing twice is a no-op."""
        with self._job_lock:
            self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _read_conversation(i: int, conversation) -> list[dict]:
    """The messages as `moelight run` reads a dataset's (workloads' parse_messages, one path for both):
    roles checked, OpenAI's text content parts joined by newlines and a tool call's JSON-text arguments
    made an object, as vLLM hands them to the template; a conversation without a user turn is the
    template's to judge, as in vLLM."""
    if not isinstance(conversation, (list, tuple)):
        raise TypeError(f"conversation {i} must be a list of {{'role': ..., 'content': ...}} messages, got "
                        f"{type(conversation).__name__}")
    try:
        return parse_messages(list(conversation), f"conversations[{i}]", need_user=False)
    except RecordError as e:
        raise ValueError(str(e)) from None


def _read_tools(tools) -> list[dict] | None:
    """`tools` checked as a dataset's are (a list of JSON-schema objects)."""
    try:
        return parse_tools({"tools": tools})
    except RecordError as e:
        raise ValueError(f"chat(): {e}") from None


def _truncated(ids: list[int], k: int | None, context: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last k tokens (-1: as many as max_model_len)."""
    if k is None:
        return ids
    k = context if k == -1 else k
    if k > context:
        raise ValueError(f"truncate_prompt_tokens {k} is above max_model_len ({context}); give at most "
                         f"{context}, or -1 for max_model_len")
    return ids[-k:]


def _as_list(prompts) -> list:
    """One prompt or a list of them; a flat list of ints is one tokenized prompt."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]
    return prompts

