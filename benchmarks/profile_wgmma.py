"""Launch the wgmma NVFP4 kernel (x pre-permuted) and cuBLAS bf16 on Qwen2.5-7B shapes, for Nsight Compute (GPU).

    ncu --clock-control none --section SpeedOfLight --section Occupancy --section WarpStateStats \
        --section SchedulerStats --section LaunchStats \
        --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio,\
    sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active,\
    smsp__issue_active.avg.pct_of_peak_sustained_active,\
    sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active \
        -k regex:"nvfp4_swap|nvjet|gemm|sm90" python benchmarks/profile_wgmma.py

Each case launches twice (the tensor-pipe metric reads n/a on the H100); raw result: docs/results/ncu_h100_2026-11-25_wgmma.txt.
"""

import torch

CASES = [("gate_up", 37888, 3584, 64), ("gate_up", 37888, 3584, 256), ("qkv", 4608, 3584, 128),
         ("down", 3584, 18944, 256)]  # (name, N, K, M)


def main() -> None:
    from qerl.bench.kernels import _weights
    from qerl.kernels.gluon import nvfp4 as gk

    for name, n, k, m in CASES:
        _, q = _weights(n, k, 1)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        for _ in range(2):
            gk.nvfp4_linear_gluon(x, **q[0], wgmma=True, x_permuted=True)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for _ in range(2):
            torch.nn.functional.linear(x, w)
        torch.cuda.synchronize()
        print(f"{name} {n}x{k} M={m}: launched", flush=True)


if __name__ == "__main__":
    main()
