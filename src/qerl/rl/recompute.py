"""Which decoder layers recompute their forward in the backward (`optim.gradient_checkpointing`).

A checkpointed layer keeps only its input for the backward and runs its forward again there; a plain layer keeps
every activation its backward needs. With a frozen base and LoRA the backward is about one forward of work (the
input gradient; LoRA's own weight gradients are small), so a pass costs about 3 forwards with every layer
checkpointed and 2 with none. `true` checkpoints every layer, `false` none, `auto` as few as the memory allows:

    per token, what a plain and a checkpointed layer keep: measured once on the model itself (`probe_saved_bytes`:
        forwards of two short streams under autograd's saved-tensor hooks; the slope over the length, so frozen
        weights and other fixed bytes drop out)
    the budget, before each update: what the update may still allocate, below `CAP` of the card, after what is
        allocated then (the rollout engine's cache when its policy, `rollout.release_kv_cache`, keeps it; with
        auto the first update recomputes every layer, so that policy decides on the least memory an update needs)
    the plan: as many plain layers as the step's largest micro-batch fits, the rest checkpointed

The budget comes after the engine's memory and the token budget (`optim.max_tokens_per_micro_batch`), so the bytes
a 4-bit base saves go to fewer recomputations. Off CUDA `auto` checkpoints every layer: there is no free-memory
count of the device, and the CPU's attention keeps quadratic weights the probe's slope does not see.
"""

import statistics
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch

from ..choices import GRADIENT_CHECKPOINTING
from ..rollout.memory import process_memory

# share of the card an update may fill, a kept engine's cache included (the rest: allocator fragmentation, the
# optimizer step's temporaries, kernels' workspaces)
CAP = 0.85
# kept back from the budget for what the probe does not count: the log-prob chunks in the backward, the gradient
# flowing between layers, the attention's per-bucket masks
MARGIN_BYTES = 2 * 2**30
PROBE_TOKENS = (64, 128)  # the probe's two stream lengths (a prompt of 16 tokens + a completion)


def checkpointable_layers(model) -> list[torch.nn.Module]:
    """The decoder layers made checkpointable (`GradientCheckpointingLayer`s given a checkpointing function), in
    order; the model classes carry the flag too but are not layers."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)
            and hasattr(m, "_gradient_checkpointing_func")]


def set_checkpointed(layers: list[torch.nn.Module], plain: int) -> None:
    """Checkpoint every layer except the last `plain` ones."""
    for i, layer in enumerate(layers):
        layer.gradient_checkpointing = i < len(layers) - plain


@dataclass(frozen=True)
class SavedBytes:
    """What one decoder layer keeps for the backward, bytes per forwarded token: plain, and checkpointed (its input)."""

    plain: float
    checkpointed: float


@contextmanager
def _count_saved(layers: list[torch.nn.Module], skip: set[int]):
    """Per layer, the bytes of the new storages autograd saves while it runs plain (a storage once: views share
    it), storages in `skip` (the model's weights) not counted, and the bytes of its input hidden states (what it
    keeps when checkpointed). Yields (saved, inputs), two per-layer lists filled on exit."""
    saved, inputs = [0] * len(layers), [0] * len(layers)
    seen = set(skip)
    current = [None]

    def pack(t: torch.Tensor):
        if current[0] is not None:
            try:
                storage = t.untyped_storage()
            except (RuntimeError, NotImplementedError):  # tensors without storage (e.g. wrapped subclasses)
                return t
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                saved[current[0]] += storage.nbytes()
        return t

    def enter(i):
        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs.get("hidden_states")
            inputs[i] = hidden.numel() * hidden.element_size()
            current[0] = i
        return hook

    handles = [layer.register_forward_pre_hook(enter(i), with_kwargs=True) for i, layer in enumerate(layers)]
    handles += [layer.register_forward_hook(lambda *_: current.__setitem__(0, None)) for layer in layers]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield saved, inputs
    finally:
        for h in handles:
            h.remove()


def probe_saved_bytes(model, forward: Callable[[int], torch.Tensor]) -> SavedBytes:
    """Measure `SavedBytes` on `model`: forward(n) runs the loss pass's forward (grad enabled) over a stream of n
    tokens; every layer runs plain for it. The per-layer medians of the slopes between `PROBE_TOKENS`, so what one
    layer alone saves (the rotary tables or masks the layers share, counted at the first) does not inflate the
    estimate. Restores the layers' checkpointing flags."""
    layers = checkpointable_layers(model)
    before = [layer.gradient_checkpointing for layer in layers]
    weights = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    counts = []
    try:
        set_checkpointed(layers, len(layers))
        for n in PROBE_TOKENS:
            with torch.enable_grad(), _count_saved(layers, weights) as totals:
                out = forward(n)
            del out
            counts.append(totals)
    finally:
        for layer, flag in zip(layers, before):
            layer.gradient_checkpointing = flag
    dn = PROBE_TOKENS[1] - PROBE_TOKENS[0]
    (saved_a, inputs_a), (saved_b, inputs_b) = counts
    slope = lambda a, b: statistics.median(max(y - x, 0) / dn for x, y in zip(a, b))  # noqa: E731
    return SavedBytes(plain=slope(saved_a, saved_b), checkpointed=slope(inputs_a, inputs_b))


def plain_layers(n_layers: int, tokens: int, saved: SavedBytes, budget: int) -> int:
    """How many of `n_layers` may stay plain in a micro-batch of `tokens` within `budget` bytes: every layer keeps its
    checkpointed bytes, one recomputing layer at a time holds a plain layer's, each plain layer adds the difference.
    """
    extra = saved.plain - saved.checkpointed
    base = tokens * (n_layers * saved.checkpointed + saved.plain)
    if extra <= 0 or tokens <= 0:  # nothing to keep (an update without a loss token forwards nothing)
        return n_layers
    return max(0, min(n_layers, int((budget - base) // (tokens * extra))))


def budget_bytes(total: int, free: int, reserved: int, allocated: int, cap: float) -> int:
    """Bytes an update may still allocate on a card of `total` bytes: below `cap` of the card and within what is
    free to this process (the device's `free` bytes and its allocator's cached ones, `reserved` - `allocated`), less
    `MARGIN_BYTES`; negative when nothing is left."""
    return min(free + reserved - allocated, int(cap * total) - allocated) - MARGIN_BYTES


def update_budget(device: torch.device, cap: float) -> int:
    """`budget_bytes` of CUDA `device` now, as this process may use it (its per-process share of the card, when
    one is set: `rollout.memory.process_memory`)."""
    free, total = process_memory(device)
    return budget_bytes(total, free, torch.cuda.memory_reserved(device), torch.cuda.memory_allocated(device), cap)


class RecomputePlan:
    """`optim.gradient_checkpointing` for one model: `plan(tokens)` before each update sets which layers recompute.

    mode: True, False or "auto" (module docstring); memory: the run's `EngineMemoryPolicy`, or None (its first-update
    rule then does not apply). For True and "auto" the model's layers must have been made checkpointable
    (`qerl.models.policy.enable_gradient_checkpointing`); a model without transformers' checkpointable layers keeps
    whatever checkpointing it has, and `recomputed` is then None (0 for False)."""

    def __init__(self, model, mode: bool | str, memory=None):
        if mode not in GRADIENT_CHECKPOINTING:
            raise ValueError(f"gradient_checkpointing must be one of {GRADIENT_CHECKPOINTING}, got {mode!r}")
        self.model, self.mode, self.memory = model, mode, memory
        self.layers = checkpointable_layers(model)
        self.saved: SavedBytes | None = None
        self.max_plain = len(self.layers)  # halved by each out-of-memory fallback (`fall_back`)
        self.fallbacks = 0  # how many there were
        self.updates_planned = 0
        self.recomputed: int | None = 0 if mode is False else len(self.layers) if self.layers else None

    @property
    def adaptive(self) -> bool:
        """Whether the plan depends on memory (auto on CUDA)."""
        return self.mode == "auto" and self.model.device.type == "cuda"

    def plan(self, tokens: int, forward: Callable[[int], torch.Tensor]) -> int | None:
        """Set the layers' flags for an update whose largest micro-batch forwards `tokens` tokens; returns how many
        layers recompute (None: True or auto on a model without checkpointable layers). forward: the probe's
        forward (`probe_saved_bytes`), called on the first auto plan only."""
        if not self.layers:
            return self.recomputed  # False: none recompute; else the model's own checkpointing, unknown here
        if self.mode is False:
            plain = len(self.layers)
        elif not self.adaptive:
            plain = 0
        else:
            if self.saved is None:
                self.saved = probe_saved_bytes(self.model, forward)
            budget = self._budget()
            plain = 0 if budget is None else min(plain_layers(len(self.layers), tokens, self.saved, budget),
                                                 self.max_plain)
        set_checkpointed(self.layers, plain)
        self.recomputed = len(self.layers) - plain
        self.updates_planned += 1
        return self.recomputed

    def _budget(self) -> int | None:
        """Bytes this update may add, or None: recompute every layer. The first update of a run whose engine memory
        policy is auto runs fully checkpointed, so the policy's keep test (its reserved peak plus the engine's bytes,
        `EngineMemoryPolicy.after_update`) sees the update's least memory; the plans after it fill the card
        around whatever the policy chose (a kept engine's cache is allocated, a freed one is not)."""
        memory, first = self.memory, self.updates_planned == 0
        if first and memory is not None and memory.auto and not memory.keep:
            return None
        return update_budget(self.model.device, CAP)

    def fall_back(self) -> bool:
        """After an out-of-memory error in an update planned with plain layers: halve the plain layers, for this
        update's retry and every later plan (the probe and the margin missed something: allocator fragmentation,
        an attention workspace). Returns whether that changed anything (False: nothing left to recompute more)."""
        plain = len(self.layers) - (self.recomputed or 0)
        if not self.adaptive or not self.layers or plain == 0:
            return False
        self.max_plain = plain // 2
        self.fallbacks += 1
        set_checkpointed(self.layers, self.max_plain)
        self.recomputed = len(self.layers) - self.max_plain
        return True
