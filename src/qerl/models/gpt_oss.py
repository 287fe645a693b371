"""gpt-oss checkpoints whose experts are stored in MXFP4 (how OpenAI released gpt-oss-20b / -120b): loaded
straight into qerl's MXFP4 `GptOssQuantExperts`, codes and scales copied, never dequantized and re-quantized;
and written back in the same layout.

The checkpoint layout (config.json `quantization_config: {"quant_method": "mxfp4", ...}`), per layer N:
    model.layers.N.mlp.experts.gate_up_proj_blocks  uint8 [E, 2I, H/32, 16]   rows interleaved: 2j gate, 2j+1 up
    model.layers.N.mlp.experts.gate_up_proj_scales  uint8 [E, 2I, H/32]       E8M0 exponents, bias 127
    model.layers.N.mlp.experts.down_proj_blocks     uint8 [E, H, I/32, 16]
    model.layers.N.mlp.experts.down_proj_scales     uint8 [E, H, I/32]
    model.layers.N.mlp.experts.{gate_up,down}_proj_bias and every other tensor: 16-bit, under transformers' names.
A block row [r, g, :] holds the 32 FP4 E2M1 codes of output row r, inputs 32g .. 32g+31, two per byte with the
even input in the LOW nibble; the codes index the E2M1 values {0, .5, 1, 1.5, 2, 3, 4, 6} (bit 3 = sign), and
the weight is value * 2^(scale - 127). Output rows first, input along the last axes: the file's matrix is the
transpose of the [E, H, 2I] / [E, I, H] parameters GptOssExperts multiplies with, and exactly the [N, K]
orientation qerl's linears use.

That is qerl's MXFP4 format bit for bit (`qerl.formats.mxfp4`: packed uint8 [N, K/2] with element 2i in the
low nibble, E8M0 uint8 scale [N, K/32], same code table and bias), so the mapping is a reshape:
    gate_up_proj_weight_packed [E, 2I, H/2] = gate_up_proj_blocks.reshape(E, 2I, H/2)
    gate_up_proj_weight_scale  [E, 2I, H/32] = gate_up_proj_scales
and the same for down_proj; `save_gpt_oss_mxfp4` reshapes back. Nothing else in the file is quantized (the
attention projections, router, embeddings and head are 16-bit there): `build_policy` then quantizes the
attention linears to the run's `model.format` and adds LoRA; the experts stay in the file's MXFP4.

transformers itself cannot keep these experts in 4 bits on the CPU (it dequantizes them to 16-bit on load
when its Triton kernels are missing); qerl builds the model on the meta device and never holds a 16-bit copy.
"""

from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from ..nn.quant_experts_gpt_oss import GptOssQuantExperts
from .atomic import atomic_directory
from .checkpoint import assign_remaining, directory_tokenizer, write_model_files
from .sources import ModelLoadError, check_safetensors
from .targets import quant_layers

MODEL_TYPE = "gpt_oss"
QUANT_METHOD = "mxfp4"
WEIGHTS = ("gate_up_proj", "down_proj")
BLOCK_BYTES = 16  # 32 FP4 codes per block, two per byte
# transformers' own default for this checkpoint family (what OpenAI's release lists): 16-bit modules
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def is_gpt_oss_mxfp4(config: dict) -> bool:
    """config.json (as a dict) of a gpt-oss checkpoint with MXFP4 experts."""
    qcfg = config.get("quantization_config") or {}
    return config.get("model_type") == MODEL_TYPE and qcfg.get("quant_method") == QUANT_METHOD


def experts_from_mxfp4(tensors: dict[str, torch.Tensor], num_experts: int, hidden: int, intermediate: int,
                       alpha: float, limit: float, bias_dtype: torch.dtype, where: str = "") -> GptOssQuantExperts:
    """One layer's checkpoint tensors -> GptOssQuantExperts holding the same codes and scales (no arithmetic).

    tensors: {"gate_up_proj_blocks": uint8 [E, 2I, H/32, 16], "gate_up_proj_scales": uint8 [E, 2I, H/32],
    "gate_up_proj_bias": [E, 2I], "down_proj_blocks": uint8 [E, H, I/32, 16], "down_proj_scales": uint8
    [E, H, I/32], "down_proj_bias": [E, H]}; the biases are cast to bias_dtype. ModelLoadError on any other
    shape or dtype (`where` names the module)."""
    rows = {"gate_up_proj": (2 * intermediate, hidden), "down_proj": (hidden, intermediate)}
    quantized = {}
    for weight, (n, k) in rows.items():
        blocks, scales = tensors[f"{weight}_blocks"], tensors[f"{weight}_scales"]
        want_blocks, want_scales = (num_experts, n, k // 32, BLOCK_BYTES), (num_experts, n, k // 32)
        if k % 32 or blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 \
                or tuple(blocks.shape) != want_blocks or tuple(scales.shape) != want_scales:
            raise ModelLoadError(f"{where}.{weight}: expected uint8 blocks {list(want_blocks)} and uint8 scales "
                                 f"{list(want_scales)}, found {blocks.dtype} {list(blocks.shape)} and "
                                 f"{scales.dtype} {list(scales.shape)}")
        quantized[weight] = {"weight_packed": blocks.reshape(num_experts, n, k // 2).contiguous(),
                             "weight_scale": scales.contiguous()}
    biases = {}
    for weight, n in (("gate_up_proj", 2 * intermediate), ("down_proj", hidden)):
        bias = tensors[f"{weight}_bias"]
        if tuple(bias.shape) != (num_experts, n):
            raise ModelLoadError(f"{where}.{weight}_bias: expected {[num_experts, n]}, found {list(bias.shape)}")
        biases[weight] = bias.to(bias_dtype)
    return GptOssQuantExperts(num_experts, hidden, intermediate, "mxfp4", alpha, limit, quantized["gate_up_proj"],
                              quantized["down_proj"], biases["gate_up_proj"], biases["down_proj"])


def mxfp4_tensors(quant: GptOssQuantExperts) -> dict[str, torch.Tensor]:
    """The inverse of `experts_from_mxfp4`: {"<w>_blocks", "<w>_scales", "<w>_bias"} in the checkpoint layout."""
    if quant.weight_format != "mxfp4":
        raise ValueError(f"gpt-oss experts in {quant.weight_format}: the gpt-oss checkpoint layout holds mxfp4 only")
    out = {}
    for weight in WEIGHTS:
        packed, scale = getattr(quant, f"{weight}_weight_packed"), getattr(quant, f"{weight}_weight_scale")
        out[f"{weight}_blocks"] = packed.reshape(*scale.shape, BLOCK_BYTES)
        out[f"{weight}_scales"] = scale
        out[f"{weight}_bias"] = getattr(quant, f"{weight}_bias")
    return out


def _read_state(path: Path, device: torch.device) -> dict[str, torch.Tensor]:
    state = {}
    for f in check_safetensors(path):
        state.update(load_file(str(f), device=str(device)))
    return state


def load_gpt_oss_mxfp4(path, dtype: torch.dtype = torch.bfloat16, device=None):
    """A gpt-oss directory with MXFP4 experts -> (GptOssForCausalLM with GptOssQuantExperts, tokenizer or None).

    The model is built on the meta device; each layer's experts are made from the file's blocks and scales
    (`experts_from_mxfp4`), every other tensor is assigned in `dtype` (default bf16). Nothing is frozen or
    quantized further here (the caller's `quantize_model` does the attention linears)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    config = AutoConfig.from_pretrained(path)
    del config.quantization_config  # build the plain model: its experts are replaced below
    device = torch.device(device or "cpu")
    state = _read_state(path, device)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    names = [n for n, m in model.named_modules() if type(m).__name__ == "GptOssExperts"]
    if not names:
        raise ModelLoadError(f"{path}: no GptOssExperts module in the model transformers built from config.json")
    for name in names:
        module = model.get_submodule(name)
        keys = [f"{w}_{t}" for w in WEIGHTS for t in ("blocks", "scales", "bias")]
        missing = [f"{name}.{k}" for k in keys if f"{name}.{k}" not in state]
        if missing:
            raise ModelLoadError(f"{path}: config says mxfp4 experts but the weights lack {missing[:4]}")
        tensors = {k: state.pop(f"{name}.{k}") for k in keys}
        quant = experts_from_mxfp4(tensors, module.num_experts, module.hidden_size, module.intermediate_size,
                                   module.alpha, module.limit, dtype, where=f"{path}: {name}")
        model.set_submodule(name, quant.to(device))
    assign_remaining(model, state, path, device, dtype)
    return model.eval(), directory_tokenizer(path)


def save_gpt_oss_mxfp4(model: nn.Module, tokenizer, out, overwrite: bool = False) -> Path:
    """Write a gpt-oss model whose experts are MXFP4 `GptOssQuantExperts` in the released checkpoint layout
    (atomic). Every other module must be dense: a policy whose attention qerl quantized is refused (save its
    LoRA adapter instead; the base is the directory it was loaded from)."""
    if model.config.model_type != MODEL_TYPE:
        raise ValueError(f"save_gpt_oss_mxfp4: model_type {model.config.model_type!r} is not {MODEL_TYPE!r}")
    if quant_layers(model):
        raise ValueError("save_gpt_oss_mxfp4: the model holds qerl-quantized linears; this layout keeps every "
                         "module but the experts 16-bit")
    experts = {n: m for n, m in model.named_modules() if isinstance(m, GptOssQuantExperts)}
    if not experts or any(type(m).__name__ == "GptOssExperts" for m in model.modules()):
        raise ValueError("save_gpt_oss_mxfp4: every experts module must be an mxfp4 GptOssQuantExperts")
    state = {}
    for key, t in model.state_dict().items():
        owner = key.rpartition(".")[0]
        if owner not in experts:
            state[key] = t
    for name, quant in experts.items():
        state.update({f"{name}.{k}": t for k, t in mxfp4_tensors(quant).items()})
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    state = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    config = model.config.to_dict()
    config.pop("qerl_weight_format", None)
    config["quantization_config"] = {"quant_method": QUANT_METHOD, "modules_to_not_convert": NOT_CONVERTED}
    with atomic_directory(out, overwrite, kind="quantized model") as tmp:
        write_model_files(tmp, state, config, model, tokenizer)
    return Path(out).expanduser().resolve()
