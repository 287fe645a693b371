"""The wgmma decode kernel with x staged through registers every step vs pre-permuted once (GPU, sm_90).

`python benchmarks/experimental/wgmma_swap/x_permuted.py [M,M,...]` (default 16,32,64): for Qwen2.5 7B/32B/72B
shapes prints cuBLAS bf16, the mma.sync form and the wgmma kernel (default tile and split) with `x_permuted`
False / True (the True time includes the permute launch), in microseconds (CUDA-graph replays, weights rotated through
> 2x L2, as `qerl bench kernels`). `gluon_nvfp4.X_PERMUTED` was set from its output.
"""

import sys

import torch
import torch.nn.functional as F

from qerl.bench.kernels import _decode_inputs, _graph_time, _rotated_weights
from qerl.kernels import gluon_nvfp4 as gk

L2 = 50 * 2**20
SHAPES = [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944), (8192, 8192), (8192, 29568), (55296, 5120)]


def main() -> None:
    ms = [int(v) for v in sys.argv[1].split(",")] if len(sys.argv) > 1 else [16, 32, 64]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| N x K | M | cuBLAS us | mma.sync us | wgmma staged us | wgmma pre-permuted us | staged / pre-permuted |"
          " mma.sync / pre-permuted |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for n, k in SHAPES:
        fp4_bytes, copies, bf, q = _rotated_weights(n, k, L2)
        for m in ms:
            xs, calls = _decode_inputs(m, k, fp4_bytes, copies)

            def timed(xperm, wgmma=True):
                def call(i):
                    qi = q[i % copies]
                    return gk.nvfp4_linear_swap(xs[i % 2], qi["weight_packed"], qi["weight_scale"].view(torch.uint8),
                                                qi["weight_global_scale"].reshape(1).float(), None, sms, wgmma=wgmma,
                                                x_permuted=xperm)
                return _graph_time(call, calls, 5)

            t_cub = _graph_time(lambda i: F.linear(xs[i % 2], bf[i % copies]), calls, 5)
            ts, t0, t1 = timed(None, wgmma=False), timed(False), timed(True)
            print(f"| {n}x{k} | {m} | {t_cub * 1e6:.1f} | {ts * 1e6:.1f} | {t0 * 1e6:.1f} | {t1 * 1e6:.1f} | "
                  f"{t0 / t1:.2f} | {ts / t1:.2f} |", flush=True)
        bf = q = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
