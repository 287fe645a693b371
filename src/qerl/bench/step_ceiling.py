"""How fast an NVFP4 LoRA step can be at most, against the bf16 LoRA step measured beside it (`qerl bench step`):
bf16's reference, loss+backward, optimizer and glue kept, its rollout divided by the ratio of bytes a decode step
reads; the argument in docs/cli.md ("The NVFP4 step's ceiling").

    python -m qerl.bench.step_ceiling docs/results/e2e_7b_h100_2026-11-25_interleaved.json
"""

import argparse
import json

from ..models.shapes import qwen25_config
from .options import md_header

BF16_BYTES = 2


def kv_cache_bytes(config, sequences: int, prompt: int, completion: int) -> float:
    """Bytes of K and V (bf16) one decode step reads, averaged over the completion: every sequence attends to
    prompt + completion / 2 positions on average, through every layer's K and V."""
    head_dim = config.hidden_size // config.num_attention_heads
    per_position = config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * BF16_BYTES
    return sequences * (prompt + completion / 2) * per_position


def decode_bytes(config, weights_gb: float) -> float:
    """Weight bytes one decode step reads: everything the policy holds except the input embedding (a decode
    step gathers one row of it per sequence)."""
    return weights_gb * 1e9 - config.vocab_size * config.hidden_size * BF16_BYTES


def ceiling(bf16: dict, nvfp4: dict, prompt: int, completion: int, layers: int | None = None) -> dict:
    """bf16, nvfp4: result rows of one (model, prompts) cell (`qerl bench step --out`, the same run); layers: the
    run's --layers (None: the model's own)."""
    config = qwen25_config(bf16["model"], layers)
    kv = kv_cache_bytes(config, bf16["sequences"], prompt, completion)
    weights = [decode_bytes(config, r["weights_gb"]) for r in (bf16, nvfp4)]
    if min(weights) <= 0:
        raise ValueError(f"weights_gb {bf16['weights_gb']} / {nvfp4['weights_gb']} do not exceed the input "
                         f"embedding of Qwen2.5-{bf16['model']}: not a run of that model")
    ratio = (weights[0] + kv) / (weights[1] + kv)
    rest = bf16["step"] - bf16["rollout"]  # reference + loss+backward + optimizer + glue, at best tied
    best = rest + bf16["rollout"] / ratio
    return dict(model=bf16["model"], prompts=bf16["prompts"], sequences=bf16["sequences"], completion=completion,
                kv_gb=kv / 1e9, byte_ratio=ratio, bf16_step=bf16["step"], bf16_rollout=bf16["rollout"],
                rest=rest, best_step=best, ceiling=bf16["step"] / best,
                no_rollout_ceiling=bf16["step"] / rest, measured=bf16["step"] / nvfp4["step"],
                nvfp4_rollout=nvfp4["rollout"], nvfp4_rest=nvfp4["step"] - nvfp4["rollout"])


def cells(report: dict) -> list[dict]:
    """The ceiling of every (model, prompts) cell of a `qerl bench step --out` report that has bf16 and nvfp4."""
    args, rows = report["args"], [r for r in report["results"] if "step" in r]
    out = []
    for r in rows:
        if r["variant"] != "nvfp4":
            continue
        base = next((b for b in rows if b["variant"] == "bf16" and b["model"] == r["model"]
                     and b["prompts"] == r["prompts"]), None)
        if base is not None:
            out.append(ceiling(base, r, args["prompt"], args["completion"], args.get("layers")))
    return out


def table(reports: list[tuple[str, dict]]) -> str:
    lines = [md_header("run | model | prompts x G | completion | bf16 step s | bf16 rollout s | bf16 rest s | KV "
                       "GB/step | bytes bf16 / NVFP4 | ceiling step s | **ceiling** | no-rollout ceiling | "
                       "**measured** | NVFP4 rollout / rest s", "lll" + "r" * 10 + "l")]
    for name, report in reports:
        g = report["args"]["group"]
        for c in cells(report):
            lines.append(f"| {name} ({report['device']}, {report['date']}) | {c['model']} | {c['prompts']} x {g} "
                         f"| {c['completion']} | {c['bf16_step']:.2f} | {c['bf16_rollout']:.2f} | {c['rest']:.2f} "
                         f"| {c['kv_gb']:.2f} | {c['byte_ratio']:.2f} | {c['best_step']:.2f} "
                         f"| **{c['ceiling']:.2f}x** | {c['no_rollout_ceiling']:.2f}x | **{c['measured']:.2f}x** "
                         f"| {c['nvfp4_rollout']:.2f} / {c['nvfp4_rest']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="step_ceiling", description=__doc__.split("\n\n")[0])
    ap.add_argument("reports", nargs="+", help="JSON files written by `qerl bench step --out`")
    args = ap.parse_args(argv)
    reports = []
    for path in args.reports:
        with open(path) as f:
            reports.append((path.rsplit("/", 1)[-1], json.load(f)))
    print(table(reports))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
