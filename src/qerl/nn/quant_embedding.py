"""An input embedding whose table is stored only in a 4-bit qerl format (opt-in, frozen).

    out[i] = dequantize(table row ids[i])

The table E [V, D] is held as the format's tensors, under the names the format uses for a linear weight
(rows = tokens, D = "input features"):
    nvfp4: weight_packed uint8 [V, D/2], weight_scale float8_e4m3fn [V, D/16], weight_global_scale fp32 [1]
    mxfp4: weight_packed uint8 [V, D/2], weight_scale uint8 (E8M0 exponents) [V, D/32]
    nf4:   weight_packed uint8 [V, D/2], weight_absmax fp32 [V*D/64] (D % 64 == 0, so no block spans rows)
A lookup gathers the packed bytes and block scales of the requested rows only and dequantizes those rows
with the format's own `dequantize` (fp32 product, one cast to the output dtype), so the result equals
`F.embedding(ids, dequantize(table, dtype))` bit for bit and no dense [V, D] table exists at any time.

The table is frozen: no parameters, no gradient. `padding_idx` only changes nn.Embedding's gradient (and its
init), never a lookup, so it is kept solely to rebuild an identical nn.Embedding (`to_embedding`).
"""

import torch
from torch import nn

from ..formats import WeightFormat, get_format
from .quant_base import QuantizedModule

# tensors that hold one value for the whole table; every other tensor has a leading row axis of V rows
_PER_TENSOR = ("weight_global_scale",)


class QuantEmbedding(QuantizedModule):
    """Frozen 4-bit token embedding. Build with `QuantEmbedding.from_embedding(embedding, fmt)`."""

    def __init__(self, num_embeddings: int, embedding_dim: int, fmt: str | WeightFormat,
                 tensors: dict[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16, padding_idx: int | None = None):
        super().__init__()
        spec = get_format(fmt)
        if spec.name in ("bf16", "fp8"):
            raise ValueError(f"QuantEmbedding needs a 4-bit format (nvfp4, mxfp4, nf4), not {spec.name}")
        check_embedding_shape(num_embeddings, embedding_dim, spec)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight_format = spec.name
        self.dtype = dtype  # the output dtype of a lookup (the model's)
        self.padding_idx = padding_idx
        self._tensor_names = tuple(tensors)
        for name, t in tensors.items():
            self.register_buffer(name, t)

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, fmt: WeightFormat) -> "QuantEmbedding":
        """Quantize nn.Embedding's table [V, D] (its own global scale, round-to-nearest)."""
        V, D = embedding.weight.shape
        check_embedding_shape(V, D, fmt)
        tensors = fmt.quantize(embedding.weight, None)
        return cls(V, D, fmt, tensors, embedding.weight.dtype, embedding.padding_idx)

    @property
    def device(self) -> torch.device:
        return self.weight_packed.device

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The whole table [V, D] as a new dense tensor (export, tests); never used by `forward`."""
        return get_format(self.weight_format).dequantize(**self.quantized_tensors(), dtype=dtype or self.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids int [*] -> embeddings [*, D] in self.dtype, dequantized from the gathered rows only."""
        flat = ids.reshape(-1)
        if flat.numel() == 0:  # (a shape check, no device sync) the unpacking cannot reshape zero rows
            return torch.empty(*ids.shape, self.embedding_dim, dtype=self.dtype, device=self.device)
        rows = {}
        for name, t in self.quantized_tensors().items():
            if name in _PER_TENSOR:
                rows[name] = t
            else:  # [V, ...] or flat [V * per_row]: gather whole rows, keep the tensor's rank
                picked = t.view(self.num_embeddings, -1).index_select(0, flat)
                rows[name] = picked if t.ndim > 1 else picked.reshape(-1)
        out = get_format(self.weight_format).dequantize(**rows, dtype=self.dtype)
        return out.view(*ids.shape, self.embedding_dim)

    def to_embedding(self, dtype: torch.dtype | None = None) -> nn.Embedding:
        """An nn.Embedding holding the dequantized table (in `dtype`, default the lookup dtype), frozen."""
        weight = self.dequantized_weight(dtype)
        emb = nn.Embedding(self.num_embeddings, self.embedding_dim, padding_idx=self.padding_idx,
                           device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            emb.weight.copy_(weight)  # after construction: nn.Embedding zeroes the padding row at init
        emb.weight.requires_grad_(False)
        return emb

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, format={self.weight_format}, dtype={self.dtype}"
                + (f", padding_idx={self.padding_idx}" if self.padding_idx is not None else ""))


def check_embedding_shape(num_embeddings: int, embedding_dim: int, fmt: WeightFormat) -> None:
    """Raise ValueError unless every row of a [V, D] table splits into whole blocks of the format (a row
    gather needs that; NF4's flattened 64-blocks must not span rows)."""
    block = fmt.block
    if embedding_dim % block or embedding_dim % 2:
        raise ValueError(f"embedding dim {embedding_dim} is not a multiple of the {fmt.name} block size {block}; "
                         "its rows cannot be looked up block-wise")
