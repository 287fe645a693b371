"""The rollout benchmark with the bf16 decode kernel on or off (GPU).

`python benchmarks/experimental/bf16_kernel_ab.py on|off [rollout.py arguments]`: runs `benchmarks/rollout.py`
with `triton_gate.BF16_SWAP_MAX_M` as it is (on: bf16 weights and the lm_head take `gluon_bf16` at decode
sizes) or at 0 (off: cuBLAS, the route before session 8).
"""

import sys

from qerl.bench.rollout import main
from qerl.kernels import triton_gate

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in ("on", "off"):
        raise SystemExit("usage: bf16_kernel_ab.py on|off [rollout.py arguments]")
    if sys.argv[1] == "off":
        triton_gate.BF16_SWAP_MAX_M = 0
    raise SystemExit(main(sys.argv[2:]))
