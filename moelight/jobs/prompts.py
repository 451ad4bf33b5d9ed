"""A request's prompt made ready to generate: tokenized, checked against the model's context, and
given its SamplingParams. One rule for every front end (`moelight run`, `LLM`, a Ray replica)."""

from __future__ import annotations

from dataclasses import replace

from moelight.errors import PromptError, TokenizerError
from moelight.jobs.job_warnings import JobWarnings
from moelight.sampling.params import SamplingParams, derived_seed, request_seed


def fit_to_context(where: str, ids: list[int], params: SamplingParams, context: int,
                   warnings: JobWarnings | None = None) -> SamplingParams:
    """`params` with max_tokens cut to what the context leaves after the prompt (counted in `warnings`);
    PromptError for an empty prompt or one that fills the context. `where` names the prompt."""
    if not ids:  # vLLM refuses a prompt of no tokens too; blank text with a BOS, or spaces, has some
        raise PromptError(f"{where} is empty: it has no tokens (text this tokenizer encodes to none, or no token "
                          "ids); give it some text or token ids")
    if len(ids) >= context:
        raise PromptError(f"{where} has {len(ids)} tokens, the model's context is {context}: a prompt may have at "
                          f"most {context - 1} tokens, leaving room for at least one generated token; shorten it")
    if params.max_tokens is None:  # asked for whatever the context leaves
        return replace(params, max_tokens=context - len(ids), min_tokens=min(params.min_tokens, context - len(ids)))
    if len(ids) + params.max_tokens > context:
        room = context - len(ids)
        if warnings is not None:
            also = f" (min_tokens {params.min_tokens} too)" if params.min_tokens > room else ""
            warnings.add("max_tokens_cut", f"{where}: {len(ids)} tokens + max_tokens {params.max_tokens} > "
                                           f"context {context}, gets {room}{also}")
        return replace(params, max_tokens=room, min_tokens=min(params.min_tokens, room))
    return params


def seeded(params: SamplingParams, base_seed: int, request_id: str) -> SamplingParams:
    """`params` with its own seed, or the request's (base + crc32(id)): a request's draws then do not
    depend on its batch, its position in the job, or the front end that ran it."""
    return params if params.seed is not None else replace(params, seed=request_seed(base_seed, request_id))


def request_params(r, opts) -> SamplingParams:
    """A dataset request's sampling: its own fields over the job's defaults (RunOptions); ValueError or
    TypeError for a combination SamplingParams refuses."""
    return SamplingParams(
        max_tokens=r.max_new_tokens or opts.gen_len,
        temperature=opts.temperature if r.temperature is None else r.temperature,
        top_p=opts.top_p if r.top_p is None else r.top_p,
        top_k=opts.top_k if r.top_k is None else r.top_k,
        seed=r.seed if r.seed is not None else request_seed(opts.seed, r.id),
        **({"ignore_eos": opts.ignore_eos} | getattr(r, "sampling", {})),  # a record's own ignore_eos wins
    )


def check_prompts(requests, tokenizer, context: int, opts, warnings: JobWarnings | None = None, checker=None):
    """Tokenize every first turn and build its SamplingParams: (prompts, params, problems) where
    problems are (request id, message) for the requests that cannot be generated (a prompt too long,
    sampling the model cannot do: `checker`, a sampling.checks.SamplingChecker); what was changed to
    make a request fit (or to format it) goes to `warnings`."""
    prompts, params, problems = [], [], []
    for r in requests:
        try:
            wanted = request_params(r, opts)
            if checker is not None:
                checker.check(wanted)
        except (ValueError, TypeError) as e:
            problems.append((r.id, f"{r.source or r.id}: {e}"))
            continue
        try:
            ids = tokenizer.encode_request(r) if (r.prompt is not None or r.messages) else []
            if r.followups:  # a later turn is a conversation: it must format now, not after turn 1 ran
                if getattr(tokenizer, "has_chat_template", True) is False:
                    raise TokenizerError(no_template_for_turns(tokenizer))
                first = r.messages or [{"role": "user", "content": r.prompt}]
                tokenizer.apply_chat_template([*first, {"role": "assistant", "content": "..."},
                                               {"role": "user", "content": r.followups[0]}], tools=r.tools,
                                              **r.chat_options)
        except TokenizerError as e:  # e.g. a conversation and no chat template: this request, by its line
            problems.append((r.id, f"{r.source or r.id}: {e}"))
            continue
        beyond = out_of_vocab(ids, checker.vocab_size) if checker is not None else None
        if beyond:
            problems.append((r.id, f"{r.source or r.id}: {beyond}"))
            continue
        try:
            p = fit_to_context(f"{r.source or r.id}: prompt", ids, wanted, context, warnings)
        except PromptError as e:
            problems.append((r.id, str(e)))
            continue
        if warnings is not None:  # (a request skipped above ran nothing to warn of)
            if wanted.n > 1 and wanted.greedy:
                warnings.add("greedy_samples", f"{r.source or r.id}: n={wanted.n}")
            if r.messages and not getattr(tokenizer, "has_chat_template", False):
                warnings.add("chat_without_template", f"{r.source or r.id}: {len(r.messages)} message(s)")
            asked = (r.meta or {}).get("model") if (r.meta or {}).get("url") else None
            if asked and asked != getattr(opts, "model", asked):
                warnings.add("other_model", f"{r.source or r.id}: body.model {asked!r}")
        prompts.append(ids)
        params.append(p)
    return prompts, params, problems


def no_template_for_turns(tokenizer) -> str:
    """Why a question with later turns cannot run on a tokenizer without a chat template, and what to do."""
    return (f"{getattr(tokenizer, 'model_dir', 'the model')}: the tokenizer has no chat_template "
            "(tokenizer_config.json or chat_template.jinja), so a multi-turn question (a later turn: --turn 2, "
            "followups) cannot be formatted; use a checkpoint with a chat template, or ask the first turn alone "
            "(no --turn 2, no followups)")


def out_of_vocab(ids: list[int], vocab: int) -> str | None:
    """What is wrong with a tokenized prompt holding ids the model has no embedding for (a tokenizer with
    more tokens than config.json's vocab_size: not this model's), or None."""
    beyond = sorted({t for t in ids if not 0 <= t < vocab})
    if not beyond:
        return None
    return (f"the tokenizer gives token id(s) {', '.join(map(str, beyond[:5]))}, beyond the model's vocabulary "
            f"(config.json's vocab_size {vocab}: ids 0..{vocab - 1}); use the tokenizer that belongs to this model")


def prompt_error(problems: list[str], remedy: str = "pass --skip-bad-lines to go on without them") -> PromptError:
    """Every bad prompt in one error (the first 20 listed), as a local run and a Ray run report them;
    `remedy`: the way past them in the front end that raises it."""
    more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
    shown = "\n  ".join(problems[:20]) + more
    return PromptError(f"{len(problems)} request(s) cannot be generated:\n  {shown}\nfix them, or {remedy}")


def prepare_prompts(requests, tokenizer, context: int, opts, warnings: JobWarnings | None = None, checker=None):
    """check_prompts, raising for bad prompts unless --skip-bad-lines; (prompts, params, {skipped id: why})."""
    prompts, params, problems = check_prompts(requests, tokenizer, context, opts, warnings, checker)
    if problems and not opts.skip_bad_lines:
        raise prompt_error([m for _, m in problems])
    return prompts, params, dict(problems)


def expand_samples(prompts: list[list[int]], params: list[SamplingParams]):
    """Each request's `n` samples as engine sequences of one sample each: (prompts, params, owners)
    where owners[i] = (request, sample). Sample k of a seeded request draws with seed + k, so the
    samples differ and each is reproducible (a greedy request's samples are equal, as in vLLM)."""
    out_prompts, out_params, owners = [], [], []
    for r, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        if p.n == 1:  # as it is (a copy checks every field again: ~20 us a request)
            out_prompts.append(prompt)
            out_params.append(p)
            owners.append((r, 0))
            continue
        for k in range(p.n):
            seed = None if p.seed is None else derived_seed(p.seed, k)
            out_prompts.append(prompt)
            out_params.append(replace(p, n=1, seed=seed, prompt_logprobs=p.prompt_logprobs if k == 0 else None))
            owners.append((r, k))
    return out_prompts, out_params, owners
