"""`plan` / `simulate` given a workload as figures count the KV pool with --shared-prefix's prefix once per batch, as
`run` counts a dataset's (runtime/paged_layout.pool_table), not once per sequence."""

from __future__ import annotations

import json
import random

import pytest
from typer.testing import CliRunner

from moelight.cli import app
from moelight.cli.workload_options import workload_from_options
from moelight.loading.presets import PRESETS
from moelight.planning.held_model import held_model_spec
from moelight.runtime.paged_layout import one_prefix_pool, pool_table

runner = CliRunner()


def _prompts(n: int, prompt_len: int, shared: int, seed: int = 0) -> list[list[int]]:
    """n prompts of prompt_len tokens, all beginning with one prefix of `shared` tokens (the rest each its own)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 30000) for _ in range(shared)]
    return [prefix + [rng.randrange(3, 30000) for _ in range(prompt_len - shared)] for _ in range(n)]


@pytest.mark.parametrize("prompt_len,shared,gen", [(600, 512, 64), (600, 500, 7), (512, 512, 64), (500, 500, 1),
                                                    (40, 10, 3), (77, 64, 128)])
def test_one_prefix_pool_is_pool_tables_for_such_prompts(prompt_len, shared, gen):
    prompts = _prompts(12, prompt_len, shared)
    table = pool_table([prompt_len + gen] * 12, True, prompts)
    alone, own, once = one_prefix_pool(prompt_len, prompt_len + gen, shared)
    assert [min(b * alone, b * own + once) for b in range(1, 13)] == table


def test_the_figures_workload_counts_the_prefix_once():
    mspec = held_model_spec(PRESETS["mixtral-8x7b"], "mixtral-8x7b")
    wl = workload_from_options(mspec, 600, 64, None, False, 4096, 512.0)
    table = pool_table([664] * 40, True, _prompts(40, 600, 512))
    assert [float(wl.pool_tokens(b)) for b in range(1, 41)] == table
    twins = workload_from_options(mspec, 512, 64, None, False, 4096, 512.0)  # the samples of one prompt
    assert [float(twins.pool_tokens(b)) for b in range(1, 41)] == pool_table([576] * 40, True, [[5] * 512] * 40)
    unshared = workload_from_options(mspec, 600, 64, None, False, 4096, 0.0)
    assert float(unshared.pool_tokens(40)) == 40 * 664  # no prefix: the ragged pool, as before


def _plan(shared: str) -> dict:
    r = runner.invoke(app, ["plan", "--model", "mixtral-8x7b", "--hardware", "s1", "--prompt-len", "600",
                            "--gen-len", "64", "--shared-prefix", shared, "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.output)


def test_plan_with_a_shared_prefix_plans_a_larger_batch_on_pool_tables_kv_bytes():
    """s1's host memory binds the KV pool (192 GB): one 512-token prefix of each 600-token prompt held once per
    batch leaves room for ~4x the sequences, and the plan's KV bytes are those of pool_table's pool for a dataset
    of that shape (main: the unshared pool, the same batch with and without the prefix)."""
    alone, shared = _plan("0"), _plan("512")
    b0, b = alone["policy"]["batch_size"], shared["policy"]["batch_size"]
    assert b > 2 * b0
    per_token = alone["cpu_memory"]["kv_cache"] / (b0 * 664)
    slots = pool_table([664] * b, True, _prompts(b, 600, 512))[-1]
    assert shared["cpu_memory"]["kv_cache"] == pytest.approx(per_token * slots, rel=1e-9)
