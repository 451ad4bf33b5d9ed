"""The AMX latent kernel's variants that the torch-free driver benchmarks/latent_amx_ceiling.cpp
(compiled and run here) exercises: on a tile-major cache (LatentArgs::tile_major, no torch op takes that
layout yet) it gives the row-major two-pass kernel's output bit for bit (`check`); the one-pass grouped
kernel (latent_amx_grouped.h: scores, online softmax and P.V per group of blocks) is as close to a float64
reference as the two-pass kernel (`ocheck`), and so is the staged experiment (latent_amx_staged.h: each item
run from a buffer the previous call copied its rows into, `scheck`). Needs g++ and a CPU with AMX."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _amx_bf16() -> bool:
    try:
        return "amx_bf16" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


pytestmark = pytest.mark.skipif(shutil.which("g++") is None or not _amx_bf16(), reason="needs g++ and AMX-BF16")


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    exe = tmp_path_factory.mktemp("latent_driver") / "latent_amx_ceiling"
    subprocess.run(
        ["g++", "-O2", "-fopenmp", "-fno-math-errno", f"-I{ROOT / 'cpu_kernels/csrc'}",
         str(ROOT / "benchmarks/latent_amx_ceiling.cpp"), str(ROOT / "benchmarks/latent_amx_onepass.cpp"),
         "-o", str(exe)],
        check=True,
    )
    return exe


# (sequences, context): a tail block (37), whole blocks (32), split-K partials with a tail (2 x 600, in
# items of 128 keys: row-major items over 160 keys take the grouped kernel, which rounds differently)
@pytest.mark.parametrize("sequences,context", [(3, 37), (2, 32), (2, 600)])
def test_tile_major_output_equals_row_major(driver: Path, sequences: int, context: int) -> None:
    run = subprocess.run([str(driver), str(sequences), str(context), "check"], capture_output=True, text=True,
                         env={"LATENT_CHUNK": "128", "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stdout + run.stderr
    assert "equals" in run.stdout


# items of 129-160 keys take the two-pass kernel (kGroupedMinKeys), whose row-major and tile-major runs agree
# bit for bit; the grouped kernel's would not
def test_items_up_to_160_keys_take_the_two_pass_kernel(driver: Path) -> None:
    run = subprocess.run([str(driver), "2", "160", "check"], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stdout + run.stderr
    assert "equals" in run.stdout


# groups of one, two and four (the engine's) blocks per pass; the driver's queries are peaked here, so the
# online softmax's rescale matters
@pytest.mark.parametrize("sequences,context", [(3, 37), (2, 32), (2, 600)])
@pytest.mark.parametrize("group", ["1", "2", "4"])
def test_one_pass_matches_float64_reference(driver: Path, sequences: int, context: int, group: str) -> None:
    run = subprocess.run(
        [str(driver), str(sequences), str(context), "ocheck"],
        capture_output=True, text=True, env={"LATENT_ONEPASS_G": group, "PATH": "/usr/bin:/bin"},
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.rstrip().endswith("ok")


# the staged kernel, its buffer row-major and tile-major; each item but the first runs from the copy the
# previous call made (2 x 600: items of 256, 256 and 88 keys, partials); or (blocks) each item copies its
# own rows a group of blocks ahead of its scores
@pytest.mark.parametrize("sequences,context", [(3, 37), (2, 32), (2, 600)])
@pytest.mark.parametrize("knobs", [{"LATENT_STAGE_TM": "0"}, {"LATENT_STAGE_TM": "1"}, {"LATENT_STAGE_BLOCKS": "1"}],
                         ids=["row-major", "tile-major", "blocks"])
def test_staged_matches_float64_reference(driver: Path, sequences: int, context: int, knobs: dict[str, str]) -> None:
    run = subprocess.run(
        [str(driver), str(sequences), str(context), "scheck"],
        capture_output=True, text=True, env={**knobs, "PATH": "/usr/bin:/bin"},
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.rstrip().endswith("ok")
