"""Seconds per `qerl train` step on a real model, side by side: arms of (format, AQN) x (new | old), where new
is the defaults (continuous rollout scheduler, packed loss passes) and old is `rollout.scheduler=static
optim.packing=false` (the padded reference). Each arm is one `qerl train` process on the same data and seed;
the table gives per arm the median over steps 2.. (step 1 compiles kernels) of the step, rollout and update
seconds, the rollout's decoded row-steps per kept token, the loss pass's computed per needed token, the mean
reward and completion length, and peak memory.

    python benchmarks/train_speed.py /tmp/q15 --steps 6 --out speed.json
    python benchmarks/train_speed.py /tmp/q15 --arms bf16:new,bf16:old,nvfp4+aqn:new,nvfp4+aqn:old \\
        --set rollout.max_new_tokens=512 lora.r=32

Defaults are the GSM8K run of the issue on a real model (Qwen2.5-Coder-1.5B-Instruct): 16 prompts x 8, <= 512
new tokens, T 1.0, LoRA r 32, lr 5e-5, the GSM8K training split (gsm8k-offline:train) with the gsm8k suffix.
"""

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

BASE = {"data.train": "gsm8k-offline:train", "data.suffix": "gsm8k", "data.max_prompt_tokens": 256,
        "rollout.prompts_per_step": 16, "rollout.group_size": 8, "rollout.max_new_tokens": 512,
        "rollout.temperature": 1.0, "lora.r": 32, "lora.alpha": 64, "optim.lr": "5.0e-5", "tensorboard": False,
        "plots": False, "seed": 0}
# values go through YAML: write floats with a dot ("5.0e-5"; YAML reads 5e-5 as a string)
MODES = {"new": {}, "old": {"rollout.scheduler": "static", "optim.packing": False, "optim.micro_batch_size": 8}}


def arm_overrides(arm: str) -> dict:
    """'nvfp4+aqn:new' -> the overrides of that arm."""
    variant, _, mode = arm.partition(":")
    fmt, _, extra = variant.partition("+")
    if mode not in MODES or extra not in ("", "aqn"):
        raise ValueError(f"bad arm {arm!r}: FORMAT[+aqn]:new|old")
    return {"model.format": fmt, "aqn.enabled": extra == "aqn", **MODES[mode]}


def run_arm(model: str, arm: str, steps: int, extra: list[str], workdir: Path) -> list[dict]:
    out = workdir / arm.replace(":", "_").replace("+", "_")
    sets = {**BASE, "model.name": model, "steps": steps, "output_dir": str(out), **arm_overrides(arm)}
    cmd = [sys.executable, "-m", "qerl.cli", "train", *[f"{k}={v}" for k, v in sets.items()], *extra]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def summarize(arm: str, rows: list[dict]) -> dict:
    timed = rows[1:] or rows
    med = lambda k: statistics.median(r.get(k, float("nan")) for r in timed)  # noqa: E731
    return dict(arm=arm, steps=len(rows), step_s=med("time_step"), rollout_s=med("time_rollout"),
                update_s=med("time_update"), rows_per_kept=med("rollout_rows_per_kept"),
                loss_computed_per_needed=med("loss_tokens_per_needed"),
                reward=statistics.mean(r["reward"] for r in rows), length=statistics.mean(
                    r["response_length"] for r in rows), memory_gb=max(r["memory_gb"] for r in rows),
                first_step_s=rows[0]["time_step"])


def table(results: list[dict], device: str) -> str:
    old = {r["arm"].split(":")[0]: r["step_s"] for r in results if r["arm"].endswith(":old")}
    lines = [f"device: {device}; {datetime.date.today()}; medians over steps 2..N",
             "| arm | step s | vs old | rollout s | update s | rows/kept | loss computed/needed | reward | "
             "length | peak GB |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        base = old.get(r["arm"].split(":")[0])
        vs = f"{base / r['step_s']:.2f}x" if base and not r["arm"].endswith(":old") else "-"
        lines.append(f"| {r['arm']} | {r['step_s']:.2f} | {vs} | {r['rollout_s']:.2f} | {r['update_s']:.2f} | "
                     f"{r['rows_per_kept']:.2f} | {r['loss_computed_per_needed']:.2f} | {r['reward']:.3f} | "
                     f"{r['length']:.0f} | {r['memory_gb']:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="model path or name (model.name)")
    ap.add_argument("--arms", default="bf16:new,bf16:old,nvfp4+aqn:new,nvfp4+aqn:old")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--set", nargs="*", default=[], help="further section.key=value overrides for every arm")
    ap.add_argument("--out", help="write the per-step metrics and the summary as JSON here")
    args = ap.parse_args(argv)
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    results, raw = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for arm in args.arms.split(","):
            raw[arm] = run_arm(args.model, arm, args.steps, args.set, Path(tmp))
            results.append(summarize(arm, raw[arm]))
            print(table(results, device), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(dict(device=device, date=str(datetime.date.today()), args=vars(args),
                                                  summary=results, metrics=raw), indent=1))
    print(table(results, device))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
