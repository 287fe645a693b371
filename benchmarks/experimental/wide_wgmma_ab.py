"""The rollout benchmark with or without the wgmma route above 64 rows (GPU, sm_90).

`python benchmarks/experimental/wide_wgmma_ab.py on|big|off [rollout.py arguments]`: runs
`benchmarks/rollout.py` with `triton_gate.WGMMA_MAX_M` / `WGMMA_MAX_M_BIG` as they are (on), with only the
weights of >= `PERMUTE_X_MIN_WEIGHT` elements routed above 64 rows (big), or with neither (off: 65+ rows
dequantize the weight and call cuBLAS, the route before session 8). Batch 128 decodes 128 rows per step.
"""

import sys

from qerl.bench.rollout import main
from qerl.kernels import triton_gate

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in ("on", "big", "off"):
        raise SystemExit("usage: wide_wgmma_ab.py on|big|off [rollout.py arguments]")
    if sys.argv[1] in ("big", "off"):
        triton_gate.WGMMA_MAX_M = triton_gate.SWAP_MAX_M
    if sys.argv[1] == "off":
        triton_gate.WGMMA_MAX_M_BIG = triton_gate.SWAP_MAX_M
    raise SystemExit(main(sys.argv[2:]))
