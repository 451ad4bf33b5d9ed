"""The one-pass AMX latent kernel (benchmarks/latent_amx_onepass.cpp, issue #31's experiment: scores,
online softmax and P.V per group of blocks) is as close to a float64 reference as the two-pass engine
kernel: benchmarks/latent_amx_ceiling.cpp's `ocheck` mode, compiled and run here. Needs g++ and AMX."""

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
    exe = tmp_path_factory.mktemp("latent_op") / "latent_amx_ceiling"
    subprocess.run(
        ["g++", "-O2", "-fopenmp", "-fno-math-errno", f"-I{ROOT / 'cpu_kernels/csrc'}",
         str(ROOT / "benchmarks/latent_amx_ceiling.cpp"), str(ROOT / "benchmarks/latent_amx_onepass.cpp"),
         "-o", str(exe)],
        check=True,
    )
    return exe


# (sequences, context): a tail block (37), whole blocks (32), split-K partials with a tail (2 x 600);
# groups of one, two and four (the engine's) blocks per pass
@pytest.mark.parametrize("sequences,context", [(3, 37), (2, 32), (2, 600)])
@pytest.mark.parametrize("group", ["1", "2", "4"])
def test_one_pass_matches_float64_reference(driver: Path, sequences: int, context: int, group: str) -> None:
    run = subprocess.run(
        [str(driver), str(sequences), str(context), "ocheck"],
        capture_output=True, text=True, env={"LATENT_ONEPASS_G": group, "PATH": "/usr/bin:/bin"},
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.rstrip().endswith("ok")
