"""Seconds per `qerl train` step on a real model, side by side: arms of (format, AQN) x (new | old), where new
is the defaults (continuous rollout scheduler, packed loss passes) and old is `rollout.scheduler=static
optim.packing=false` (the padded reference). Each arm is one `qerl train` process on the same data and seed;
the table gives per arm the median over steps 2.. (step 1 compiles kernels) of the step, rollout and update
seconds, the rollout's decoded row-steps per kept token, the loss pass's computed per needed token, the mean
reward and completion length, and peak memory.

    python benchmarks/train_speed.py /tmp/q15 --steps 6 --out speed.json
    python benchmarks/train_speed.py /tmp/q15 --arms bf16:new,bf16:old,nvfp4+aqn:new,nvfp4+aqn:old \\
        --set rollout.max_new_tokens=512 lora.r=32
    python benchmarks/train_speed.py --metrics bf16=RUN/metrics.jsonl nvfp4+aqn=RUN2/metrics.jsonl --device H200

An arm is FORMAT[+aqn][+dense|+denseall]:new|old (+dense: model.dense_weights=update, +denseall: all). The
per-token columns divide the timed steps' summed seconds by their summed work (loss tokens computed, decoded
row-steps), since arms sample completions of different lengths.

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


DENSE = {"dense": "update", "denseall": "all"}  # arm flag -> model.dense_weights


def arm_overrides(arm: str) -> dict:
    """'nvfp4+aqn+dense:new' -> the overrides of that arm."""
    variant, _, mode = arm.partition(":")
    fmt, *flags = variant.split("+")
    dense = [DENSE[f] for f in flags if f in DENSE]
    if mode not in MODES or any(f not in ("aqn", *DENSE) for f in flags) or len(dense) > 1:
        raise ValueError(f"bad arm {arm!r}: FORMAT[+aqn][+dense|+denseall]:new|old")
    return {"model.format": fmt, "aqn.enabled": "aqn" in flags, **({"model.dense_weights": dense[0]} if dense else {}),
            **MODES[mode]}


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
    # per unit of work, over the timed steps together: sampled lengths differ between arms
    per = lambda t, n: sum(r[t] for r in timed) / max(sum(r.get(n, 0) for r in timed), 1)  # noqa: E731
    return dict(arm=arm, steps=len(rows), step_s=med("time_step"), rollout_s=med("time_rollout"),
                update_s=med("time_update"), update_ms_per_1k_tokens=1e6 * per("time_update", "loss_tokens_computed"),
                decode_us_per_row_step=1e6 * per("time_generate", "rollout_decoded_row_steps"),
                rows_per_kept=med("rollout_rows_per_kept"),
                loss_computed_per_needed=med("loss_tokens_per_needed"),
                reward=statistics.mean(r["reward"] for r in rows), length=statistics.mean(
                    r["response_length"] for r in rows), memory_gb=max(r["memory_gb"] for r in rows),
                first_step_s=rows[0]["time_step"])


def table(results: list[dict], device: str) -> str:
    old = {r["arm"].split(":")[0]: r["step_s"] for r in results if r["arm"].endswith(":old")}
    lines = [f"device: {device}; {datetime.date.today()}; medians over steps 2..N",
             "| arm | step s | vs old | rollout s | update s | update ms / 1k loss tokens | decode us / row-step | "
             "rows/kept | loss computed/needed | reward | length | peak GB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        base = old.get(r["arm"].split(":")[0])
        vs = f"{base / r['step_s']:.2f}x" if base and not r["arm"].endswith(":old") else "-"
        lines.append(f"| {r['arm']} | {r['step_s']:.2f} | {vs} | {r['rollout_s']:.2f} | {r['update_s']:.2f} | "
                     f"{r['update_ms_per_1k_tokens']:.1f} | {r['decode_us_per_row_step']:.1f} | "
                     f"{r['rows_per_kept']:.2f} | {r['loss_computed_per_needed']:.2f} | {r['reward']:.3f} | "
                     f"{r['length']:.0f} | {r['memory_gb']:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", help="model path or name (model.name)")
    ap.add_argument("--arms", default="bf16:new,bf16:old,nvfp4+aqn:new,nvfp4+aqn:old")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--set", nargs="*", default=[], help="further section.key=value overrides for every arm")
    ap.add_argument("--out", help="write the per-step metrics and the summary as JSON here")
    ap.add_argument("--metrics", nargs="*", default=[], metavar="ARM=FILE",
                    help="summarize runs made earlier (their metrics.jsonl) instead of running; --device names the GPU")
    ap.add_argument("--device", help="with --metrics: the device the runs were made on")
    args = ap.parse_args(argv)
    if args.metrics:
        results = []
        for item in args.metrics:
            arm, _, path = item.partition("=")
            rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
            results.append(summarize(arm, rows))
        print(table(results, args.device or "unknown"))
        return 0
    if not args.model:
        ap.error("give a model (or --metrics ARM=FILE ...)")
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
