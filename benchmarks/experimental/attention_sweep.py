"""Tile sweep of the flash-decoding kernel (`triton_decode_attention`) at Qwen2.5-7B decode shapes (GPU).

`python benchmarks/experimental/attention_sweep.py`: for batch 8 / 64 and attended lengths 512 / 1024 (28
query heads, 4 kv heads, head dim 128, every slot valid, the decode slot at the end), times the default
launch (`choose_tile`; before session 6 always BLOCK_N 64, 2 programs per SM, Triton's stages) and each
(BLOCK_N, programs per SM, num_warps, num_stages) in microseconds per call (CUDA-graph replays; 8 layers'
caches rotated so K/V come from HBM) and prints the best against the default.
"""

import itertools

import torch

from qerl.bench.kernels import _graph_time
from qerl.kernels import triton_decode_attention as tda

H, KV, HD, LAYERS = 28, 4, 128, 8


def main() -> None:
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| batch | S | default us | best us | best (block_n, programs/SM, warps, stages) | default / best |"
          " KV GB/s (best) |")
    print("|---:|---:|---:|---:|---|---:|---:|")
    for B, S in itertools.product((8, 64), (512, 1024)):
        gen = torch.Generator(device="cuda").manual_seed(B + S)
        q = torch.randn(B, H, HD, device="cuda", generator=gen).bfloat16()
        ks = [torch.randn(B, KV, S, HD, device="cuda", generator=gen).bfloat16() for _ in range(LAYERS)]
        vs = [torch.randn(B, KV, S, HD, device="cuda", generator=gen).bfloat16() for _ in range(LAYERS)]
        valid = torch.ones(B, S, dtype=torch.bool, device="cuda")
        slot = torch.tensor(S - 1, device="cuda")

        def timed(**kw):
            return _graph_time(lambda i: tda.decode_attention_triton(q, ks[i % LAYERS], vs[i % LAYERS], valid, slot, S,
                                                                     HD ** -0.5, **kw), 2 * LAYERS, 10)

        t_def = timed()
        best = (t_def, "default")
        for bn, pps, nw, ns in itertools.product((32, 64, 128), (1, 2, 4, 8), (4, 8), (2, 3, 4)):
            splits, _ = tda.choose_splits(B * KV, S, bn, q.device, pps)
            try:
                t = timed(splits=splits, block_n=bn, num_warps=nw, num_stages=ns)
            except Exception as e:  # out of shared memory or registers for this tile
                print(f"skip {bn, pps, nw, ns}: {type(e).__name__}")
                continue
            if t < best[0]:
                best = (t, (bn, pps, nw, ns))
        kv_bytes = 2 * B * KV * S * HD * 2
        print(f"| {B} | {S} | {t_def * 1e6:.1f} | {best[0] * 1e6:.1f} | {best[1]} | {t_def / best[0]:.2f} | "
              f"{kv_bytes / best[0] / 1e9:.0f} |", flush=True)


if __name__ == "__main__":
    main()
