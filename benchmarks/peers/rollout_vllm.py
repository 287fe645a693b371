"""The rollout alone, vLLM against qerl's engine, on the rows `qerl bench rollout --lengths` times: random
Qwen2.5-shaped weights, prompts x G rows (G completions of each prompt), every row forced to a length drawn from
a recorded length profile (EOS ignored), temperature 1; medians over the draws.

    python benchmarks/peers/rollout_vllm.py --models 1.5b,7b --variants bf16,bf16+lora,nvfp4 --workdir /tmp/peers \\
        --out vllm_rollout.json --qerl

Variants: bf16 (the 16-bit model), bf16+lora (vLLM with LoRA enabled and a random rank --lora-r adapter on every
linear, as a policy being trained is served), nvfp4 (qerl's own export, `qerl quantize --format nvfp4`, which vLLM
loads as compressed-tensors NVFP4). `--qerl` then runs `qerl bench rollout` on the same shapes, rows, draws and
seeds in a second process (bf16+lora and nvfp4+lora) and prints both in one table. Installs nothing: vLLM must be
importable; vLLM's engine start (minutes: compilation, CUDA graphs) is left out of the times and printed apart.
"""

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

VARIANTS = ("bf16", "bf16+lora", "nvfp4")


def random_model_dir(size: str, workdir: Path) -> Path:
    """A saved random-weight Qwen2.5 `size` model (bf16 safetensors and config; no tokenizer: prompts are ids)."""
    from transformers import AutoModelForCausalLM

    from qerl.models.shapes import qwen25_config

    path = workdir / f"qwen25-{size}-random"
    if not (path / "config.json").exists():
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(qwen25_config(size), dtype=torch.bfloat16)
        for p in model.parameters():  # small values keep the logits finite; speed does not depend on them
            p.data.normal_(0, 0.02)
        model.save_pretrained(path)
        del model
        torch.cuda.empty_cache()
    return path


def random_adapter_dir(model_dir: Path, r: int, workdir: Path) -> Path:
    """A PEFT LoRA adapter of rank r on every linear of the model at model_dir, B non-zero (as after training)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    path = workdir / f"{model_dir.name}-lora{r}"
    if not (path / "adapter_config.json").exists():
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        model = get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 1e-3)
        model.save_pretrained(path)
    return path


def nvfp4_dir(model_dir: Path, workdir: Path) -> Path:
    """qerl's NVFP4 export of the model at model_dir (round-to-nearest; `qerl quantize`)."""
    path = workdir / f"{model_dir.name}-nvfp4"
    if not (path / "config.json").exists():
        subprocess.run([sys.executable, "-m", "qerl.cli", "quantize", str(model_dir), "--format", "nvfp4",
                        "--out", str(path), "--no-check"], check=True)
    return path


def rows_and_draws(args, vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    """The prompt ids of every row (prompts x G, a prompt's rows adjacent) and the forced lengths per repeat: the
    same as `qerl bench rollout` (its `prompts_tensor` and `draw`, seed + repeat)."""
    from qerl.data.length_profiles import draw
    from qerl.bench.rollout import prompts_tensor

    batch = args.prompts * args.group
    ids = prompts_tensor(batch // args.group, args.prompt, vocab).repeat_interleave(args.group, 0)
    return ids.tolist(), [draw(args.profile, batch, args.group, args.seed + rep) for rep in range(args.repeats)]


def time_vllm(model_dir: Path, variant: str, args, lora_dir: Path | None) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    kwargs = dict(enable_lora=True, max_lora_rank=args.lora_r, max_loras=1) if lora_dir else {}
    llm = LLM(model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16", seed=0, enable_prefix_caching=True,
              gpu_memory_utilization=args.gpu_memory_utilization,
              max_model_len=args.prompt + args.profile.max_new_tokens, **kwargs)
    engine_start = time.perf_counter() - started
    request = None
    if lora_dir:
        from vllm.lora.request import LoRARequest

        request = LoRARequest("policy", 1, str(lora_dir))
    rows, draws = rows_and_draws(args, llm.llm_engine.model_config.get_vocab_size())
    prompts = [TokensPrompt(prompt_token_ids=r) for r in rows]

    def generate(lengths, seed):
        params = [SamplingParams(temperature=1.0, max_tokens=n, min_tokens=n, ignore_eos=True, seed=seed + i,
                                 detokenize=False) for i, n in enumerate(lengths)]
        torch.cuda.synchronize()
        t = time.perf_counter()
        outs = llm.generate(prompts, params, lora_request=request, use_tqdm=False)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t
        got = [len(o.outputs[0].token_ids) for o in outs]
        if got != list(lengths):
            raise RuntimeError(f"vLLM did not produce the forced lengths (first rows: {got[:4]} vs {lengths[:4]})")
        return seconds

    generate([2] * len(rows), 10**6)  # untimed: the first call's own set-up
    seconds = [generate(lengths, 1000 * rep) for rep, lengths in enumerate(draws)]
    kept = [sum(lengths) for lengths in draws]
    return dict(engine="vllm", variant=variant, seconds=statistics.median_high(seconds), seconds_all=seconds,
                kept_tok_s=statistics.median_high(k / s for k, s in zip(kept, seconds)), engine_start_s=engine_start)


def run_qerl(args) -> list[dict]:
    """`qerl bench rollout` on the same rows and draws, bf16+lora and nvfp4+lora, in its own process."""
    out = Path(args.workdir) / "qerl_rollout.json"
    cmd = [sys.executable, "-m", "qerl.cli", "bench", "rollout", "--models", ",".join(args.models),
           "--variants", "bf16+lora,nvfp4+lora", "--batches", str(args.prompts * args.group), "--prompt",
           str(args.prompt), "--lengths", args.lengths, "--group", str(args.group), "--seed", str(args.seed),
           "--repeats", str(args.repeats), "--lora-r", str(args.lora_r), "--out", str(out)]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    rows = json.loads(out.read_text())
    rows = rows.get("results", rows) if isinstance(rows, dict) else rows
    return [dict(engine="qerl", model=r["model"], variant=r["variant"], seconds=r["seconds"],
                 kept_tok_s=r["kept_tok_s"]) for r in rows if "seconds" in r]


def main(argv=None) -> int:
    from qerl.data.length_profiles import resolve_lengths

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="1.5b,7b")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--lengths", default="gsm8k-qwen2.5-coder-1.5b", help="a length profile (qerl bench rollout's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--lora-r", type=int, default=32)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--workdir", required=True, help="where the random models, adapters and exports are kept")
    ap.add_argument("--qerl", action="store_true", help="also run qerl bench rollout on the same rows")
    ap.add_argument("--out", default=None)
    ap.add_argument("--cell", default=None, help=argparse.SUPPRESS)  # SIZE:VARIANT, run by the script itself
    args = ap.parse_args(argv)
    args.models, variants = args.models.split(","), args.variants.split(",")
    if any(v not in VARIANTS for v in variants):
        ap.error(f"--variants: choose from {', '.join(VARIANTS)}")
    args.profile, _, _ = resolve_lengths(ap, args.lengths, None, "--completion", 512, 1)
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)

    import vllm

    if args.cell:  # one engine in this process: the row is the last line of its output
        size, variant = args.cell.split(":")
        base = random_model_dir(size, workdir)
        model_dir = nvfp4_dir(base, workdir) if variant == "nvfp4" else base
        lora = random_adapter_dir(base, args.lora_r, workdir) if variant == "bf16+lora" else None
        print(json.dumps(dict(model=size, **time_vllm(model_dir, variant, args, lora))), flush=True)
        return 0
    results = []
    for size in args.models:
        for variant in variants:  # a process per engine: all of the GPU's memory back between them
            argv_cell = [a for a in (sys.argv[1:] if argv is None else argv) if a != "--qerl"]
            done = subprocess.run([sys.executable, __file__, *argv_cell, "--cell", f"{size}:{variant}"],
                                  check=True, stdout=subprocess.PIPE, text=True)
            row = json.loads(done.stdout.strip().splitlines()[-1])
            print(json.dumps(row), flush=True)
            results.append(row)
    if args.qerl:
        results += run_qerl(args)
    device = torch.cuda.get_device_name()
    lines = [f"device: {device}; {datetime.date.today()}; vLLM {vllm.__version__}; {args.prompts} prompts x G "
             f"{args.group}, prompt {args.prompt}, lengths {args.lengths} "
             f"(seeds {args.seed}..{args.seed + args.repeats - 1}, "
             "medians); random Qwen2.5 weights",
             "| model | engine | variant | rollout s | kept tok/s | engine start s |", "|---|---|---|---:|---:|---:|"]
    for r in results:
        start = f"{r['engine_start_s']:.0f}" if "engine_start_s" in r else "-"
        lines.append(f"| {r['model']} | {r['engine']} | {r['variant']} | {r['seconds']:.2f} | {r['kept_tok_s']:.0f} | "
                     f"{start} |")
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text(json.dumps({"device": device, "date": str(datetime.date.today()),
                                              "vllm": vllm.__version__, "args": {k: v for k, v in vars(args).items()
                                                                                 if k != "profile"},
                                              "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
