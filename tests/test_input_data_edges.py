"""Input data that used to slip past the readers and go wrong after the model loaded: NaN sampling values,
meta values JSON cannot hold, lone surrogates outside the prompt, compressed or UTF-16 files, CR line
endings. Each is refused (or read) before any model loads, by its file and line."""

from __future__ import annotations

from pathlib import Path

import pytest

from moelight.sampling.params import SamplingParams
from workloads import load_dataset


def _jsonl(path: Path, *lines: str) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


@pytest.mark.parametrize("record", [
    '{"prompt": "a", "temperature": NaN}',
    '{"prompt": "a", "top_p": NaN}',
    '{"prompt": "a", "min_p": NaN}',
    '{"prompt": "a", "presence_penalty": NaN}',
    '{"prompt": "a", "logit_bias": {"3": NaN}}',
    '{"custom_id": "c", "body": {"prompt": "a", "temperature": NaN}}',
])
def test_a_nan_sampling_value_is_a_bad_record(tmp_path, record):
    data = _jsonl(tmp_path / "d.jsonl", record, record.replace("NaN", "0.5"))
    loaded = load_dataset(data, skip_bad_lines=True)
    assert len(loaded.requests) == 1 and loaded.skipped[0].where == f"{data}:1", loaded.skipped
    assert "nan" in loaded.skipped[0].message.lower()


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                                   "repetition_penalty"])
def test_sampling_params_refuse_nan(field):
    with pytest.raises(ValueError, match=f"{field} must be a number, got nan"):
        SamplingParams(**{field: float("nan")})
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: float("nan")})
