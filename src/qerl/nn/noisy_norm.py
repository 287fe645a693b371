"""Adaptive Quantization Noise (AQN): channel-wise Gaussian noise merged into the RMSNorm weights.

In every decoder layer `input_layernorm` feeds q/k/v and `post_attention_layernorm` feeds gate/up. With
w_noisy = w + z, z ~ N(0, sigma^2)^d, column j of every weight the norm feeds is scaled by (1 + z_j / w_j):
one noise vector per norm, shared by its consumers, no extra parameters, no kernel change.

`NoisyNorms` is a context manager: entering saves each norm weight and adds noise in place (so CUDA
graphs that read the weight see it), `resample()` draws fresh noise (the per-forward variant), leaving
copies the saved weights back bit for bit. While it is active `state_dict()` still returns the clean
weights, so a checkpoint or adapter saved mid-rollout carries no noise. Do not let an optimizer step
the norm weights while the noise is applied.

A norm into which AWQ folded a channel scale s (weight w / s, consumers' columns times s) carries s in the
non-persistent buffer `CHANNEL_SCALE`; its noise is z / s, so (w + z) / s feeds W s and every consumer
column is again scaled by (1 + z_j / w_j), the same policy perturbation as without AWQ for the same z.

`relative=True` (beyond the paper) draws z_j ~ N(0, (sigma |w_j|)^2): every column is scaled by (1 + sigma n_j),
n ~ N(0, 1), whatever the size of the model's norm weights (a median |w| of 0.27 in SmolLM2-135M, 1.6 in
Qwen2.5-Coder-1.5B, where the same absolute sigma perturbs the policy ~100x less; how far either rule moves a
policy still depends on the model, docs/results.md). On a folded norm sigma |w_j| / s_j = sigma |w_j / s_j|: the
stored weight gives it directly.
"""

import torch
from torch import nn

from ..quant.awq import CHANNEL_SCALE  # fp32 [D] buffer on an AWQ-folded norm

NORM_NAMES = ("input_layernorm", "post_attention_layernorm")


def find_noisy_norms(model: nn.Module) -> list[nn.Module]:
    """The `input_layernorm` / `post_attention_layernorm` modules of every decoder layer, in order.

    Matched by attribute name on any module (not by class, which differs per architecture and which the
    official implementation's class check missed), and each must carry a 1-D `weight`.
    """
    norms = []
    for module in model.modules():
        for name in NORM_NAMES:
            norm = getattr(module, name, None)
            if isinstance(norm, nn.Module) and norm not in norms:
                w = getattr(norm, "weight", None)
                if not isinstance(w, torch.Tensor) or w.ndim != 1:
                    raise TypeError(f"{name} of {type(module).__name__} has no 1-D weight to perturb")
                norms.append(norm)
    if not norms:
        raise ValueError(f"no {NORM_NAMES} found in {type(model).__name__}; AQN has nothing to perturb")
    return norms


def median_abs_norm_weight(model: nn.Module) -> float:
    """The median |weight| over every channel of the norms AQN perturbs (its noise acts as a relative change
    z / w of each channel, so this sets how far a given sigma moves the model). An AWQ-folded norm counts with
    its unfolded weight w = folded weight * CHANNEL_SCALE, the units its noise is drawn in."""
    weights = []
    for norm in find_noisy_norms(model):
        w = norm.weight.detach().float().flatten()
        scale = getattr(norm, CHANNEL_SCALE, None)
        weights.append((w if scale is None else w * scale.float().flatten().to(w.device)).abs().cpu())
    return float(torch.cat(weights).median())


class NoisyNorms:
    """with NoisyNorms(model, sigma, seed=...): ...  -- noisy norm weights inside, exact originals after.

    sigma: noise std (from `qerl.rl.aqn.AQNSchedule`); per_forward: the rollout engine calls `resample()`
    before every forward pass (otherwise one draw per rollout batch, on entry). sigma == 0 adds nothing.

    Cost: a handful of launches per entry, draw and exit, whatever the number of layers. The norms of one
    device and dtype are handled as one flat vector: one `randn` over all their channels (each norm's noise
    is its slice of it), one fused add into a flat buffer and one multi-tensor copy into the weights (in place:
    the weights keep their address and object, so captured CUDA graphs and every cache keyed on the module
    stay valid). Nothing here waits for the device.
    """

    def __init__(self, model: nn.Module, sigma: float, per_forward: bool = False, seed: int | None = None,
                 generator: torch.Generator | None = None, relative: bool = False):
        if sigma < 0:
            raise ValueError(f"AQN sigma must be >= 0, got {sigma}")
        self.norms = find_noisy_norms(model)
        self.sigma, self.per_forward, self.relative = float(sigma), per_forward, relative
        self.generator = generator
        if self.generator is None and seed is not None:
            self.generator = torch.Generator(self.norms[0].weight.device).manual_seed(seed)
        self._saved: list[torch.Tensor] | None = None
        self._groups: list[_FlatGroup] = []
        self._hooks = []

    @property
    def active(self) -> bool:
        return self._saved is not None

    @torch.no_grad()
    def __enter__(self) -> "NoisyNorms":
        if self.active:
            raise RuntimeError("NoisyNorms is already applied")
        by_kind: dict[tuple, list[int]] = {}
        for i, n in enumerate(self.norms):
            by_kind.setdefault((n.weight.device, n.weight.dtype), []).append(i)
        saved: list[torch.Tensor | None] = [None] * len(self.norms)
        self._groups = []
        for index in by_kind.values():
            group = _FlatGroup([self.norms[i] for i in index], self.sigma)
            self._groups.append(group)
            for i, view in zip(index, group.saved):
                saved[i] = view
        self._saved = saved
        self._hooks = [n.register_state_dict_post_hook(self._clean_state_dict_hook(i))
                       for i, n in enumerate(self.norms)]
        self.resample()
        return self

    @torch.no_grad()
    def resample(self) -> None:
        """w <- w_clean + z with a fresh z per norm (fp32 draw, one rounding to the weight's dtype).

        On an AWQ-folded norm (CHANNEL_SCALE s) w <- w_clean + z / s: the same draw, in the unfolded units.
        relative: z_j = sigma |w_clean_j| n_j instead of sigma n_j."""
        if not self.active:
            raise RuntimeError("resample() outside the NoisyNorms context")
        if self.sigma == 0.0:
            return  # bit-identical by construction: nothing is written
        for group in self._groups:
            group.apply_noise(self.sigma, self.generator, self.relative)

    @torch.no_grad()
    def __exit__(self, *exc) -> None:
        for group in self._groups:
            group.restore()
        for h in self._hooks:
            h.remove()
        self._saved, self._groups, self._hooks = None, [], []

    def _clean_state_dict_hook(self, i: int):
        def hook(module, state_dict, prefix, local_metadata):
            key = prefix + "weight"
            if key in state_dict and self._saved is not None:
                state_dict[key] = self._saved[i].clone()
        return hook


class _FlatGroup:
    """The norms of one device and dtype as one flat vector: the clean weights (exact copy, `saved` holds a view
    per norm), their fp32 values, the fp32 divisor 1 / s of the AWQ-folded ones (None when no norm is folded)."""

    def __init__(self, norms: list[nn.Module], sigma: float):
        self.weights = [n.weight for n in norms]
        self.sizes = [w.numel() for w in self.weights]
        self.clean = torch.cat([w.detach().reshape(-1) for w in self.weights])  # the exact copy, one launch
        self.saved = [v.view(w.shape) for v, w in zip(self.clean.split(self.sizes), self.weights)]
        self.clean32 = self.clean.float() if sigma > 0 else None  # (no copy when already fp32; never written)
        scales = [getattr(n, CHANNEL_SCALE, None) for n in norms]
        self.scale = None
        if sigma > 0 and any(s is not None for s in scales):
            dev = self.clean.device
            self.scale = torch.cat([torch.ones(k, device=dev) if s is None else s.detach().reshape(-1).float().to(dev)
                                    for s, k in zip(scales, self.sizes)])

    def apply_noise(self, sigma: float, generator: torch.Generator | None, relative: bool = False) -> None:
        z = torch.randn(self.clean.numel(), generator=generator, device=self.clean.device, dtype=torch.float32)
        noise = z.mul_(sigma)
        if relative:  # sigma |w|: on a folded norm |w / s| already is the unfolded rule's sigma |w| / s
            noise = noise.mul_(self.clean32.abs())
        elif self.scale is not None:
            noise = noise.div_(self.scale)
        noisy = noise.add_(self.clean32).to(self.clean.dtype)  # w + noise: fp32, one rounding to the dtype
        torch._foreach_copy_(self.weights, [v.view(w.shape) for v, w in zip(noisy.split(self.sizes), self.weights)])

    def restore(self) -> None:
        torch._foreach_copy_(self.weights, self.saved)
