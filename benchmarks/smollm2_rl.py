"""RL on the real SmolLM2-135M-Instruct, several arms x several seeds side by side (docs/results.md): held-out
pass@1 before/after, reward and entropy curves, time split and memory, as mean ± std over seeds.

  python benchmarks/smollm2_rl.py --model smollm2-135m-instruct --train reasoning-gym:basic_arithmetic \\
      --test reasoning-gym:basic_arithmetic --arms nvfp4+aqn,nvfp4,bf16,bf16+aqn,nf4 --seeds 0,1,2 \\
      --steps 30 --parallel 8 --deadline-s 510 --out runs/study

An arm is FORMAT[-METHOD][+aqn][:DECAY][@LR] (FORMAT in nvfp4, mxfp4, nf4, bf16; METHOD in rtn (the default),
4over6, gptq, awq; DECAY, only with +aqn, in exponential (the default), linear, cosine, logarithmic; @LR the
arm's own learning rate, e.g. nvfp4@5e-4). Every (arm, seed) job uses the same data, steps and
hyper-parameters (--set section.key=value adds overrides to all of them); the same seed gives the same data
order and LoRA initialisation in every arm.

Each job runs in its own process, --parallel N at a time, and writes --out/<arm>_s<seed>/result.json (arm
spelled with _ for + and :) as soon as it finishes, with the trainer's metrics.jsonl and its log job.log
beside it. Running the same command again skips the finished jobs and runs only the missing ones (delete a
job's directory to redo it). --deadline-s T starts no job after T seconds and kills those still running, so
the command ends inside a hard time limit; --mps runs the CUDA MPS daemon for the study when it is
installed. At the end: a Markdown table on stdout, results.json (every run, the aggregate, the arguments,
device, date) and study_reward.png, study_entropy.png, study_pass1.png, plus study_ablation_reward.png when
two or more AQN decays of one format are among the arms.
"""

import shlex
import sys

from qerl.bench.study import main

if __name__ == "__main__":
    raise SystemExit(main(description=__doc__, prog=shlex.join(["python3", sys.argv[0]])))
