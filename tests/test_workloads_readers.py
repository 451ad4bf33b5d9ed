"""Dataset readers: every format, replication, and every kind of bad input."""

from __future__ import annotations

import json
import logging
import os
import statistics
import threading
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from workloads import (
    DatasetError,
    Request,
    load_dataset,
    mtbench_like_lengths,
    read_dataset,
    synthetic_prompts,
    synthetic_requests,
)

MTBENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "mtbench" / "question.jsonl"
if not MTBENCH.exists():
    MTBENCH = Path("/work/shared/data/mtbench/question.jsonl")
needs_mtbench = pytest.mark.skipif(not MTBENCH.exists(), reason="shared MT-Bench file not present")


def write_lines(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


# ----------------------------------------------------------------------------- MT-Bench


@needs_mtbench
def test_mtbench_real_file_first_turn():
    reqs = read_dataset(MTBENCH)
    assert len(reqs) == 80
    assert len({r.id for r in reqs}) == 80
    cats = {r.meta["category"] for r in reqs}
    assert cats == {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
    assert all(sum(r.meta["category"] == c for r in reqs) == 10 for c in cats)
    r = reqs[0]
    assert r.id == "81" and r.meta["question_id"] == 81 and r.meta["input_format"] == "mtbench"
    assert r.messages == [{"role": "user", "content": r.text}] and r.followups == []
    assert r.prompt is None and r.source.endswith("question.jsonl:1")


@needs_mtbench
def test_mtbench_turn_2_and_explicit_format():
    reqs = read_dataset(MTBENCH, format="mtbench", turn=2)
    assert len(reqs) == 80
    first = json.loads(MTBENCH.read_text().splitlines()[0])
    assert reqs[0].messages == [{"role": "user", "content": first["turns"][0]}]
    assert reqs[0].followups == [first["turns"][1]]
    with pytest.raises(DatasetError, match="turn 3 asked"):
        read_dataset(MTBENCH, turn=3)


@needs_mtbench
def test_mtbench_replication_and_truncation():
    reqs = read_dataset(MTBENCH, num_requests=200)
    assert len(reqs) == 200 and len({r.id for r in reqs}) == 200
    assert reqs[0].id == "81#0" and reqs[80].id == "81#1" and reqs[199].id == "120#2"
    assert reqs[80].messages == reqs[0].messages and reqs[80].messages is not reqs[0].messages
    assert reqs[80].meta["original_id"] == "81"
    few = read_dataset(MTBENCH, num_requests=5)
    assert [r.id for r in few] == ["81", "82", "83", "84", "85"]


def test_mtbench_small_file(tmp_path):
    p = write_lines(tmp_path / "q.jsonl", [
        {"question_id": 1, "category": "math", "turns": ["What is 2+2?", "And 3+3?"]},
        {"question_id": 2, "category": "stem", "turns": ["Why is the sky blue?"]},
    ])
    assert [r.text for r in read_dataset(p)] == ["What is 2+2?", "Why is the sky blue?"]
    with pytest.raises(DatasetError) as e:
        read_dataset(p, turn=2)
    assert f"{p}:2" in str(e.value) and "1 turn(s)" in str(e.value)


# ----------------------------------------------------------------------------- plain jsonl


def test_prompt_jsonl(tmp_path):
    p = write_lines(tmp_path / "d.jsonl", [
        {"id": "a", "prompt": "Hello", "max_tokens": 16, "temperature": 0.5, "top_p": 0.9, "top_k": 5,
         "seed": 3},
        {"prompt": "No id here", "max_new_tokens": 8, "category": "x"},
        "",
        {"id": 7, "messages": [{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": "Hi"}]},
        {"id": "f", "prompt": "First", "followups": ["Second"]},
    ])
    reqs = read_dataset(p)
    a, b, c, f = reqs
    assert (a.id, a.prompt, a.max_new_tokens, a.temperature, a.top_p, a.top_k, a.seed) == \
        ("a", "Hello", 16, 0.5, 0.9, 5, 3)
    assert (b.id, b.max_new_tokens, b.meta["category"], b.source) == ("2", 8, "x", f"{p}:2")
    assert c.id == "7" and c.messages[0]["role"] == "system" and c.prompt is None and c.is_chat
    assert f.messages == [{"role": "user", "content": "First"}] and f.followups == ["Second"]
    assert b.temperature is None and not b.is_chat


# ----------------------------------------------------------------------------- parquet


def test_parquet(tmp_path):
    p = tmp_path / "d.parquet"
    pq.write_table(pa.table({"id": ["a", "b"], "text": ["Hello", "World"], "max_tokens": [4, None]}), p)
    reqs = read_dataset(p, prompt_column="text")
    assert [(r.id, r.prompt, r.max_new_tokens) for r in reqs] == [("a", "Hello", 4), ("b", "World", None)]
    assert reqs[0].meta["input_format"] == "parquet"
    q = tmp_path / "noid.parquet"
    pq.write_table(pa.table({"prompt": ["x", "y", "z"]}), q)
    assert [r.id for r in read_dataset(q, num_requests=4)] == ["1#0", "2#0", "3#0", "1#1"]


def test_parquet_of_chat_messages_needs_no_prompt_column(tmp_path):
    """A `messages` column (structs, or JSON text as a parquet output writes it) is a chat dataset: it was
    refused for want of a prompt column, and --prompt-column messages then for not holding strings."""
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    structs, text = tmp_path / "s.parquet", tmp_path / "t.parquet"
    pq.write_table(pa.table({"id": ["a"], "messages": [turns]}), structs)
    pq.write_table(pa.table({"id": ["a", "b"], "messages": [json.dumps(turns), "{not json"]}), text)
    assert read_dataset(structs)[0].messages == turns
    with pytest.raises(DatasetError, match=r"row 2: column 'messages' is not JSON"):
        read_dataset(text)
    assert [r.messages for r in read_dataset(text, skip_bad_lines=True)] == [turns]


def test_parquet_errors(tmp_path):
    p = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": ["ok", None, "  ", None]}), p)  # blank text is a prompt, as in vLLM
    with pytest.raises(DatasetError) as e:
        read_dataset(p)
    msg = str(e.value)
    assert f"{p}:row 2" in msg and f"{p}:row 4" in msg and "row 1:" not in msg and "row 3:" not in msg
    assert [r.id for r in read_dataset(p, skip_bad_lines=True)] == ["1", "3"]
    with pytest.raises(DatasetError, match="no column 'text'.*columns: prompt"):
        read_dataset(p, prompt_column="text")
    pq.write_table(pa.table({"prompt": [1, 2]}), p)
    with pytest.raises(DatasetError, match="must hold strings"):
        read_dataset(p)
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), p)
    with pytest.raises(DatasetError, match="empty"):
        read_dataset(p)
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"PAR1 not really")
    with pytest.raises(DatasetError, match="bad.parquet: not a readable parquet"):
        read_dataset(bad)


# ----------------------------------------------------------------------------- bad input


def test_malformed_lines_all_reported(tmp_path):
    p = write_lines(tmp_path / "mtbench.jsonl", [
        {"question_id": 1, "category": "math", "turns": ["ok"]},
        '{"question_id": 2, "turns": ["a" "b"]}',
        {"question_id": 3, "category": "math", "turns": ["ok"]},
        "[1, 2]",
        "{not json",
    ])
    with pytest.raises(DatasetError) as e:
        read_dataset(p)
    msg = str(e.value)
    assert f"{p}: 3 bad records" in msg
    assert f"{p}:2: invalid JSON (Expecting ',' delimiter at column" in msg
    assert f"{p}:4: expected a JSON object, got list" in msg
    assert f"{p}:5: invalid JSON" in msg
    assert "skip_bad_lines" in msg
    assert [pr.where for pr in e.value.problems] == [f"{p}:2", f"{p}:4", f"{p}:5"]


def test_single_bad_line_reads_as_one_line(tmp_path):
    p = write_lines(tmp_path / "d.jsonl", [{"prompt": "a"}, '{"prompt": "b",}'])
    with pytest.raises(DatasetError) as e:
        read_dataset(p)
    assert str(e.value).startswith(f"{p}:2: invalid JSON (")


def test_many_bad_lines_listing_is_capped(tmp_path):
    p = write_lines(tmp_path / "d.jsonl", [{"prompt": "ok"}] + ["{bad"] * 30)
    with pytest.raises(DatasetError) as e:
        read_dataset(p)
    msg = str(e.value)
    assert "30 bad records" in msg and "and 10 more" in msg and f"{p}:21:" in msg and f"{p}:22:" not in msg
    assert len(e.value.problems) == 30


def test_skip_bad_lines(tmp_path, caplog):
    p = write_lines(tmp_path / "d.jsonl", [{"prompt": "a"}, "{bad", {"prompt": 3}, {"prompt": "d"}])
    with caplog.at_level(logging.WARNING, logger="workloads"):
        ds = load_dataset(p, skip_bad_lines=True)
    assert [r.id for r in ds.requests] == ["1", "4"]
    assert [pr.where for pr in ds.skipped] == [f"{p}:2", f"{p}:3"]
    assert f"{p}:2" in caplog.text and "skipped 2 bad record" in caplog.text
    q = write_lines(tmp_path / "all_bad.jsonl", ["{bad", {"prompt": None}])
    with pytest.raises(DatasetError, match="no usable requests"):
        read_dataset(q, skip_bad_lines=True)


@pytest.mark.parametrize("record, problem", [
    ({"id": "x"}, "missing required field 'prompt'"),
    ({"prompt": 42}, "'prompt' must be a string, got int"),
    ({"prompt": "a", "max_tokens": "10"}, "'max_tokens' must be an integer"),
    ({"prompt": "a", "max_tokens": 0}, "'max_tokens' must be >= 1"),
    ({"prompt": "a", "temperature": "hot"}, "'temperature' must be a number"),
    ({"prompt": "a", "top_p": 1.5}, "'top_p' must be in"),
    ({"prompt": "a", "id": True}, "'id' must be a string or integer"),
    ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "not both"),
    ({"messages": "hi"}, "must be a list"),
    ({"messages": []}, "'messages' is empty"),
    ({"messages": [{"role": "robot", "content": "b"}]}, "role must be one of"),
    ({"messages": [{"role": "user"}]}, "missing 'content'"),
    ({"messages": [{"role": "user", "content": 7}]}, "content must be a string, got int"),
    ({"messages": [{"role": "system", "content": "sys"}]}, "no user turn"),
    ({"prompt": "a", "followups": "b"}, "'followups' must be a list"),
    ({"messages": [{"role": "user", "content": "b"}], "tools": {"name": "f"}}, "'tools' must be a list"),
    ({"prompt": "a", "tools": [{"type": "function"}]}, "'tools' needs 'messages'"),
    ({"prompt": "a", "stop_token_ids": [2.0]}, "'stop_token_ids' must be a list of integer token ids (>= 0), got 2.0"),
    ({"prompt": "a", "allowed_token_ids": [5, -1]}, "got -1 at [1]"),
    ({"prompt": "a", "stop_token_ids": []}, "must be a non-empty list of integer token ids (>= 0), got an empty list"),
    ({"prompt": "a", "stop_token_ids": 2}, "got int 2"),
])
def test_bad_prompt_records(tmp_path, record, problem):
    p = write_lines(tmp_path / "data.jsonl", [{"prompt": "fine"}, record])
    with pytest.raises(DatasetError) as e:
        read_dataset(p, format="jsonl")
    assert f"{p}:2: " in str(e.value) and problem in str(e.value)


@pytest.mark.parametrize("record, problem", [
    ({"question_id": 5, "category": "math"}, "missing required field 'turns'"),
    ({"category": "math", "turns": ["a"]}, "missing required field 'question_id'"),
    ({"question_id": 5, "turns": "abc"}, "'turns' must be a non-empty list"),
    ({"question_id": 5, "turns": ["a", None]}, "turns[1] must be a string"),
    ({"question_id": 5, "turns": [3]}, "turns[0] must be a string"),
])
def test_bad_mtbench_records(tmp_path, record, problem):
    p = write_lines(tmp_path / "q.jsonl", [{"question_id": 1, "turns": ["fine"]}, record])
    with pytest.raises(DatasetError) as e:
        read_dataset(p, format="mtbench")
    assert f"{p}:2: " in str(e.value) and problem in str(e.value)


def test_duplicate_ids(tmp_path):
    p = write_lines(tmp_path / "d.jsonl", [{"id": "a", "prompt": "x"}, {"id": "a", "prompt": "y"}])
    with pytest.raises(DatasetError, match=r"d.jsonl:2: duplicate id 'a' \(first at .*d.jsonl:1\)"):
        read_dataset(p)


def test_a_duplicate_of_a_line_number_id_says_that_records_without_ids_are_numbered(tmp_path):
    p = write_lines(tmp_path / "d.jsonl", [{"prompt": "x"}, {"id": "1", "prompt": "y"}, {"id": "b", "prompt": "z"},
                                           {"id": "b", "prompt": "w"}])
    with pytest.raises(DatasetError) as e:
        read_dataset(p)
    first, second = [line for line in str(e.value).splitlines() if "duplicate id" in line]
    assert "'1'" in first and "a record without an id takes its line (or row) number as its id" in first
    assert "'b'" in second and "without an id" not in second  # an id that is no line number: no hint


@pytest.mark.parametrize("content, fmt", [(b"", None), (b'{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": "y"}\n',
                                              "jsonl"), (None, "parquet")])
def test_a_pipe_is_read_once_whatever_its_size_says(tmp_path, content, fmt):
    """A named fifo (or /dev/stdin) has size 0 while it holds records: it was refused as empty; it is read,
    once (the format sniff used to take its first bytes), and an empty one is still refused."""
    if content is None:
        table = pa.table({"id": ["a", "b"], "prompt": ["x", "y"]})
        pq.write_table(table, tmp_path / "t.parquet")
        content = (tmp_path / "t.parquet").read_bytes()
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_bytes(content), daemon=True)
    writer.start()
    try:
        if not content:
            with pytest.raises(DatasetError, match="pipe: file is empty"):
                load_dataset(fifo)
        else:
            loaded = load_dataset(fifo)
            assert [r.id for r in loaded.requests] == ["a", "b"] and loaded.format == fmt
    finally:
        writer.join(timeout=10)


def test_a_table_of_another_format_is_named_as_such(tmp_path):
    """A .csv gave "invalid JSON" on every line and "No line could be read": the format is named, with the
    formats read; with a format given the file is read as asked."""
    table = tmp_path / "q.csv"
    table.write_text("id,prompt\na,hello\nb,world\n")
    with pytest.raises(DatasetError, match=r"q.csv: moelight reads no .csv datasets; it reads mtbench, jsonl, "
                                           r"openai, parquet .*convert the file") as e:
        read_dataset(table)
    assert "invalid JSON" not in str(e.value)
    with pytest.raises(DatasetError, match="invalid JSON"):
        read_dataset(table, format="jsonl")
    pq.write_table(pa.table({"id": ["a"], "prompt": ["x"]}), tmp_path / "misnamed.csv")
    assert [r.id for r in read_dataset(tmp_path / "misnamed.csv")] == ["a"]


def test_file_level_errors(tmp_path):
    with pytest.raises(DatasetError, match="missing.jsonl: dataset file does not exist"):
        read_dataset(tmp_path / "missing.jsonl")
    with pytest.raises(DatasetError, match="is a directory"):
        read_dataset(tmp_path)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DatasetError, match="empty.jsonl: file is empty"):
        read_dataset(empty)
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n  \n")
    with pytest.raises(DatasetError, match="blank.jsonl: file is empty"):
        read_dataset(blank)
    ok = write_lines(tmp_path / "ok.jsonl", [{"prompt": "a"}])
    with pytest.raises(DatasetError, match="unknown dataset format 'csv'; choose one of"):
        read_dataset(ok, format="csv")
    with pytest.raises(DatasetError, match="turn=2 applies to MT-Bench"):
        read_dataset(ok, turn=2)
    with pytest.raises(DatasetError, match="num_requests"):
        read_dataset(ok, num_requests=0)
    weird = write_lines(tmp_path / "weird.jsonl", [{"text": "a"}])
    with pytest.raises(DatasetError, match=r"weird.jsonl:1: cannot tell the dataset format.*keys: text"):
        read_dataset(weird)
    binary = tmp_path / "bin.jsonl"
    binary.write_bytes(b'{"prompt": "a"}\n{"prompt": "\xff\xfe"}\n')
    with pytest.raises(DatasetError, match="bin.jsonl:2: not valid UTF-8"):
        read_dataset(binary)


def test_request_needs_text():
    with pytest.raises(ValueError, match="needs messages or a prompt"):
        Request(id="x")


# ----------------------------------------------------------------------------- synthetic


def test_synthetic_prompts_follow_length_stats():
    prompts = synthetic_prompts(500, mean_len=120, max_len=600, seed=3)
    lengths = [len(p) for p in prompts]
    assert abs(statistics.mean(lengths) - 120) < 2 and max(lengths) == 600 and min(lengths) >= 1
    assert all(p.isascii() and not p.endswith(" ") for p in prompts)
    assert len(prompts[0].split()) > 1
    assert synthetic_prompts(5, 30, 60, seed=1) == synthetic_prompts(5, 30, 60, seed=1)
    assert synthetic_prompts(5, 30, 60, seed=1) != synthetic_prompts(5, 30, 60, seed=2)


def test_mtbench_like_lengths_and_requests():
    lengths = mtbench_like_lengths(1000)
    assert abs(statistics.mean(lengths) - 77) < 1 and max(lengths) == 418
    reqs = synthetic_requests(4, 20, 40, max_new_tokens=8)
    assert [r.id for r in reqs] == ["synthetic-0", "synthetic-1", "synthetic-2", "synthetic-3"]
    assert all(r.prompt and r.max_new_tokens == 8 for r in reqs)
    with pytest.raises(ValueError):
        synthetic_prompts(3, mean_len=100, max_len=50)
