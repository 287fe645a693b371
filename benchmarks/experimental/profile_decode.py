"""Launch the routed Gluon decode kernel on a few Qwen2.5-7B shapes, for `ncu` to profile (GPU).

`ncu --clock-control none --section SpeedOfLight --section Occupancy --section WarpStateStats
--section SchedulerStats --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio
-k regex:nvfp4_swap python benchmarks/experimental/profile_decode.py`: each case runs twice (the first
compiles); the report's stall breakdown says where the kernel's warps wait (docs/benchmarks.md, Kernels).
"""

import torch

from qerl.bench.kernels import _weights
from qerl.kernels import triton_nvfp4 as tk

CASES = [("7B gate_up", 37888, 3584, 8), ("7B gate_up", 37888, 3584, 64), ("7B down", 3584, 18944, 64),
         ("7B qkv", 4608, 3584, 8)]


def main() -> None:
    for name, n, k, m in CASES:
        _, q = _weights(n, k, 1)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        for _ in range(2):
            tk.nvfp4_linear_swap(x, **q[0])
        torch.cuda.synchronize()
        print(f"{name} {n}x{k} M={m}: launched", flush=True)


if __name__ == "__main__":
    main()
