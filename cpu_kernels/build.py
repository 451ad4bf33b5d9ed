"""Builds and loads the C++ kernels (cpu_kernels/csrc) as the torch.ops.moelight library.

Order of attempts, first success wins:
1. the library setup.py built at install time (``cpu_kernels/lib/``), if it was built from
   these sources (the source hash it carries; an edited csrc/ must not load a stale build);
2. ``torch.utils.cpp_extension.load`` (JIT with ninja, cached in ~/.cache/torch_extensions);
3. a single compiler call with the same flags (no ninja needed), cached next to (2).
Any failure leaves the pure-torch path in place; the caller warns once.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import time
from pathlib import Path

import torch

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ["ops.cpp", "decode_attention.cpp", "prefill_attention.cpp", "stream_read.cpp", "isa.cpp",
           "isa_avx512bf16.cpp", "isa_avx512.cpp", "isa_avx2.cpp", "expert_mix.cpp", "expert_isa_avx512bf16.cpp",
           "expert_isa_avx512vnni.cpp", "expert_isa_amx.cpp", "expert_isa_avx2.cpp", "topk_rows.cpp",
           "paged_attention.cpp", "latent_attention.cpp", "latent_amx.cpp", "latent_avx512bf16.cpp",
           "latent_avx512.cpp", "latent_avx2.cpp", "small_linear.cpp", "small_linear_avx2.cpp",
           "small_linear_avx512.cpp", "norm_rotary.cpp", "expert_pack.cpp", "row_quant_avx512.cpp",
           "row_quant_avx2.cpp", "route.cpp", "strip_linear.cpp",
           "strip_gemm_avx2.cpp"]
CFLAGS = ["-O3", "-fopenmp", "-fno-math-errno"]
LDFLAGS = ["-fopenmp"]
NAME = "moelight_cpu_kernels"
# Where setup.py's install-time build puts the library: lib/ is not a package, so tools that
# import every module of cpu_kernels never meet this torch-ops library (it has no module init).
LIB_DIR = Path(__file__).resolve().parent / "lib"
LIB_NAME = "moelight_kernels"


def _ops_loaded() -> bool:
    return hasattr(torch.ops, "moelight") and hasattr(torch.ops.moelight, "decode_attention")


def _source_hash() -> str:
    h = hashlib.sha256(torch.__version__.encode())
    for f in sorted(CSRC.iterdir()):
        if f.suffix in (".cpp", ".h"):
            h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()[:16]


def source_hash_define() -> str:
    """Compiler flag that stamps a build with _source_hash() (a bare token: no quotes to survive
    ninja's shell); ops.cpp stores it as the string source_hash_marker() looks for."""
    return f"-DMOELIGHT_SOURCE_HASH={_source_hash()}"


def source_hash_marker() -> bytes:
    return f"moelight-source-hash={_source_hash()};".encode()


def prebuilt_library() -> Path | None:
    """The library setup.py built (in LIB_DIR), or None."""
    libs = sorted(LIB_DIR.glob(f"{LIB_NAME}*.so"))
    return libs[0] if libs else None


def _load_prebuilt() -> bool:
    lib = prebuilt_library()
    if lib is None:
        raise FileNotFoundError("no library built at install time")
    if source_hash_marker() not in lib.read_bytes():
        raise RuntimeError(f"{lib} was built from other sources (csrc/ or torch changed since install)")
    torch.ops.load_library(str(lib))
    return _ops_loaded()


# A build directory in which nothing changed for this long holds no live build: a compile of one
# source takes well under a minute, and a live build writes an object file per source.
STALE_LOCK_S = 600.0


def _load_jit(verbose: bool) -> bool:
    from torch.utils.cpp_extension import _get_build_directory, load, verify_ninja_availability

    name = f"{NAME}_{_source_hash()}"
    build_dir = Path(_get_build_directory(name, verbose))
    built = build_dir / f"{name}.so"
    if built.exists():
        # Built before, from these sources (the name carries their hash): load it without torch's
        # build lock. A process killed while holding that lock (a job stopped during start-up)
        # leaves it behind, and every later load() would wait for it forever.
        try:
            torch.ops.load_library(str(built))
            return _ops_loaded()
        except OSError:
            pass  # a link cut short: let ninja redo it
    _drop_stale_lock(build_dir)
    verify_ninja_availability()  # raises when ninja is missing: go to the plain-compiler path
    load(name=name, sources=[str(CSRC / s) for s in SOURCES],
         extra_cflags=CFLAGS, extra_ldflags=LDFLAGS, is_python_module=False, verbose=verbose)
    return _ops_loaded()


def _drop_stale_lock(build_dir: Path, now: float | None = None) -> bool:
    """Removes torch's build lock where no build has touched the directory for STALE_LOCK_S (its holder
    was killed mid-build); True if it did."""
    lock = build_dir / "lock"
    try:
        newest = max(f.stat().st_mtime for f in build_dir.iterdir())
    except (OSError, ValueError):  # no directory, or an empty one
        return False
    if not lock.exists() or (now if now is not None else time.time()) - newest < STALE_LOCK_S:
        return False
    lock.unlink(missing_ok=True)
    return True


def _load_direct(verbose: bool) -> bool:
    from torch.utils.cpp_extension import _get_build_directory, include_paths, library_paths

    out_dir = Path(_get_build_directory(f"{NAME}_direct_{_source_hash()}", verbose))
    lib = out_dir / f"{NAME}.so"
    if not lib.exists():
        cxx = os.environ.get("CXX", shutil.which("c++") or "g++")
        abi = int(torch.compiled_with_cxx11_abi())
        cmd = [cxx, "-shared", "-fPIC", *CFLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
               f"-DTORCH_EXTENSION_NAME={NAME}", *[f"-I{p}" for p in include_paths()],
               *[str(CSRC / s) for s in SOURCES], *[f"-L{p}" for p in library_paths()],
               "-lc10", "-ltorch_cpu", "-ltorch", *LDFLAGS, "-o", str(lib) + ".tmp"]
        subprocess.run(cmd, check=True, capture_output=not verbose)
        os.replace(str(lib) + ".tmp", lib)
    torch.ops.load_library(str(lib))
    return _ops_loaded()


loaded_from = ""  # which attempt of load_kernels() loaded the library


def load_kernels(verbose: bool = False) -> tuple[bool, str]:
    """Returns (loaded, reason for failure)."""
    global loaded_from
    if _ops_loaded():
        return True, ""
    errors = []
    attempts = (("install-time build", _load_prebuilt), ("JIT build", lambda: _load_jit(verbose)),
                ("direct compile", lambda: _load_direct(verbose)))
    for name, attempt in attempts:
        try:
            if attempt():
                loaded_from = name
                return True, ""
        except Exception as e:  # noqa: BLE001 - any build failure means "use the fallback"
            errors.append(f"{type(e).__name__}: {str(e).strip()[-300:]}")
    return False, "; ".join(errors) or "no build method available"
