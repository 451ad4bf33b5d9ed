"""`LLM.chat` reads its messages as `moelight run` reads a dataset's (workloads' parse_messages, one
path): OpenAI's text content parts joined by newlines and a tool call's JSON-text arguments made an
object before the template sees them, as vLLM hands them over; a bad message is a ValueError."""

from __future__ import annotations

import json

import pytest

from moelight import LLM, SamplingParams

pytest.importorskip("transformers")

from tests.checkpoints import make_hf_model, save_checkpoint  # noqa: E402
from tests.test_tokenizer import build_tokenizer  # noqa: E402

GREEDY = SamplingParams(max_tokens=1, temperature=0.0)
PARTS = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]
# ChatML with tool calls written through tojson, as Qwen-style templates write an object's arguments
TOJSON = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] %}{{ m['content'] }}{% endif %}"
          "{% for tc in m.tool_calls or [] %}<tool_call>{{ tc.function.arguments | tojson }}</tool_call>{% endfor %}"
          "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tool_turns(arguments) -> list[dict]:
    return [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    out = save_checkpoint(make_hf_model(vocab_size=512), tmp_path_factory.mktemp("m") / "m", byte_tokenizer=False)
    return build_tokenizer(out)


@pytest.fixture(scope="module")
def llm(folder) -> LLM:
    return LLM(str(folder), dtype="float32", hardware="cpu-server")


def test_content_parts_are_joined_as_moelight_run_joins_them(llm, folder, tmp_path):
    from typer.testing import CliRunner

    from moelight.cli import app

    out = llm.chat(PARTS, GREEDY)[0]
    assert out.prompt_token_ids == llm.chat([{"role": "user", "content": "Hi\nthere"}], GREEDY)[0].prompt_token_ids
    data, written = tmp_path / "d.jsonl", tmp_path / "o.jsonl"
    data.write_text(json.dumps({"id": "0", "messages": PARTS, "max_tokens": 1, "temperature": 0}) + "\n")
    r = CliRunner().invoke(app, ["run", "--dataset", str(data), "--model", str(folder), "--output", str(written),
                                 "--dtype", "float32", "--hardware", "cpu-server", "--no-progress"])
    assert r.exit_code == 0, r.output
    assert json.loads(written.read_text())["prompt_tokens"] == len(out.prompt_token_ids)


def test_tool_call_arguments_reach_the_template_once_encoded(llm):
    as_text = llm.chat(tool_turns('{"city": "Paris"}'), GREEDY, chat_template=TOJSON)[0]
    as_object = llm.chat(tool_turns({"city": "Paris"}), GREEDY, chat_template=TOJSON)[0]
    assert '<tool_call>{"city": "Paris"}</tool_call>' in as_text.prompt
    assert as_text.prompt_token_ids == as_object.prompt_token_ids


@pytest.mark.parametrize("conversation, tools, needle", [
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], None,
     "only text content parts are supported, got 'image_url'"),
    ([{"role": "user", "content": 3}], None, r"conversations\[0\]\[0\]: content must be a string"),
    (PARTS, {"name": "f"}, "field 'tools' must be a list of tool objects"),
])
def test_bad_messages_and_tools_are_value_errors(llm, conversation, tools, needle):
    with pytest.raises(ValueError, match=needle):
        llm.chat(conversation, GREEDY, tools=tools)


def test_a_conversation_without_a_user_turn_is_the_templates_to_judge(llm):
    """vLLM's LLM.chat renders a system prompt alone, or an assistant turn to continue; a dataset's
    conversation needs a user turn (it is a prompt), LLM.chat's does not."""
    ChatML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    alone = llm.chat([{"role": "system", "content": "You write haiku."}], GREEDY, chat_template=ChatML)[0]
    assert alone.prompt.startswith("<|im_start|>system\nYou write haiku.")
    cont = llm.chat([{"role": "assistant", "content": "Once upon"}], GREEDY, chat_template=ChatML,
                    add_generation_prompt=False, continue_final_message=True)[0]
    assert cont.prompt.endswith("Once upon")
