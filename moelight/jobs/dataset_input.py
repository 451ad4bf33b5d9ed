"""A job's requests: the dataset read and checked (every bad record with file:line, before any
model loads), less what a resumed output already holds."""

from __future__ import annotations

import workloads
from moelight.jobs.output_file import check_output, finished_ids
from moelight.jobs.run_options import RunOptions


def read_requests(opts: RunOptions):
    """The dataset's requests less those a resumed output already holds; the output format."""
    loaded = workloads.load_dataset(
        opts.dataset, opts.dataset_format, turn=opts.turn, num_requests=opts.num_requests,
        skip_bad_lines=opts.skip_bad_lines, prompt_column=opts.prompt_column,
    )
    out_format = workloads.output_format(opts.output, loaded.format)
    check_output(opts)
    done = finished_ids(opts)
    return loaded, [r for r in loaded.requests if r.id not in done], out_format
