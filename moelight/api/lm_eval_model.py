"""moelight as an lm-evaluation-harness model (`moelight` in lm-eval's registry; `moelight eval` runs it).

Log-likelihoods come from one engine job per task (batched and planned as any job): as lm-eval's
`hf` model does, the last max_length + 1 tokens of context + continuation are scored, all but the
last from `prompt_logprobs` of the first max_length, the last from the first generated position
(that token allowed alone, its logprob and rank taken before any transform); a continuation of no
tokens or of more than max_length is refused, as `hf` refuses it (lm-eval's vllm model would score an
empty one 0.0, which ranks that choice first). A window then fills the
model's input without a prompt longer than the engine takes. `is_greedy` is every continuation token
ranking first. `loglikelihood_rolling` scores a text in windows of max_length (the model's context
less the slot a prompt leaves) as the `hf` model does (`get_rolling_token_windows`, one prefix token);
`generate_until` keeps the last max_length - max_gen_toks context tokens, as `hf` does (a budget that
leaves no room for the context is refused, as `hf` does; the budget
under any of lm-eval's names: max_gen_toks, max_new_tokens, max_tokens, max_completion_tokens), stops at
lm-eval's `until` strings, with the task's sampling settings (temperature, top_k, top_p, min_p,
repetition_penalty; others refused, not dropped). Tokenization follows the `hf` model's: the
tokenizer's own special tokens, or BOS as `add_bos_token` says (True adds it whatever the tokenizer
does); none for a string that already starts with BOS; the prefix token BOS (else EOS) for an empty
context. One difference: a Llama-style tokenizer.json without a post-processor gets BOS from moelight
by default (see tokenization/tokenizer.py), none from transformers 5: pass add_bos_token=False for hf's.
Chat templates (`apply_chat_template=True`) render as moelight's chat jobs do, and as `hf` renders
them a gen_prefix continues the assistant's message, and a template that refuses a system message
(a system_instruction or task description) renders without it, with a warning.
lm-eval is an optional extra: `pip install -e ".[eval]"`. Importing this module registers `moelight`
in lm-eval's registry (`moelight eval` does), beside lm-eval's own models.
"""

from __future__ import annotations

import logging
import re

import lm_eval.models  # noqa: F401 - lm-eval fills its registry only while it is empty: its models first
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from moelight.api.llm import LLM
from moelight.engine.options import DEVICES, OptionError
from moelight.errors import PromptError, TokenizerError
from moelight.sampling.params import SamplingParams

log = logging.getLogger(__name__)


def engine_device(device: str | None) -> str | None:
    """moelight's --device for lm-eval's `device` ("cuda:0" and the like name the GPU: cuda); None: the
    engine's default. Checked before any load, so a typo costs nothing."""
    if device is None:
        return None
    name = str(device).strip().lower()
    if name in DEVICES:
        return name
    if re.fullmatch(r"cuda:\d+", name):
        return "cuda"
    raise OptionError(f"--device {device!r} is not one of the valid choices: {', '.join(DEVICES)} "
                      "(or cuda:N, taken as cuda)")


@register_model("moelight")
class MoelightLM(TemplateLM):
    def __init__(self, pretrained: str = "tiny", add_bos_token: bool | None = None, max_length: int | None = None,
                 max_gen_toks: int = 256, batch_size=None, max_batch_size=None, device=None,
                 **engine_options) -> None:
        """`pretrained`: a model folder or preset; `engine_options`: LLM's (dtype, load_format, ...).
        `batch_size` and `max_batch_size` are lm-eval's generic arguments, ignored: the planner decides
        the batch. `device` is
        the engine's (auto, cpu, cuda, emulated; lm-eval's "cuda:N" is cuda); others are refused."""
        super().__init__()
        engine_options = {k: v for k, v in engine_options.items() if v is not None}
        if device is not None:
            engine_options["device"] = engine_device(device)
        self.llm = LLM(pretrained, **engine_options)
        self.tokenizer = self.llm.tokenizer
        self.add_bos_token = add_bos_token
        context = self.llm.max_model_len  # the model's context, or LLM's max_model_len below it
        self._max_length = min(max_length or context - 1, context - 1)  # a prompt must leave one slot
        self.max_gen_toks = max_gen_toks

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.tokenizer.bos_id if self.tokenizer.bos_id is not None else self.tokenizer.eos_id

    @property
    def max_length(self) -> int:
        return self._max_length

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        add = add_special_tokens if add_special_tokens is not None else self.add_bos_token
        bos = self._bos_text()
        if add_special_tokens is None and bos and string.startswith(bos):  # hf's: the text has its BOS already
            add = False
        ids = self.tokenizer.encode(string, add_bos=add is not False)
        bos_id = self.tokenizer.bos_id
        if add and self.add_bos_token and bos_id is not None and ids[:1] != [bos_id]:
            ids = [bos_id, *ids]  # add_bos_token=True: BOS even where the tokenizer adds none (hf sets it so)
        return ids

    def _bos_text(self) -> str:
        if self.tokenizer.bos_id is None:
            return ""
        if hasattr(self.tokenizer, "backend"):  # a tokenizer.json: BOS as its text, as transformers decodes it
            return self.tokenizer.decode([self.tokenizer.bos_id], skip_special_tokens=False)
        return ""

    def _score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(sum of the continuation's logprobs, all greedy) for (context, continuation) token pairs."""
        prompts, params, conts = [], [], []
        for context, continuation in pairs:
            full = (context + continuation)[-(self.max_length + 1):]
            prompts.append({"prompt_token_ids": full[:-1]})
            params.append(SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, logprobs=0,
                                         allowed_token_ids=[full[-1]]))
            conts.append(min(len(continuation), len(full) - 1))
        scores = []
        for out, n in zip(self.llm.generate(prompts, params), conts, strict=True):
            ids, lps = out.prompt_token_ids, out.prompt_logprobs
            last = out.outputs[0].logprobs[0][out.outputs[0].token_ids[0]]
            scored = [lps[i][ids[i]] for i in range(len(ids) - n + 1, len(ids))] + [last]
            scores.append((sum(lp.logprob for lp in scored), all(lp.rank == 1 for lp in scored)))
        return scores

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        for key, _, continuation in requests:  # hf asserts both; moelight scored a context token or a cut one
            if not continuation or len(continuation) > self.max_length:
                what = "encodes to no tokens" if not continuation else \
                    f"is {len(continuation)} tokens, more than the model's max_length of {self.max_length}"
                raise PromptError(f"loglikelihood request {key!r}: the continuation {what}, so it cannot be "
                                  "scored (lm-eval's hf model refuses it too); check the task's choices, "
                                  "target_delimiter and chat template")
        return self._score([(context, continuation) for _, context, continuation in requests])

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owner = [], []
        for i, (text,) in enumerate(req.args for req in requests):
            for context, continuation in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((context, continuation))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owner, self._score(windows), strict=True):
            totals[i] += logprob
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        prompts, params = [], []
        for req in requests:
            context, gen_kwargs = req.args
            kwargs = dict(gen_kwargs)
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_tokens = generation_budget(kwargs, self.max_gen_toks)
            if max_tokens >= self.max_length:  # hf asserts it: no room would be left for the context
                raise OptionError(f"task {req.task_name}: a generation budget of {max_tokens} tokens (max_gen_toks) "
                                  f"leaves no room for the context in the model's max_length of {self.max_length}; "
                                  "lower the task's max_gen_toks (or the model's, in model_args)")
            ids = self.tok_encode(context)[-(self.max_length - max_tokens):]  # hf's max_ctx_len
            prompts.append({"prompt_token_ids": ids})
            params.append(SamplingParams(max_tokens=max_tokens, stop=[u for u in until if u] or None,
                                         **generation_sampling(kwargs)))
        return [self._continuation_text(out.outputs[0].token_ids, until)
                for out in self.llm.generate(prompts, params)]

    def _continuation_text(self, token_ids: list[int], until: list[str]) -> str:
        """hf's text of a generation: its tokens decoded alone (a Llama-style decoder drops a leading
        space there, and a cut character stays U+FFFD), cut at the first of the until strings."""
        text = self.tokenizer.decode(list(token_ids), True)
        for term in until:
            if term:
                text = text.split(term)[0]
        return text

    # ---- chat templates (lm-eval's apply_chat_template=True) ----
    @property
    def tokenizer_name(self) -> str:
        return str(self.llm.options.model).replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        templates = getattr(self.tokenizer, "chat_templates", None)
        if isinstance(templates, dict) and isinstance(chat_template, str):
            return templates.get(chat_template)
        return getattr(self.tokenizer, "chat_template", None)

    def apply_chat_template(self, chat_history: list[dict], add_generation_prompt: bool = True) -> str:
        """As lm-eval's `hf` model: without a generation prompt (a task's gen_prefix) the last message is
        left open to continue; a template that refuses the conversation is tried once more without its
        system message (a system_instruction or task description), with a warning."""
        try:
            return self._render_chat(chat_history, add_generation_prompt)
        except TokenizerError:
            if not any(message.get("role") == "system" for message in chat_history):
                raise
        log.warning("the chat template refused the conversation: trying it without the system message "
                    "(as lm-eval's hf model does)")
        return self._render_chat([m for m in chat_history if m.get("role") != "system"], add_generation_prompt)

    def _render_chat(self, chat_history: list[dict], add_generation_prompt: bool) -> str:
        if add_generation_prompt:
            return self.tokenizer.render_chat(chat_history, add_generation_prompt=True)
        return self.tokenizer.apply_chat_template(chat_history, add_generation_prompt=False, tokenize=False,
                                                  continue_final_message=True)


# lm-eval's generation settings that carry over (HF generate's names, as its `hf` model passes them on)
_SAMPLING_KWARGS = {"top_k": int, "top_p": float, "min_p": float, "repetition_penalty": float}
# lm-eval's names for the generation budget, first wins (normalize_gen_kwargs' order)
MAX_TOKENS_KWARGS = ("max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens")


def generation_budget(kwargs: dict, default: int) -> int:
    """Tokens to generate: the first of lm-eval's aliases set (all taken out of `kwargs`), else `default`.
    lm-eval's normalize_gen_kwargs accepts the four names, and its hf model honours any of them."""
    given = [kwargs.pop(name, None) for name in MAX_TOKENS_KWARGS]
    return int(next((v for v in given if v is not None), default))


def generation_sampling(kwargs: dict) -> dict:
    """SamplingParams fields of a task's generation_kwargs (until and the budget taken out), by lm-eval's
    normalize_gen_kwargs (its hf and vllm models follow it): sampling if do_sample, or if do_sample is
    unset and temperature > 0; greedy otherwise. A setting moelight cannot honour is refused, not dropped."""
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    temperature = kwargs.pop("temperature", None)
    sample = bool(kwargs.pop("do_sample", temperature is not None and float(temperature) > 0))
    temperature = 1.0 if temperature is None else float(temperature)  # HF's default when sampling
    picked = {name: kind(kwargs.pop(name)) for name, kind in _SAMPLING_KWARGS.items() if name in kwargs}
    if kwargs:
        raise OptionError(f"generation_kwargs {', '.join(sorted(kwargs))}: moelight cannot honour them; a task's "
                          f"generation_kwargs may hold until, {', '.join(MAX_TOKENS_KWARGS)}, do_sample, "
                          f"temperature, {', '.join(_SAMPLING_KWARGS)}")
    if not sample:  # HF ignores the sampling settings of a greedy generate
        return {"temperature": 0.0} | {k: v for k, v in picked.items() if k == "repetition_penalty"}
    return {"temperature": temperature, **picked}
