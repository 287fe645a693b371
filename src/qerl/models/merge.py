"""A trained adapter merged into the 16-bit model: one Hugging Face directory any server loads.

An adapter `qerl train` wrote on a 4-bit base names the original model as its base
(`base_model_name_or_path`), and PEFT merges it into that model's 16-bit weights: each targeted weight
W [out, in] becomes W + scaling * B [out, r] @ A [r, in] (expert LoRA and trained routers as PEFT merges them).
On Qwen2.5-Coder-1.5B such an adapter scored as a bf16-trained one on the 16-bit model, and 0.02-0.04 lower on
its 4-bit training base (docs/results.md, "The gap is in the base").
"""

from pathlib import Path

from .adapter import AdapterError, read_adapter_weights, trained_base
from .atomic import atomic_directory, check_output_dir


def adapter_base(adapter) -> str:
    """The model an adapter directory names as its base, as qerl names it (`adapter.trained_base`);
    FileNotFoundError when it is not a PEFT adapter directory, ValueError when it names no base."""
    config = Path(adapter).expanduser() / "adapter_config.json"
    if not config.is_file():
        raise FileNotFoundError(f"{adapter}: no adapter_config.json (a PEFT adapter directory, e.g. RUN/adapter)")
    base = trained_base(adapter)
    if not base:
        raise ValueError(f"{config}: names no base model; give it with --model")
    return base


def merge_adapter(adapter, out, model: str | None = None, dtype: str = "bf16", device: str = "cpu",
                  trust_remote_code: bool = False, overwrite: bool = False) -> Path:
    """Load the 16-bit `model` (default: the adapter's base), merge the adapter in with PEFT, write model and
    tokenizer to `out` (atomic; `atomic.check_output_dir`'s rule: FileExistsError unless overwrite, which replaces
    only a directory qerl wrote, and never one of the inputs). dtype: of the loaded and written weights (bf16,
    fp16, fp32); the merge adds the adapter's product in that dtype. The adapter loads strictly (`_strict_load`).
    Returns the written directory."""
    from .pretrained import is_quantized_checkpoint
    from .loader import ModelSpec, load_policy
    from .targets import quant_layers

    model = model or adapter_base(adapter)
    # everything that can be refused is, before the model loads
    out = check_output_dir(out, overwrite, inputs={"adapter": adapter, "--model": model})
    weights = read_adapter_weights(Path(adapter).expanduser())
    quantized = (f"{model} is a quantized checkpoint: merge into the 16-bit model it was made from (--model), whose "
                 "weights the adapter's product is added to")
    if is_quantized_checkpoint(model):
        raise ValueError(quantized)
    base, tokenizer = load_policy(ModelSpec(name=model, dtype=dtype, device=device,
                                            trust_remote_code=trust_remote_code))
    if quant_layers(base):  # a source that is quantized without saying so in a local config.json
        raise ValueError(quantized)
    merged = _strict_load(base, Path(adapter).expanduser(), weights, model).merge_and_unload()
    with atomic_directory(out, overwrite, kind="merged model") as tmp:
        merged.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    return out


def _strict_load(base, adapter: Path, weights: dict, model: str):
    """`base` wrapped by PEFT with the adapter's weights; AdapterError unless every tensor of the adapter is used
    and every one the wrapped model needs is there with its shape (PEFT itself skips keys that match no module,
    so an adapter merged into a smaller model lost half its tensors without a word)."""
    from peft import LoraConfig, get_peft_model
    from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict

    try:
        config = LoraConfig.from_pretrained(str(adapter))
    except Exception as e:
        raise AdapterError(f"{adapter / 'adapter_config.json'}: not a LoRA adapter config ({e})") from None
    try:
        wrapped = get_peft_model(base, config)
    except ValueError as e:  # e.g. target modules the base does not have
        raise AdapterError(f"{adapter} does not fit {model}: {e}") from None
    expected = {k: v.shape for k, v in get_peft_model_state_dict(wrapped).items()}
    missing, unused = sorted(expected.keys() - weights.keys()), sorted(weights.keys() - expected.keys())
    wrong = sorted(k for k in expected.keys() & weights.keys() if tuple(weights[k].shape) != tuple(expected[k]))
    if missing or unused or wrong:
        parts = [f"{len(unused)} of its {len(weights)} tensors match no module of the model (e.g. {unused[0]})"
                 if unused else "",
                 f"{len(missing)} tensors the model needs are missing (e.g. {missing[0]})" if missing else "",
                 f"{len(wrong)} tensors have another shape (e.g. {wrong[0]}: adapter "
                 f"{tuple(weights[wrong[0]].shape)}, model {tuple(expected[wrong[0]])})" if wrong else ""]
        raise AdapterError(f"{adapter} does not fit {model}: {'; '.join(p for p in parts if p)}; merge into the "
                           "model it was trained on (--model)")
    set_peft_model_state_dict(wrapped, weights)
    return wrapped
