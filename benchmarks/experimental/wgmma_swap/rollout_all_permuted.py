"""The 7B rollout (nvfp4+lora, batch 16/32/64) with x pre-permuted for every weight of the wgmma form (GPU).

`python benchmarks/experimental/wgmma_swap/rollout_all_permuted.py`: `qerl bench rollout` with
`triton_gate.PERMUTE_X_MIN_WEIGHT = 0`, so the small q/k/v and o weights also take the permute launch
(alone they measured 0.88-0.98x at 16-64 rows; with programmatic dependent launch the extra launch may
hide). Compare with the same command of `benchmarks/rollout.py`.
"""

import sys

from qerl.bench.rollout import main
from qerl.kernels import triton_gate

if __name__ == "__main__":
    triton_gate.PERMUTE_X_MIN_WEIGHT = 0
    sys.argv = [sys.argv[0], "--models", "7b", "--variants", "nvfp4+lora", "--batches", "16,32,64"]
    main()
