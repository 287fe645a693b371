"""gpt-oss's mixture-of-experts MLP held in a qerl 4-bit format (`GptOssQuantExperts`).

transformers 5's `GptOssExperts` differs from the Qwen-MoE layout `QuantExperts` was built for in three ways:
- its weights are stored transposed: `gate_up_proj` [E, H, 2I] and `down_proj` [E, I, H] (input dim first);
- gate and up are INTERLEAVED along the 2I axis (gate j at 2j, up j at 2j + 1), not concatenated;
- each projection has a bias, `gate_up_proj_bias` [E, 2I] and `down_proj_bias` [E, H], and the activation is
  a clamped SwiGLU: gate clamped above at `limit`, up clamped to [-limit, limit], then
  (up + 1) * gate * sigmoid(alpha * gate)  (alpha 1.702, limit 7.0 in the released models).

Here each expert's matrices are held as qerl's linear layers hold theirs, output rows by input columns:

    <fmt tensors>  gate_up_proj_* [E, 2I, ...]  rows = the interleaved gate/up outputs (row 2j gate, 2j + 1 up)
                   down_proj_*    [E, H, ...]
    gate_up_proj_bias [E, 2I], down_proj_bias [E, H]   16-bit, frozen (they follow the model's dtype)

which is exactly the orientation of the gpt-oss MXFP4 checkpoint (`<w>_blocks` [E, N, K/32, 16] with
`<w>_scales` [E, N, K/32]: reshaped, the blocks ARE qerl's `weight_packed` [E, N, K/2] and the scales its E8M0
`weight_scale` [E, N, K/32]; see `qerl.models.gpt_oss`), so such a checkpoint loads with no re-quantization.
The forward is transformers' eager `GptOssExperts.forward` (the hit experts' loop; x W^T + b, clamped
SwiGLU, down + b, times the routing weight, `index_add_`), on weights dequantized per call, or the grouped
4-bit path of `QuantExperts` where it applies.
"""

import torch
from torch import nn

from ..formats import WeightFormat
from .quant_experts import QuantExperts, _stack_quantized

BIASES = ("gate_up_proj_bias", "down_proj_bias")


class GptOssQuantExperts(QuantExperts):
    """Frozen 4-bit gpt-oss experts. Build with `from_experts(GptOssExperts module, fmt)` (quantizes) or
    directly from already quantized tensors (`qerl.models.gpt_oss.experts_from_mxfp4`)."""

    def __init__(self, num_experts: int, hidden_dim: int, intermediate_dim: int, fmt: str | WeightFormat,
                 alpha: float, limit: float, gate_up: dict[str, torch.Tensor], down: dict[str, torch.Tensor],
                 gate_up_bias: torch.Tensor, down_bias: torch.Tensor):
        super().__init__(num_experts, hidden_dim, intermediate_dim, fmt, None, gate_up, down)
        if tuple(gate_up_bias.shape) != (num_experts, 2 * intermediate_dim) or \
                tuple(down_bias.shape) != (num_experts, hidden_dim):
            raise ValueError(f"gpt-oss expert biases {tuple(gate_up_bias.shape)} and {tuple(down_bias.shape)} are "
                             f"not [E, 2I] = {(num_experts, 2 * intermediate_dim)} and [E, H] = "
                             f"{(num_experts, hidden_dim)}")
        self.alpha, self.limit = float(alpha), float(limit)
        # buffers, not parameters: frozen, and unlike the 4-bit tensors they are cast with the model's dtype
        self.register_buffer("gate_up_proj_bias", gate_up_bias.detach())
        self.register_buffer("down_proj_bias", down_bias.detach())

    def add_lora(self, lora) -> None:
        """Expert LoRA is implemented for the Qwen-MoE layout only (gpt-oss's interleaved, transposed, biased
        experts would need their own factor layout and PEFT mapping)."""
        raise ValueError("expert LoRA (lora.experts) is not supported on gpt-oss experts (GptOssQuantExperts); "
                         "turn lora.experts off: LoRA then trains the attention projections only")

    @staticmethod
    def hf_dims(experts: nn.Module) -> tuple[int, int, int]:
        """(E, H, I) of a GptOssExperts-shaped module: gate_up_proj [E, H, 2I], down_proj [E, I, H]."""
        gate_up, down = experts.gate_up_proj, experts.down_proj
        e, h, two_i = gate_up.shape
        if two_i % 2 or tuple(down.shape) != (e, two_i // 2, h):
            raise ValueError(f"{type(experts).__name__}: gate_up_proj {tuple(gate_up.shape)} and down_proj "
                             f"{tuple(down.shape)} are not [E, H, 2I] and [E, I, H] (gpt-oss layout)")
        return e, h, two_i // 2

    @classmethod
    def from_experts(cls, experts: nn.Module, fmt: str | WeightFormat) -> "GptOssQuantExperts":
        """Quantize a `GptOssExperts` (round-to-nearest, each expert's [2I, H] and [H, I] matrix as a dense
        QuantLinear would be); its biases are kept as they are."""
        e, h, i = cls.hf_dims(experts)
        with torch.no_grad():
            gate_up = _stack_quantized(fmt, experts.gate_up_proj.transpose(1, 2))  # [E, 2I, H]: rows interleaved
            down = _stack_quantized(fmt, experts.down_proj.transpose(1, 2))  # [E, H, I]
            return cls(e, h, i, fmt, experts.alpha, experts.limit, gate_up, down,
                       experts.gate_up_proj_bias.detach().clone(), experts.down_proj_bias.detach().clone())

    def dequantized_hf(self, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """GptOssExperts' four parameters in its own layout: gate_up_proj [E, H, 2I], gate_up_proj_bias [E, 2I],
        down_proj [E, I, H], down_proj_bias [E, H]."""
        return {"gate_up_proj": self.dequantized_gate_up(dtype).transpose(1, 2).contiguous(),
                "gate_up_proj_bias": self.gate_up_proj_bias.to(dtype),
                "down_proj": self.dequantized_down(dtype).transpose(1, 2).contiguous(),
                "down_proj_bias": self.down_proj_bias.to(dtype)}

    def _glu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [rows, 2I] interleaved -> the clamped SwiGLU [rows, I], as GptOssExperts computes it."""
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def _add_bias(self, out: torch.Tensor, weight: str, expert) -> torch.Tensor:
        return out + getattr(self, f"{weight}_bias")[expert].to(out.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, alpha={self.alpha}, limit={self.limit}"
