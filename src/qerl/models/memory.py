"""Memory reports: the bytes a converted model holds, split into its quantized base, kept 16-bit layers, LoRA
and the rest; and the bytes a decode step reads of it (`policy_bytes`)."""

from typing import Iterable

from torch import nn

from ..nn import QuantEmbedding
from .convert import input_embeddings_tied
from .lora_attach import lora_parameters
from .targets import quant_embeddings, quant_experts, quant_layers


def memory_report(model: nn.Module) -> dict[str, float]:
    """Bytes held by the model (parameters + buffers), split into the quantized base, the rest, and LoRA.

    `base_bytes_per_param` counts every stored byte of the quantized layers (codes, scales, global
    scales, biases) per base weight they represent. A quantized input embedding (`QuantEmbedding`) is part
    of the quantized base: its V x D entries and its bytes are included. Layers kept in 16 bits beside 4-bit
    ones (`keep_bf16`) are counted apart, `kept_bf16_params` / `kept_bf16_bytes`, so that
    `base_bytes_per_param` stays the 4-bit format's figure; in an all-bf16 model (format bf16) they are the base.
    4-bit MoE experts (`QuantExperts`) are quantized base too: E x (2I x H + H x I) weights and their buffers.
    """
    layers = quant_layers(model)
    experts = list(quant_experts(model).values())
    four_bit = bool(experts) or any(m.weight_format != "bf16" for m in layers.values())
    kept = [m for m in layers.values() if four_bit and m.weight_format == "bf16"]
    base = [m for m in layers.values() if not (four_bit and m.weight_format == "bf16")]
    embeds = list(quant_embeddings(model).values())
    q_bytes = _buffer_bytes([*base, *embeds, *experts])
    q_params = (sum(m.in_features * m.out_features for m in base)
                + sum(m.num_embeddings * m.embedding_dim for m in embeds)
                + sum(m.num_experts * 3 * m.intermediate_dim * m.hidden_dim for m in experts))
    kept_bytes = _buffer_bytes(kept)
    lora = sum(p.numel() * p.element_size() for p in lora_parameters(model).values())
    # parameters() and buffers() each skip duplicates, so tied embeddings count once.
    total = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    return {
        "quantized_params": q_params,
        "quantized_bytes": q_bytes,
        "base_bytes_per_param": q_bytes / max(q_params, 1),
        "kept_bf16_params": sum(m.in_features * m.out_features for m in kept),
        "kept_bf16_bytes": kept_bytes,
        "lora_bytes": lora,
        "other_bytes": total - q_bytes - kept_bytes - lora,
        "total_bytes": total,
    }


def _buffer_bytes(modules: Iterable[nn.Module]) -> int:
    return sum(t.numel() * t.element_size() for m in modules for t in m.buffers())


def policy_bytes(model) -> tuple[int, int]:
    """(bytes a decode step reads for weights: everything but the input embedding; total policy bytes).

    A step looks up B rows of the input embedding, not the table, so an untied table is not counted as
    read, whether dense (nn.Embedding) or 4-bit (QuantEmbedding: its packed codes and scales)."""
    total = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    emb = model.get_input_embeddings()
    if isinstance(emb, QuantEmbedding):
        emb_bytes = sum(t.numel() * t.element_size() for t in emb.buffers())
    else:  # (the tie test also holds for a model built on the meta device, where every data_ptr is 0)
        emb_bytes = 0 if input_embeddings_tied(model) else emb.weight.numel() * emb.weight.element_size()
    return total - emb_bytes, total
