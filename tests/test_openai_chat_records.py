"""Chat records as OpenAI and vLLM's server write them: content parts, tools and tool_choice, tool-call
arguments, and OpenAI Batch input lines with their bodies' fields (vLLM's extra sampling fields too)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workloads import DatasetError, load_dataset, read_dataset


def write_lines(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path

def test_openai_style_content_parts(tmp_path):
    p = write_lines(tmp_path / "d.jsonl", [{"messages": [
        {"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]}]}])
    assert read_dataset(p)[0].messages[0]["content"] == "Hel\nlo"  # vLLM joins a string template's parts so


def _chat_body(**body) -> dict:
    return {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "Hi"}], **body}}


WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def test_tool_choice_as_vllm_takes_it(tmp_path):
    """'auto' renders the tools, 'none' leaves them out of the prompt (vLLM's default), and a choice
    that forces a call is refused by its line: moelight writes the model's text and forces no call."""
    p = write_lines(tmp_path / "t.jsonl", [_chat_body(tools=WEATHER, tool_choice="auto"),
                                           {**_chat_body(tools=WEATHER, tool_choice="none"), "custom_id": "b"}])
    auto, none = load_dataset(p).requests
    assert auto.tools == WEATHER and none.tools is None
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        bad = write_lines(tmp_path / "r.jsonl", [_chat_body(tools=WEATHER, tool_choice=choice)])
        with pytest.raises(DatasetError, match="tool_choice.* is not supported: moelight does not force"):
            load_dataset(bad)
        jsonl = write_lines(tmp_path / "j.jsonl", [{"messages": [{"role": "user", "content": "Hi"}],
                                                    "tools": WEATHER, "tool_choice": choice}])
        with pytest.raises(DatasetError, match="tool_choice"):
            load_dataset(jsonl)


def test_tool_call_arguments_reach_the_template_as_an_object(tmp_path):
    """OpenAI writes a call's arguments as JSON text; vLLM parses them before rendering, so a template's
    `arguments | tojson` is not encoded twice. Text that is no JSON object is left as it is."""
    call = lambda args: {"id": "c1", "type": "function", "function": {"name": "f", "arguments": args}}  # noqa: E731
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None,
                                                "tool_calls": [call('{"city": "Paris"}'), call("not json")]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    p = write_lines(tmp_path / "c.jsonl", [{"messages": msgs}])
    calls = read_dataset(p)[0].messages[1]["tool_calls"]
    assert [c["function"]["arguments"] for c in calls] == [{"city": "Paris"}, "not json"]
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # the caller's left alone


@pytest.mark.parametrize("body,match", [({"top_logprobs": 3}, "'top_logprobs' needs 'logprobs': true"),
                                        ({"stream": True}, "'stream' must be false")])
def test_openai_fields_that_would_do_nothing_are_refused(tmp_path, body, match):
    bad = write_lines(tmp_path / "b.jsonl", [_chat_body(**body)])
    with pytest.raises(DatasetError, match=match):
        load_dataset(bad)


def test_chat_template_fields_are_read_or_refused_by_line(tmp_path):
    """vLLM's chat fields go to the request's template arguments (kwargs over the flags, as vLLM merges
    them); a wrong type, a combination vLLM refuses, or one with nothing to render is refused by its line."""
    kw = {"chat_template_kwargs": {"enable_thinking": False}, "add_generation_prompt": False}
    for i, line in enumerate([_chat_body(**kw), {"messages": [{"role": "user", "content": "Hi"}], **kw}]):
        (r,) = load_dataset(write_lines(tmp_path / f"ok{i}.jsonl", [line])).requests
        assert r.chat_options == {"add_generation_prompt": False, "enable_thinking": False}
        assert "add_generation_prompt" not in r.meta
    user = [{"role": "user", "content": "Hi"}]
    bad = [({"chat_template_kwargs": "x"}, "'chat_template_kwargs' must be an object"),
           ({"add_generation_prompt": "no"}, "'add_generation_prompt' must be true or false"),
           ({"chat_template_kwargs": {"continue_final_message": 1}}, "'chat_template_kwargs.continue_final_message'"),
           ({"continue_final_message": True}, "needs add_generation_prompt false"),
           ({"continue_final_message": True, "add_generation_prompt": True}, "needs add_generation_prompt false"),
           ({"chat_template_kwargs": {"chat_template": "{{ 1 }}"}}, "own chat template is not supported"),
           ({"chat_template_kwargs": {"tools": []}}, "give them as the request's 'tools'")]
    for fields, match in bad:
        lines = [{"custom_id": "a", "body": {"messages": user, **fields}}, {"messages": user, **fields}]
        for i, line in enumerate(lines):
            f = write_lines(tmp_path / f"b{i}.jsonl", [line])
            with pytest.raises(DatasetError, match=f"{f}:1: .*{match}"):
                load_dataset(f)
    no_chat = [({"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "Hi", **kw}}, "need 'messages'"),
               ({"prompt": "Hi", **kw}, "need 'messages'"),
               ({"prompt": "Hi", "followups": ["And?"], "add_generation_prompt": False}, "'followups' ask the model")]
    for i, (line, match) in enumerate(no_chat):
        f = write_lines(tmp_path / f"c{i}.jsonl", [line])
        with pytest.raises(DatasetError, match=f"{f}:1: .*{match}"):
            load_dataset(f)


# ----------------------------------------------------------------------------- OpenAI batch


def test_openai_batch(tmp_path):
    p = write_lines(tmp_path / "batch.jsonl", [
        {"custom_id": "req-1", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "mixtral", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 20,
                  "temperature": 0, "top_p": 1, "seed": 1}},
        {"custom_id": "req-2", "method": "POST", "url": "/v1/completions",
         "body": {"model": "mixtral", "prompt": "Once upon", "max_completion_tokens": 5}},
    ])
    ds = load_dataset(p)
    assert ds.format == "openai"
    r1, r2 = ds.requests
    assert (r1.id, r1.max_new_tokens, r1.temperature, r1.top_p, r1.seed) == ("req-1", 20, 0.0, 1.0, 1)
    assert r1.meta["custom_id"] == "req-1" and r1.meta["model"] == "mixtral"
    assert r1.meta["url"] == "/v1/chat/completions" and r1.meta["input_format"] == "openai"
    assert (r2.prompt, r2.max_new_tokens, r2.meta["url"]) == ("Once upon", 5, "/v1/completions")


VLLM_EXTRAS = {"min_p": 0.5, "repetition_penalty": 1.2, "min_tokens": 3, "stop_token_ids": [7], "ignore_eos": True,
               "include_stop_str_in_output": True, "prompt_logprobs": 1, "allowed_token_ids": [1, 2]}


def test_openai_bodies_and_jsonl_records_take_vllms_extra_sampling_fields(tmp_path):
    """vLLM's server takes its own SamplingParams names in a body (extra parameters): they were dropped
    without a word; a jsonl record's ignore_eos and max_completion_tokens went to its meta."""
    p = write_lines(tmp_path / "batch.jsonl", [
        {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "Hi"}], **VLLM_EXTRAS}},
        {"custom_id": "b", "method": "POST", "url": "/v1/completions", "body": {"prompt": "Hi", **VLLM_EXTRAS}},
    ])
    for r in load_dataset(p).requests:
        assert r.sampling == VLLM_EXTRAS, r.sampling
    q = write_lines(tmp_path / "d.jsonl", [{"prompt": "Hi", "max_completion_tokens": 3, **VLLM_EXTRAS}])
    (r,) = load_dataset(q).requests
    assert r.sampling == VLLM_EXTRAS and r.max_new_tokens == 3 and set(r.meta) <= {"input_format"}, r.meta
    echo = write_lines(tmp_path / "e.jsonl", [{"custom_id": "a", "method": "POST", "url": "/v1/completions",
                                               "body": {"prompt": "Hi", "echo": True}}])
    with pytest.raises(DatasetError, match="'echo' is not supported"):
        load_dataset(echo)
    for field in ({"guided_choice": ["yes", "no"]}, {"best_of": 4}, {"use_beam_search": True},
                  {"truncate_prompt_tokens": 8}):
        bad = write_lines(tmp_path / "g.jsonl", [{"prompt": "Hi", **field}])
        with pytest.raises(DatasetError, match=f"{next(iter(field))} not supported"):
            load_dataset(bad)
    both = write_lines(tmp_path / "m.jsonl", [{"prompt": "Hi", "max_tokens": 3, "max_completion_tokens": 5}])
    assert load_dataset(both).requests[0].max_new_tokens == 5  # vLLM's rule, as in an OpenAI body


def test_openai_batch_bad_records(tmp_path):
    p = write_lines(tmp_path / "batch.jsonl", [
        {"custom_id": "ok", "body": {"messages": [{"role": "user", "content": "Hi"}]}},
        {"custom_id": "x", "method": "GET", "url": "/v1/chat/completions", "body": {"prompt": "a"}},
        {"custom_id": "y", "url": "/v1/embeddings", "body": {"input": "a"}},
        {"custom_id": "z", "body": {"messages": [{"role": "user", "content": "a"}], "n": 0}},  # n >= 1
        {"custom_id": "w", "body": {"messages": [{"role": "user", "content": "a"}], "max_tokens": "10"}},
        {"custom_id": "v", "body": {}},
        {"custom_id": "ok", "body": {"prompt": "dup"}},
    ])
    with pytest.raises(DatasetError) as e:
        read_dataset(p)
    msg = str(e.value)
    for line, text in [(2, "'method'"), (3, "'url'"), (4, "'n' must be in [1"), (5, "max_tokens"), (6, "body.messages"),
                       (7, "duplicate id 'ok'")]:
        assert f"{p}:{line}: " in msg and text in msg, (line, msg)
    assert f"{p}:1:" not in msg


def test_a_bodys_cache_salt_is_taken_as_llm_generate_takes_it(tmp_path):
    """vLLM's server takes cache_salt (a non-empty string), as LLM.generate does: read, not warned of as an
    ignored field (moelight's prefix cache lives for one job, so there is nothing to isolate); a bad one is
    refused by its line, as vLLM answers 400."""
    p = write_lines(tmp_path / "s.jsonl", [_chat_body(cache_salt="tenant-a")])
    loaded = load_dataset(p)
    assert [r.id for r in loaded.requests] == ["a"] and loaded.warnings == []
    for salt in ("", 3):
        bad = write_lines(tmp_path / "b.jsonl", [_chat_body(cache_salt=salt)])
        with pytest.raises(DatasetError, match=f"{bad}:1: body.cache_salt must be a non-empty string"):
            read_dataset(bad)
