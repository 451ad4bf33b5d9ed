"""MT-Bench ``question.jsonl`` (FastChat llm_judge): ``question_id``, ``category``, ``turns``.

MoE-Lightning evaluates on the first turn; ``turn=k`` asks the first k turns as one
conversation (turn 1 as the prompt, the rest as follow-ups answered in order).
"""

from __future__ import annotations

from ..request import Request
from .fields import RecordError, get_id


def looks_like_mtbench(obj: dict) -> bool:
    return "turns" in obj and ("question_id" in obj or "category" in obj)


def parse_mtbench(obj: dict, where: str, lineno: int, turn: int = 1) -> Request:
    if obj.get("question_id") is None:
        raise RecordError("missing required field 'question_id'")
    qid = get_id(obj, "question_id", "")
    turns = obj.get("turns")
    if turns is None:
        raise RecordError("missing required field 'turns'")
    if not isinstance(turns, list) or not turns:
        raise RecordError("field 'turns' must be a non-empty list of strings")
    for i, t in enumerate(turns):
        if not isinstance(t, str):
            raise RecordError(f"turns[{i}] must be a string, got {type(t).__name__}")  # blank is a turn, as in vLLM
    if len(turns) < turn:
        raise RecordError(f"turn {turn} asked but the question has {len(turns)} turn(s)")
    category = obj.get("category")
    if category is not None and not isinstance(category, str):
        raise RecordError(f"field 'category' must be a string, got {type(category).__name__}")
    meta = {"question_id": obj["question_id"], "category": category, "turn": turn}
    return Request(
        id=qid,
        messages=[{"role": "user", "content": turns[0]}],
        followups=list(turns[1:turn]),
        source=where,
        meta=meta,
    )
