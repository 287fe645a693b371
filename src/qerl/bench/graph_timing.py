"""Time a GPU function the way the kernel benchmarks do (many calls captured in one CUDA graph, replays timed, over
weight copies rotated through more than the L2 cache), and the device-copy bandwidth every benchmark's floor
divides by."""

import statistics
import time

import torch

from ..kernels.workspace import capture_graph


def elapsed_ms(fn) -> float:
    """Milliseconds of one fn() on the current stream, timed by CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def rotated_copies(weight_bytes: int, l2_bytes: int) -> int:
    """Copies of a weight a timed sequence cycles through so that it is read from HBM: enough to exceed twice the
    L2 cache, at most 16."""
    return min(16, max(1, -(-2 * l2_bytes // weight_bytes)))


def calls_per_graph(weight_bytes: int, copies: int) -> int:
    """Calls one captured graph makes: every weight copy at least once, and about 2 ms of work at 3 TB/s."""
    return copies * max(1, min(8, int(2e-3 * 3e12 // (weight_bytes * copies))))


def rotated_weights(n: int, k: int, l2_bytes: int):
    """(FP4 bytes of one weight, copies, bf16 weights, NVFP4 weights): enough random [N, K] copies (never zeros)
    to exceed 2x L2."""
    from qerl.formats.nvfp4 import quantize_nvfp4

    fp4_bytes = n * k // 2 + n * k // 16
    copies = rotated_copies(fp4_bytes, l2_bytes)
    bf = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    return fp4_bytes, copies, bf, [quantize_nvfp4(w) for w in bf]


def free_weights(*held: list) -> None:
    """Empty the lists of weights the timed lambdas hold, so the weights are freed."""
    for h in held:
        h.clear()
    torch.cuda.empty_cache()


def graph_time(fn, calls: int, replays: int) -> float:
    """Median seconds per call: fn(0), ..., fn(calls - 1) captured in one CUDA graph (after a warm-up: compile,
    autotune caches, cuBLAS handles) and replayed once, then each of `replays` replays timed."""
    def all_calls():
        for i in range(calls):
            fn(i)

    g, _ = capture_graph(all_calls, warmups=1)
    g.replay()
    return statistics.median(elapsed_ms(g.replay) / 1e3 / calls for _ in range(replays))


def event_ms(fn, repeats: int, warmups: int = 1) -> float:
    """Median milliseconds of fn() over `repeats` calls, each timed by CUDA events (after `warmups` untimed calls)."""
    for _ in range(warmups):
        fn()
    return statistics.median([elapsed_ms(fn) for _ in range(repeats)])


def copy_bandwidth() -> float:
    """Device-to-device copy of 2 GiB, bytes read + written per second: the floor's denominator in every benchmark
    (`qerl bench rollout|kernels`, `decode_profile`)."""
    x = torch.randn(512 * 2**20, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    bw = 2 * x.numel() * 4 * 10 / (time.perf_counter() - t)
    del x, y
    return bw
