"""moelight: high-throughput batch inference for Mixture-of-Experts LLMs on small GPUs and CPUs.

The C++ CPU kernels (cpu_kernels/csrc) are built here, into cpu_kernels/lib/, with
torch.utils.cpp_extension against the torch already installed (`pip install
--no-build-isolation`). Where torch is not importable at build time (an isolated build) or the
compiler fails, the install still succeeds and the kernels compile at first use instead
(cpu_kernels/build.py), or moelight warns once and runs its pure-torch attention.
"""

import importlib.util
from pathlib import Path

from setuptools import find_packages, setup


def kernel_build() -> tuple[list, dict]:
    """(ext_modules, cmdclass) for the C++ kernels, or nothing when torch is not importable."""
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        return [], {}
    # cpu_kernels/build.py by path: its sources, flags and source hash, without importing the package.
    build_py = Path(__file__).parent / "cpu_kernels" / "build.py"
    spec = importlib.util.spec_from_file_location("_moelight_kernel_build", build_py)
    kb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kb)

    class OptionalBuildExtension(BuildExtension):
        """A failed kernel build must not fail the install: the kernels then compile at first use."""

        def build_extensions(self) -> None:  # torch checks the compiler here, before building
            try:
                super().build_extensions()
            except Exception as e:  # noqa: BLE001 - compiler missing or failing: JIT or torch fallback
                print(f"moelight: C++ CPU kernels not built at install ({type(e).__name__}: {e}); "
                      "they will compile at first use")

        def copy_extensions_to_source(self) -> None:
            """Editable installs copy the library into the tree; lib/ is not a package, so make it."""
            try:
                kb.LIB_DIR.mkdir(exist_ok=True)
                super().copy_extensions_to_source()
            except Exception as e:  # noqa: BLE001 - as above: never fail the install for the kernels
                print(f"moelight: C++ CPU kernels not installed ({type(e).__name__}: {e}); "
                      "they will compile at first use")

    ext = CppExtension(
        f"cpu_kernels.{kb.LIB_DIR.name}.{kb.LIB_NAME}",  # into build.LIB_DIR, where the loader looks
        [f"cpu_kernels/csrc/{s}" for s in kb.SOURCES],
        extra_compile_args=[*kb.CFLAGS, kb.source_hash_define()],
        extra_link_args=kb.LDFLAGS,
    )
    return [ext], {"build_ext": OptionalBuildExtension}


ext_modules, cmdclass = kernel_build()

setup(
    name="moelight",
    version="0.1.0",
    description="High-throughput batch inference for Mixture-of-Experts LLMs (MoE-Lightning)",
    python_requires=">=3.10",
    packages=find_packages(include=["moelight*", "cpu_kernels*", "hrm*", "optimizer*", "workloads*"]),
    package_data={"cpu_kernels": ["csrc/*.cpp", "csrc/*.h"], "workloads": ["examples/*.jsonl"]},
    install_requires=[
        "torch==2.13.0",
        "numpy",
        "scipy",
        "pulp",
        "pyarrow",
        "typer",
        "safetensors",
        "tokenizers",
        "jinja2",
        "tqdm",
    ],
    extras_require={
        "test": ["pytest", "transformers", "matplotlib", "ruff", "import-linter", "xgrammar>=0.2", "lm-eval>=0.4.9",
                 "compressed-tensors",
                 "accelerate",
                 # the fused dequant-GEMM's tests run its Triton kernel in Triton's interpreter on the CPU
                 'triton; platform_machine == "x86_64" and sys_platform == "linux"'],
        "plot": ["matplotlib"],
        "ray": ["ray[data]>=2.50"],
        "structured": ["xgrammar>=0.2"],
        "eval": ["lm-eval>=0.4.9"],
    },
    entry_points={"console_scripts": ["moelight=moelight.cli:main"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
