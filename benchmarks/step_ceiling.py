"""Upper bound of the NVFP4 / bf16 LoRA step speedup from a `qerl bench step --out` report: python
benchmarks/step_ceiling.py REPORT.json ... (see `qerl.bench.step_ceiling`)."""

from qerl.bench.step_ceiling import main

if __name__ == "__main__":
    raise SystemExit(main())
