"""The rollout benchmark with the bf16 decode kernel on or off (GPU).

`python benchmarks/experimental/bf16_kernel_ab.py on|off|ROWS [rollout.py arguments]`: runs
`benchmarks/rollout.py` with `triton_gate.BF16_SWAP_MAX_M` as it is (on: bf16 weights and the lm_head take
`gluon_bf16` at decode sizes), at 0 (off: cuBLAS, the route before session 8) or at ROWS.
"""

import sys

from qerl.bench.rollout import main
from qerl.kernels import triton_gate

if __name__ == "__main__":
    if len(sys.argv) < 2 or not (sys.argv[1] in ("on", "off") or sys.argv[1].isdigit()):
        raise SystemExit("usage: bf16_kernel_ab.py on|off|ROWS [rollout.py arguments]")
    if sys.argv[1] != "on":
        triton_gate.BF16_SWAP_MAX_M = 0 if sys.argv[1] == "off" else int(sys.argv[1])
    raise SystemExit(main(sys.argv[2:]))
