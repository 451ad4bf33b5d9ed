"""moelight: high-throughput batch inference for Mixture-of-Experts LLMs on small GPUs and CPUs.

The C++ CPU kernels (cpu_kernels/csrc) are compiled at first use with
torch.utils.cpp_extension (JIT, cached under ~/.cache/torch_extensions), so
`pip install --no-build-isolation -e .` never needs a CUDA toolchain or a second torch.
"""

from setuptools import find_packages, setup

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
        "test": ["pytest", "transformers", "matplotlib", "ruff"],
        "plot": ["matplotlib"],
    },
    entry_points={"console_scripts": ["moelight=moelight.cli:main"]},
)
