"""What qerl's frozen 4-bit modules share: a weight held only in its storage format, as buffers whose dtypes never
change, and (for the ones that carry LoRA) the switch that the KL reference pass turns off.

`QuantLinear`, `QuantEmbedding` and `QuantExperts` (with gpt-oss's `GptOssQuantExperts`) derive from
`QuantizedModule`; each registers the format's tensors as buffers and lists their names in `_tensor_names`.
"""

from contextlib import contextmanager

import torch
from torch import nn


class QuantizedModule(nn.Module):
    """A module holding a weight in the qerl format `weight_format` as the buffers named in `_tensor_names`.

    `.half()`, `.to(dtype)` etc. may move those buffers but never change their dtype (`_apply`). Subclasses
    with LoRA set `carries_lora` and keep an instance flag `lora_enabled` (on by default), which
    `lora_disabled` turns off."""

    weight_format: str
    _tensor_names: tuple[str, ...] = ()
    carries_lora = False

    def quantized_tensors(self) -> dict[str, torch.Tensor]:
        """{buffer name: tensor} of the format's tensors, in registration order."""
        return {name: getattr(self, name) for name in self._tensor_names}

    def _apply(self, fn, recurse=True):
        """Module._apply for a layer holding a 4-bit format: torch casts every floating buffer, and NVFP4's FP8
        block scales or its FP32 global scale (a divisor up to ~1e7 for small-amax weights, inf in fp16) would
        silently change the weight, so the format's tensors only follow the device. Bias, LoRA and other
        buffers follow the requested dtype as usual; the dense "bf16" format does too."""
        if getattr(self, "weight_format", "bf16") == "bf16":
            return super()._apply(fn, recurse)
        def device_only(t):
            out = fn(t)
            owned = any(t is getattr(self, name) for name in self._tensor_names)
            return t.to(out.device) if owned and out.dtype != t.dtype else out

        return super()._apply(device_only, recurse)


@contextmanager
def lora_disabled(model: nn.Module):
    """Inside, every quantized module of `model` that carries LoRA (`QuantLinear`, and the 4-bit experts stacks
    `QuantExperts` with expert LoRA) computes its base only: the reference policy pi_ref of GRPO's KL term, with
    no second copy of the model."""
    layers = [m for m in model.modules() if isinstance(m, QuantizedModule) and m.carries_lora]
    previous = [m.lora_enabled for m in layers]
    for m in layers:
        m.lora_enabled = False
    try:
        yield
    finally:
        for m, p in zip(layers, previous):
            m.lora_enabled = p
