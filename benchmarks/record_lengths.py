"""Record a completion-length profile (`qerl.data.length_profiles`) from real rollouts of a model on math prompts.

A `qerl train` run logs only the mean response length per step (metrics.jsonl: response_length), not the length
of each row, so this tool samples the rollouts itself, the way a training step's collection does: the policy
built as `qerl train` builds it (`model.format`, fresh LoRA, whose B = 0 leaves the base's outputs), prompts
drawn from the dataset and built with the same template and suffix, G completions per prompt sampled by the
rollout engine (EOS ends a row), and each row's length = its completion_mask sum (the stop token included, as
the trainer counts it). The lengths are written in prompt order, G per group, so that `draw` can resample
whole groups.

The named profile `gsm8k-qwen2.5-coder-1.5b` (GPU, about a minute):

    python benchmarks/record_lengths.py Qwen/Qwen2.5-Coder-1.5B-Instruct \\
        --out src/qerl/data/profiles/gsm8k-qwen2.5-coder-1.5b.json

(MODEL may be a local Hugging Face directory of that model instead of the hub id.)
"""

import argparse
import datetime
import random
import subprocess
import sys
from pathlib import Path

DEFAULT_NAME = "gsm8k-qwen2.5-coder-1.5b"


def pick_prompts(rows: list[dict], n: int, seed: int) -> list[dict]:
    """n distinct rows, the same for the same seed."""
    if n > len(rows):
        raise ValueError(f"--prompts {n} exceeds the {len(rows)} problems that fit --max-prompt-tokens")
    return random.Random(seed).sample(rows, n)




def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def record(args):
    """Build the policy, sample args.prompts x args.group completions; the LengthProfile of their lengths."""
    import torch

    from qerl.data.length_profiles import LengthProfile
    from qerl.config import LoraSection, ModelSection
    from qerl.data import build_prompt, encode_prompt, filter_by_length, load_problems
    from qerl.models.policy import build_policy
    from qerl.rl.trainer import resolve_device
    from qerl.rollout.engine import RolloutEngine
    from qerl.rollout.sampling import SamplingParams

    device = resolve_device(args.device)
    model, tokenizer = build_policy(ModelSection(name=args.model, format=args.format), LoraSection(r=args.lora_r),
                                    device)
    if tokenizer is None:
        raise ValueError(f"{args.model}: no tokenizer found; the prompts need one")
    problems = load_problems(args.dataset, split=args.split, seed=args.seed)
    problems = filter_by_length(problems, tokenizer, args.max_prompt_tokens, suffix=args.suffix)
    chosen = pick_prompts(problems, args.prompts, args.seed)
    ids = [encode_prompt(build_prompt(p["question"], tokenizer, suffix=args.suffix), tokenizer) for p in chosen]
    rows = [r for r in ids for _ in range(args.group)]  # each prompt's G rows adjacent, as the trainer samples
    engine = RolloutEngine(model, tokenizer, max_seq_len=args.max_prompt_tokens + args.max_new_tokens)
    rollout = engine.generate(rows, args.max_new_tokens, SamplingParams(temperature=args.temperature), seed=args.seed)
    lengths = [int(n) for n in rollout.completion_mask.sum(1).tolist()]
    where = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    source = (f"recorded by benchmarks/record_lengths.py (qerl {_commit()}) on {where}, {datetime.date.today()}: "
              f"{args.model} as {args.format} + fresh LoRA r{args.lora_r}, {args.dataset} ({args.split} split) "
              f"{args.prompts} prompts (seed {args.seed}) x {args.group} completions, suffix {args.suffix!r}, "
              f"temperature {args.temperature}, <= {args.max_new_tokens} new tokens, EOS ends a row; "
              f"length = completion_mask sum (stop token included)")
    return LengthProfile(args.name, args.max_new_tokens, tuple(lengths), source, args.group)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="record_lengths", description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="embedded name, Hugging Face directory or hub id")
    ap.add_argument("--out", required=True, help="profile JSON to write")
    ap.add_argument("--name", default=DEFAULT_NAME, help="the profile's name")
    ap.add_argument("--dataset", default="gsm8k-offline", help="a qerl data source (qerl.data.load_problems)")
    ap.add_argument("--split", default="test", help="split of the source (gsm8k-offline has only test)")
    ap.add_argument("--suffix", default="gsm8k", help="answer-format suffix: gsm8k, boxed, none or text:LITERAL TEXT")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=8, help="G completions per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--max-prompt-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--format", default="nvfp4", help="weight format of the policy, as model.format of qerl train")
    ap.add_argument("--lora-r", type=int, default=32)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    args = ap.parse_args(argv)
    for flag in ("prompts", "group", "max_new_tokens", "max_prompt_tokens"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be >= 1")
    if Path(args.out).exists() and not args.overwrite:
        ap.error(f"{args.out} exists; pass --overwrite to replace it")
    return args


def main(argv=None) -> int:
    from qerl.data.length_profiles import describe, read_profile, to_json

    args = parse_args(argv)
    profile = record(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(to_json(profile))
    print(describe(read_profile(out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
