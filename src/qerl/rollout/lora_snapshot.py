"""The engine's frozen copy of the LoRA adapters, and the linears of the decode step that read it.

Quantized layers (`QuantLinear`) are called through their parts: the base matmul on the stored 4-bit (or
bf16) tensors, read by reference, plus the LoRA delta from a snapshot of A and scaling*B cast to the
activation dtype once per `generate` call (r x K, a few MB for a 7B model). The snapshot is refreshed
from the trainer's fp32 masters at the start of every call, so the adapter just updated is the one that
samples; it saves two casts per layer per token and lets a CUDA graph read fixed addresses. Dropout is
never applied while sampling. On CUDA the quantized q/k/v and gate/up siblings are stored back to back
once (`qerl.models.siblings`), so each group decodes as one base matmul with one LoRA product.
"""

from typing import Sequence

import torch
from torch import nn

from ..kernels import quantized_linear
from ..kernels.bf16_matmul import bf16_linear
from ..kernels.lora_a import lora_a
from ..models.siblings import fuse_sibling_storage, fused_tensors
from ..nn.quant_linear import QuantLinear


class LoraSnapshot:
    """Activation-dtype copies of the enabled adapters, refreshed in place from the trainer's fp32 masters.

    Linears are registered in groups of siblings that read the same input (q/k/v, gate/up, o, down). For a
    group the A matrices are stacked, [sum r, K], so the whole group's x @ A^T is one GEMM; each member then
    adds its slice times scaling*B [N, r] onto its base output, inside the NVFP4 decode kernel's launch where
    that kernel applies, else in one addmm. At decode sizes these small GEMMs are launch-bound, so fewer of
    them is what counts. In-place refresh keeps addresses fixed, so captured CUDA graphs read the new adapter.

    Sibling groups whose weights are stored back to back (`qerl.models.siblings`, done here when fuse=True)
    run as ONE base matmul over the concatenated rows: their biases are concatenated into a snapshot too,
    and the B matrices placed block-diagonally in one [sum N, sum r] matrix, so the LoRA term of the whole
    group is one product as well.
    """

    def __init__(self, groups: Sequence[Sequence[nn.Module]], dtype: torch.dtype, fuse: bool = False):
        self.dtype = dtype
        self.groups = [tuple(g) for g in groups]
        self.index = {id(m): gi for gi, g in enumerate(self.groups) for m in g}
        self.a: dict[int, torch.Tensor] = {}  # group index -> stacked A [sum r, K]
        self.b: dict[int, tuple[int, int, torch.Tensor]] = {}  # id(module) -> (row0, row1 of A, scaling*B)
        # group index -> fused base tensors, output sizes, concatenated bias | None, block scaling*B | None
        self.fused: dict[int, tuple[dict, list[int], torch.Tensor | None, torch.Tensor | None]] = {}
        self.fuse = fuse
        if fuse:
            for g in self.groups:
                if len(g) > 1:
                    fuse_sibling_storage(g)
        self.refresh()

    @staticmethod
    def _enabled(m: nn.Module) -> bool:
        return isinstance(m, QuantLinear) and m.lora_A is not None and m.lora_enabled

    def signature(self) -> tuple:
        """What the captured graphs depend on: which adapters are on and their shapes, which groups are fused."""
        return tuple((self._enabled(m), tuple(m.lora_A.weight.shape) if self._enabled(m) else None)
                     for g in self.groups for m in g) + tuple(
            len(g) > 1 and fused_tensors(g) is not None for g in self.groups)

    def clear(self) -> None:
        """Forget every snapshot tensor (the next `refresh` allocates them anew)."""
        self.a.clear(), self.b.clear(), self.fused.clear()

    @staticmethod
    def _keep(old: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
        """new's values at old's address when the shapes agree (what a captured graph reads)."""
        if old is not None and old.shape == new.shape:
            return old.copy_(new)
        return new

    @torch.no_grad()
    def refresh(self) -> None:
        """Re-read A and scaling*B of every enabled adapter (and the fused groups' biases and block B) from
        the trainer's weights, cast to `dtype`; in place wherever the shapes agree."""
        for gi, group in enumerate(self.groups):
            on = [m for m in group if self._enabled(m)]
            if not on:
                self.a.pop(gi, None)
            else:
                self.a[gi] = self._keep(self.a.get(gi), torch.cat([m.lora_A.weight for m in on]).to(self.dtype))
            row = 0
            for m in on:
                r = m.lora_A.weight.shape[0]
                b = self._keep(self.b[id(m)][2] if id(m) in self.b else None,
                               (m.lora_B.weight.float() * m.scaling).to(self.dtype))
                self.b[id(m)] = (row, row + r, b)
                row += r
            self._refresh_fused(gi, group, on)

    def _refresh_fused(self, gi: int, group: tuple, on: list) -> None:
        tensors = fused_tensors(group) if self.fuse and len(group) > 1 else None
        if tensors is None:
            self.fused.pop(gi, None)
            return
        _, _, old_bias, old_lb = self.fused.get(gi, (None, None, None, None))
        sizes = [m.out_features for m in group]
        bias = None
        if group[0].bias is not None:
            bias = self._keep(old_bias, torch.cat([m.bias for m in group]).to(self.dtype))
        lb = None
        if on:
            block = torch.zeros(sum(sizes), self.a[gi].shape[0], dtype=self.dtype, device=self.a[gi].device)
            n0 = 0
            for m, n in zip(group, sizes):
                if id(m) in self.b and self._enabled(m):
                    r0, r1, b = self.b[id(m)]
                    block[n0:n0 + n, r0:r1] = b
                n0 += n
            lb = self._keep(old_lb, block)
        self.fused[gi] = (tensors, sizes, bias, lb)

    def stacked_a(self, mod: nn.Module) -> torch.Tensor | None:
        """The stacked A [sum r, K] of the group `mod` starts (or belongs to), None without an enabled adapter."""
        return self.a.get(self.index.get(id(mod)))

    def linears(self, mods: Sequence[nn.Module], x: torch.Tensor, xa: torch.Tensor | None = None
                ) -> list[torch.Tensor]:
        """x [..., K] in the activation dtype -> [mod(x) [..., N_i] for mod in mods] (one registered group),
        without dropout. xa: x @ stacked_a(mods[0])^T [M, sum r] when the caller already has it (the decode
        step's norm launch computes it, `kernels.fused_ops.add_norm_lora_a`)."""
        gi = self.index.get(id(mods[0]))
        a = self.a.get(gi)
        h = None if a is None else xa if xa is not None else lora_a(x, a)  # [M, sum r]: one launch on CUDA
        fused = self.fused.get(gi)
        if fused is not None and tuple(mods) == self.groups[gi]:
            tensors, sizes, bias, lb = fused
            lora = None if h is None or lb is None else (h, lb)
            y = quantized_linear(mods[0].weight_format, x, tensors, bias, lora=lora)
            return list(y.split(sizes, dim=-1))  # column slices: views, no copy
        outs = []
        for mod in mods:
            if not isinstance(mod, QuantLinear):
                # a plain nn.Linear (an unquantized model) takes the bf16 decode kernel where it applies
                outs.append(bf16_linear(x, mod.weight, mod.bias) if type(mod) is nn.Linear else mod(x))
                continue
            entry = self.b.get(id(mod)) if h is not None else None
            lora = None
            if entry is not None and self._enabled(mod):
                r0, r1, b = entry
                lora = (h[:, r0:r1], b)
            # the "+ h @ (scaling B)^T" rides in the NVFP4 decode kernel's launch, else it is one addmm
            outs.append(quantized_linear(mod.weight_format, x, mod.quantized_tensors(), mod.bias, lora=lora))
        return outs

    def linear(self, mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> mod(x) [..., N], for a module registered alone (o_proj, down_proj)."""
        return self.linears((mod,), x)[0]
