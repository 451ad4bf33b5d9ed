"""Help texts and the README's CLI reference say what the code does: the policies a command takes
come from the registry, `auto` is described as `cache_policy_name()` picks, markup-like text survives
rich, and every command appears in the reference."""

from __future__ import annotations

import re
from pathlib import Path

from typer.testing import CliRunner

from moelight.cli import app
from moelight.engine.options import EngineOptions
from moelight.expert_cache.policy_registry import POLICIES
from tests.cli_text import says

README = Path(__file__).resolve().parents[1] / "README.md"


def _help(*command: str) -> str:
    res = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    return res.output


def test_run_help_matches_the_code(tmp_path):
    text = _help("run")
    assert says(text, "pip install -e '.[ray]'")
    assert says(text, "auto: moe-infinity when --eamc is given, else combined")
    assert says(text, "default: the policy's own budget")
    eamc = tmp_path / "e.npz"
    eamc.write_bytes(b"")
    assert EngineOptions(model="tiny", eamc=str(eamc)).cache_policy_name() == "moe-infinity"
    assert EngineOptions(model="tiny").cache_policy_name() == "combined"


def test_simulate_cache_help_lists_every_registered_policy():
    text = _help("simulate-cache")
    assert says(text, ", ".join(POLICIES)) and says(text, "--dtype") and says(text, "float16, bfloat16 or float32")


def test_readme_cli_reference_names_every_command():
    block = README.read_text().split("## CLI reference", 1)[1].split("```text", 1)[1].split("```", 1)[0]
    listed = set(re.findall(r"^moelight ([\w-]+)", block, re.M))
    assert listed == {c.name for c in app.registered_commands}
    assert "--quick" in block and says(_help("profile"), "--quick")
    for option in ("--tasks", "--include-path", "--limit", "--num-fewshot", "--device", "--overwrite"):
        assert option in block and says(_help("eval"), option), option


def test_llm_docstring_names_every_engine_option():
    from moelight.api.llm import LLM

    doc = " ".join(LLM.__init__.__doc__.split())
    missing = [n for n in EngineOptions.names() if n != "model" and n not in doc]
    assert not missing, missing
