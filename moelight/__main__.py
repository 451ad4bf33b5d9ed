"""`python -m moelight ...` runs the CLI (what torchrun launches: `torchrun --nproc-per-node N -m moelight run ...`)."""

from moelight.cli import main

if __name__ == "__main__":
    main()
