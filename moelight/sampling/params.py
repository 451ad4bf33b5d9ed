"""Sampling parameters in vLLM's names and semantics, and the per-request seed rule both front ends share.

What each field does, in the order the sampler applies it (as vLLM's v1 sampler does):
logprobs are taken from the model's raw logits (float32 log-softmax, before any transform); then
`allowed_token_ids`, `bad_words`, `min_tokens` (EOS and stop tokens banned until then) and
`logit_bias`; then `repetition_penalty` (prompt and output tokens; a positive logit divided, a
negative one multiplied), `frequency_penalty` (minus penalty x count in the output) and
`presence_penalty` (minus penalty once a token is in the output); then a structured-output
grammar's token mask; then greedy argmax (temperature 0), or temperature, `min_p` (tokens below
min_p x the top probability dropped), `top_k`, `top_p`, and a draw from the request's generator.
`stop` strings are matched on the detokenized text as it grows; the text is cut before the stop
string unless `include_stop_str_in_output`.
"""

from __future__ import annotations

import copy
import math
import zlib
from dataclasses import dataclass, field

# vLLM's default max_logprobs: top-k per token (and per prompt token) asked for at most; one definition with
# the dataset reader's, which may not import moelight
from workloads.readers.sampling_options import MAX_LOGPROBS

# torch's generators take seeds in [-2^63, 2^64); a negative one draws as its value mod 2^64
SEED_MIN, SEED_SPAN = -(2**63), 2**64
GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS: a temperature under it samples greedily
FLOAT_FIELDS = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p")
# the fields vLLM's from_optional reads None as their default (an OpenAI request leaves them out as None)
OPTIONAL_FIELDS = ("n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p",
                   "stop_token_ids")
LOGIT_BIAS_LIMIT = 100.0  # from_optional clamps each bias to +-100, as vLLM's does


@dataclass
class StructuredOutputsParams:
    """vLLM's `StructuredOutputsParams`: exactly one constraint — a JSON schema (a dict, its JSON
    text, or True: any JSON value, as JSON Schema reads a boolean schema), any JSON object, a regex,
    one of several strings, or an EBNF grammar."""

    json: dict | str | bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError("structured_outputs takes exactly one of json, regex, choice, grammar, json_object; "
                             f"got {', '.join(given) or 'none'}")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            raise TypeError(f"structured_outputs.choice must be a non-empty list of strings, got {self.choice!r}")
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise TypeError(f"structured_outputs.{name} must be a string")
        if self.json is not None and not isinstance(self.json, (dict, str, bool)):
            raise TypeError("structured_outputs.json must be a JSON schema (a dict, its JSON text, or True)")

    def key(self) -> tuple:
        """What compiles to one grammar: equal keys share one compiled grammar."""
        import json as _json

        schema = _json.dumps(self.json) if isinstance(self.json, (dict, bool)) else self.json
        return (schema, self.regex, tuple(self.choice) if self.choice else None, self.grammar, bool(self.json_object))


@dataclass
class SamplingParams:
    """temperature 0 (below 1e-5) means greedy; top_k 0 or -1 disables top-k; seed makes a request reproducible;
    max_tokens None: as many as the model's context leaves after the prompt (vLLM's None)."""

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None  # -1 is None, as in vLLM
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = field(default_factory=list)  # None is [], as in vLLM
    n: int = 1
    stop: str | list[str] | None = None
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    detokenize: bool = True  # False: token ids only, the text left empty (vLLM's)
    # vLLM's; it spaces special tokens for slow (Python) tokenizers only: a tokenizer.json decodes as it is
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None  # vLLM's: the prompt's last k tokens only (-1: max_model_len)

    def __post_init__(self) -> None:
        self._read_vllm_spellings()
        if self.max_tokens is not None:
            _check_type("max_tokens", self.max_tokens, int)
        _check_type("temperature", self.temperature, float)
        _check_type("top_p", self.top_p, float)
        _check_type("top_k", self.top_k, int)
        _check_type("ignore_eos", self.ignore_eos, bool)
        _check_type("n", self.n, int)
        _check_type("min_tokens", self.min_tokens, int)
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"):
            _check_type(name, getattr(self, name), float)
        for name in ("include_stop_str_in_output", "skip_special_tokens", "detokenize",
                     "spaces_between_special_tokens"):
            _check_type(name, getattr(self, name), bool)
        for name in ("seed", "logprobs", "prompt_logprobs", "truncate_prompt_tokens"):
            if getattr(self, name) is not None:
                _check_type(name, getattr(self, name), int)
        _check_ints("stop_token_ids", self.stop_token_ids)
        if self.allowed_token_ids is not None:
            _check_ints("allowed_token_ids", self.allowed_token_ids)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and (not isinstance(self.stop, list) or not all(isinstance(s, str) and s
                                                                                 for s in self.stop)):
            raise TypeError(f"stop must be a string or a list of non-empty strings, got {self.stop!r}")
        if self.bad_words is not None and (not isinstance(self.bad_words, list)
                                           or not all(isinstance(w, str) and w.strip() for w in self.bad_words)):
            raise TypeError(f"bad_words must be a list of non-empty strings, got {self.bad_words!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise TypeError(f"logit_bias must be a dict of token id -> bias, got {type(self.logit_bias).__name__}")
            if any(isinstance(k, bool) for k in self.logit_bias):  # True is an int in Python, not a token id
                raise TypeError(f"logit_bias keys must be token ids (ints), got a bool in {self.logit_bias!r}")
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError):
                raise TypeError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}") from None
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise TypeError("structured_outputs must be a StructuredOutputsParams")
        self._check_values()

    def _read_vllm_spellings(self) -> None:
        """Values vLLM's SamplingParams takes for others, so a vLLM script means the same here: seed -1 is no
        seed (each request its own draws, not one shared seed), stop_token_ids None is none, logprobs /
        prompt_logprobs True is 1 and False is None (no logprobs, what a script writing False means; vLLM
        reads the bool as the int 0, the sampled token's logprob alone), and a tuple of stop strings or stop
        ids is a list."""
        if isinstance(self.seed, int) and self.seed == -1:  # True / False are 1 / 0, never -1
            self.seed = None
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, tuple):
            self.stop_token_ids = list(self.stop_token_ids)
        if isinstance(self.stop, tuple):
            self.stop = list(self.stop)
        for name in ("logprobs", "prompt_logprobs"):
            if isinstance(getattr(self, name), bool):
                setattr(self, name, 1 if getattr(self, name) else None)

    def _check_values(self) -> None:
        floats = {name: getattr(self, name) for name in FLOAT_FIELDS}
        floats.update({f"logit_bias[{k}]": b for k, b in (self.logit_bias or {}).items()})
        for name, v in floats.items():
            if v != v:  # NaN passes every range test below (each comparison is false)
                raise ValueError(f"{name} must be a number, got nan")
        if self.seed is not None and not SEED_MIN <= self.seed < SEED_SPAN:
            raise ValueError(f"seed must be in [-2^63, 2^64) (a 64-bit seed; -1 or None: none), got {self.seed}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1 (or None: what the context leaves), got {self.max_tokens}")
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if not 0 <= self.temperature < math.inf:  # inf: masked logits (-inf / inf) would turn to NaN mid-job
            raise ValueError(f"temperature must be >= 0 and finite, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 <= self.min_tokens <= (self.max_tokens if self.max_tokens is not None else self.min_tokens):
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True (they are found in the text); use stop_token_ids")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0 < self.repetition_penalty < math.inf:
            raise ValueError(f"repetition_penalty must be > 0 and finite, got {self.repetition_penalty}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}] (the top-k returned per token), got {k}")
        if self.truncate_prompt_tokens is not None and (self.truncate_prompt_tokens == 0
                                                        or self.truncate_prompt_tokens < -1):
            raise ValueError("truncate_prompt_tokens must be >= 1 (the prompt's last k tokens) or -1 (max_model_len), "
                             f"got {self.truncate_prompt_tokens}")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("allowed_token_ids must not be empty")

    @staticmethod
    def from_optional(**kwargs) -> SamplingParams:
        """vLLM's: SamplingParams from a request whose unset fields are None (n, the penalties, temperature,
        top_p, stop_token_ids take their defaults), logit_bias keys made ints and biases clamped to [-100, 100]."""
        kwargs = {k: v for k, v in kwargs.items() if not (k in OPTIONAL_FIELDS and v is None)}
        bias = kwargs.get("logit_bias")
        if isinstance(bias, dict):
            try:
                kwargs["logit_bias"] = {int(t): min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, float(b)))
                                        for t, b in bias.items()}
            except (TypeError, ValueError):
                raise TypeError(f"logit_bias must map token ids to numbers, got {bias!r}") from None
        return SamplingParams(**kwargs)

    def clone(self) -> SamplingParams:
        """vLLM's: a deep copy, so changing it (or its lists) leaves this one as it is."""
        return copy.deepcopy(self)

    @property
    def greedy(self) -> bool:
        """Temperatures below vLLM's 1e-5 are greedy: dividing by them overflows the logits to inf."""
        return self.temperature < GREEDY_BELOW

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1.0

    @property
    def has_processors(self) -> bool:
        """Anything to apply to the logits before sampling, beyond temperature and top-k/top-p."""
        return bool(self.allowed_token_ids or self.bad_words or self.min_tokens or self.logit_bias
                    or self.has_penalties or self.structured_outputs is not None)


def _check_type(name: str, value, kind: type) -> None:
    """TypeError in vLLM's manner for a field of the wrong type (a float field takes an int too)."""
    if kind is bool:
        ok = isinstance(value, bool)
    elif isinstance(value, bool):  # True is an int in Python, not a token count
        ok = False
    else:
        ok = isinstance(value, int) if kind is int else isinstance(value, (int, float))
    if not ok:
        raise TypeError(f"{name} must be {'a' if kind is not int else 'an'} {kind.__name__}, got "
                        f"{type(value).__name__} {value!r}")


def _check_ints(name: str, values) -> None:
    if not isinstance(values, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in values):
        raise TypeError(f"{name} must be a list of ints, got {values!r}")


def request_seed(base_seed: int, request_id: str) -> int:
    """The seed of a request that sets none: base + crc32(id), so a request's draws do not depend
    on which other requests share its batch, nor on the front end that started the job."""
    return derived_seed(base_seed, zlib.crc32(request_id.encode()))


def derived_seed(seed: int, offset: int) -> int:
    """seed + offset as the 64-bit seed torch draws with (mod 2^64: the same draws for a negative sum), so a
    sum of -1 stays a seed when it is copied into SamplingParams, where -1 means none."""
    return (seed + offset) % SEED_SPAN
