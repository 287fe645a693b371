"""TRL's GRPOTrainer on the job a qerl config describes: the same model (16-bit), problems, prompts, reward and
settings, timed per step, for the side-by-side in docs/peers.md.

    python benchmarks/peers/trl_grpo.py --config configs/gsm8k-grpo-1.5b.yaml --steps 20 --out runs/peers/trl
    python benchmarks/peers/trl_grpo.py ... --liger --sleep --gpu-memory-utilization 0.5   # TRL's speed options
    python benchmarks/peers/trl_grpo.py --config configs/smollm2-demo.yaml --generation transformers \\
        --steps 2 --set rollout.prompts_per_step=2 rollout.max_new_tokens=16                 # a check, CPU too

Installs nothing: it needs trl (1.16), peft, datasets, and vllm for `--generation vllm` (the default: TRL's
colocated engine, its recommended setup for speed), beside qerl.

Taken from the qerl config, so both sides run one job: `model.name` (an embedded name becomes the 16-bit directory
`qerl train` builds from it), `lora` r / alpha / targets / dropout / rsLoRA, `data` (problems, suffix, system,
max_prompt_tokens: the same prompts, built by qerl's template and filtered by length as qerl does), `rollout`
prompts_per_step x group_size, max_new_tokens, temperature, top_p / top_k, `algo` name (TRL's loss_type of the same
name), kl_beta, clip_low / clip_high, scale_rewards, overlong_filter, tis_cap (TRL's token-level truncated importance
sampling at the same cap, on the vLLM sampler's log-probs), `optim` lr / schedule / warmup / weight decay /
max_grad_norm, `rewards` (qerl's reward functions, which have TRL's signature) and their weights, `seed`. The
prompts come in qerl's order, step by step: the rows qerl's own `PromptStream` draws for the seed (`--prompts`, the
file side_by_side.py writes, or computed here), fed to TRL unshuffled. Not the same: the base stays 16-bit (TRL has
no 4-bit RL path), no AQN, and TRL's own defaults elsewhere (gradient checkpointing on, its fused LM head); the
list per job is in docs/peers.md, "What is the same and what differs".

Writes OUT/trl.json: seconds per step (the device synchronised at both ends of each optimizer step: generation,
loss passes, optimizer), the median over steps 3..N, the time from the script's start to the end of step 1, peak
memory (torch's allocator, and the device's used memory sampled at step ends, which also counts vLLM's own pools),
the mean reward per step, the importance-sampling correction applied and the digest of the prompt order fed
(`order_digest`; the order itself in OUT/prompts.jsonl); and OUT/adapter, for the held-out score with the scorer
qerl's runs use:
    qerl eval MODEL --adapter OUT/adapter --dataset gsm8k-offline:heldout --greedy
"""

import argparse
import datetime
import hashlib
import json
import statistics
import sys
import time
from pathlib import Path

START = time.perf_counter()

LOSS_TYPES = {"grpo": "grpo", "dapo": "dapo", "dr_grpo": "dr_grpo"}  # qerl algo.name -> TRL loss_type


def model_directory(name: str) -> str:
    """What TRL (and its vLLM engine) load: an embedded qerl model as its cached 16-bit directory, else the name."""
    from qerl.models.registry import EMBEDDED, embedded_hf_dir

    return str(embedded_hf_dir(name)) if name in EMBEDDED else name


def prompt_order(cfg, tokenizer, steps: int) -> list[dict]:
    """The problems `qerl train` with `cfg` draws in its first `steps` steps, in its order: the trainer's loader
    and length filter, then its `PromptStream` (the config's seed, reshuffled each epoch), prompts_per_step rows a
    step on one process. Dynamic sampling would draw more; the peers refuse it (`grpo_settings`)."""
    from qerl.data.datasets import filter_by_length, load_problems
    from qerl.rl.prompt_stream import PromptStream

    d = cfg.data
    rows = load_problems(d.train, split="train", limit=d.limit, seed=cfg.seed, question_key=d.question_key,
                         answer_key=d.answer_key, max_bad_fraction=d.max_bad_fraction)
    rows = filter_by_length(rows, tokenizer, d.max_prompt_tokens, suffix=d.suffix, system=d.system)
    return PromptStream(rows, cfg.seed).take(steps * cfg.rollout.prompts_per_step)


def write_prompt_order(path: Path, rows: list[dict], prompts_per_step: int) -> None:
    """`rows` as JSONL, each with the 1-based `step` it belongs to (prompts_per_step rows a step)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"step": i // prompts_per_step + 1, **r}) + "\n" for i, r in enumerate(rows)))


def read_prompt_order(path: Path, steps: int, prompts_per_step: int) -> list[dict]:
    """The first steps x prompts_per_step rows of a `write_prompt_order` file, without `step`; SystemExit when it
    holds fewer or was written for another prompts_per_step (its rows would fall into other steps)."""
    lines = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    need = steps * prompts_per_step
    if len(lines) < need:
        raise SystemExit(f"--prompts {path}: {len(lines)} rows, {steps} steps of {prompts_per_step} need {need}")
    if any(r.get("step") != i // prompts_per_step + 1 for i, r in enumerate(lines[:need])):
        raise SystemExit(f"--prompts {path}: its steps are not of {prompts_per_step} prompts "
                         "(rollout.prompts_per_step)")
    return [{k: v for k, v in r.items() if k != "step"} for r in lines[:need]]


def order_digest(rows: list[dict]) -> str:
    """sha256 of the rows' questions and answers in order: equal digests, the same prompts in the same steps."""
    text = "\n".join(json.dumps([r["question"], r["answer"]]) for r in rows)
    return hashlib.sha256(text.encode()).hexdigest()


def problems(cfg, tokenizer, rows: list[dict]):
    """`rows` (in their order) as TRL's dataset: `prompt` (qerl's built prompt text) and `answer`. With
    `grpo_settings`' shuffle_dataset=False TRL's RepeatSampler reads it front to back, generation_batch_size /
    num_generations = n = prompts_per_step consecutive rows an optimizer step, so step k (from 1) trains on rows
    (k-1)n .. kn-1, the ones qerl draws for it (`prompt_order`)."""
    from datasets import Dataset

    from qerl.data.templates import build_prompt

    d = cfg.data
    return Dataset.from_list([{"prompt": build_prompt(r["question"], tokenizer, suffix=d.suffix, system=d.system),
                               "answer": r["answer"]} for r in rows])


def grpo_settings(cfg, args, out: Path) -> dict:
    """The keyword arguments of TRL's GRPOConfig for the qerl config `cfg` (module docstring): one optimizer step
    per generation batch of prompts_per_step x group_size completions, run in micro-batches of args.micro_batch
    completions; the dataset read in its order (`problems`); and, when the completions come from vLLM
    (args.generation), qerl's truncated importance sampling: w_t = min(pi_old / mu, tis_cap) per token, mu the
    sampler's log-probs, pi_old the loss policy's (TRL's token_truncate mode at clip_max = tis_cap, no lower bound).
    With transformers generation the sampler is the loss policy itself (TRL then takes no sampler log-probs), so
    there is nothing to correct."""
    import torch

    r, a, o = cfg.rollout, cfg.algo, cfg.optim
    if a.name not in LOSS_TYPES:
        raise SystemExit(f"algo.name {a.name!r}: no TRL loss of that name")
    if a.num_updates != 1 or a.dynamic_sampling or a.overlong_buffer:
        raise SystemExit("algo.num_updates > 1, dynamic_sampling and overlong_buffer are not mapped to TRL here")
    if a.old_logprobs != "recompute":  # TRL's pi_old is always the loss policy; qerl's "sampling" has no TRL twin
        raise SystemExit(f"algo.old_logprobs {a.old_logprobs!r}: TRL's pi_old is the loss policy (recompute)")
    completions = r.prompts_per_step * r.group_size
    if completions % args.micro_batch:
        raise SystemExit(f"--micro-batch {args.micro_batch} must divide prompts_per_step x group_size = {completions}")
    accumulation = completions // args.micro_batch
    vllm = args.generation == "vllm"
    tis = vllm and a.tis_cap is not None
    return dict(
        output_dir=str(out / "trainer"), max_steps=args.steps, seed=cfg.seed, report_to="none", save_strategy="no",
        logging_steps=1, bf16=torch.cuda.is_available(), use_cpu=not torch.cuda.is_available(),
        per_device_train_batch_size=args.micro_batch, gradient_accumulation_steps=accumulation,
        steps_per_generation=accumulation, num_generations=r.group_size, num_iterations=1, shuffle_dataset=False,
        max_completion_length=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
        loss_type=LOSS_TYPES[a.name], beta=a.kl_beta, epsilon=a.clip_low,
        epsilon_high=a.clip_high, scale_rewards="group" if a.scale_rewards and a.name != "dr_grpo" else "none",
        mask_truncated_completions=a.overlong_filter, reward_weights=cfg.reward_weights,
        learning_rate=o.lr, lr_scheduler_type=o.schedule, warmup_steps=o.warmup_steps, weight_decay=o.weight_decay,
        max_grad_norm=o.max_grad_norm, optim="adamw_torch", gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False}, use_liger_kernel=args.liger,
        use_vllm=vllm, vllm_mode="colocate", vllm_gpu_memory_utilization=args.gpu_memory_utilization,
        vllm_enable_sleep_mode=args.sleep, vllm_importance_sampling_correction=tis,
        **({"vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_clip_min": None,
            "vllm_importance_sampling_clip_max": a.tis_cap} if tis else {}))


def importance_sampling(settings: dict) -> dict | None:
    """What `grpo_settings` asked of the IS correction, for the result file: mode and cap, or None when off."""
    if not settings.get("vllm_importance_sampling_correction"):
        return None
    return {"mode": settings["vllm_importance_sampling_mode"], "cap": settings["vllm_importance_sampling_clip_max"]}


def job_prompts(cfg, tokenizer, args, out: Path) -> list[dict]:
    """The run's prompts in qerl's order: from --prompts (side_by_side.py writes one file per seed for every job),
    else computed here (`prompt_order`); written to OUT/prompts.jsonl either way, the record of what was fed."""
    n = cfg.rollout.prompts_per_step
    rows = (read_prompt_order(Path(args.prompts), args.steps, n) if args.prompts
            else prompt_order(cfg, tokenizer, args.steps))
    write_prompt_order(out / "prompts.jsonl", rows, n)
    return rows


PROGRESS_FILE = "progress.json"  # a peer job's measurements so far, rewritten after every step


def step_timer(record: dict, started: float = START, progress: Path | None = None):
    """A TrainerCallback filling record: step seconds (device synchronised), device memory used at step ends, and
    time_to_first_step_s, counted from `started` (a perf_counter value; default: this module's import). With
    `progress`, after every logged step it also rewrites that file with `timing_summary` so far and `steps_done`:
    a job stopped before its result file still leaves what it measured."""
    import torch
    from transformers import TrainerCallback

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            sync()
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            sync()
            record["step_s"].append(time.perf_counter() - self.started)
            if len(record["step_s"]) == 1:
                record["time_to_first_step_s"] = time.perf_counter() - started
            if torch.cuda.is_available():
                free, total = torch.cuda.mem_get_info()
                record["device_used_gb"] = max(record.get("device_used_gb", 0.0), (total - free) / 1e9)

        def on_log(self, args, state, control, **kwargs):  # after the step's metrics reach the log history
            if progress is not None and record["step_s"]:
                tmp = progress.with_name(progress.name + ".tmp")
                tmp.write_text(json.dumps({"steps_done": len(record["step_s"]),
                                           **timing_summary(record, state.log_history)}, indent=1))
                tmp.replace(progress)

    return StepTimer()


IS_RATIO = "sampling/importance_sampling_ratio/mean"  # what TRL (and Unsloth's loss) log when the correction ran


def timing_summary(record: dict, log_history: list[dict]) -> dict:
    """The measured fields of OUT/*.json from `step_timer`'s record and the trainer's log history, with the mean
    importance-sampling weight per step where the trainer logged one (empty: the correction did not run)."""
    import torch

    steps = record["step_s"]
    timed = steps[2:] or steps
    return {"step_s": steps, "median_step_s": statistics.median(timed),
            "median_over": f"steps {3 if len(steps) > 2 else 1}-{len(steps)}",
            "time_to_first_step_s": record.get("time_to_first_step_s"),
            "peak_allocated_gb": torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else None,
            "peak_device_used_gb": record.get("device_used_gb"),
            "reward": [log["reward"] for log in log_history if "reward" in log],
            "importance_sampling_ratio_mean": [log[IS_RATIO] for log in log_history if IS_RATIO in log]}


def table_row(name: str, r: dict) -> str:
    """One printed line: median step, time to the first step, peaks, first and last reward."""
    return (f"| {name} | {r['median_step_s']:.2f} s ({r['median_over']}) | "
            f"first step {r['time_to_first_step_s']:.1f} s | peak {r['peak_allocated_gb'] or 0:.1f} GB allocated, "
            f"{r['peak_device_used_gb'] or 0:.1f} GB used | "
            f"reward {r['reward'][0]:.3f} -> {r['reward'][-1]:.3f} |")


def job_arguments(ap: argparse.ArgumentParser, result: str, memory_share: float) -> None:
    """The options every peer script takes: the job (a qerl config and overrides), steps, the output directory
    (`result`: the JSON file written there), the loss micro-batch, vLLM's memory share and the prompt order."""
    ap.add_argument("--config", default="configs/gsm8k-grpo-1.5b.yaml", help="the qerl config of the job")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="qerl config overrides")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", required=True, help=f"directory for {result} and the adapter")
    ap.add_argument("--micro-batch", type=int, default=16, help="completions per loss forward/backward")
    ap.add_argument("--gpu-memory-utilization", type=float, default=memory_share,
                    help=f"vLLM's share of the GPU (default {memory_share}, the peer's own)")
    ap.add_argument("--prompts", help="the per-step prompt order, a `write_prompt_order` file (side_by_side.py "
                                      "writes it); default: qerl's order for the config, computed here")


def empty_output(out: str) -> Path:
    """--out as a Path; SystemExit when it holds files (nothing is overwritten)."""
    path = Path(out)
    if path.exists() and any(path.iterdir()):
        raise SystemExit(f"--out {path}: not empty; choose a new directory")
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    job_arguments(ap, "trl.json", 0.3)
    ap.add_argument("--generation", choices=("vllm", "transformers"), default="vllm",
                    help="vllm: TRL's colocated vLLM engine; transformers: HF generate (slow; for checks)")
    ap.add_argument("--sleep", action="store_true", help="vLLM sleep mode: free its memory during the update")
    ap.add_argument("--liger", action="store_true", help="Liger kernels in the model's layers")
    args = ap.parse_args(argv)
    out = empty_output(args.out)

    import peft
    import torch
    import transformers
    import trl
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from qerl.config import load_config
    from qerl.rewards.resolve import resolve_reward

    cfg = load_config(args.config, args.set)
    model = model_directory(cfg.model.name)
    tokenizer = AutoTokenizer.from_pretrained(model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    lora = peft.LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
                           target_modules=list(cfg.lora.targets), use_rslora=cfg.lora.use_rslora,
                           task_type="CAUSAL_LM")
    record = {"step_s": []}
    settings = grpo_settings(cfg, args, out)
    rows = job_prompts(cfg, tokenizer, args, out)
    trainer = GRPOTrainer(model=model, reward_funcs=[resolve_reward(name) for name in cfg.rewards],
                          args=GRPOConfig(**settings), train_dataset=problems(cfg, tokenizer, rows),
                          processing_class=tokenizer, peft_config=lora,
                          callbacks=[step_timer(record, progress=out / PROGRESS_FILE)])
    trainer.train()
    trainer.save_model(str(out / "adapter"))

    versions = {"trl": trl.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
                "torch": torch.__version__}
    if args.generation == "vllm":
        import vllm

        versions["vllm"] = vllm.__version__
    result = {
        "peer": "trl", "date": str(datetime.date.today()),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "versions": versions,
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]) if argv is None else " ".join(argv),
        "config": args.config, "overrides": args.set, "model": model, "generation": args.generation,
        "micro_batch": args.micro_batch, "gpu_memory_utilization": args.gpu_memory_utilization,
        "sleep": args.sleep, "liger": args.liger, "importance_sampling": importance_sampling(settings),
        "prompt_order_sha256": order_digest(rows), **timing_summary(record, trainer.state.log_history),
        "adapter": str(out / "adapter"),
    }
    (out / "trl.json").write_text(json.dumps(result, indent=1))
    options = "".join(f", {o}" for o in ("liger", "sleep") if getattr(args, o))
    print(table_row(f"TRL {trl.__version__} ({args.generation}{options})", result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
