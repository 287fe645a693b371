"""Fused NVFP4 kernel benchmark; same as `qerl bench kernels` (see qerl.bench.kernels for options)."""

from qerl.bench.kernels import main

if __name__ == "__main__":
    raise SystemExit(main())
