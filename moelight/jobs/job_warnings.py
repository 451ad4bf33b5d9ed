"""What a job did that the user did not ask for, counted for the summary and the report: nothing is
degraded silently."""

from __future__ import annotations

from dataclasses import dataclass, field

KINDS = {
    "max_tokens_cut": "max_tokens cut so prompt + answer fit the model's context",
    "chat_without_template": "chat messages formatted without a chat template (the tokenizer has none): a lone user "
                             "turn as its text, the byte tokenizer's turns in its minimal <|role|> format",
    "turn_does_not_fit": "a later turn does not fit the model's context: the conversation ends before it",
    "harmony_without_final": "a harmony (GPT-OSS) answer without a final channel (cut by max_tokens, or a tool "
                             "call): the next turn's history holds what it wrote after its last <|message|>",
    "other_model": "an OpenAI body names another model than --model: answered by --model's, whose name the "
                   "output's body.model carries",
    "greedy_samples": "n > 1 at temperature 0 (greedy, the job's --temperature default where a record sets none): "
                      "the n samples are the same; give the records or --temperature a temperature",
}
EXAMPLES = 3  # kept per kind


@dataclass
class JobWarnings:
    counts: dict[str, int] = field(default_factory=dict)
    examples: dict[str, list[str]] = field(default_factory=dict)

    def add(self, kind: str, example: str) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1
        shown = self.examples.setdefault(kind, [])
        if len(shown) < EXAMPLES:
            shown.append(example)

    def absorb(self, other: JobWarnings | dict) -> None:
        other = other if isinstance(other, JobWarnings) else JobWarnings(**other) if other else JobWarnings()
        for kind, n in other.counts.items():
            self.counts[kind] = self.counts.get(kind, 0) + n
            room = EXAMPLES - len(self.examples.setdefault(kind, []))
            self.examples[kind] += other.examples.get(kind, [])[:max(0, room)]

    def to_dict(self) -> dict:
        return {"counts": dict(self.counts), "examples": {k: list(v) for k, v in self.examples.items()}}

    def lines(self) -> list[str]:
        return [f"{n} request(s): {KINDS.get(kind, kind)} (e.g. {self.examples[kind][0]})"
                for kind, n in self.counts.items() if n]
