"""Datasets in, results out: readers (MT-Bench, jsonl, OpenAI Batch, parquet), synthetic
workloads, and streaming result writers with resume. No torch, no moelight imports."""

from .dataset import (
    FORMATS,
    PARSERS,
    SKIP_HINT,
    LoadedDataset,
    check_dataset_file,
    check_duplicates,
    detect_jsonl_format,
    duplicate_id,
    line_of,
    load_dataset,
    normalize_format,
    parse_dataset,
    read_dataset,
    replicate,
    skip_hint,
)
from .errors import DatasetError, OutputExistsError, OutputPathError, OutputWriteError, Problem
from .request import Request
from .results import TurnOutput, build_error_result, build_result, to_openai_batch
from .resume import finished_ids, read_results, sidecar_path
from .synthetic import (
    MTBENCH_MAX_LEN,
    MTBENCH_MEAN_LEN,
    mtbench_like_lengths,
    mtbench_like_prompts,
    synthetic_lengths,
    synthetic_prompts,
    synthetic_requests,
)
from .writer import OUTPUT_FORMATS, ResultWriter, output_format

__all__ = [
    "FORMATS",
    "PARSERS",
    "SKIP_HINT",
    "MTBENCH_MAX_LEN",
    "MTBENCH_MEAN_LEN",
    "OUTPUT_FORMATS",
    "DatasetError",
    "LoadedDataset",
    "OutputExistsError",
    "OutputPathError",
    "OutputWriteError",
    "Problem",
    "Request",
    "ResultWriter",
    "TurnOutput",
    "build_error_result",
    "build_result",
    "check_dataset_file",
    "check_duplicates",
    "duplicate_id",
    "detect_jsonl_format",
    "line_of",
    "normalize_format",
    "parse_dataset",
    "finished_ids",
    "load_dataset",
    "mtbench_like_lengths",
    "mtbench_like_prompts",
    "output_format",
    "read_dataset",
    "read_results",
    "replicate",
    "sidecar_path",
    "skip_hint",
    "synthetic_lengths",
    "synthetic_prompts",
    "synthetic_requests",
    "to_openai_batch",
]
