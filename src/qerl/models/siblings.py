"""Sibling linears (q/k/v, gate/up) stored back to back, so that one matmul serves the whole group.

At decode sizes a matmul costs about a launch, whatever its width: q, k and v as three launches (plus
three split-K reduces) cost nearly three times one launch over their concatenated rows. Serving engines
fuse the weights at load time; qerl keeps one module per linear (the trainer, the checkpoints and PEFT
names need them), so `fuse_sibling_storage` instead moves the siblings' quantized tensors into one buffer,
rows concatenated, and points each module's buffer at its slice. Memory is unchanged, every module keeps
working on its own (training, `state_dict`, safetensors: the slices do not overlap), and
`fused_tensors` views the group as one weight [sum N, ...] whenever that layout still holds. Anything
that copies the buffers apart (`.to()`, `load_state_dict` with `assign=True`) just ends the fusion: the
group then runs as separate matmuls again.

Fusable: QuantLinear siblings of one format, input size and device, whose tensors are either per output
row ([N, ...], concatenated) or one shared scalar of equal value (NVFP4's global scale: `quantize_model`
gives siblings one global scale for exactly this reason).
"""

from typing import Sequence

import torch

from ..nn import QuantLinear

_CHECKED = "_qerl_sibling_scalars"  # on the first module: (versions of the shared scalars) when verified equal


def _row_tensor(t: torch.Tensor, mod: QuantLinear) -> bool:
    return t.dim() >= 1 and t.shape[0] == mod.out_features and t.is_contiguous()


def _scalar_names(mods: Sequence[QuantLinear]) -> list[str]:
    return [n for n in mods[0]._tensor_names if not _row_tensor(getattr(mods[0], n), mods[0])]


def _same_layout(mods: Sequence[QuantLinear]) -> bool:
    first = mods[0]
    if len(mods) < 2 or not all(isinstance(m, QuantLinear) for m in mods):
        return False
    for m in mods:
        if (m.weight_format, m.in_features, m._tensor_names) != (first.weight_format, first.in_features,
                                                                 first._tensor_names):
            return False
        for name in m._tensor_names:
            t, t0 = getattr(m, name), getattr(first, name)
            if t.device != t0.device or t.dtype != t0.dtype:
                return False
            if _row_tensor(t0, first):
                if not _row_tensor(t, m) or t.shape[1:] != t0.shape[1:]:
                    return False
            elif t.numel() != 1 or t0.numel() != 1:
                return False
    return len({m.bias is None for m in mods}) == 1


def _scalars_equal(mods: Sequence[QuantLinear]) -> bool:
    """Shared scalars (e.g. the NVFP4 global scale) equal across siblings. Read from the device once per
    change (cached with the tensors' version counters); False, without a sync, during CUDA graph capture
    when not verified yet."""
    names = _scalar_names(mods)
    versions = tuple(getattr(m, n)._version for m in mods for n in names)
    ptrs = tuple(getattr(m, n).data_ptr() for m in mods for n in names)
    if getattr(mods[0], _CHECKED, None) == (versions, ptrs):
        return True
    t0 = getattr(mods[0], names[0]) if names else None
    if t0 is not None and t0.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    same = all(torch.equal(getattr(m, n), getattr(mods[0], n)) for m in mods[1:] for n in names)
    if same:
        setattr(mods[0], _CHECKED, (versions, ptrs))
    return same


def fused_tensors(mods: Sequence[QuantLinear]) -> dict[str, torch.Tensor] | None:
    """The group's tensors as one weight ({name: [sum N, ...] view, or the shared scalar}), or None when the
    siblings are not (or no longer) stored back to back with equal shared scalars."""
    if not _same_layout(mods):
        return None
    out = {}
    for name in mods[0]._tensor_names:
        t0 = getattr(mods[0], name)
        if not _row_tensor(t0, mods[0]):
            out[name] = t0
            continue
        row_bytes = t0[0].numel() * t0.element_size()
        expect = t0.data_ptr()
        for m in mods:
            t = getattr(m, name)
            if t.data_ptr() != expect or t.untyped_storage().data_ptr() != t0.untyped_storage().data_ptr():
                return None
            expect += t.shape[0] * row_bytes
        rows = sum(getattr(m, name).shape[0] for m in mods)
        out[name] = t0.as_strided((rows, *t0.shape[1:]), t0.stride())
    return out if _scalars_equal(mods) else None


@torch.no_grad()
def fuse_sibling_storage(mods: Sequence[QuantLinear]) -> bool:
    """Store the siblings' per-row tensors in one buffer each (rows in `mods` order) and point every module
    at its slice. Values, shapes and dtypes are unchanged. Returns whether the group is fused (True at once
    when it already was); False, changing nothing, when the siblings cannot share a weight."""
    if not _same_layout(mods) or not _scalars_equal(mods):
        return False
    if fused_tensors(mods) is not None:
        return True
    for name in mods[0]._tensor_names:
        if not _row_tensor(getattr(mods[0], name), mods[0]):
            continue
        whole = torch.cat([getattr(m, name) for m in mods])  # old tensors are freed as each slice replaces them
        row = 0
        for m in mods:
            n = m.out_features
            setattr(m, name, whole[row:row + n])
            row += n
    return True
