"""Sweep the one-launch LoRA-A kernel's split count and R tile against cuBLAS (`x @ a.t()`), at the decode
shapes of a Qwen2.5-7B engine step (LoRA r16: q/k/v R = 48, o R = 16, gate/up R = 32, down R = 16).

`python benchmarks/lora_a_sweep.py [--r 16]`: prints a table of microseconds per call (CUDA-graph replays
of 50 calls each, median of 5) for cuBLAS and each (splits, block_r) candidate. GPU only.
"""

import argparse

import torch

from qerl.kernels.triton.lora_a import config, lora_a_triton
from qerl.kernels.workspace import capture_graph


def graph_time(fn, reps: int = 50) -> float:
    """Median microseconds per call of `fn` over CUDA-graph replays (capture after a warm-up)."""
    def all_calls():
        for _ in range(reps):
            fn()

    g, _ = capture_graph(all_calls, warmups=1)
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1000 / reps)
    return sorted(times)[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--r", type=int, default=16)
    ap.add_argument("--batches", default="1,8,16,64")
    args = ap.parse_args()
    dev = torch.device("cuda")
    shapes = [("qkv", 3 * args.r, 3584), ("o", args.r, 3584), ("gate_up", 2 * args.r, 3584), ("down", args.r, 18944)]
    print(f"device: {torch.cuda.get_device_name()}")
    print("| M | group | R x K | cuBLAS us | default (splits, BR) us | best (splits, BR) us |")
    print("|---:|---|---|---:|---|---|")
    for m in map(int, args.batches.split(",")):
        for name, r, k in shapes:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            a = torch.randn(r, k, device=dev, dtype=torch.bfloat16) * 0.05
            ref = (x.float() @ a.float().t())
            cub = graph_time(lambda: x @ a.t())
            d = config(m, r, k, dev)
            best = None
            for splits in (1, 2, 4, 7, 10, 14, 20, 28, 37, 56):
                for br in (16, 32, 64):
                    if br > max(16, r) * 2:
                        continue
                    try:
                        h = lora_a_triton(x, a, splits=splits, block_r=br)
                    except Exception as e:  # a combination the kernel refuses
                        print(f"skip {splits} {br}: {e}")
                        continue
                    err = float((h.float() - ref).abs().max() / ref.abs().max())
                    if not err < 2e-2:
                        raise RuntimeError(f"wrong result {err} at splits {splits} BR {br}")
                    t = graph_time(lambda: lora_a_triton(x, a, splits=splits, block_r=br))
                    if best is None or t < best[0]:
                        best = (t, splits, br)
            t_def = graph_time(lambda: lora_a_triton(x, a))
            print(f"| {m} | {name} | {r} x {k} | {cub:.1f} | ({d.get('splits')}, {d.get('block_r', d.get('BR'))}) "
                  f"{t_def:.1f} | ({best[1]}, {best[2]}) {best[0]:.1f} |", flush=True)


if __name__ == "__main__":
    main()
