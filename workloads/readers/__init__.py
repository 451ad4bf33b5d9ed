"""Per-format record parsers; ``workloads.dataset`` picks one and drives it."""

from .jsonl_lines import iter_json_lines, read_json_lines
from .mtbench import looks_like_mtbench, parse_mtbench
from .openai_batch import looks_like_openai_batch, parse_openai_record
from .parquet import read_parquet
from .prompt_jsonl import looks_like_prompt_jsonl, parse_prompt_record

__all__ = [
    "looks_like_mtbench",
    "looks_like_openai_batch",
    "looks_like_prompt_jsonl",
    "parse_mtbench",
    "parse_openai_record",
    "parse_prompt_record",
    "iter_json_lines",
    "read_json_lines",
    "read_parquet",
]
