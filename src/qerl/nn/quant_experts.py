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
  launch for gate_up and one for down over all hit experts (`kernels.triton.fp4_grouped`), weights decoded in
  registers, and the same for the input gradient in the backward. No host sync, so the rollout engine
  captures MoE decode steps in CUDA graphs when every experts module takes this path;
- reference (NF4, the CPU, fp32, or the flag off): transformers' loop over the hit experts, each expert's
  weights dequantized (in the input dtype) on every call.
Subclasses change only the layout-specific pieces (`hf_dims`, `_glu`, `_add_bias`, `dequantized_hf`):
`quant_experts_gpt_oss.GptOssQuantExperts` holds gpt-oss's experts (biases, interleaved gate/up rows, a
clamped SwiGLU) on the same stacked buffers.
Saving and loading in compressed-tensors form is `qerl.models.moe_checkpoint`. Gradients reach the input and
the routing weights, never the 4-bit experts.

Expert LoRA (opt-in, `add_lora`; `lora.experts` in the config): per expert e and weight W in (gate_up_proj,
down_proj) trainable fp32 factors `lora_A[W]` [E, r, K] and `lora_B[W]` [E, N, r] (A Kaiming-uniform over each
expert's [r, K] like the dense LoRA, B zero), so expert e's weight acts as W_e + scaling * B_e @ A_e, with
the dense LoRA's scaling (alpha / r, or alpha / sqrt(r) with rslora) and no dropout (PEFT's ParamWrapper,
whose adapter format `qerl.models.adapter` writes, cannot express it). Both paths add the term: the reference
loop per expert, the grouped path over its sorted rows with `torch._grouped_mm` where that works for the
device, dtype and shapes (no host sync: still capturable), else with a loop over the experts that reads the
offsets on the host (then `capturable()` is False and the rollout engine decodes eagerly).
"""

import math

import torch
from torch import nn

from ..formats import WeightFormat, get_format
from .lora import LoraConfig
from .quant_base import QuantizedModule

WEIGHTS = ("gate_up_proj", "down_proj")


def _stack_quantized(fmt: str | WeightFormat, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """weight [E, N, K] -> {tensor name: stacked tensor [E, ...]}, one `quantize` per expert (own global scale)."""
    quantize = get_format(fmt).quantize
    per_expert = [quantize(weight[e]) for e in range(weight.shape[0])]
    return {name: torch.stack([t[name] for t in per_expert]) for name in per_expert[0]}


class _GroupedLinear(torch.autograd.Function):
    """x [rows, K] sorted by expert -> x_e @ W_e^T [rows, N] per expert; backward: grad_x = g_e @ W_e (the experts
    are frozen: no weight gradient). offsets int [E + 1] on the device; the tensors as QuantExperts stores them."""

    @staticmethod
    def forward(ctx, x, offsets, packed, scale, global_scale, group, mx):
        from ..kernels.triton.fp4_grouped import grouped_fp4_linear

        ctx.save_for_backward(packed, scale, global_scale)
        ctx.offsets, ctx.group, ctx.mx = offsets, group, mx
        return grouped_fp4_linear(x, offsets, packed, scale, global_scale, group, mx)

    @staticmethod
    def backward(ctx, grad_out):
        from ..kernels.triton.fp4_grouped import grouped_fp4_grad_input

        packed, scale, global_scale = ctx.saved_tensors
        grad_x = grouped_fp4_grad_input(grad_out.contiguous(), ctx.offsets, packed, scale, global_scale, ctx.group,
                                        ctx.mx)
        return grad_x, None, None, None, None, None, None


def lora_rows_loop(x: torch.Tensor, offsets: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """x [rows, K] sorted by expert, offsets int [E + 1], a [E, r, K], b [E, N, r] (scaled, in x.dtype) ->
    (x_e @ a_e^T) @ b_e^T [rows, N] per expert, zero past offsets[-1]. Reads the offsets on the host (a sync):
    the fallback where `torch._grouped_mm` does not work."""
    out = x.new_zeros(x.shape[0], b.shape[1])
    bounds = offsets.tolist()
    for e in range(a.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            out[lo:hi] = (x[lo:hi] @ a[e].t()) @ b[e].t()
    return out


def lora_rows_grouped_mm(x: torch.Tensor, offsets: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """As `lora_rows_loop`, as two `torch._grouped_mm` calls (differentiable, device ops only: no host sync).
    Rows past offsets[-1] (routing sentinels) are left undefined by the op, in the forward and in x's gradient
    (uninitialised memory: NaN at times), so they are masked on the way in and out: `where` drops what it does not
    select, NaN included, in both directions."""
    ends = offsets[1:].to(torch.int32)
    real = (torch.arange(x.shape[0], device=x.device) < offsets[-1])[:, None]
    h = torch._grouped_mm(torch.where(real, x, 0), a.transpose(1, 2), offs=ends)  # [rows, r]
    out = torch._grouped_mm(h, b.transpose(1, 2), offs=ends)  # [rows, N]
    return torch.where(real, out, 0)


_GROUPED_MM_WORKS: dict[tuple, bool] = {}


def grouped_mm_works(device: torch.device, dtype: torch.dtype, r: int, k: int, n: int) -> bool:
    """Whether `lora_rows_grouped_mm` runs, forward and backward, for these operands on `device`: torch has
    `_grouped_mm` and its kernel takes this dtype, compute capability and these strides (alignment rules differ
    by torch version and device, so it is tried once on a tiny input and remembered)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # one key per GPU, however the caller names it
        device = torch.device("cuda", torch.cuda.current_device())
    key = (device, dtype, r, k, n)
    if key not in _GROUPED_MM_WORKS:
        _GROUPED_MM_WORKS[key] = hasattr(torch, "_grouped_mm") and _try_grouped_mm(key[0], dtype, r, k, n)
    return _GROUPED_MM_WORKS[key]


def _try_grouped_mm(device: torch.device, dtype: torch.dtype, r: int, k: int, n: int) -> bool:
    try:
        with torch.enable_grad():
            x = torch.ones(4, k, device=device, dtype=dtype, requires_grad=True)
            a = torch.ones(2, r, k, device=device, dtype=dtype, requires_grad=True)
            b = torch.ones(2, n, r, device=device, dtype=dtype, requires_grad=True)
            offsets = torch.tensor([0, 1, 3], device=device)
            lora_rows_grouped_mm(x, offsets, a, b).sum().backward()
        return bool(torch.isfinite(a.grad).all())
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return False


EXPERT_FORMATS = ("nvfp4", "mxfp4", "nf4")  # the grouped kernels' formats (fp8 experts: not built)


class QuantExperts(QuantizedModule):
    """Frozen 4-bit experts. Build with `QuantExperts.from_experts(experts_module, fmt)`."""

    carries_lora = True  # expert LoRA (`add_lora`); `lora_disabled` switches it off
    grouped_kernel = True  # the grouped Triton path where it applies (see the module docstring)

    def __init__(self, num_experts: int, hidden_dim: int, intermediate_dim: int, fmt: str | WeightFormat,
                 act_fn: nn.Module, gate_up: dict[str, torch.Tensor], down: dict[str, torch.Tensor]):
        super().__init__()
        fmt = fmt if isinstance(fmt, str) else fmt.name  # only the name is stored; EXPERT_FORMATS checks it
        if fmt not in EXPERT_FORMATS:
            raise ValueError(f"QuantExperts holds a 4-bit format ({', '.join(EXPERT_FORMATS)}), not {fmt}"
                             + ("; bf16 experts need no surgery" if fmt == "bf16" else ""))
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
        self._tensor_names = tuple(names)  # their dtypes are kept through casts (QuantizedModule._apply)
        self.lora_A = self.lora_B = self.lora_config = None  # expert LoRA: `add_lora`
        self.lora_enabled = True  # `lora_disabled` turns it off (the KL reference pass)
        self.scaling = 1.0

    @classmethod
    def from_experts(cls, experts: nn.Module, fmt: str | WeightFormat) -> "QuantExperts":
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

    def weight_dims(self, weight: str) -> tuple[int, int]:
        """(N, K) of each expert's `weight` matrix, as the format stores it: gate_up [2I, H], down [H, I]."""
        h, i = self.hidden_dim, self.intermediate_dim
        return {"gate_up_proj": (2 * i, h), "down_proj": (h, i)}[weight]

    def add_lora(self, lora: LoraConfig) -> None:
        """Attach fresh trainable expert LoRA (replacing any): `lora_A[w]` fp32 [E, r, K] Kaiming-uniform per
        expert (fan-in K, as `init_lora_`), `lora_B[w]` fp32 [E, N, r] zero, for w in WEIGHTS."""
        if lora.dropout > 0:  # x_e is shared by the base and the LoRA term only without dropout (PEFT refuses it too)
            raise ValueError(f"expert LoRA does not support lora.dropout > 0 (got {lora.dropout})")
        device = getattr(self, self._tensor_names[0]).device
        a, b = {}, {}
        for weight in WEIGHTS:
            n, k = self.weight_dims(weight)
            a[weight] = nn.Parameter(torch.empty(self.num_experts, lora.r, k, device=device, dtype=torch.float32))
            # over the [E * r, K] view each row has fan-in K, as each expert's [r, K] A would alone
            nn.init.kaiming_uniform_(a[weight].data.view(-1, k), a=math.sqrt(5))
            b[weight] = nn.Parameter(torch.zeros(self.num_experts, n, lora.r, device=device, dtype=torch.float32))
        self.lora_A, self.lora_B = nn.ParameterDict(a), nn.ParameterDict(b)
        self.lora_config, self.scaling = lora, lora.scaling

    def remove_lora(self) -> None:
        """Drop the expert LoRA (the module is frozen base only again)."""
        self.lora_A = self.lora_B = self.lora_config = None
        self.scaling = 1.0

    @property
    def lora_active(self) -> bool:
        """Expert LoRA attached and not switched off by `lora_disabled`."""
        return self.lora_A is not None and self.lora_enabled

    def lora_factors(self, weight: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(A [E, r, K], scaling * B [E, N, r]) of `weight` in `dtype`: the fp32 masters cast in-graph (so the
        gradient reaches them, and a captured CUDA graph reads the masters the optimizer updates in place); B
        scaled before the cast, as `QuantLinear` and the rollout engine do."""
        return self.lora_A[weight].to(dtype), (self.lora_B[weight] * self.scaling).to(dtype)

    def lora_delta(self, weight: str) -> torch.Tensor:
        """scaling * B_e @ A_e fp32 [E, N, K]: what expert LoRA adds to each expert's dense `weight`."""
        return torch.bmm(self.lora_B[weight].float(), self.lora_A[weight].float()) * self.scaling

    def _grouped_lora(self, x: torch.Tensor, offsets: torch.Tensor, weight: str) -> torch.Tensor:
        """The LoRA term [rows, N] of `weight` over rows x [rows, K] sorted by expert (zero past offsets[-1])."""
        a, b = self.lora_factors(weight, x.dtype)
        if grouped_mm_works(x.device, x.dtype, a.shape[1], a.shape[2], b.shape[1]):
            return lora_rows_grouped_mm(x, offsets, a, b)
        return lora_rows_loop(x, offsets, a, b)

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
        if not self._grouped_applies(probe):
            return False
        if self.lora_active:  # the LoRA term syncs unless torch._grouped_mm works here (see the module docstring)
            r = self.lora_A[WEIGHTS[0]].shape[1]
            return all(grouped_mm_works(device, dtype, r, self.weight_dims(w)[1], self.weight_dims(w)[0])
                       for w in WEIGHTS)
        return True

    def _kernel_linear(self, x: torch.Tensor, offsets: torch.Tensor, weight: str) -> torch.Tensor:
        """The grouped 4-bit product of one weight (`kernels.triton.fp4_grouped`), with its input gradient."""
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
        x = hidden_states[token]
        gate_up = self._add_bias(self._with_lora(linear(x, offsets, "gate_up_proj"), x, offsets, "gate_up_proj"),
                                 "gate_up_proj", expert)
        h = self._glu(gate_up)
        rows = self._add_bias(self._with_lora(linear(h, offsets, "down_proj"), h, offsets, "down_proj"),
                              "down_proj", expert)
        real = (flat[order] < self.num_experts)[:, None]  # sentinel rows: no expert, no output, no gradient
        rows = torch.where(real, rows * top_k_weights.reshape(-1)[order, None], 0)
        return torch.zeros_like(hidden_states).index_add_(0, token, rows.to(hidden_states.dtype))

    def _with_lora(self, out: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor, weight: str) -> torch.Tensor:
        """out [rows, N] from `linear`, plus the expert LoRA term of `weight` on its input x [rows, K] when on."""
        return out + self._grouped_lora(x, offsets, weight) if self.lora_active else out

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
            gate_up = self._expert_linear(current_state, "gate_up_proj", expert_idx)
            current_hidden_states = self._glu(self._add_bias(gate_up, "gate_up_proj", expert_idx))
            down = self._expert_linear(current_hidden_states, "down_proj", expert_idx)
            current_hidden_states = self._add_bias(down, "down_proj", expert_idx)
            current_hidden_states = current_hidden_states * top_k_weights[token_idx, top_k_pos, None]
            final_hidden_states.index_add_(0, token_idx, current_hidden_states.to(final_hidden_states.dtype))
        return final_hidden_states

    def _expert_linear(self, x: torch.Tensor, weight: str, expert: int) -> torch.Tensor:
        """x [rows, K] @ W_e^T [rows, N] on expert `expert`'s dequantized `weight` (in x.dtype), plus its LoRA term
        (x @ A_e^T) @ (scaling * B_e)^T when expert LoRA is on."""
        out = nn.functional.linear(x, self.dequantized_expert(weight, expert, x.dtype))
        if self.lora_active:  # this expert's factors only, cast as `lora_factors` casts them
            a = self.lora_A[weight][expert].to(x.dtype)
            b = (self.lora_B[weight][expert] * self.scaling).to(x.dtype)
            out = out + nn.functional.linear(nn.functional.linear(x, a), b)
        return out

    def extra_repr(self) -> str:
        r = 0 if self.lora_A is None else self.lora_A[WEIGHTS[0]].shape[1]
        return (f"num_experts={self.num_experts}, hidden={self.hidden_dim}, intermediate={self.intermediate_dim}, "
                f"format={self.weight_format}, lora_r={r}")
