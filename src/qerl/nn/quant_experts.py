"""A frozen stack of mixture-of-experts MLPs whose weights are held in a qerl 4-bit format.

transformers 5 stores the experts of Qwen3-MoE / Qwen2-MoE as two 3-D parameters, `gate_up_proj`
[E, 2I, H] (gate rows 0..I-1, up rows I..2I-1) and `down_proj` [E, H, I]. `QuantExperts` replaces such a
module: each expert's [2I, H] and [H, I] matrix is quantized exactly as a dense `QuantLinear` of that shape
would be (`get_format(fmt).quantize(w_2d)`), and every tensor the format returns is stacked along a new
leading expert dimension and registered as one buffer named `<weight>_<tensor>`:

    nvfp4: gate_up_proj_weight_packed        uint8          [E, 2I, H/2]
           gate_up_proj_weight_scale         float8_e4m3fn  [E, 2I, H/16]
           gate_up_proj_weight_global_scale  float32        [E, 1]       (one per expert, gate and up share it)
           down_proj_weight_packed           uint8          [E, H, I/2]
           down_proj_weight_scale            float8_e4m3fn  [E, H, I/16]
           down_proj_weight_global_scale     float32        [E, 1]
    mxfp4: <w>_weight_packed uint8 [E, N, K/2], <w>_weight_scale uint8 (E8M0 exponents) [E, N, K/32]
    nf4:   <w>_weight_packed uint8 [E, N, K/2], <w>_weight_absmax float32 [E, N*K/64]

`buffer[e]` is expert e's tensor, identical to what `QuantLinear.from_linear` stores for that matrix, so a
compressed-tensors per-expert checkpoint (`experts.{e}.gate_proj.weight_packed`, ...) is a slice per expert:
gate_proj is rows [:I] and up_proj rows [I:] of the gate_up tensors (for NF4, whose blocks run over the
flattened matrix, rows [:I] are the first I*H/64 absmax entries; I*H is a multiple of 64). NVFP4's global
scale is chosen per expert over the fused [2I, H] matrix, so gate and up share it, as fused serving needs.

The forward has exactly the semantics of transformers' eager experts forward: act_fn(gate) * up, down, times
the token's routing weight, `index_add_` into the output. Two paths compute it:
- grouped (the default wherever it applies: NVFP4 / MXFP4 on CUDA in bf16 / fp16; `grouped_kernel = False`
  on a module or the class turns it off): the token-expert pairs sorted by expert, then one grouped 4-bit kernel
  launch for gate_up and one for down over all hit experts (`kernels.triton_fp4_grouped`), weights decoded in
  registers, and the same for the input gradient in the backward. No host sync, so the rollout engine
  captures MoE decode steps in CUDA graphs when every experts module takes this path;
- reference (NF4, the CPU, fp32, or the flag off): transformers' loop over the hit experts, each expert's
  weights dequantized (in the input dtype) on every call.
Subclasses change only the layout-specific pieces (`hf_dims`, `_glu`, `_add_bias`, `dequantized_hf`):
`quant_experts_gpt_oss.GptOssQuantExperts` holds gpt-oss's experts (biases, interleaved gate/up rows, a
clamped SwiGLU) on the same stacked buffers.
LoRA on experts is later work (they are frozen here); saving and loading in compressed-tensors form is
`qerl.models.moe_checkpoint`. Gradients reach the input and the routing weights, never the experts.
"""

import torch
from torch import nn

from ..formats import get_format
from .quant_linear import apply_keeping_storage_dtypes

WEIGHTS = ("gate_up_proj", "down_proj")


def _stack_quantized(fmt: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """weight [E, N, K] -> {tensor name: stacked tensor [E, ...]}, one `quantize` per expert (own global scale)."""
    quantize = get_format(fmt).quantize
    per_expert = [quantize(weight[e]) for e in range(weight.shape[0])]
    return {name: torch.stack([t[name] for t in per_expert]) for name in per_expert[0]}


class _GroupedLinear(torch.autograd.Function):
    """x [rows, K] sorted by expert -> x_e @ W_e^T [rows, N] per expert; backward: grad_x = g_e @ W_e (the experts
    are frozen: no weight gradient). offsets int [E + 1] on the device; the tensors as QuantExperts stores them."""

    @staticmethod
    def forward(ctx, x, offsets, packed, scale, global_scale, group, mx):
        from ..kernels.triton_fp4_grouped import grouped_fp4_linear

        ctx.save_for_backward(packed, scale, global_scale)
        ctx.offsets, ctx.group, ctx.mx = offsets, group, mx
        return grouped_fp4_linear(x, offsets, packed, scale, global_scale, group, mx)

    @staticmethod
    def backward(ctx, grad_out):
        from ..kernels.triton_fp4_grouped import grouped_fp4_grad_input

        packed, scale, global_scale = ctx.saved_tensors
        grad_x = grouped_fp4_grad_input(grad_out.contiguous(), ctx.offsets, packed, scale, global_scale, ctx.group,
                                        ctx.mx)
        return grad_x, None, None, None, None, None, None


class QuantExperts(nn.Module):
    """Frozen 4-bit experts. Build with `QuantExperts.from_experts(experts_module, fmt)`."""

    grouped_kernel = True  # the grouped Triton path where it applies (see the module docstring)

    def __init__(self, num_experts: int, hidden_dim: int, intermediate_dim: int, fmt: str, act_fn: nn.Module,
                 gate_up: dict[str, torch.Tensor], down: dict[str, torch.Tensor]):
        super().__init__()
        fmt = get_format(fmt).name
        if fmt == "bf16":
            raise ValueError("QuantExperts holds a 4-bit format (nvfp4, mxfp4, nf4); bf16 experts need no surgery")
        self.num_experts, self.hidden_dim, self.intermediate_dim = num_experts, hidden_dim, intermediate_dim
        self.weight_format = fmt
        self.act_fn = act_fn
        names = []
        for weight, tensors in (("gate_up_proj", gate_up), ("down_proj", down)):
            for name, t in tensors.items():
                if t.shape[0] != num_experts:
                    raise ValueError(f"{weight}.{name}: expected {num_experts} experts, got shape {tuple(t.shape)}")
                self.register_buffer(f"{weight}_{name}", t)
                names.append(f"{weight}_{name}")
        self._tensor_names = tuple(names)  # read by apply_keeping_storage_dtypes

    @classmethod
    def from_experts(cls, experts: nn.Module, fmt: str) -> "QuantExperts":
        """Quantize an HF experts module with `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I] (no bias).

        Only the layout is checked here; `qerl.models.experts.quantize_experts` also checks the module class."""
        gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
        if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)
                and gate_up.ndim == 3 and down.ndim == 3):
            raise ValueError(f"{type(experts).__name__}: expected 3-D gate_up_proj [E, 2I, H] and down_proj "
                             f"[E, H, I] tensors")
        e, h, i = cls.hf_dims(experts)
        act_fn = getattr(experts, "act_fn", None)
        if not callable(act_fn):
            raise ValueError(f"{type(experts).__name__}: has no act_fn")
        with torch.no_grad():
            return cls(e, h, i, fmt, act_fn, _stack_quantized(fmt, gate_up), _stack_quantized(fmt, down))

    @staticmethod
    def hf_dims(experts: nn.Module) -> tuple[int, int, int]:
        """(E, H, I) of an HF experts module holding gate_up_proj [E, 2I, H] and down_proj [E, H, I];
        ValueError when the two shapes do not fit that layout."""
        gate_up, down = experts.gate_up_proj, experts.down_proj
        e, two_i, h = gate_up.shape
        if two_i % 2 or tuple(down.shape) != (e, h, two_i // 2):
            raise ValueError(f"{type(experts).__name__}: gate_up_proj {tuple(gate_up.shape)} and down_proj "
                             f"{tuple(down.shape)} are not [E, 2I, H] and [E, H, I]")
        return e, h, two_i // 2

    def _apply(self, fn, recurse=True):
        return apply_keeping_storage_dtypes(self, super()._apply, fn, recurse)

    def _expert_tensors(self, weight: str, expert: int) -> dict[str, torch.Tensor]:
        prefix = weight + "_"
        return {name[len(prefix):]: getattr(self, name)[expert] for name in self._tensor_names
                if name.startswith(prefix)}

    def dequantized_expert(self, weight: str, expert: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Expert `expert`'s `weight` ("gate_up_proj" [2I, H] or "down_proj" [H, I]) as a dense tensor."""
        if weight not in WEIGHTS:
            raise ValueError(f"weight must be one of {WEIGHTS}, got {weight!r}")
        return get_format(self.weight_format).dequantize(**self._expert_tensors(weight, expert), dtype=dtype)

    def dequantized_gate_up(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """All experts' gate_up_proj [E, 2I, H] as a new dense tensor (for export and tests)."""
        return torch.stack([self.dequantized_expert("gate_up_proj", e, dtype) for e in range(self.num_experts)])

    def dequantized_down(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """All experts' down_proj [E, H, I] as a new dense tensor (for export and tests)."""
        return torch.stack([self.dequantized_expert("down_proj", e, dtype) for e in range(self.num_experts)])

    def dequantized_hf(self, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """The HF experts module's parameters (name -> dense tensor, in its layout) that this module replaces."""
        return {"gate_up_proj": self.dequantized_gate_up(dtype), "down_proj": self.dequantized_down(dtype)}

    def _glu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [rows, 2I] (gate columns first, then up) -> act(gate) * up [rows, I]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate) * up

    def _add_bias(self, out: torch.Tensor, weight: str, expert) -> torch.Tensor:
        """out [rows, N] + the bias of `weight` for `expert` (an int, or int64 [rows]); these experts have none."""
        return out

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """hidden_states [T, H], top_k_index int [T, k], top_k_weights [T, k] -> [T, H] in hidden_states.dtype.
        An index equal to num_experts (an expert-parallel sentinel) is skipped."""
        if self._grouped_applies(hidden_states):
            return self.grouped_forward(hidden_states, top_k_index, top_k_weights, self._kernel_linear)
        return self.reference_forward(hidden_states, top_k_index, top_k_weights)

    def _grouped_applies(self, hidden_states: torch.Tensor) -> bool:
        from ..kernels.route import use_triton

        return self.grouped_kernel and self.weight_format in ("nvfp4", "mxfp4") and use_triton(hidden_states)

    def capturable(self, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether a forward on `dtype` activations on `device` takes the grouped path (no host sync: a CUDA
        graph can capture it)."""
        probe = torch.empty(0, self.hidden_dim, dtype=dtype, device=device)
        return self._grouped_applies(probe)

    def _kernel_linear(self, x: torch.Tensor, offsets: torch.Tensor, weight: str) -> torch.Tensor:
        """The grouped 4-bit product of one weight (`kernels.triton_fp4_grouped`), with its input gradient."""
        mx = self.weight_format == "mxfp4"
        gs = None if mx else getattr(self, f"{weight}_weight_global_scale")
        return _GroupedLinear.apply(x, offsets, getattr(self, f"{weight}_weight_packed"),
                                    getattr(self, f"{weight}_weight_scale"), gs, 32 if mx else 16, mx)

    def grouped_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                        linear) -> torch.Tensor:
        """The forward with the token-expert pairs sorted by expert and each weight applied by one grouped call
        `linear(x [T*k, K] sorted by expert, offsets int64 [E + 1] on the device, weight name) -> [T*k, N]` (the
        4-bit kernel; tests pass a plain-torch one), whose rows of sentinel pairs (index E, sorted last, past
        offsets[-1]) are zero. Device ops only: no host sync, so a CUDA graph can capture it."""
        T, k = top_k_index.shape
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(self.num_experts + 1, dtype=torch.int64, device=flat.device)
        counts.scatter_add_(0, flat.long(), torch.ones_like(flat, dtype=torch.int64))
        offsets = torch.cat([counts.new_zeros(1), counts[: self.num_experts].cumsum(0)])
        token = order // k
        expert = flat[order].clamp(max=self.num_experts - 1)  # a sentinel row reads a bias, then is zeroed
        gate_up = self._add_bias(linear(hidden_states[token], offsets, "gate_up_proj"), "gate_up_proj", expert)
        rows = self._add_bias(linear(self._glu(gate_up), offsets, "down_proj"), "down_proj", expert)
        real = (flat[order] < self.num_experts)[:, None]  # sentinel rows: no expert, no output, no gradient
        rows = torch.where(real, rows * top_k_weights.reshape(-1)[order, None], 0)
        return torch.zeros_like(hidden_states).index_add_(0, token, rows.to(hidden_states.dtype))

    def reference_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                          top_k_weights: torch.Tensor) -> torch.Tensor:
        """The transformers eager loop over the hit experts, each dequantized on this call."""
        final_hidden_states = torch.zeros_like(hidden_states)
        with torch.no_grad():
            expert_mask = nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1)
            expert_mask = expert_mask.permute(2, 1, 0)  # [E + 1, k, T]
            expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()

        for expert_idx in expert_hit.flatten().tolist():
            if expert_idx == self.num_experts:
                continue
            top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
            current_state = hidden_states[token_idx]
            gate_up = self.dequantized_expert("gate_up_proj", expert_idx, hidden_states.dtype)
            gate_up = self._add_bias(nn.functional.linear(current_state, gate_up), "gate_up_proj", expert_idx)
            current_hidden_states = self._glu(gate_up)
            down = self.dequantized_expert("down_proj", expert_idx, hidden_states.dtype)
            current_hidden_states = self._add_bias(nn.functional.linear(current_hidden_states, down), "down_proj",
                                                   expert_idx)
            current_hidden_states = current_hidden_states * top_k_weights[token_idx, top_k_pos, None]
            final_hidden_states.index_add_(0, token_idx, current_hidden_states.to(final_hidden_states.dtype))
        return final_hidden_states

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden={self.hidden_dim}, intermediate={self.intermediate_dim}, "
                f"format={self.weight_format}")
