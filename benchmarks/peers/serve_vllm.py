"""Does a policy qerl trained serve in vLLM as it scored in qerl? One trained adapter, greedy on the held-out
problems, scored by qerl's scorer (flexible and strict pass@1), served up to six ways:

    qerl, 16-bit base      `qerl eval MODEL --adapter A` (the adapter on the 16-bit model, as a merge serves it)
    qerl, 4-bit base       `qerl eval MODEL --adapter A --format nvfp4 --keep-bf16 K` (the policy as trained)
    vLLM, merged           vLLM on `qerl merge A` (16-bit weights with the adapter folded in)
    vLLM, NVFP4 + LoRA     vLLM on qerl's NVFP4 export (`qerl quantize --format nvfp4 --keep-bf16 K`) with A as a LoRA
                           adapter (if vLLM takes LoRA over its NVFP4 path; else the row says why not)
    vLLM, 16-bit + LoRA    vLLM on the 16-bit model with A as a LoRA adapter (no merge: vLLM's own numerics only)
    vLLM, merged fp32      vLLM in float32 on `qerl merge A --dtype fp32` (no bf16 rounding of the merged weights)

The last two split a gap between `qerl eval` and vLLM-merged into the merge's rounding and vLLM's decode.

    python benchmarks/peers/serve_vllm.py --model qwen2.5-coder-1.5b-instruct --adapter RUN/adapter \\
        --keep-bf16 last:2 --workdir /tmp/serve --out serve.json

Each way runs in its own process (vLLM and qerl each take the GPU's memory their own way). Installs nothing: the vLLM
rows need vllm importable. The table: pass@1, strict, the share of problems whose score equals the first row's
way ("same score"), and seconds (engine start excluded for vLLM, printed apart).
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

PY = sys.executable
WAYS = ("qerl-16bit", "qerl-4bit", "vllm-merged", "vllm-nvfp4-lora", "vllm-16bit-lora", "vllm-merged-fp32")
# what each vLLM way loads (a --workdir directory, or "base": the 16-bit model), its dtype, and whether A is a LoRA
VLLM_WAYS = {"vllm-merged": ("merged", "bfloat16", False), "vllm-nvfp4-lora": ("nvfp4", "bfloat16", True),
             "vllm-16bit-lora": ("base", "bfloat16", True), "vllm-merged-fp32": ("merged_fp32", "float32", False)}


def scores(texts: list[str], rows: list[dict], suffix: str) -> list[dict]:
    """qerl's measures of each completion against its problem's answer, for the style `suffix` asks for."""
    from qerl.data.templates import requested_style
    from qerl.rewards.scores import score

    style = requested_style(suffix)
    out = []
    for text, row in zip(texts, rows):
        s = score(text, row["answer"], style)
        out.append({"flexible": float(bool(s.flexible)), "strict": float(bool(s.strict))})
    return out


def qerl_way(way: str, args, work: Path) -> list[dict]:
    """Per problem {"flexible", "strict"} from `qerl eval` (a subprocess writing its per-problem file)."""
    path = work / f"{way}.jsonl"
    if not path.is_file():
        flags = []
        if way == "qerl-4bit":
            flags = ["--format", args.format] + (["--keep-bf16", args.keep_bf16] if args.keep_bf16 else [])
        subprocess.run([PY, "-m", "qerl.cli", "eval", args.model, "--adapter", args.adapter, "--dataset", args.test,
                        "--limit", str(args.limit), "--greedy", "--max-new-tokens", str(args.max_new_tokens),
                        "--suffix", args.suffix, *flags, "--out", str(path)], check=True)
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{"flexible": r["rewards"][0], "strict": r["strict"][0]} for r in rows]


def base_dir(model: str) -> str:
    """The 16-bit model as a directory vLLM loads: an embedded name's converted cache (made once), else the
    argument (a Hugging Face directory or hub id)."""
    from qerl.models.registry import EMBEDDED, embedded_hf_dir

    return str(embedded_hf_dir(model)) if model in EMBEDDED else model


def prepare(args, work: Path, ways: list[str]) -> None:
    """What the vLLM ways load, made once and kept in --workdir: the merged 16-bit directory (its tokenizer builds
    every vLLM way's prompts), the fp32 merge and the NVFP4 export for the ways that read them."""
    merged, quantized = work / "merged", work / "nvfp4"
    for out, dtype in ((merged, "bf16"), *([(work / "merged_fp32", "fp32")] if "vllm-merged-fp32" in ways else [])):
        if not (out / "config.json").is_file():
            subprocess.run([PY, "-m", "qerl.cli", "merge", args.adapter, "--model", args.model, "--dtype", dtype,
                            "--out", str(out)], check=True)
    if "vllm-nvfp4-lora" in ways and not (quantized / "config.json").is_file():
        keep = ["--keep-bf16", args.keep_bf16] if args.keep_bf16 else []
        subprocess.run([PY, "-m", "qerl.cli", "quantize", args.model, "--format", args.format, *keep,
                        "--out", str(quantized)], check=True)


def vllm_way(way: str, args, work: Path) -> dict:
    """Run in this process (started by `main` with --one): vLLM greedy on the held-out prompts; per problem scores."""
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from qerl.data import load_problems
    from qerl.data.templates import build_prompt, encode_prompt

    rows = load_problems(args.test, split="test", limit=args.limit)
    tokenizer = AutoTokenizer.from_pretrained(work / "merged")
    ids = [encode_prompt(build_prompt(r["question"], tokenizer, args.suffix), tokenizer) for r in rows]
    where, dtype, lora = VLLM_WAYS[way]
    adapter_config = json.loads((Path(args.adapter) / "adapter_config.json").read_text())
    started = time.perf_counter()
    llm = LLM(model=base_dir(args.model) if where == "base" else str(work / where), dtype=dtype, seed=0,
              enable_lora=lora,
              max_lora_rank=adapter_config["r"] if lora else 16,
              max_model_len=max(map(len, ids)) + args.max_new_tokens,
              gpu_memory_utilization=args.gpu_memory_utilization)
    start_s = time.perf_counter() - started
    request = None
    if lora:
        from vllm.lora.request import LoRARequest

        request = LoRARequest("policy", 1, str(Path(args.adapter).resolve()))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens)
    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ids], params, lora_request=request, use_tqdm=False)
    seconds = time.perf_counter() - t0
    return {"way": way, "scores": scores([o.outputs[0].text for o in outs], rows, args.suffix), "seconds": seconds,
            "engine_start_s": start_s}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct",
                    help="the 16-bit model the adapter was trained on")
    ap.add_argument("--adapter", required=True, help="a trained PEFT adapter (a qerl run's adapter/)")
    ap.add_argument("--format", default="nvfp4", help="the 4-bit base it was trained on")
    ap.add_argument("--keep-bf16", default="", help="the layers its config kept in bf16, e.g. last:2")
    ap.add_argument("--test", default="gsm8k-offline:heldout")
    ap.add_argument("--limit", type=int, default=500)
    ap.add_argument("--suffix", default="gsm8k")
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    ap.add_argument("--ways", default=",".join(WAYS), help=f"comma-separated, of {', '.join(WAYS)}")
    ap.add_argument("--workdir", required=True, help="merged / exported models and per-way results (kept, reused)")
    ap.add_argument("--out", help="JSON file for the table")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one vLLM way in this process, print its JSON
    args = ap.parse_args(argv)
    if not (Path(args.adapter) / "adapter_config.json").is_file():
        ap.error(f"--adapter {args.adapter}: no adapter_config.json there")
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    if args.one:
        print("RESULT " + json.dumps(vllm_way(args.one, args, work)), flush=True)
        return 0
    ways = [w.strip() for w in args.ways.split(",") if w.strip()]
    unknown = [w for w in ways if w not in WAYS]
    if unknown:
        ap.error(f"unknown way(s) {', '.join(unknown)}; choose from {', '.join(WAYS)}")
    if any(w.startswith("vllm") for w in ways):
        prepare(args, work, ways)
    results = {}
    for way in ways:
        if way.startswith("qerl"):
            t0 = time.perf_counter()
            results[way] = {"way": way, "scores": qerl_way(way, args, work), "seconds": time.perf_counter() - t0}
            continue
        argv_one = [PY, __file__, "--one", way, *(argv if argv is not None else sys.argv[1:])]
        done = subprocess.run(argv_one, capture_output=True, text=True)
        found = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode != 0 or not found:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            results[way] = {"way": way, "error": last[:300]}
            continue
        results[way] = json.loads(found[-1][len("RESULT "):])
    first = next((r for r in results.values() if "scores" in r), None)
    print("| way | pass@1 | strict | same score as the first row | s |\n|---|---:|---:|---:|---:|")
    for way, r in results.items():
        if "error" in r:
            print(f"| {way} | - | - | - | failed: {r['error']} |")
            continue
        s = r["scores"]
        r["pass1"] = sum(x["flexible"] for x in s) / len(s)
        r["strict"] = sum(x["strict"] for x in s) / len(s)
        same = sum(a["flexible"] == b["flexible"] for a, b in zip(s, first["scores"])) / len(s)
        r["same_score"] = same
        print(f"| {way} | {r['pass1']:.3f} | {r['strict']:.3f} | {same:.0%} | {r['seconds']:.0f} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "one"},
                                              "ways": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
