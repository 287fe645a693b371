"""Calibration for the calibrated methods (gptq, awq) and lora.init eora, in three steps:

  tokens      `calibration_ids`: a source's text (`qerl.data.calibration`: reasoning-gym problems, the model's own
              answers, the run's prompts, a file) as token ids int64 [S, T]
  statistics  the tokens run through the embedding; a pre-hook on decoder layer 0 records the hidden states and the
              arguments the model passes its layers (position embeddings, mask); per layer, hooks on the dense
              target linears accumulate each input's Hessian H = sum x x^T / n (fp32 [K, K]) and keep a row
              sample for AWQ
  the loop    `calibrated_quantize`: per decoder layer, in order, the statistics of the dense layer, AWQ's folds,
              the quantized linears (`surgery`), and the quantized layer computes the next layer's inputs, so later
              layers absorb earlier layers' error

Only one layer's statistics and the hidden states [S, T, D] are alive at a time, so the loop also works on the
layer-by-layer builder's meta-device skeleton. `convert.quantize_model(method="gptq" | "awq")` and the layer-by-layer
builder (`stream`) call it.
"""

from contextlib import contextmanager
from typing import Iterable

import torch
from rich.progress import Progress
from torch import nn

from ..data.calibration import calibration_texts, pack_tokens
from ..data.templates import build_prompt
from ..formats import WeightFormat
from ..quant import quantize_weights
from ..quant.awq import FOLDED_SCALES, apply_awq, folded_covariances
from .lora_attach import add_lora_to
from .precision import names_under
from .quantization import Quantization
from .surgery import keep_dense_linears, method_quantizer, replace_linears, sibling_groups
from .targets import find_targets

AWQ_SAMPLE_ROWS = 2048  # input rows kept per linear for AWQ's search (its cost is linear in them)
BATCH_TOKENS = 8192  # calibration tokens per layer call


# calibration tokens -------------------------------------------------------------------------------

# calibration sequences when none are asked for: the statistics pass costs CPU time in proportion to the
# tokens while GPTQ's rounding does not; on SmolLM2 64 and 128 sequences of 256 give the same KL (0.103 /
# 0.106) and 64 keeps GPTQ under two minutes on two cores (docs/formats.md)
DEFAULT_SAMPLES = {"cpu": 64, "cuda": 128}


def default_samples(device) -> int:
    """Calibration sequences for a model quantized on `device` when the user names none."""
    return DEFAULT_SAMPLES.get(torch.device(device).type, DEFAULT_SAMPLES["cuda"])


@torch.no_grad()
def greedy_answers(model: nn.Module, tokenizer, rows: list[dict], max_new_tokens: int = 128,
                   batch_size: int = 32) -> list[str]:
    """The (16-bit) model's own greedy completions of the rows' prompts, as calibration answers; on the CPU
    generated in float32 (the model gets its dtypes back after)."""
    device = next(p.device for p in model.parameters() if not p.is_meta)
    with computing_in(model, calibration_compute_dtype(device)):
        return _greedy_answers(model, tokenizer, rows, max_new_tokens, batch_size, device)


def _greedy_answers(model, tokenizer, rows, max_new_tokens, batch_size, device) -> list[str]:
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    pad_token = tokenizer.pad_token
    if pad_token is None:  # batching needs one; EOS is masked out by the attention mask anyway
        tokenizer.pad_token = tokenizer.eos_token
    pad = tokenizer.pad_token_id
    answers = []
    try:
        for r0 in range(0, len(rows), batch_size):
            prompts = [build_prompt(r["question"], tokenizer) for r in rows[r0:r0 + batch_size]]
            enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
            answers += tokenizer.batch_decode(out[:, enc.input_ids.shape[1]:], skip_special_tokens=True)
    finally:
        tokenizer.padding_side, tokenizer.pad_token = side, pad_token
    return answers


def calibration_ids(source: str, tokenizer, samples: int = DEFAULT_SAMPLES["cuda"], max_tokens: int = 256,
                    model: nn.Module | None = None,
                    train_rows: list[dict] | None = None) -> torch.Tensor:
    """Calibration token ids int64 [S <= samples, max_tokens] from a source of `qerl.data.calibration`.

    model: the 16-bit model, whole (source "self", or "self:FILE" for the prompts of a question/answer JSONL);
    train_rows: the run's training problems (source "train", and added to "auto" when given)."""
    answer = None if model is None else (lambda rows: greedy_answers(model, tokenizer, rows))
    texts = calibration_texts(source, tokenizer, samples, max_tokens, answer=answer, train_rows=train_rows)
    return pack_tokens(texts, tokenizer, samples, max_tokens, where=source)

# layer statistics ---------------------------------------------------------------------------------

class _Captured(Exception):
    pass


def calibration_compute_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype the layer-by-layer passes compute in: float32 on the CPU, where bf16 matmuls are far
    slower (`qerl.models.sources.compute_dtype`); None (the model's own) on a GPU."""
    return torch.float32 if device.type == "cpu" else None


def cast_floating(obj, dtype: torch.dtype | None):
    """obj with every floating tensor in it (nested tuples, lists, dicts) cast to dtype; None keeps it."""
    if dtype is None:
        return obj
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, (tuple, list)):
        return type(obj)(cast_floating(o, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: cast_floating(v, dtype) for k, v in obj.items()}
    return obj


@contextmanager
def computing_in(layer: nn.Module, dtype: torch.dtype | None):
    """Run `layer` in `dtype` inside (None: unchanged). On exit the parameters and buffers that the cast
    changed (present on entry in another dtype, in `dtype` now) get their entry dtype back; tensors
    created inside (LoRA's fp32 masters, AWQ's channel scales, the formats' own storage) keep theirs."""
    if dtype is None:
        yield
        return
    entry = {name: t.dtype for name, t in [*layer.named_parameters(), *layer.named_buffers()]}
    layer.to(dtype)
    try:
        yield
    finally:
        for name, t in [*layer.named_parameters(), *layer.named_buffers()]:
            if name in entry and t.dtype == dtype != entry[name]:
                t.data = t.data.to(entry[name])


def capture_layer_inputs(model: nn.Module, ids: torch.Tensor, device, dtype: torch.dtype | None = None
                         ) -> list[tuple[torch.Tensor, dict]]:
    """[(hidden [B, T, D], layer kwargs)] per batch of calibration rows, as decoder layer 0 receives them;
    dtype: cast the hidden states and floating kwargs (RoPE cos/sin, an additive mask) to it."""
    layers = model.model.layers
    batches = []

    def hook(_module, args, kwargs):
        hidden = args[0] if args else kwargs.pop("hidden_states")
        kwargs = {k: v for k, v in kwargs.items() if k not in ("hidden_states", "past_key_values", "past_key_value")}
        kwargs["use_cache"] = False
        batches.append((cast_floating(hidden.detach(), dtype), cast_floating(kwargs, dtype)))
        raise _Captured

    rows = max(1, BATCH_TOKENS // ids.shape[1])
    handle = layers[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        for r0 in range(0, ids.shape[0], rows):
            try:
                model(input_ids=ids[r0:r0 + rows].to(device), use_cache=False)
            except _Captured:
                pass
    finally:
        handle.remove()
    return batches


def layer_output(layer: nn.Module, hidden: torch.Tensor, kwargs: dict) -> torch.Tensor:
    out = layer(hidden, **kwargs)
    return out[0] if isinstance(out, tuple) else out


@torch.no_grad()
def layer_statistics(layer: nn.Module, names: list[str], batches, total_rows: int, hessians: bool = True,
                     samples: bool = True) -> tuple[dict, dict]:
    """Run the dense `layer` on every batch; ({name: H fp32 [K, K]}, {name: input rows [<= AWQ_SAMPLE_ROWS, K]}).
    hessians / samples: whether to collect each (gptq needs the Hessians, awq the row samples)."""
    sums, counts, rows = {}, {}, {}
    stride = max(1, -(-total_rows // AWQ_SAMPLE_ROWS))
    seen = set()

    def hook_for(name):
        def hook(_module, args):
            seen.add(name)
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            if hessians:
                if name in sums:
                    sums[name].addmm_(x.t(), x)
                else:
                    sums[name] = x.t() @ x
                counts[name] = counts.get(name, 0) + x.shape[0]
            if samples:
                rows.setdefault(name, []).append(x[::stride].cpu())
            if len(seen) == len(names):  # every input recorded: the rest of the layer (down_proj...) is not needed
                raise _Captured
        return hook

    handles = [layer.get_submodule(n).register_forward_pre_hook(hook_for(n)) for n in names]
    try:
        for hidden, kwargs in batches:
            seen.clear()
            try:
                layer_output(layer, hidden, kwargs)
            except _Captured:
                pass
    finally:
        for h in handles:
            h.remove()
    return ({n: sums[n] / counts[n] for n in sums},
            {n: torch.cat(r)[:AWQ_SAMPLE_ROWS] for n, r in rows.items()})


def awq_fake_quant(fmt: WeightFormat):
    """AWQ's search quantizer: list of W [N_i, K] fp32 -> dequantized round-to-nearest copies (sharing one
    global scale). Round-to-nearest, as AWQ searches: the search calls it 21 times per group, so the
    method's own dearer rounding is kept for the final weights."""
    def fake_quant(ws):
        return [fmt.dequantize(**t, dtype=torch.float32) for t in quantize_weights(fmt, "rtn", ws)]
    return fake_quant

# the layer-by-layer loop ----------------------------------------------------------------------------

@torch.no_grad()
def calibrated_quantize(model: nn.Module, q: Quantization, *, device=None, fill=None, show_progress: bool = False,
                        keep: Iterable[str] = ()) -> dict:
    """Quantize every decoder layer of an HF causal LM as `q` with a calibrated method (gptq, awq), in order; also
    any method when `q.lora.init` is eora, whose adapters are fitted on each layer's input covariance (`lora_init`).
    The next layer's inputs then come from the quantized layer with its fitted adapter (the model RL starts from),
    so with gptq the later layers' Hessians, and so their codes, differ from gptq with a zero-init adapter. With awq
    the eora fit is to the folded weights, on the covariances of the folded inputs (`awq.folded_covariances`).

    q.calibration: int64 [S, T] calibration tokens. Per layer: its inputs' Hessians and row samples from the dense
    layer; AWQ folds its scales; the layer is quantized; the quantized layer makes the next layer's inputs, so
    later layers absorb earlier layers' error. fill(module, prefix): materialise each decoder layer from the meta
    device first (the layer-by-layer builder; the embedding and rotary module must be real already). keep: full
    names of targets left 16-bit (`keep_bf16`, resolved); AWQ still folds into them (exact), they are just not
    rounded. Returns {"tokens", "awq_scales": {module path: s fp32 [K]}}."""
    if not q.calibrated:
        raise ValueError(f"{q.method!r} needs no calibration; use quantize_model(method={q.method!r})")
    ids = q.calibration
    device = torch.device(device or next(p.device for p in model.parameters() if not p.is_meta))
    compute = calibration_compute_dtype(device)
    body = model.model
    awq_scales = {}
    with Progress(disable=not show_progress, transient=True) as progress:
        batches = capture_layer_inputs(model, ids, device, compute)
        task = progress.add_task(f"calibrating + quantizing to {q.format.name} ({q.method})", total=len(body.layers))
        for i, layer in enumerate(body.layers):
            prefix = f"model.layers.{i}."
            if fill is not None:
                fill(layer, prefix)
            with computing_in(layer, compute):
                awq_scales.update(_calibrate_layer(layer, prefix, q, names_under(set(keep), prefix), batches, device))
                batches = [(layer_output(layer, h, kw), kw) for h, kw in batches]
            progress.advance(task)
    for name, p in model.named_parameters():  # embeddings, norms, lm_head: frozen as in the rtn path
        p.requires_grad_(".lora_" in name)
    if awq_scales:  # adapters of this model are saved / loaded as adapters of the unfolded model
        setattr(model, FOLDED_SCALES, awq_scales)
    return {"tokens": ids.numel(), "awq_scales": awq_scales}


def _calibrate_layer(layer: nn.Module, prefix: str, q: Quantization, kept_here: set[str], batches,
                     device) -> dict[str, torch.Tensor]:
    """One decoder layer of `calibrated_quantize`: statistics, AWQ folding, quantization, in place; kept_here: the
    targets left 16-bit, relative to the layer. Returns this layer's AWQ scales {full module path: s fp32 [K]}
    (empty for gptq)."""
    linears = find_targets(layer, q.targets)  # AWQ folds into these modules in place: they stay the ones to replace
    names = [n for n in linears if n not in kept_here]
    leaders = [g[0] for g in sibling_groups(names)]  # siblings share their input: one Hessian each
    # gptq: the Hessians; awq: row samples (it rounds without a Hessian: the folded weights see scaled inputs)
    hessians, samples = layer_statistics(layer, leaders, batches, q.calibration.numel(),
                                         hessians=q.method == "gptq" or q.eora, samples=q.method == "awq")
    awq_scales = {}
    if q.method == "awq":
        leaf_samples = {n.rpartition(".")[2]: s.to(device) for n, s in samples.items()}
        fake_quant = awq_fake_quant(q.format)
        folds = apply_awq(layer, leaf_samples, fake_quant)
        awq_scales.update({prefix + name: s for name, s in folds.items()})
        if q.eora:  # the adapters are fitted to the folded weights, whose inputs are the folded ones
            hessians = folded_covariances(hessians, folds)
    kept = keep_dense_linears(layer, {n: linears[n] for n in sorted(kept_here)})
    if names:  # rtn (eora only): the default quantizer, as quantize_keeping's
        quantizer = None if q.method == "rtn" else method_quantizer(layer, names, q.format, q.method, hessians)
        covariances = {n: hessians[g[0]] for g in sibling_groups(names) for n in g} if q.eora else None
        replace_linears(layer, {n: linears[n] for n in names}, q.format, q.lora, quantizer, covariances=covariances)
    add_lora_to(kept, q.lora)
    return awq_scales
