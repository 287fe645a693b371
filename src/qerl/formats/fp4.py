"""FP4 E2M1 element codes shared by NVFP4 and MXFP4: rounding, packing two per byte, decoding.

A code is 4 bits: bit 3 is the sign, bits 0-2 index the magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6}.
Packing follows compressed-tensors / vLLM: element 2i goes in the LOW nibble of byte i.
"""

import functools

import torch

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0

# (threshold, inclusive) between consecutive magnitudes. A tie rounds to the code with an even
# mantissa bit (code & 1 == 0), i.e. round-to-nearest-even: 0.25->0, 0.75->1, 1.25->1, 1.75->2, ...
_E2M1_STEPS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def e2m1_values(device=None) -> torch.Tensor:
    """All 16 code values, float32 [16]; index = code (codes 8..15 are the negatives, 8 is -0).

    Cached per device: a host-to-device copy per call would break CUDA-graph capture of the fallback path.
    Treat the result as read-only."""
    return _e2m1_table(str(torch.device(device if device is not None else "cpu")))


@functools.lru_cache(maxsize=None)
def _e2m1_table(device: str) -> torch.Tensor:
    mags = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=device)
    return torch.cat([mags, -mags])


def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round float32 values (already divided by their block scale) to E2M1 codes, uint8 of x's shape.

    Saturates at +-6. The sign bit is set for x < 0, so a negative value that rounds to zero gives
    code 8 (-0) while an input of exactly -0.0 gives code 0, as compressed-tensors does (its CPU path
    multiplies by torch.sign(x), its Triton kernel tests x < 0; torchao's cast keeps -0.0 as code 8).
    NaN must be rejected before calling.
    """
    mag = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for threshold, inclusive in _E2M1_STEPS:
        code += (mag >= threshold) if inclusive else (mag > threshold)
    return code | ((x < 0).to(torch.uint8) << 3)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes (any shape) -> float32 values of the same shape."""
    return e2m1_values(codes.device)[codes.long()]


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., K] (K even) -> packed uint8 [..., K/2], element 2i in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"FP4 packing needs an even last dimension, got shape {tuple(codes.shape)}")
    pairs = codes.reshape(*codes.shape[:-1], -1, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """packed uint8 [..., K/2] -> uint8 codes [..., K]."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(*packed.shape[:-1], -1)
