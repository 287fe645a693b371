"""Rollout throughput: HF `generate` vs the qerl engine (bf16, bf16+LoRA, NVFP4+LoRA, ...) on random-weight
Qwen2.5-7B/14B/32B-shaped models built directly on the GPU (speed does not depend on weight values).

Every run: prompt of `--prompt` random tokens, exactly `--new` new tokens (EOS ignored), sampling at
temperature 1 (the engine's sampling cost is included). Reported per cell: end-to-end tokens/s (new tokens
over prefill + decode), decode-only tokens/s, ms per decode step, peak GPU memory, policy weight bytes,
and -- as gpt-fast does -- the weight bandwidth achieved and the fraction of the memory-bandwidth floor
(weights + the KV cache a step reads, over the measured device copy bandwidth).

HF `generate` runs far fewer new tokens (`--hf-new`): at ~60 ms per step a 512-token run per batch would
cost minutes of device time; its decode rate is measured from the difference of two lengths.

    python benchmarks/rollout.py --models 7b --batches 1,8,32,64,128 --out results.json
"""

import argparse
import datetime
import gc
import json
import time

import torch

QWEN25 = {  # Qwen2.5 shapes (config.json of the hub releases); vocab 152064, untied embeddings
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4),
    "14b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40,
                num_key_value_heads=8),
    "32b": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                num_key_value_heads=8),
    "72b": dict(hidden_size=8192, intermediate_size=29568, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8),
}


def qwen25_config(size: str, layers: int | None = None):
    from transformers import Qwen2Config

    shape = dict(QWEN25[size])
    if layers:
        shape["num_hidden_layers"] = layers
    return Qwen2Config(vocab_size=152064, max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
                       tie_word_embeddings=False, use_sliding_window=False, bos_token_id=151643,
                       eos_token_id=151645, pad_token_id=151643, **shape)


def build_model(size: str, layers: int | None, fmt: str | None, lora_r: int, embeddings: bool = False):
    """Random bf16 model on the GPU; fmt None = plain HF modules, else qerl QuantLinear(fmt) + LoRA.

    embeddings: also store the input embedding in fmt (`QuantEmbedding`; 4-bit formats only)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(qwen25_config(size, layers), dtype=torch.bfloat16)
    model.eval().requires_grad_(False)
    if fmt is not None:
        from ..models.convert import quantize_model
        from ..nn import LoraConfig

        quantize_model(model, fmt=fmt, lora=LoraConfig(r=lora_r, alpha=2 * lora_r), embeddings=embeddings)
        with torch.no_grad():  # a trained-looking adapter (B = 0 would be the same speed, but be honest)
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 1e-3)
    torch.cuda.synchronize()
    return model


def policy_bytes(model) -> tuple[int, int]:
    """(bytes a decode step reads for weights: everything but the input embedding; total policy bytes).

    A step looks up B rows of the input embedding, not the table, so an untied table is not counted as
    read, whether dense (nn.Embedding) or 4-bit (QuantEmbedding: its packed codes and scales)."""
    from ..models.convert import input_embeddings_tied
    from ..nn import QuantEmbedding

    total = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    emb = model.get_input_embeddings()
    if isinstance(emb, QuantEmbedding):
        emb_bytes = sum(t.numel() * t.element_size() for t in emb.buffers())
    else:  # (the tie test also holds for a model built on the meta device, where every data_ptr is 0)
        emb_bytes = 0 if input_embeddings_tied(model) else emb.weight.numel() * emb.weight.element_size()
    return total - emb_bytes, total


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (the floor's denominator)."""
    x = torch.randn(512 * 2**20, device="cuda")  # 2 GiB
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    bw = 2 * x.numel() * 4 * 10 / (time.perf_counter() - t)
    del x, y
    return bw


def timed(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def prompts_tensor(batch: int, length: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(batch)
    return torch.randint(0, vocab - 1000, (batch, length), generator=g)


def kv_bytes_per_token(cfg) -> int:
    hd = cfg.hidden_size // cfg.num_attention_heads
    return cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * hd * 2


def bench_hf(model, batch, args) -> dict:
    ids = prompts_tensor(batch, args.prompt, model.config.vocab_size).cuda()
    mask = torch.ones_like(ids)

    def run(n):
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, pad_token_id=model.config.pad_token_id)

    run(2)
    torch.cuda.reset_peak_memory_stats()
    short = timed(lambda: run(4))
    long = timed(lambda: run(4 + args.hf_new))
    step = (long - short) / args.hf_new
    prefill = max(short - 4 * step, 0.0)
    return dict(step_ms=1e3 * step, decode_tok_s=batch / step,
                e2e_tok_s=batch * args.new / (prefill + args.new * step),  # extrapolated to --new tokens
                prefill_s=prefill, peak_gb=torch.cuda.max_memory_allocated() / 1e9, new_tokens=args.hf_new)


def bench_engine(engine, batch, args) -> dict:
    from ..rollout.sampling import SamplingParams

    ids = prompts_tensor(batch, args.prompt, engine.model.config.vocab_size)
    sp = SamplingParams(temperature=1.0)
    engine.warmup(batch, args.prompt + args.new)
    engine.generate(ids, 2, sp, seed=0, ignore_eos=True)
    torch.cuda.reset_peak_memory_stats()
    prefill = timed(lambda: engine.generate(ids, 1, sp, seed=0, ignore_eos=True))
    total = timed(lambda: engine.generate(ids, args.new, sp, seed=0, ignore_eos=True))
    step = (total - prefill) / (args.new - 1)
    return dict(step_ms=1e3 * step, decode_tok_s=batch / step, e2e_tok_s=batch * args.new / total,
                prefill_s=prefill, peak_gb=torch.cuda.max_memory_allocated() / 1e9, new_tokens=args.new)


def free(*objs):
    for o in objs:
        del o
    gc.collect()
    torch.cuda.empty_cache()


def run_size(size, args, copy_bw, results):
    from ..rollout.engine import RolloutEngine

    cfg = qwen25_config(size, args.layers)
    kvb = kv_bytes_per_token(cfg)
    for variant in args.variants:
        fmt = None if variant in ("hf", "bf16") else variant.split("+")[0]
        embeddings = args.quantize_embeddings and fmt not in (None, "bf16")
        model = build_model(size, args.layers, fmt, args.lora_r, embeddings)
        read_bytes, total_bytes = policy_bytes(model)
        engine = None if variant == "hf" else RolloutEngine(model, max_seq_len=args.prompt + args.new,
                                                           cuda_graphs=not args.eager,
                                                           fused_sampling=not args.eager_sampling)
        for batch in (args.hf_batches if variant == "hf" else args.batches):
            try:
                r = bench_hf(model, batch, args) if variant == "hf" else bench_engine(engine, batch, args)
            except torch.OutOfMemoryError:
                r = dict(error="out of memory")
                torch.cuda.empty_cache()
            if "step_ms" in r:
                avg_ctx = args.prompt + args.new / 2
                floor_s = (read_bytes + batch * avg_ctx * kvb) / copy_bw
                r.update(weight_gb_s=read_bytes / (r["step_ms"] / 1e3) / 1e9,
                         floor_frac=floor_s / (r["step_ms"] / 1e3))
            r.update(model=size, variant=variant, batch=batch, policy_gb=total_bytes / 1e9,
                     quantized_embeddings=embeddings)
            results.append(r)
            print(json.dumps(r), flush=True)
        del engine, model
        free()


def table(results, device, copy_bw) -> str:
    lines = [f"device: {device}; copy bandwidth {copy_bw / 1e12:.2f} TB/s; {datetime.date.today()}",
             "| model | variant | batch | e2e tok/s | decode tok/s | ms/step | weight GB/s | % floor | peak GB | policy GB |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['variant']} | {r['batch']} | {r['error']} | | | | | | |")
            continue
        variant = r["variant"] + ("+qemb" if r.get("quantized_embeddings") else "")  # 4-bit input embedding
        lines.append(f"| {r['model']} | {variant} | {r['batch']} | {r['e2e_tok_s']:.0f} | {r['decode_tok_s']:.0f}"
                     f" | {r['step_ms']:.2f} | {r['weight_gb_s']:.0f} | {100 * r['floor_frac']:.0f}% "
                     f"| {r['peak_gb']:.1f} | {r['policy_gb']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="qerl bench rollout", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="7b", help="comma list of 7b,14b,32b")
    ap.add_argument("--variants", default="hf,bf16,bf16+lora,nvfp4+lora",
                    help="hf (HF generate, bf16), bf16 (engine, plain HF modules), <fmt>+lora (QuantLinear)")
    ap.add_argument("--batches", default="1,8,32,64,128")
    ap.add_argument("--hf-batches", default="1,8,32")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=512)
    ap.add_argument("--hf-new", type=int, default=24)
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--layers", type=int, default=None, help="fewer layers (smoke tests)")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--eager-sampling", action="store_true",
                    help="sample with torch ops instead of the one-launch Triton sampler")
    ap.add_argument("--quantize-embeddings", action="store_true",
                    help="<fmt>+lora variants with a 4-bit fmt also store the input embedding in fmt")
    ap.add_argument("--disable", default="",
                    help="comma list of kernel backends to route around (qerl.kernels.route names, e.g. "
                         "gluon_wgmma_ws): an A/B of one kernel inside the engine")
    ap.add_argument("--out", default=None, help="write all results as JSON here")
    args = ap.parse_args(argv)
    from ..kernels.route import BACKENDS, kernel_policy

    disabled = [b for b in args.disable.split(",") if b]
    unknown = sorted(set(disabled) - set(BACKENDS))
    if unknown:
        ap.error(f"unknown backends {unknown}; known: {', '.join(BACKENDS)}")
    if not torch.cuda.is_available():
        ap.error("the rollout benchmark needs a CUDA GPU")
    args.variants = args.variants.split(",")
    args.batches = [int(b) for b in args.batches.split(",")]
    args.hf_batches = [int(b) for b in args.hf_batches.split(",")]
    device = torch.cuda.get_device_name()
    bw = copy_bandwidth()
    results = []
    with kernel_policy(disabled=disabled):
        for size in args.models.split(","):
            run_size(size, args, bw, results)
    print(table(results, device, bw))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=device, date=str(datetime.date.today()), copy_bw=bw, torch=torch.__version__,
                           args=vars(args), results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
