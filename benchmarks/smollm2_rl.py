"""RL on the real SmolLM2-135M-Instruct, several arms side by side: held-out pass@1 before/after,
reward and entropy curves, time split and memory. Prints a table; writes results.json and one PNG per
quantity (all arms) to --out.

  python benchmarks/smollm2_rl.py --model smollm2-135m-instruct --train reasoning-gym:basic_arithmetic \
      --test reasoning-gym:basic_arithmetic --arms nvfp4+aqn,nvfp4,bf16 --steps 40 --out runs/study

An arm is FORMAT[+aqn] (FORMAT in nvfp4, mxfp4, nf4, bf16); every arm uses the same seed, data, steps and
hyper-parameters (--set section.key=value adds overrides to all arms).
"""

import argparse
import json
import time
from pathlib import Path

import torch


def run_arm(arm: str, args, test_rows) -> dict:
    from qerl.config import load_config
    from qerl.eval.evaluate import evaluate
    from qerl.rl.run_log import read_metrics
    from qerl.rl.trainer import Trainer
    from qerl.rollout.sampling import SamplingParams

    fmt, _, flag = arm.partition("+")
    overrides = [f"model.name={args.model}", f"model.format={fmt}", f"aqn.enabled={'true' if flag == 'aqn' else 'false'}",
                 f"data.train={args.train}", f"steps={args.steps}", f"seed={args.seed}",
                 f"output_dir={args.out}/{arm.replace('+', '_')}", "tensorboard=false", *args.set]
    cfg = load_config(args.config, overrides)
    trainer = Trainer(cfg)
    sampling = SamplingParams(args.eval_temperature, 0, 0.95)

    def held_out() -> float:
        res = evaluate(trainer.model, trainer.tokenizer, test_rows, n_samples=args.eval_n, sampling=sampling,
                       max_new_tokens=cfg.rollout.max_new_tokens, suffix=cfg.data.suffix, seed=args.seed,
                       engine=trainer.engine, progress=False)
        return res["pass@1"]

    before = held_out()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - t0
    after = held_out()
    metrics = read_metrics(Path(cfg.output_dir) / "metrics.jsonl")
    last = metrics[-max(1, len(metrics) // 5):]  # final 20% of steps
    mean = lambda key, rows: sum(r[key] for r in rows) / len(rows)  # noqa: E731
    return {"arm": arm, "pass1_before": before, "pass1_after": after, "seconds": seconds,
            "reward_first": mean("reward", metrics[: len(last)]), "reward_last": mean("reward", last),
            "entropy_first": mean("entropy", metrics[: len(last)]), "entropy_last": mean("entropy", last),
            "time_rollout": mean("time_rollout", metrics), "time_update": mean("time_update", metrics),
            "memory_gb": max(r["memory_gb"] for r in metrics), "metrics": metrics}


def plot(results: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for key, label in (("reward", "reward"), ("entropy", "entropy (nats/token)")):
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for r in results:
            ax.plot([m["step"] for m in r["metrics"]], [m[key] for m in r["metrics"]], label=r["arm"])
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / f"study_{key}.png", dpi=100)
        plt.close(fig)


def main(argv=None) -> int:
    from qerl.data import load_problems

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--config", default="configs/smollm2-demo.yaml")
    p.add_argument("--train", default="reasoning-gym:basic_arithmetic")
    p.add_argument("--test", default="reasoning-gym:basic_arithmetic")
    p.add_argument("--eval-limit", type=int, default=200)
    p.add_argument("--eval-n", type=int, default=4)
    p.add_argument("--eval-temperature", type=float, default=0.6)
    p.add_argument("--arms", default="nvfp4+aqn,nvfp4,bf16")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", action="append", default=[], help="section.key=value for every arm")
    p.add_argument("--out", default="runs/study")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    test_rows = load_problems(args.test, split="test", limit=args.eval_limit, seed=args.seed)
    results = [run_arm(arm, args, test_rows) for arm in args.arms.split(",")]
    (out / "results.json").write_text(json.dumps(results, indent=1))
    plot(results, out)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(f"\n{args.model}, {args.steps} steps, seed {args.seed}, {device}, {time.strftime('%Y-%m-%d')}")
    print(f"{'arm':<12}{'pass@1 before':>14}{'after':>8}{'reward first->last':>20}{'entropy first->last':>21}"
          f"{'rollout s':>10}{'update s':>9}{'peak GB':>8}")
    for r in results:
        print(f"{r['arm']:<12}{r['pass1_before']:>14.3f}{r['pass1_after']:>8.3f}"
              f"{r['reward_first']:>10.3f} -> {r['reward_last']:<6.3f}{r['entropy_first']:>11.3f} -> {r['entropy_last']:<6.3f}"
              f"{r['time_rollout']:>10.2f}{r['time_update']:>9.2f}{r['memory_gb']:>8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
