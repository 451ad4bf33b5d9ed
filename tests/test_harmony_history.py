"""A harmony (GPT-OSS) answer reaches the next turn's history as its final channel, as openai-harmony and
vLLM's server parse it, not as its text without special tokens ("analysis...assistantfinal..."); an answer
with no final channel keeps what the model wrote after its last <|message|>, counted in the report."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from moelight.engine.sequence import SequenceResult
from moelight.jobs.report import RunReport
from moelight.jobs.serving import PreparedJob, generate_prepared
from moelight.sampling.params import SamplingParams
from moelight.tokenization.harmony import final_channel, is_harmony
from moelight.tokenization.tokenizer import load_tokenizer
from tests.chat_template_cases import FAMILIES, family_tokenizer
from workloads import Request

ANSWERED = "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Bonjour<|return|>"
CUT = "<|channel|>analysis<|message|>Still thinking"


@pytest.mark.parametrize("text,want", [
    (ANSWERED, ("Bonjour", True)),
    ("<|channel|>final <|constrain|>json<|message|>{}<|end|>", ("{}", True)),
    ("<|channel|>final<|message|>Cut sho", ("Cut sho", True)),  # cut inside the final channel: still the answer
    (CUT, ("Still thinking", False)),
    ("<|channel|>commentary to=functions.f<|message|>{\"a\": 1}<|call|>", ('{"a": 1}', False)),
    ("no tags", ("no tags", False)),
])
def test_final_channel(text, want):
    assert final_channel(text) == want


@pytest.fixture(scope="module")
def harmony(tmp_path_factory):
    template, special, plain, config = FAMILIES["harmony"]
    return load_tokenizer(family_tokenizer(tmp_path_factory.mktemp("harmony"), template, special, plain, **config))


class _Session:
    """Answers each round with the scripted completions and keeps the prompts it was given."""

    def __init__(self, tokenizer, answers: list[list[str]]):
        self.tokenizer, self.answers, self.prompts = tokenizer, answers, []
        self.config = SimpleNamespace(max_position_embeddings=4096, context_length=4096)

    def engine(self, plan, prompts, params, turn):
        return self

    def generate(self, prompts, params, offsets, batch, micro, on_finish, stats):
        answers = self.answers[len(self.prompts)]
        self.prompts.append(prompts)
        for i, text in enumerate(answers):
            ids = self.tokenizer.encode(text, add_bos=False)
            on_finish(SequenceResult(i, ids, "stop", text=self.tokenizer.decode(ids)))


def test_a_later_turn_holds_the_harmony_answers_final_channel(harmony):
    assert is_harmony(harmony)
    requests = [Request(id=str(i), messages=[{"role": "user", "content": "Hi"}], followups=["And?"]) for i in (0, 1)]
    params = [SamplingParams(max_tokens=8, temperature=0.0)] * 2
    prompts = [harmony.encode_request(r) for r in requests]
    session = _Session(harmony, [[ANSWERED, CUT], ["Fin", "Fin"]])
    job = PreparedJob(requests, prompts, params, SimpleNamespace(batch_size=2, micro_batch_size=2),
                      RunReport("m", "float32", 2, 2, 2))
    written: list[dict] = []
    generate_prepared(session, SimpleNamespace(model="m", turn=2), job, SimpleNamespace(write=written.append))
    for prompt, answer in zip(session.prompts[1], ("Bonjour", "Still thinking"), strict=True):
        history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": answer},
                   {"role": "user", "content": "And?"}]
        assert prompt == harmony.apply_chat_template(history)
    assert job.report.warnings["counts"] == {"harmony_without_final": 1}
    assert written[0]["turns"][0]["output"] == "analysisThink.assistantfinalBonjour"  # the record's text: vLLM's
