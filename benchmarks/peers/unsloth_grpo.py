"""Unsloth's GRPO (its patched TRL GRPOTrainer, vLLM generation through `fast_inference`) on the job a qerl config
describes: the same model, problems, prompts, reward and settings as `trl_grpo.py`, for docs/peers.md.

    python benchmarks/peers/unsloth_grpo.py --config configs/gsm8k-grpo-1.5b.yaml --steps 20 --weights 16bit \\
        --out runs/peers/unsloth-16bit
    python benchmarks/peers/unsloth_grpo.py ... --weights 4bit    # its QLoRA (bitsandbytes NF4 base)
    python benchmarks/peers/unsloth_grpo.py ... --weights fp8     # its FP8 RL (Hopper and newer)

Installs nothing: it needs unsloth (and the unsloth_zoo, vllm, trl, peft, datasets it pins) beside qerl, and a
CUDA GPU (Unsloth refuses to import without one). It writes OUT/unsloth.json and OUT/adapter as `trl_grpo.py`
writes trl.json: the same fields, measured the same way (`trl_grpo.step_timer`), with TRL's settings from the same
qerl config (`trl_grpo.grpo_settings` for vLLM generation: Unsloth's engine samples, so qerl's truncated importance
sampling applies as in the TRL job, which Unsloth's patched loss honours), the prompts in qerl's order
(`trl_grpo.job_prompts`), and Unsloth's own recommended settings where it has them: its gradient checkpointing
("unsloth") and vLLM sharing the policy's weights (`--gpu-memory-utilization`, default its 0.6).
"""

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

START = time.perf_counter()  # before Unsloth's import and patching: they count in the time to the first step

sys.path.insert(0, str(Path(__file__).parent))
from trl_grpo import (empty_output, grpo_settings, importance_sampling, job_arguments, job_prompts,  # noqa: E402
                      model_directory, order_digest, problems, step_timer, table_row, timing_summary,
                      PROGRESS_FILE)


def unsloth_settings(cfg, args, out: Path) -> dict:
    """TRL's GRPOConfig arguments for Unsloth's trainer: `grpo_settings` with vLLM generation, as Unsloth runs it
    (with fast_inference its patched trainer sets use_vllm and samples with the model's own engine), so the
    importance-sampling correction, which Unsloth turns off by default, is on at qerl's cap; TRL's own engine
    options (sleep mode, Liger) stay off: Unsloth's engine is built by `FastLanguageModel.from_pretrained`."""
    return grpo_settings(cfg, argparse.Namespace(**{**vars(args), "generation": "vllm", "sleep": False,
                                                    "liger": False}), out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    job_arguments(ap, "unsloth.json", 0.6)  # 0.6: Unsloth's GRPO examples
    ap.add_argument("--weights", choices=("16bit", "4bit", "fp8"), default="16bit",
                    help="the frozen base: bf16 (16-bit LoRA), bitsandbytes 4-bit (QLoRA) or FP8")
    ap.add_argument("--tokenizer-repair", choices=("on", "off"), default="on",
                    help="Unsloth's tokenizer repair at load (its fix_tokenizer, on by default); off keeps the "
                         "model directory's tokenizer as it is (docs/peers.md: the repair failed on this one)")
    args = ap.parse_args(argv)
    out = empty_output(args.out)

    # its full messages in the job log: the one failure seen (its tokenizer patch, docs/peers.md) printed only a summary
    os.environ.setdefault("UNSLOTH_ENABLE_LOGGING", "1")
    import unsloth  # first among the ML imports: it patches transformers, peft and trl as they import
    from unsloth import FastLanguageModel

    # isort: split
    import torch
    import trl
    from trl import GRPOConfig, GRPOTrainer

    from qerl.config import load_config
    from qerl.rewards.resolve import resolve_reward

    cfg = load_config(args.config, args.set)
    model_dir = model_directory(cfg.model.name)
    # what Unsloth's own tokenizer loader makes of the directory, before its model load (which checks the pad token)
    from unsloth.tokenizer_utils import load_correct_tokenizer

    probe = load_correct_tokenizer(model_dir, fix_tokenizer=args.tokenizer_repair == "on")
    print(f"Unsloth's tokenizer loader, repair {args.tokenizer_repair}: {type(probe).__name__}, {len(probe)} tokens, "
          f"eos {probe.eos_token!r}, pad {probe.pad_token!r}", flush=True)
    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name=model_dir, max_seq_length=cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens,
        load_in_4bit=args.weights == "4bit", load_in_fp8=args.weights == "fp8", fast_inference=True,
        max_lora_rank=cfg.lora.r, gpu_memory_utilization=args.gpu_memory_utilization, random_state=cfg.seed,
        fix_tokenizer=args.tokenizer_repair == "on")
    print(f"tokenizer after Unsloth's load: eos {tokenizer.eos_token!r} ({tokenizer.eos_token_id}), pad "
          f"{tokenizer.pad_token!r} ({tokenizer.pad_token_id})", flush=True)
    model = FastLanguageModel.get_peft_model(
        model, r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
        target_modules=list(cfg.lora.targets), use_rslora=cfg.lora.use_rslora,
        use_gradient_checkpointing="unsloth", random_state=cfg.seed)
    settings = unsloth_settings(cfg, args, out)
    rows = job_prompts(cfg, tokenizer, args, out)
    record = {"step_s": []}
    trainer = GRPOTrainer(model=model, reward_funcs=[resolve_reward(name) for name in cfg.rewards],
                          args=GRPOConfig(**settings), train_dataset=problems(cfg, tokenizer, rows),
                          processing_class=tokenizer, callbacks=[step_timer(record, START, out / PROGRESS_FILE)])
    trainer.train()
    model.save_pretrained(str(out / "adapter"))
    tokenizer.save_pretrained(str(out / "adapter"))

    result = {
        "peer": "unsloth", "weights": args.weights, "date": str(datetime.date.today()),
        "device": torch.cuda.get_device_name(),
        "versions": {"unsloth": unsloth.__version__, "trl": trl.__version__, "torch": torch.__version__},
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]) if argv is None else " ".join(argv),
        "config": args.config, "overrides": args.set, "model": model_dir, "micro_batch": args.micro_batch,
        "gpu_memory_utilization": args.gpu_memory_utilization, "tokenizer_repair": args.tokenizer_repair,
        "importance_sampling": importance_sampling(settings),
        "prompt_order_sha256": order_digest(rows), **timing_summary(record, trainer.state.log_history),
        "adapter": str(out / "adapter"),
    }
    (out / "unsloth.json").write_text(json.dumps(result, indent=1))
    print(table_row(f"Unsloth {unsloth.__version__} ({args.weights})", result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
