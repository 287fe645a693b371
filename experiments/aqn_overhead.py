"""Does AQN cost time? `qerl train` steps with and without AQN on the same seed and data, split into rollout
seconds, generated tokens and decode steps, plus the rollout engine at forced lengths, with and without
`aqn=NoisyNorms(...)`, and the cost of NoisyNorms itself (this implementation vs the per-norm loop it replaced).

  PYTHONPATH=src python experiments/aqn_overhead.py --model /tmp/qm/SmolLM2-135M-Instruct.Q4_1.gguf --out DIR

Parts (each prints a table; everything is also written to DIR/aqn_overhead.json):
  A  natural lengths: K steps of the demo config (configs/smollm2-demo.yaml: NVFP4 rtn + LoRA r16, 6 x 8
     completions, <= 80 new tokens, T 0.7, lr 1e-3), AQN off, then the same K steps from the same state (LoRA,
     optimizer, data position, sampler RNG) with the config's AQN schedule (5 stages, sigma 1e-2 -> 5e-4). A
     step's rollout runs until every row stopped (checked every 32 tokens) or the budget is spent, so its
     time follows the number of decode steps (the longest row), not the tokens kept.
  B  forced lengths: the same trainer, every completion forced to the full budget (ignore_eos), steps
     alternating AQN off / on (constant sigma): identical work, so any difference is AQN's own cost.
  C  engine only: `engine.generate(..., ignore_eos=True)` without AQN, with NoisyNorms (one draw per batch),
     and with per_forward=True, alternating; the legacy per-norm NoisyNorms too. Counts CUDA graph captures
     and resets with AQN on.
  D  NoisyNorms alone: enter + exit and one resample, wall time (host launch cost) and device time; a host
     sync check (torch.cuda.set_sync_debug_mode("error")) around enter / resample / exit.
  E  (--runs on,off,on) whole `qerl train` runs of the demo config, one process each, in that order, sharing a
     Triton cache that starts empty (TRITON_CACHE_DIR=DIR/triton-cache): how two separate runs compare when
     one of them compiles the kernels. Only this part runs when --runs is given.
"""

import argparse
import copy
import datetime
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from qerl.config import load_config
from qerl.nn.noisy_norm import CHANNEL_SCALE, NoisyNorms
from qerl.rl import trainer as trainer_mod
from qerl.rl.trainer import Trainer
from qerl.rollout import RolloutEngine
from qerl.rollout.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]


class LegacyNoisyNorms(NoisyNorms):
    """The per-norm implementation this file measured against (qerl before 2026-11-26): per norm a clone on
    entry, and per draw randn + scale + add + copy (about 6 launches per norm), a copy back per norm on exit."""

    @torch.no_grad()
    def __enter__(self):
        self._saved = [n.weight.detach().clone() for n in self.norms]
        self._hooks = []
        self.resample()
        return self

    @torch.no_grad()
    def resample(self):
        if self.sigma == 0.0:
            return
        for norm, clean in zip(self.norms, self._saved):
            z = torch.randn(clean.shape, generator=self.generator, device=clean.device, dtype=torch.float32)
            noise = self.sigma * z
            scale = getattr(norm, CHANNEL_SCALE, None)
            if scale is not None:
                noise = noise / scale.float()
            norm.weight.copy_(clean.float() + noise)

    @torch.no_grad()
    def __exit__(self, *exc):
        for norm, clean in zip(self.norms, self._saved):
            norm.weight.copy_(clean)
        self._saved = None


class ConstantSigma:
    """Stands in for the trainer's AQNSchedule: the same sigma at every step."""

    def __init__(self, sigma: float):
        self.value = sigma

    def sigma(self, step, total):
        return self.value

    def stage(self, step, total):
        return 1 if self.value > 0 else 0


def write_products(path: Path, n: int = 2000, seed: int = 0) -> None:
    """One- and two-digit products (like reasoning-gym `products`), question/answer JSONL."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            a, b = rng.randint(2, 99), rng.randint(2, 9)
            f.write(json.dumps({"question": f"Solve the following multiplication: {a} * {b}. Give only the result as "
                                            "your final answer.", "answer": str(a * b)}) + "\n")


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepRecorder:
    """Wraps the trainer's collect_experience to record what a step's rollout did."""

    def __init__(self):
        self.last = None
        self.orig = trainer_mod.collect_experience

    def __call__(self, engine, *args, **kwargs):
        exp = self.orig(engine, *args, **kwargs)
        self.last = {"gen_seconds": exp.stats["gen_seconds"], "gen_tokens": exp.stats["gen_tokens"],
                     "decode_steps": int(exp.completion_ids.shape[1]), "rows": int(exp.completion_ids.shape[0]),
                     "sigma": kwargs.get("sigma", 0.0)}
        return exp


def snapshot(tr: Trainer) -> dict:
    return {"params": [p.detach().clone() for p in tr.params], "optim": copy.deepcopy(tr.optimizer.state_dict()),
            "sched": copy.deepcopy(tr.scheduler.state_dict()), "gen": tr.generator.get_state(),
            "stream": copy.deepcopy(tr.stream.state()), "step": tr.step,
            "cpu_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


@torch.no_grad()
def restore(tr: Trainer, s: dict) -> None:
    for p, v in zip(tr.params, s["params"]):
        p.copy_(v)
        p.grad = None
    tr.optimizer.load_state_dict(copy.deepcopy(s["optim"]))
    tr.scheduler.load_state_dict(copy.deepcopy(s["sched"]))
    tr.generator.set_state(s["gen"])
    tr.stream.load_state(copy.deepcopy(s["stream"]))
    tr.step = s["step"]
    tr.bad_in_a_row = 0
    torch.set_rng_state(s["cpu_rng"])
    if s["cuda_rng"] is not None:
        torch.cuda.set_rng_state_all(s["cuda_rng"])


def run_steps(tr: Trainer, rec: StepRecorder, sigmas) -> list[dict]:
    """One trainer step per entry of sigmas (None: the trainer's own schedule; a number: that constant)."""
    out = []
    schedule = tr.aqn
    for sigma in sigmas:
        tr.aqn = schedule if sigma is None else ConstantSigma(sigma)
        sync(tr.device)
        m = tr.train_step()
        sync(tr.device)
        r = dict(rec.last)
        r.update(step=m["step"], time_step=m["time_step"], time_rollout=m["time_rollout"],
                 time_update=m["time_update"], reward=m["reward"], response_length=m["response_length"],
                 entropy=m["entropy"], aqn_sigma=m["aqn_sigma"])
        out.append(r)
    tr.aqn = schedule
    return out


def summarize(rows: list[dict]) -> dict:
    n = len(rows)
    tot = {k: sum(r[k] for r in rows) for k in ("time_step", "time_rollout", "time_update", "gen_seconds",
                                                    "gen_tokens", "decode_steps")}
    return {"steps": n, "s_per_step": tot["time_step"] / n, "rollout_s": tot["time_rollout"] / n,
            "gen_s": tot["gen_seconds"] / n, "update_s": tot["time_update"] / n,
            "gen_tokens": tot["gen_tokens"] / n, "decode_steps": tot["decode_steps"] / n,
            "ms_per_token": 1e3 * tot["gen_seconds"] / max(tot["gen_tokens"], 1),
            "ms_per_decode_step": 1e3 * tot["gen_seconds"] / max(tot["decode_steps"], 1),
            "median_step_s": statistics.median(r["time_step"] for r in rows),
            "median_gen_s": statistics.median(r["gen_seconds"] for r in rows),
            "median_update_s": statistics.median(r["time_update"] for r in rows),
            "reward": sum(r["reward"] for r in rows) / n}


def print_steps_table(title: str, arms: dict[str, dict]) -> None:
    print(f"\n## {title}\n")
    print("| arm | steps | s/step (mean) | s/step (median) | rollout s | generate s | update s | generated tokens "
          "| decode steps | ms / token | ms / decode step | reward |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, s in arms.items():
        print(f"| {name} | {s['steps']} | {s['s_per_step']:.3f} | {s['median_step_s']:.3f} | {s['rollout_s']:.3f} | "
              f"{s['gen_s']:.3f} | {s['update_s']:.3f} | {s['gen_tokens']:.0f} | {s['decode_steps']:.1f} | "
              f"{s['ms_per_token']:.3f} | {s['ms_per_decode_step']:.2f} | {s['reward']:.3f} |")


def engine_level(tr: Trainer, batch: int, new_tokens: int, reps: int, sigma: float, reps_per_forward: int) -> dict:
    """engine.generate at forced lengths, variants alternating; captures / resets counted."""
    model, tok, device = tr.model, tr.tokenizer, tr.device
    rows = tr.stream.take(batch)
    prompts = [tr.encode(r)[1] for r in rows]
    P = max(map(len, prompts))
    engine = RolloutEngine(model, tok, max_seq_len=P + new_tokens)
    captures, resets = [0], [0]
    graphs = engine.decode_graphs
    cap0, reset0 = graphs._capture, graphs.reset

    def counting_capture(step):
        captures[0] += 1
        return cap0(step)

    def counting_reset():
        resets[0] += 1
        return reset0()

    graphs._capture, graphs.reset = counting_capture, counting_reset
    sp = SamplingParams(temperature=0.7)
    gen = torch.Generator(device).manual_seed(123)
    variants = {
        "off": lambda: None,
        "aqn": lambda: NoisyNorms(model, sigma, generator=gen),
        "aqn legacy": lambda: LegacyNoisyNorms(model, sigma, generator=gen),
        "aqn per_forward": lambda: NoisyNorms(model, sigma, per_forward=True, generator=gen),
        "aqn per_forward legacy": lambda: LegacyNoisyNorms(model, sigma, per_forward=True, generator=gen),
    }
    times = {k: [] for k in variants}
    graph_counts = {k: [] for k in variants}
    caps = {k: 0 for k in variants}
    for k, make in variants.items():  # warm-up: compile, capture
        engine.generate(prompts, new_tokens, sp, generator=gen, ignore_eos=True, aqn=make())
    warm_captures, warm_resets = captures[0], resets[0]
    for rep in range(reps):
        for k, make in variants.items():
            if "per_forward" in k and rep >= reps_per_forward:
                continue
            c = captures[0]
            sync(device)
            t0 = time.perf_counter()
            engine.generate(prompts, new_tokens, sp, generator=gen, ignore_eos=True, aqn=make())
            sync(device)
            times[k].append(time.perf_counter() - t0)
            graph_counts[k].append(len(engine.graphs))
            caps[k] += captures[0] - c
    base = statistics.median(times["off"])
    res = {"batch": batch, "new_tokens": new_tokens, "prompt_len": P, "sigma": sigma,
           "warmup_captures": warm_captures, "resets_while_timed": resets[0] - warm_resets, "variants": {}}
    for k, ts in times.items():
        med = statistics.median(ts)
        res["variants"][k] = {"median_s": med, "all_s": ts, "vs_off": med / base - 1,
                              "ms_per_decode_step": 1e3 * med / new_tokens,
                              "graphs_after_each": graph_counts[k], "captures_while_timed": caps[k]}
    return res


def print_engine_table(res: dict) -> None:
    print(f"\n## C: engine.generate, {res['batch']} rows x {res['new_tokens']} forced new tokens "
          f"(prompt {res['prompt_len']}), sigma {res['sigma']:g}\n")
    print("| variant | reps | median s | vs off | ms / decode step | graphs after each call | captures while timed |")
    print("|---|---|---|---|---|---|---|")
    for k, v in res["variants"].items():
        print(f"| {k} | {len(v['all_s'])} | {v['median_s']:.4f} | {100 * v['vs_off']:+.1f}% | "
              f"{v['ms_per_decode_step']:.3f} | {sorted(set(v['graphs_after_each']))} | {v['captures_while_timed']} |")
    print(f"(graph captures during warm-up {res['warmup_captures']}, graph resets while timed "
          f"{res['resets_while_timed']})")


def noisy_norms_alone(tr: Trainer, sigma: float, iters: int) -> dict:
    model, device = tr.model, tr.device
    gen = torch.Generator(device).manual_seed(7)
    out = {"norms": len(NoisyNorms(model, sigma).norms)}
    for name, cls in (("NoisyNorms", NoisyNorms), ("legacy", LegacyNoisyNorms)):
        aqn = cls(model, sigma, generator=gen)
        for _ in range(3):
            with aqn:
                aqn.resample()
        # enter + exit (one draw)
        sync(device)
        t0 = time.perf_counter()
        for _ in range(iters):
            with aqn:
                pass
        t_host = (time.perf_counter() - t0) / iters
        sync(device)
        t_all = (time.perf_counter() - t0) / iters
        with aqn:
            sync(device)
            t0 = time.perf_counter()
            for _ in range(iters):
                aqn.resample()
            r_host = (time.perf_counter() - t0) / iters
            sync(device)
            r_all = (time.perf_counter() - t0) / iters
        out[name] = {"enter_exit_host_ms": 1e3 * t_host, "enter_exit_ms": 1e3 * t_all,
                     "resample_host_ms": 1e3 * r_host, "resample_ms": 1e3 * r_all}
    if device.type == "cuda":
        aqn = NoisyNorms(model, sigma, per_forward=True, generator=gen)
        torch.cuda.set_sync_debug_mode("error")
        try:
            with aqn:
                aqn.resample()
            out["host_syncs"] = "none (set_sync_debug_mode error raised nothing)"
        except RuntimeError as e:
            out["host_syncs"] = f"SYNC: {e}"
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return out


def separate_runs(args, data: Path, out: Path) -> dict:
    """Part E: one `qerl train` process per entry of --runs, one after the other, sharing a fresh Triton cache."""
    env = dict(os.environ, TRITON_CACHE_DIR=str(out / "triton-cache"), PYTHONUNBUFFERED="1")
    runs = []
    for i, arm in enumerate(args.runs.split(",")):
        run_dir = out / f"run{i}_{arm}"
        cmd = [sys.executable, "-c", "import sys; from qerl.cli import main; sys.exit(main())", "train",
               "--config", str(ROOT / "configs" / "smollm2-demo.yaml"), f"model.name={args.model}",
               f"data.train={data}", f"steps={args.steps}", "tensorboard=false", "plots=false",
               f"aqn.enabled={'true' if arm == 'on' else 'false'}", *args.set, "--output-dir", str(run_dir)]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode:
            print(proc.stdout[-3000:], proc.stderr[-3000:])
            raise SystemExit(f"run {i} ({arm}) failed")
        m = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
        later = m[1:]
        runs.append({"arm": arm, "wall_s": wall, "first_step_s": m[0]["time_step"],
                     "step_s_mean": statistics.mean(x["time_step"] for x in later),
                     "step_s_median": statistics.median(x["time_step"] for x in later),
                     "rollout_s": statistics.mean(x["time_rollout"] for x in later),
                     "update_s": statistics.mean(x["time_update"] for x in later),
                     "response_length": statistics.mean(x["response_length"] for x in later),
                     "tokens_per_s": statistics.mean(x["tokens_per_s"] for x in later),
                     "stage0_step_s": [x["time_step"] for x in m if x["aqn_sigma"] == 0][1:],
                     "metrics": m})
    print(f"\n## E: separate `qerl train` processes, {args.steps} steps each, in this order, one Triton cache "
          "(empty before the first)\n")
    print("| run | AQN | first step s | s/step, steps 2.. (mean) | (median) | rollout s | update s | response length "
          "| generated tok/s | process wall s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for i, r in enumerate(runs):
        print(f"| {i} | {r['arm']} | {r['first_step_s']:.2f} | {r['step_s_mean']:.3f} | {r['step_s_median']:.3f} | "
              f"{r['rollout_s']:.3f} | {r['update_s']:.3f} | {r['response_length']:.1f} | {r['tokens_per_s']:.0f} | "
              f"{r['wall_s']:.1f} |")
    print("\nsteps 2.. with sigma 0 in every run (identical work: same seed, data and LoRA until AQN starts): "
          + "; ".join(f"run {i} {' '.join(f'{t:.2f}' for t in r['stage0_step_s'])}" for i, r in enumerate(runs)))
    return {"runs": runs}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--out", default="runs/aqn_overhead")
    ap.add_argument("--steps", type=int, default=12, help="part A: steps per arm")
    ap.add_argument("--forced-steps", type=int, default=10, help="part B: steps (alternating off / on)")
    ap.add_argument("--sigma", type=float, default=1e-2, help="parts B-D: the AQN sigma (the schedule's largest)")
    ap.add_argument("--reps", type=int, default=7, help="part C: timed calls per variant")
    ap.add_argument("--engine", default="48x80,128x256", help="part C: ROWSxTOKENS[,...]")
    ap.add_argument("--set", nargs="*", default=[], help="extra config overrides section.key=value")
    ap.add_argument("--skip", default="", help="parts to skip, e.g. AB")
    ap.add_argument("--runs", default="", help="part E only: e.g. on,off,on (one qerl train process each)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="aqn_overhead_"))
    data = tmp / "products.jsonl"
    write_products(data)
    if args.runs:
        results = {"meta": {"date": datetime.date.today().isoformat(), "argv": sys.argv,
                            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}}
        print(f"# AQN overhead, separate runs: {results['meta']['device']}, {results['meta']['date']}")
        results["E"] = separate_runs(args, data, out)
        with open(out / "aqn_overhead_runs.json", "w") as f:
            json.dump(results, f, indent=1, default=str)
        return 0
    overrides = [f"model.name={args.model}", f"data.train={data}", f"steps={args.steps}",
                 f"output_dir={tmp / 'run'}", "tensorboard=false", "plots=false", *args.set]
    cfg = load_config(ROOT / "configs" / "smollm2-demo.yaml", overrides)
    tr = Trainer(cfg)
    device = tr.device
    meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "date": datetime.date.today().isoformat(), "torch": torch.__version__, "argv": sys.argv,
            "config": {"rollout": vars(cfg.rollout), "aqn": vars(cfg.aqn), "lr": cfg.optim.lr,
                       "format": cfg.model.format, "method": cfg.model.quant_method}}
    print(f"# AQN overhead: {meta['device']}, {meta['date']}, torch {meta['torch']}")
    results = {"meta": meta}
    rec = StepRecorder()
    trainer_mod.collect_experience = rec

    # warm-up step (kernel compilation), then back to the initial state
    s0 = snapshot(tr)
    t0 = time.perf_counter()
    run_steps(tr, rec, [args.sigma])
    results["warmup_step_s"] = time.perf_counter() - t0
    restore(tr, s0)

    if "A" not in args.skip:
        off = run_steps(tr, rec, [0.0] * args.steps)
        restore(tr, s0)
        on = run_steps(tr, rec, [None] * args.steps)  # the config's schedule over `steps`
        restore(tr, s0)
        off2 = run_steps(tr, rec, [0.0] * args.steps)  # off again: run-to-run spread, warm-up bias of the first arm
        restore(tr, s0)
        results["A"] = {"off": off, "on": on, "off_repeat": off2}
        print_steps_table(f"A: natural lengths, {args.steps} steps per arm from the same state (AQN on = the "
                          f"config's schedule, sigma {sorted({r['aqn_sigma'] for r in on})})",
                          {"AQN off": summarize(off), "AQN on": summarize(on), "AQN off (repeat)": summarize(off2),
                           "AQN on, steps with sigma > 0": summarize([r for r in on if r["aqn_sigma"] > 0]),
                           "AQN off, same steps": summarize([r for r, o in zip(off, on) if o["aqn_sigma"] > 0])})
        print("\nper step (off | on): decode steps, generated tokens, generate s, step s")
        for a, b in zip(off, on):
            print(f"  step {a['step']:>2}  sigma {b['aqn_sigma']:.1e}  {a['decode_steps']:>3} | "
                  f"{b['decode_steps']:>3}  {a['gen_tokens']:>5.0f} | {b['gen_tokens']:>5.0f}  "
                  f"{a['gen_seconds']:.3f} | {b['gen_seconds']:.3f}  {a['time_step']:.3f} | {b['time_step']:.3f}")

    if "B" not in args.skip:
        orig_generate = tr.engine.generate

        def forced(prompts, max_new_tokens, sampling=SamplingParams(), seed=None, stop=(), ignore_eos=False, *rest,
                   **kw):
            return orig_generate(prompts, max_new_tokens, sampling, seed, stop, True, *rest, **kw)

        tr.engine.generate = forced
        run_steps(tr, rec, [0.0, args.sigma])  # warm the forced-length graphs / shapes
        rows = run_steps(tr, rec, [0.0, args.sigma] * (args.forced_steps // 2))
        del tr.engine.generate  # back to the class's method
        restore(tr, s0)
        results["B"] = rows
        off, on = summarize([r for r in rows if r["sigma"] == 0]), summarize([r for r in rows if r["sigma"] > 0])
        print_steps_table(f"B: forced lengths ({cfg.rollout.max_new_tokens} tokens every row), steps alternating "
                          f"off / on (sigma {args.sigma:g})", {"AQN off": off, "AQN on": on})
        print(f"\nAQN on vs off at forced lengths: step {100 * (on['median_step_s'] / off['median_step_s'] - 1):+.1f}% "
              f"(median), generate {100 * (on['median_gen_s'] / off['median_gen_s'] - 1):+.1f}%, "
              f"update {100 * (on['median_update_s'] / off['median_update_s'] - 1):+.1f}%")

    if "C" not in args.skip:
        results["C"] = []
        for spec in args.engine.split(","):
            b, t = map(int, spec.split("x"))
            res = engine_level(tr, b, t, args.reps, args.sigma, reps_per_forward=min(3, args.reps))
            results["C"].append(res)
            print_engine_table(res)

    if "D" not in args.skip:
        d = noisy_norms_alone(tr, args.sigma, iters=50)
        results["D"] = d
        print(f"\n## D: NoisyNorms alone ({d['norms']} norms), ms per call\n")
        print("| implementation | enter + exit, host | enter + exit, done | resample, host | resample, done |")
        print("|---|---|---|---|---|")
        for k in ("NoisyNorms", "legacy"):
            v = d[k]
            print(f"| {k} | {v['enter_exit_host_ms']:.3f} | {v['enter_exit_ms']:.3f} | {v['resample_host_ms']:.3f} | "
                  f"{v['resample_ms']:.3f} |")
        if "host_syncs" in d:
            print(f"host syncs in enter / resample / exit: {d['host_syncs']}")

    with open(out / "aqn_overhead.json", "w") as f:
        json.dump(results, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
