"""Batch buckets and memory sizing: how many rows one generate pass may hold.

The KV cache and the static step buffers are allocated for a batch bucket (one captured decode graph per
bucket), so a batch of n rows costs `bucket_batch(n)` rows of memory. A batch larger than what fits runs
as several passes; `rows_per_pass` picks the pass size from `max_batch` or, on CUDA, the free memory.
"""

from typing import Callable

import torch

from .kv_cache import KVCache

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def round_up(n: int, m: int) -> int:
    """n rounded up to a multiple of m."""
    return -(-n // m) * m


def bucket_batch(n: int) -> int:
    """Smallest batch bucket >= n (one captured graph per bucket)."""
    for b in BATCH_BUCKETS:
        if b >= n:
            return b
    return round_up(n, BATCH_BUCKETS[-1])


def bytes_per_row(runner, max_seq_len: int, vocab_size: int) -> int:
    """Memory one batch row needs during generate: its K and V over max_seq_len in every layer of `runner`
    (a `CausalLMRunner`), plus the step logits and the fp32 sampling temporaries over the vocabulary."""
    r = runner
    elem = torch.finfo(r.dtype).bits // 8
    kv = 2 * len(r.layers) * r.n_kv * r.head_dim * max_seq_len * elem
    return kv + vocab_size * (elem + 3 * 4)


def process_memory(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of CUDA `device` as this process may use them. Without a cap, the device's own. Under a
    per-process cap (`torch.cuda.set_per_process_memory_fraction(F)`, which a study job sharing one GPU sets
    first), past which torch's allocator refuses: total = F x the card and free = what the cap leaves above this
    process's reserved bytes, at most the device's free bytes (other processes hold the rest)."""
    free, total = torch.cuda.mem_get_info(device)
    fraction = process_fraction(device)
    if fraction < 1.0:
        cap = int(fraction * total)
        free, total = min(free, max(cap - torch.cuda.memory_reserved(device), 0)), cap
    return free, total


def process_fraction(device: torch.device) -> float:
    """The per-process share of `device`'s memory torch's allocator enforces (1.0: none)."""
    get = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # torch >= 2.6
    if get is None:
        return 1.0
    try:
        return min(1.0, float(get(device)))
    except (RuntimeError, TypeError, ValueError):  # an allocator without the setting (e.g. cudaMallocAsync)
        return 1.0


def free_bytes(device: torch.device, cache: KVCache | None) -> int | None:
    """Device memory a new cache may use (free to this process, `process_memory`, + cached by the allocator + the
    current cache, which the engine frees first); None off CUDA, where the batch is not split by memory."""
    if device.type != "cuda":
        return None
    free, _ = process_memory(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if cache is not None:
        free += cache.nbytes()
    return free


def rows_per_pass(n: int, seq_len: int, max_seq_len: int, max_batch: int | None, memory_fraction: float,
                  free: Callable[[], int | None], row_bytes: Callable[[], int]) -> int:
    """Rows one generate pass may hold: n, or fewer when its batch bucket (what the cache is allocated
    for) exceeds `max_batch` or, when max_batch is None, what `memory_fraction` of `free()` bytes holds at
    `row_bytes()` bytes a row (both called only when needed). seq_len (prompt + new tokens) is only
    checked against max_seq_len."""
    if seq_len > max_seq_len:
        return n  # the engine's _generate raises the clear error
    limit = max_batch
    if limit is None:
        free_now = free()
        if free_now is not None:
            limit = int(free_now * memory_fraction) // row_bytes()
    if limit is None or bucket_batch(n) <= limit:
        return n
    if limit < 1:
        raise torch.OutOfMemoryError(
            f"not even one row's KV cache ({row_bytes() / 2**30:.2f} GiB for max_seq_len "
            f"{max_seq_len}) fits in free GPU memory; lower max_new_tokens or the prompt length")
    return max(b for b in BATCH_BUCKETS if b <= limit)


# auto keeps the engine's memory while the run's peak so far plus the engine's bytes stay below this share of
# the card: the rest covers a later update peaking higher than the ones seen (longer or more sequences)
KEEP_FRACTION = 0.7


class EngineMemoryPolicy:
    """Whether the rollout engine keeps its KV cache and captured decode graphs through the update.

    Freeing them (`RolloutEngine.release_memory`) gives the backward their memory; keeping them saves the next
    rollout re-allocating the cache and re-capturing one decode graph per batch width it visits (two warm-up
    steps plus the capture, eager, per width; continuous batching visits up to five widths per rollout).

    release: True = free after every rollout; False = never free; None = auto: free after the first rollout
    (measuring what the engine held), then keep from the next one on if the run's peak reserved memory so far
    plus those bytes fit `KEEP_FRACTION` of the card. Auto frees always off CUDA and under data parallel
    (a rank that ran out of memory mid-update would leave the others waiting in the all-reduce)."""

    def __init__(self, release: bool | None, device: torch.device, distributed: bool = False,
                 fraction: float = KEEP_FRACTION):
        self.device, self.fraction = device, fraction
        self.auto = release is None and device.type == "cuda" and not distributed
        self.keep = release is False
        self.engine_bytes: int | None = None  # what the last freeing returned to the device (auto only)

    def after_rollout(self, engine) -> bool:
        """Free the engine's memory unless it is kept; returns whether it was freed."""
        if self.keep:
            return False
        before = torch.cuda.memory_reserved(self.device) if self.auto else 0
        engine.release_memory()  # empties the allocator's cache: the drop in reserved bytes is the engine's
        if self.auto:
            self.engine_bytes = max(before - torch.cuda.memory_reserved(self.device), 0)
        return True

    def after_update(self) -> None:
        """Auto: decide from the run's peak so far whether the next rollouts keep the engine's memory (once kept,
        always kept: from then on the peak includes it)."""
        if not self.auto or self.keep or self.engine_bytes is None:
            return
        _, total = process_memory(self.device)  # the card, or this process's share of it
        self.keep = torch.cuda.max_memory_reserved(self.device) + self.engine_bytes <= self.fraction * total
