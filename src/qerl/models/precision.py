"""Per-layer precision: which quantization targets stay in 16 bits (`keep_bf16`), and what that costs.

A kept linear becomes `QuantLinear(format="bf16")`, the same layer class as its 4-bit neighbours, so LoRA,
the trainer and the rollout engine treat it like any other. Each `keep_bf16` entry is matched against the
full module names of the model's target linears (`model.layers.3.self_attn.q_proj`):

  exact name       model.layers.0.self_attn.q_proj
  fnmatch pattern  *.down_proj, model.layers.2?.mlp.*   (`*` also crosses dots: model.layers.1* is
                   layers 1 and 10-19; case-sensitive)
  module name      model.layers.29 (every target inside that module, as model.layers.29.*)
  last:N           every target of the last N decoder layers, N >= 1 (last:2 on a 28-layer model is
                   model.layers.26.* and model.layers.27.*)

An entry that matches no target is an error naming it. Embeddings, norms and lm_head are never targets:
they are 16-bit anyway.

Serving note: vLLM fuses q/k/v and gate/up into one matmul and refuses a checkpoint in which only some
members of such a group are quantized. qerl and transformers handle partial groups (the quantized members
still share one global scale); `partial_sibling_groups` names them so a caller can warn.
"""

from fnmatch import fnmatchcase
from functools import lru_cache
from typing import Iterable

import torch
from torch import nn

# check_keep_bf16: the syntax check needs no model, so it lives in the torch-free `qerl.choices` (config validation)
from ..choices import KEEP_BF16_LAST as LAST, check_keep_bf16, keep_bf16_last_count as _last_count  # noqa: F401
from ..formats import FORMATS, WeightFormat
from ..nn import DEFAULT_TARGETS
from .targets import FUSED_GROUPS, find_targets

_EXAMPLES = 4  # valid names quoted in an error message


def parse_keep_bf16(text: str) -> list[str]:
    """A command line's "--keep-bf16 last:2,*.down_proj" as checked entries ([] for ""); ValueError (prefixed
    --keep-bf16) when one is malformed."""
    try:
        return check_keep_bf16([k.strip() for k in text.split(",") if k.strip()])
    except ValueError as e:
        raise ValueError(f"--keep-bf16: {e}") from None


def decoder_layer_index(name: str) -> int | None:
    """The decoder layer a module name lies in: its first all-digit component (`model.layers.7.mlp` -> 7)."""
    return next((int(part) for part in name.split(".") if part.isdigit()), None)


def _matches(name: str, pattern: str) -> bool:
    # `pattern + ".*"` lets a module's own name select everything inside it
    return fnmatchcase(name, pattern) or fnmatchcase(name, pattern + ".*")


def _last_layers(names: list[str], spec: str) -> set[str]:
    n = _last_count(spec)
    index = {name: decoder_layer_index(name) for name in names}
    layers = sorted({i for i in index.values() if i is not None})
    if not layers:
        raise ValueError(f"keep_bf16 entry {spec!r}: no target lies in a numbered decoder layer")
    if n > len(layers):
        raise ValueError(f"keep_bf16 entry {spec!r}: the model has only {len(layers)} decoder layers")
    last = set(layers[-n:])
    return {name for name, i in index.items() if i in last}


def _no_match(spec: str, names: list[str]) -> ValueError:
    shown = names[:_EXAMPLES - 1] + names[-1:] if len(names) > _EXAMPLES else names
    return ValueError(
        f"keep_bf16 entry {spec!r} matches no quantization target; targets are named like "
        f"{', '.join(shown)} ({len(names)} in all; embeddings, norms and lm_head are 16-bit anyway)")


def match_keep_bf16(names: Iterable[str], specs: Iterable[str]) -> list[str]:
    """The target names (full module names, in the given order) that any entry of `specs` selects.

    ValueError for a malformed entry or one that selects nothing. `last:N` counts decoder layers among
    `names`, so `names` must be the whole model's targets."""
    return _matched(list(names), check_keep_bf16(specs))


def _matched(names: list[str], specs: list[str]) -> list[str]:
    """`match_keep_bf16` for entries already checked."""
    chosen = set()
    for spec in specs:
        hit = _last_layers(names, spec) if spec.startswith(LAST) else {n for n in names if _matches(n, spec)}
        if not hit:
            raise _no_match(spec, names)
        chosen |= hit
    return [n for n in names if n in chosen]


def resolve_keep_bf16(model: nn.Module, specs: Iterable[str], targets: Iterable[str] = DEFAULT_TARGETS,
                      name_prefix: str = "") -> set[str]:
    """The full module names of the target linears of `model` that `specs` keep in 16 bits.

    model: a whole causal LM (a meta-device skeleton works: only names are read), or one block whose
    names get `name_prefix` (e.g. "model.layers.3."); `last:N` needs the whole model and is refused then."""
    return resolve_checked_keep_bf16(model, check_keep_bf16(specs), targets, name_prefix)


def resolve_checked_keep_bf16(model: nn.Module, specs: list[str], targets: Iterable[str] = DEFAULT_TARGETS,
                              name_prefix: str = "") -> set[str]:
    """`resolve_keep_bf16` for entries whose syntax is checked already (`Quantization.keep_bf16`)."""
    if name_prefix and any(s.startswith(LAST) for s in specs):
        raise ValueError("keep_bf16 last:N needs the whole model to count its layers; resolve it with "
                         "resolve_keep_bf16(whole model) and pass the resulting names")
    names = [name_prefix + n for n in find_targets(model, targets)]
    return set(_matched(names, specs))


def refuse_kept_experts(experts: Iterable[str], specs: Iterable[str]) -> None:
    """ValueError when a keep_bf16 entry (`specs`, syntax checked) names one of `experts` (full names of MoE experts
    stacks): experts are not kept in 16 bits. last:N selects target linears only; the experts there stay 4-bit."""
    experts = list(experts)
    for spec in specs:
        hit = None if spec.startswith(LAST) else next((n for n in experts if _matches(n, spec)), None)
        if hit is not None:
            raise ValueError(f"keep_bf16 entry {spec!r} matches the MoE experts module {hit}: keeping experts in "
                             "16 bits is not supported; narrow the pattern to linears, or pass experts=False to "
                             "leave every experts module dense")


def names_under(kept: Iterable[str], prefix: str) -> set[str]:
    """The names in `kept` that lie under module `prefix` ("model.layers.3."), relative to it ("mlp.up_proj")."""
    return {n[len(prefix):] for n in kept if n.startswith(prefix)}


def partial_sibling_groups(kept: Iterable[str], names: Iterable[str]) -> list[list[str]]:
    """Fused groups (q/k/v, gate/up under one parent) of which some members are kept and others are not.

    kept: the kept names; names: every target name (kept or quantized). Returns each such group's present
    members, in FUSED_GROUPS order: the groups a serving engine that fuses siblings (vLLM) refuses."""
    kept, names = set(kept), set(names)
    out = []
    for parent in sorted({n.rpartition(".")[0] for n in kept}):
        for group in FUSED_GROUPS:
            members = [f"{parent}.{leaf}" if parent else leaf for leaf in group]
            members = [m for m in members if m in names]
            if len({m in kept for m in members}) > 1:
                out.append(members)
    return out


@lru_cache(maxsize=None)
def _format_row_bytes(fmt: WeightFormat, in_features: int) -> tuple[int, int]:
    """(bytes per output row, bytes per weight) of `fmt` at this input size, incl. every scale."""

    def stored(rows: int) -> int:  # quantize a small stand-in: the layout depends only on the shape
        tensors = fmt.quantize(torch.ones(rows, in_features), None)
        return sum(t.numel() * t.element_size() for t in tensors.values())

    # 64 and 128 rows keep N*K a multiple of every block (NF4 blocks run over the flattened tensor)
    small, large = stored(64), stored(128)
    per_row = (large - small) // 64
    return per_row, small - 64 * per_row


def format_bytes(fmt: WeightFormat, out_features: int, in_features: int) -> int:
    """Bytes a weight [out_features, in_features] takes in `fmt`: codes, block scales, global scales."""
    per_row, per_weight = _format_row_bytes(fmt, in_features)
    return out_features * per_row + per_weight


def keep_bf16_extra_bytes(model: nn.Module, kept: Iterable[str], fmt: WeightFormat) -> int:
    """Bytes the kept linears take in bf16 beyond what `fmt` would take for them (biases excluded: equal).

    model: before or after quantization (nn.Linear or QuantLinear, only in/out features are read);
    kept: their module names (`resolve_keep_bf16`)."""
    extra = 0
    for name in kept:
        mod = model.get_submodule(name)
        n, k = mod.out_features, mod.in_features
        try:
            extra += format_bytes(FORMATS["bf16"], n, k) - format_bytes(fmt, n, k)
        except ValueError as e:  # e.g. in_features not a multiple of the block: no 4-bit size to compare
            raise ValueError(f"{name}: {e}") from None
    return extra


def describe_keep_bf16(model: nn.Module, kept: Iterable[str], fmt: WeightFormat) -> str:
    """One line for the logs, e.g. "keep_bf16: 14 linears, +12.3 MiB over nvfp4"."""
    kept = list(kept)
    mib = keep_bf16_extra_bytes(model, kept, fmt) / 2**20
    return f"keep_bf16: {len(kept)} linear{'s' * (len(kept) != 1)}, +{mib:.1f} MiB over {fmt.name}"
