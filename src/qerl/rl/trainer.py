"""The RL loop, one process, one model in memory.

Per step: sample prompts -> G completions each from the rollout engine (AQN noise at the scheduled
sigma, merged into the norm weights) -> rewards -> group advantages -> clipped policy loss on the same
quantized + LoRA model -> AdamW on the LoRA parameters. The pieces live in their own modules (collect,
update, losses, logprobs, aqn, run_log, checkpointing; the policy is built by `qerl.models.policy`, the
rewards named by `qerl.rewards.resolve`) and take settings objects built once from the config
(`settings`); `step` chains them into one step, the same for `qerl bench step`; this file keeps the state,
the metrics and the run around it.
"""

import contextlib
import dataclasses
import random
import resource
import time
from pathlib import Path

import numpy as np
import torch
from rich.console import Console

from ..config import TrainConfig, save_config, to_dict
from ..data import DatasetError, build_prompt, encode_prompt, filter_by_length, load_problems
from ..data.templates import resolve_suffix
from ..kernels.dequant_cache import dense_weight_bytes
from ..models import load_adapter, lora_parameters, save_adapter
from ..models.adapter import check_adapter_files, non_finite_parameters
from ..models.atomic import check_apart_from_inputs, check_output_dir, check_writable
from ..models.calibration import default_samples
from ..models.policy import build_policy
from ..models.router import router_parameters
from ..models.registry import kernel_cache_dir
from ..models.run_lock import RunLock
from ..models.targets import quant_layers
from ..nn.noisy_norm import median_abs_norm_weight
from ..rewards import RewardRunner
from ..rewards.resolve import resolve_reward
from .checkpointing import (CONFIG_CHANGES_FILE, check_resume_changes, list_checkpoints, load_trainer_state,
                            record_config_changes, rng_state, save_checkpoint, set_rng_state)
from .aqn import weak_noise_note
from .collect import collect_experience, failed_rewards
from .distributed import barrier, init_distributed, mean_metrics
from .prompt_stream import PromptStream
from .step import rl_step
from .stop import StopRequests, TrainingAborted, TrainingInterrupted  # noqa: F401 (re-exported)
from .runtime import build_runtime
from .run_log import RunLog, copy_metrics, is_run_metrics, plot_metrics, read_metrics, truncate_metrics
from .step_metrics import add_time_metrics, add_update_metrics, experience_metrics, step_line
from .settings import aqn_schedule, collect_settings, entropy_controller, lr_schedule, update_settings


def check_run_dir_path(run_dir: Path, inputs: dict[str, object] | None = None) -> None:
    """Refuse, before any work, an output_dir that is a file, one of the run's inputs (the model, the data) or a
    path inside one, under a file, or that cannot be written (ValueError). What it holds is checked once the run
    holds its lock (`check_new_run_dir`)."""
    if not run_dir.exists():
        check_output_dir(run_dir, what="output_dir", inputs=inputs)  # a file on the way or an unwritable parent
        return
    check_apart_from_inputs(run_dir.resolve(), inputs or {}, "output_dir", containing=False)  # a run adds files
    if not run_dir.is_dir():
        raise ValueError(f"output_dir {run_dir}: is a file; give a directory path")
    check_writable(run_dir, run_dir, "output_dir")


def check_new_run_dir(run_dir: Path) -> None:
    """Refuse an output_dir that already holds a run (FileExistsError: --resume continues it) or what a run would
    write over (ValueError). Other files may stay beside a run (a launcher's log, say): a run never deletes
    anything. Called under the run's lock, so a run being written by another process is refused as such."""
    if any((run_dir / name).exists() for name in ("config.yaml", "checkpoints")) or \
            is_run_metrics(run_dir / "metrics.jsonl"):
        raise FileExistsError(f"{run_dir} already holds a run; pass --resume to continue it or choose "
                              "another output_dir")
    taken = [name for name in ("metrics.jsonl", "adapter", "tensorboard", CONFIG_CHANGES_FILE)
             if (run_dir / name).exists()]
    if taken:
        raise ValueError(f"output_dir {run_dir}: holds {', '.join(taken)}, which a run writes (and qerl did not "
                         "write these); choose another output_dir")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def local_inputs(cfg: TrainConfig) -> dict[str, object]:
    """The run's inputs that are local paths, which its output_dir must stay apart from."""
    return {"model.name": cfg.model.name, "model.adapter": cfg.model.adapter, "data.train": cfg.data.train}


def compile_notice(device: torch.device) -> str | None:
    """What to say before the first step on `device`: on a GPU it compiles the Triton kernels (on a CPU nothing
    compiles, so None). Compiled kernels stay on disk (`kernel_cache_dir`), so later runs with the same shapes skip
    most of it."""
    if device.type != "cuda":
        return None
    return f"the first step compiles the GPU kernels (tens of seconds; cached in {kernel_cache_dir()} for later runs)"


def _layer_summary(model, cfg: TrainConfig) -> str:
    layers = quant_layers(model)
    return (f"{len(layers)} linear layers in {cfg.model.format} with LoRA r={cfg.lora.r}, "
            f"{sum(p.numel() for p in lora_parameters(model).values()) / 1e6:.2f} M trained weights")


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


class Trainer:
    def __init__(self, cfg: TrainConfig, resume: str | None = None, console: Console | None = None,
                 override: tuple[str, ...] = ()):
        """resume: "auto" (the run's newest readable checkpoint) or a checkpoint directory (of this run, or of
        another whose run then continues in output_dir); override: config keys a resumed run may change beyond
        FUTURE_ONLY_KEYS (`--resume --override KEY ...`). The run directory is locked from here to the end of
        `train` (or `close`): a second writer is refused at once."""
        self.cfg, self.console = cfg, console or Console(stderr=True)
        self._created, self._steps_run = time.perf_counter(), 0  # for time_to_first_step (this process's first)
        if override and not resume:
            raise ValueError("--override names config keys a resumed run may change: it needs --resume")
        self.device = resolve_device(cfg.model.device)
        self.dist = init_distributed(self.device)
        if self.dist.enabled and self.device.type == "cuda":
            self.device = torch.device("cuda", self.dist.local_rank)
        if cfg.model.calibration.samples is None:  # the run config records the number used, for resume and repeats
            calibration = dataclasses.replace(cfg.model.calibration, samples=default_samples(self.device))
            self.cfg = cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, calibration=calibration))
        if cfg.rollout.prompts_per_step % self.dist.world:
            raise ValueError(f"rollout.prompts_per_step ({cfg.rollout.prompts_per_step}) must be a multiple of the "
                             f"number of processes ({self.dist.world})")
        # everything that can be refused is checked before the expensive model load: the run directory (and, on
        # --resume, the checkpoint and the config changes), the prompt suffix, the rewards and the data
        self.run_dir = Path(cfg.output_dir)
        self._override = tuple(override)
        self._source_run = self._checkpoint_run(resume)
        if resume == "auto" and not self.run_dir.is_dir():
            raise FileNotFoundError(f"--resume: {self.run_dir} holds no run, so no complete checkpoint to resume from "
                                    "(output_dir or --output-dir names the run's directory)")
        # a new run, or a checkpoint of another run continued here
        new_run = not resume or (self._source_run is not None and self._source_run != self.run_dir.resolve())
        if new_run:
            check_run_dir_path(self.run_dir, local_inputs(cfg))
        # the lock before what the directory holds: a run being written now is refused as such, not as a
        # finished one to --resume
        self._lock = RunLock(self.run_dir) if self.dist.is_main else None
        if self._lock is not None:
            self._lock.acquire()
            if self._lock.stale_note:
                self.console.print(f"[yellow]{self._lock.stale_note}", highlight=False)
        try:
            if new_run:
                check_new_run_dir(self.run_dir)
            self._setup(resume)
        except BaseException:
            self.close()
            raise

    def _setup(self, resume: str | None) -> None:
        cfg = self.cfg
        random.seed(cfg.seed)
        np.random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)  # same on every rank: identical LoRA initialisation
        # each rank samples its own completions (and AQN noise)
        self.generator = torch.Generator(self.device).manual_seed(cfg.seed + 1_000_003 * self.dist.rank)
        self._resume_from = self._plan_resume(resume, self._override) if resume else None
        try:
            resolve_suffix(cfg.data.suffix)
        except ValueError as e:
            raise ValueError(f"data.suffix: {e}") from None
        self.rewards = RewardRunner([resolve_reward(name) for name in cfg.rewards], cfg.reward_weights,
                                    cfg.reward_timeout_s)
        try:
            rows = load_problems(cfg.data.train, split="train", limit=cfg.data.limit, seed=cfg.seed,
                                 question_key=cfg.data.question_key, answer_key=cfg.data.answer_key,
                                 max_bad_fraction=cfg.data.max_bad_fraction)
        except OSError as e:  # e.g. permission denied; what the loader checks itself is a DatasetError already
            raise DatasetError(f"data.train {cfg.data.train!r}: cannot read it ({e})") from None
        except DatasetError as e:  # the loader names the file, the option is the run's
            raise DatasetError(f"data.train: {e}") from None
        if cfg.model.adapter:  # loaded after the base: a broken or NaN one is refused now, not after the load
            try:
                check_adapter_files(cfg.model.adapter)
            except ValueError as e:
                raise ValueError(f"model.adapter: {e}") from None
        if len(rows) < cfg.rollout.prompts_per_step and self.dist.is_main:
            self.console.print(f"[yellow]data.train has {len(rows)} problems, fewer than rollout.prompts_per_step "
                               f"({cfg.rollout.prompts_per_step}): each step repeats some of them", highlight=False)
        loading = f"loading {cfg.model.name}, quantizing it to {cfg.model.format} ({cfg.model.quant_method})"
        self._progress(f"{loading}, attaching LoRA r={cfg.lora.r}")
        with self.console.status(loading):
            self.model, self.tokenizer = build_policy(cfg.model, cfg.lora, self.device, train_rows=rows,
                                                      gradient_checkpointing=cfg.optim.gradient_checkpointing,
                                                      console=self.console, train_router=cfg.moe.train_router,
                                                      aux_loss=cfg.moe.aux_loss_coef > 0)
        self._progress(f"model ready ({time.perf_counter() - self._created:.1f}s): {_layer_summary(self.model, cfg)}")
        if cfg.moe.aux_loss_coef > 0 and not cfg.moe.train_router:
            self.console.print("[yellow]moe.aux_loss_coef > 0 with a frozen router: the load-balancing loss reaches "
                               "only the LoRA weights below the routers (moe.train_router: true trains the routers)")
        # what the steps run on besides the model (`runtime.build_runtime`, as `qerl bench step` builds it): the
        # kernel routing the loss pass's layers hold and the rollouts run in, the store of 16-bit weight copies
        # (model.dense_weights), the engine, its memory policy and the recompute plan
        runtime = build_runtime(self.model, self.tokenizer,
                                max_seq_len=cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens,
                                scheduler=cfg.rollout.scheduler, compute=cfg.model.compute,
                                grad_input_no_temporary=cfg.optim.grad_input_no_temporary,
                                dense_weights=cfg.model.dense_weights, release_kv_cache=cfg.rollout.release_kv_cache,
                                distributed=self.dist.enabled, gradient_checkpointing=cfg.optim.gradient_checkpointing)
        self.runtime = runtime
        self.routing, self.dense_store, self.engine = runtime.routing, runtime.dense_store, runtime.engine
        self.engine_memory, self.recompute = runtime.engine_memory, runtime.recompute
        rows = filter_by_length(rows, self.tokenizer, cfg.data.max_prompt_tokens, suffix=cfg.data.suffix,
                                system=cfg.data.system)
        self.stream = PromptStream(rows, cfg.seed)
        self._build_optimizer()
        self.aqn = aqn_schedule(cfg)
        self.controller = entropy_controller(cfg)
        if cfg.aqn.enabled and not cfg.aqn.relative and self.controller is None and self.dist.is_main:
            note = weak_noise_note(cfg.aqn.sigma_start, median_abs_norm_weight(self.model))
            if note:
                self.console.print(f"[yellow]{note}", highlight=False)
        self.collect_settings = collect_settings(cfg, self.dist.world)
        self.update_settings = update_settings(cfg, self.model.config)
        self.step = 0
        self.bad_in_a_row = self.bad_total = 0
        self.reward_failures_in_a_row = {name: 0 for name in self.rewards.names}  # steps it failed on every row
        self.reward_ever_scored = {name: False for name in self.rewards.names}  # any row, any step of the run
        self.best_reward, self._rewards_since_save = float("-inf"), []
        self.log = None
        if self.dist.is_main:  # one writer
            self.run_dir.mkdir(parents=True, exist_ok=True)
        if self._resume_from is not None:
            self._resume(*self._resume_from)
        if self.dist.is_main:
            save_config(cfg, self.run_dir / "config.yaml")
            self.log = RunLog(self.run_dir, cfg.tensorboard)
        barrier(self.dist)

    def close(self) -> None:
        """Release the run directory (idempotent; `train` calls it however it ends)."""
        if getattr(self, "_lock", None) is not None:
            self._lock.release()

    def _progress(self, text: str) -> None:
        """One line of what the trainer is doing before the first step (which may take minutes)."""
        if self.dist.is_main:
            self.console.print(text, highlight=False, soft_wrap=True)

    @staticmethod
    def _checkpoint_run(resume: str | None) -> Path | None:
        """The run directory a `--resume CHECKPOINT` belongs to (RUN/checkpoints/step-N -> RUN); None otherwise."""
        if not resume or resume == "auto":
            return None
        checkpoint = Path(resume).expanduser().resolve()
        return checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else checkpoint.parent

    def _build_optimizer(self) -> None:
        """The trained parameters, their AdamW and its LR schedule (again after a resume attached new LoRA
        parameters; the checkpoint's states are then loaded into these)."""
        self.params = self._trainable_parameters()
        self.optimizer = torch.optim.AdamW(self.params, lr=self.cfg.optim.lr, weight_decay=self.cfg.optim.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_schedule(self.cfg))

    def _trainable_parameters(self) -> list[torch.nn.Parameter]:
        """What the optimizer updates, in a fixed order (the optimizer state relies on it): the LoRA weights,
        then the MoE routers' fp32 masters when moe.train_router is on."""
        routers = [p for p in router_parameters(self.model).values() if p.requires_grad]
        return [*lora_parameters(self.model).values(), *routers]

    # prompts ----------------------------------------------------------------------------------

    def encode(self, row: dict) -> tuple[str, list[int]]:
        text = build_prompt(row["question"], self.tokenizer, suffix=self.cfg.data.suffix, system=self.cfg.data.system)
        return text, encode_prompt(text, self.tokenizer)

    def _my_problems(self, n: int) -> list[dict]:
        """This rank's n prompts: every rank draws the same n x world and keeps its own interleaved slice,
        so the data position stays identical on all ranks."""
        return self.stream.take(n * self.dist.world)[self.dist.rank::self.dist.world]

    def kernel_routing(self):
        """The run's kernel routing as a scope (model.compute, optim.grad_input_no_temporary) for work done with
        its engine: the rollouts, and an evaluation through `self.engine` (`Runtime.kernel_routing`)."""
        return self.runtime.kernel_routing()

    # one step ---------------------------------------------------------------------------------

    def train_step(self) -> dict:
        cfg = self.cfg
        sigma = self.aqn.sigma(self.step, cfg.steps) * (self.controller.multiplier if self.controller else 1.0)
        lr = self.scheduler.get_last_lr()[0]  # the rate this step's update uses
        with self.kernel_routing():
            result = rl_step(lambda: collect_experience(self.engine, self._my_problems, self.encode, self.rewards,
                                                        self.collect_settings, sigma=sigma, generator=self.generator),
                             model=self.model, engine=self.engine, memory=self.engine_memory, optimizer=self.optimizer,
                             params=self.params, settings=self.update_settings, dist_ctx=self.dist,
                             dense_store=self.dense_store, scheduler=self.scheduler, recompute=self.recompute)
        exp, times = result.experience, result.times
        stage = self.aqn.stage(self.step, cfg.steps) if cfg.aqn.enabled else 0
        metrics = experience_metrics(exp, self.step + 1, sigma, stage, lr)
        if self.controller is not None:  # sets the next step's sigma multiplier
            metrics["aqn_multiplier"] = self.controller.update(metrics["entropy"])
        add_update_metrics(metrics, result.update)
        metrics["skipped"] = int(result.non_finite is not None)
        self._count_bad_step(result.non_finite)
        self.step += 1
        metrics["bad_steps_total"] = self.bad_total
        add_time_metrics(metrics, times, peak_memory_gb(self.device))
        self._steps_run += 1
        if self._steps_run == 1:  # model loading, quantization, kernel compilation and graph capture included
            metrics["time_to_first_step"] = time.perf_counter() - self._created
        if self.dense_store is not None:  # model.dense_weights: what the 16-bit copies hold
            metrics["dense_weights_gb"] = dense_weight_bytes(self.dense_store) / 1e9
        metrics = mean_metrics(metrics, self.dist)
        self._count_reward_failures(metrics)
        return metrics

    def _count_bad_step(self, non_finite: str | None) -> None:
        """A skipped step (non-finite loss or gradient: no parameter changed) is counted, and the run stops after
        optim.max_bad_steps of them in a row; an update that made a parameter non-finite (a finite gradient
        times an absurd rate) stops it at once, before anything holding those values is saved."""
        cfg = self.cfg
        if non_finite is None:
            self.bad_in_a_row = 0
            bad = non_finite_parameters(self.model)
            if bad:
                last = list_checkpoints(self.run_dir)
                kept = f"the last checkpoint, {last[-1]}, holds finite weights" if last else "no checkpoint was written"
                raise TrainingAborted(
                    f"step {self.step + 1}'s update made {len(bad)} adapter tensors NaN or Inf (e.g. {bad[0]}) with "
                    f"optim.lr {cfg.optim.lr:g}: nothing of it was saved ({kept}); lower optim.lr or "
                    "optim.max_grad_norm")
            return
        self.bad_in_a_row += 1
        self.bad_total += 1
        self.console.print(f"[yellow]step {self.step + 1} skipped: {non_finite} ({self.bad_in_a_row} in a row)")
        if self.bad_in_a_row >= cfg.optim.max_bad_steps:
            raise TrainingAborted(
                f"{self.bad_in_a_row} steps in a row had a non-finite loss or gradient; lower optim.lr, "
                "raise optim.max_grad_norm's strictness, or check the data and rewards")

    def _count_reward_failures(self, metrics: dict) -> None:
        """Per reward function, the steps in a row in which it failed on every row (of every rank: `metrics`
        are the rank mean, so all ranks count alike); a step where it scored any row resets its count."""
        rows = metrics["groups_sampled"] * self.cfg.rollout.group_size
        failed = failed_rewards(metrics, self.rewards.names, rows)
        for name in self.rewards.names:
            self.reward_failures_in_a_row[name] = self.reward_failures_in_a_row[name] + 1 if name in failed else 0
            self.reward_ever_scored[name] |= name not in failed

    def _abort_if_a_reward_keeps_failing(self) -> None:
        """Stop, after a checkpoint, once one reward function has failed on every row for
        `max_reward_failure_steps` steps in a row: training on would learn from the other rewards only (or from
        all-zero rewards) while looking healthy. Called on every rank at the same point of the step."""
        limit = self.cfg.max_reward_failure_steps
        for configured, name in zip(self.cfg.rewards, self.rewards.names):
            if self.reward_failures_in_a_row[name] >= limit:
                checkpoint = self.save_checkpoint()
                error = (self.rewards.last_errors.get(name) or "no message").strip().splitlines()[0][:300]
                raise TrainingAborted(
                    f"reward {configured!r} failed on every row for {limit} steps in a row (last error: {error}); "
                    f"fix it and continue with --resume (checkpoint {checkpoint})")

    # the run ----------------------------------------------------------------------------------

    def train(self) -> Path:
        """Run the remaining steps, save the adapter; the run directory's lock is released however this ends."""
        try:
            return self._train()
        finally:
            self.close()

    def _train(self) -> Path:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        cfg = self.cfg
        columns = (TextColumn("[bold]train"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                   TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[info]}"))
        wide = self.console.is_terminal  # a log file or a pipe gets one short line per step
        with contextlib.ExitStack() as stack:
            progress = stack.enter_context(Progress(*columns, console=self.console, transient=False))
            task = progress.add_task("train", total=cfg.steps, completed=self.step, info="")
            stop = stack.enter_context(StopRequests(self.console))
            if self.dist.is_main and self.step < cfg.steps:
                rows = cfg.rollout.prompts_per_step * cfg.rollout.group_size
                progress.console.print(f"step {self.step + 1}: sampling {rows} completions, then the update"
                                       + (f"; {compile_notice(self.device)}" if compile_notice(self.device) else ""),
                                       highlight=False, soft_wrap=True)
            while self.step < cfg.steps:
                metrics = self._guarded_step()
                signum = self._agreed_stop(stop)
                if self.dist.is_main:
                    self._report_step(metrics, progress, task, wide)
                self._after_step(signum)
        self.save_checkpoint()
        if not self.dist.is_main:
            return self.run_dir / "adapter"
        never = [c for c, name in zip(cfg.rewards, self.rewards.names) if not self.reward_ever_scored[name]]
        warning = (f"reward {', '.join(map(repr, never))} failed on every row of every step (1-{self.step}): "
                   "this adapter learned without its signal") if never else None
        final = save_adapter(self.model, self.run_dir / "adapter", base_model_name_or_path=cfg.model.name,
                             overwrite=True, check_owner=False, notes={"warning": warning} if warning else None)
        self.log.close()
        if cfg.plots:
            for path in plot_metrics(self.run_dir / "metrics.jsonl", self.run_dir):
                self.console.print(f"plot: {path}")
        rewards = [m["reward"] for m in read_metrics(self.run_dir / "metrics.jsonl")]
        k = max(1, len(rewards) // 4)
        self.console.print(f"reward: mean of the first {k} steps {sum(rewards[:k]) / k:.3f} -> "
                           f"last {k} steps {sum(rewards[-k:]) / k:.3f}")
        self.console.print(f"adapter: {final}")
        if warning:
            error = "; ".join((self.rewards.last_errors.get(n) or "no message").strip().splitlines()[0][:200]
                              for c, n in zip(cfg.rewards, self.rewards.names) if c in never)
            raise TrainingAborted(f"{warning} (last error: {error}); the adapter's metadata says so "
                                  f"(qerl_warning in {final / 'adapter_model.safetensors'})")
        return final

    def _report_step(self, metrics: dict, progress, task, wide: bool) -> None:
        """Rank 0: the step's row of metrics.jsonl, its console line and the progress bar."""
        self.log.log(metrics)
        self._rewards_since_save.append(metrics["reward"])
        recompute = len(self.recompute.layers) if self.recompute.mode == "auto" else None
        progress.console.print(step_line(metrics, recompute, wide), highlight=False, soft_wrap=not wide)
        if "time_to_first_step" in metrics:
            progress.console.print(f"first step finished {metrics['time_to_first_step']:.1f} s after the "
                                   "trainer started (loading, quantizing and compiling included)", highlight=False,
                                   soft_wrap=True)
        if "dense_weights_gb" in metrics and metrics["step"] == 1:
            progress.console.print(f"model.dense_weights: {metrics['dense_weights_gb']:.2f} GB of 16-bit "
                                   "weight copies kept for the run", highlight=False, soft_wrap=True)
        progress.update(task, completed=self.step, info=f"reward {metrics['reward']:.3f}")

    def _after_step(self, signum: int) -> None:
        """Every rank at the same point of each step: a stop signal (checkpoint, then stop), a reward that keeps
        failing (checkpoint, then abort) or a save_every checkpoint; rank 0 writes, the others join its barriers."""
        cfg = self.cfg
        if signum:
            raise TrainingInterrupted(signum, self.save_checkpoint())
        self._abort_if_a_reward_keeps_failing()
        if cfg.save_every and self.step % cfg.save_every == 0 and self.step < cfg.steps:
            self.save_checkpoint()

    def _micro_batch_knob(self) -> str:
        """The setting that sizes the loss pass's micro-batches, with its value (packed: tokens; padded: rows)."""
        o = self.cfg.optim
        if o.packing:
            chosen = " by model size" if o.max_tokens_per_micro_batch is None else ""
            return f"optim.max_tokens_per_micro_batch (now {self.update_settings.max_tokens_per_micro_batch}{chosen})"
        return f"optim.micro_batch_size (now {o.micro_batch_size})"

    def _guarded_step(self) -> dict:
        try:
            return self.train_step()
        except torch.OutOfMemoryError:
            kept = ("; the rollout engine's KV cache and graphs were kept through the update "
                    "(rollout.release_kv_cache=true frees them)" if self.engine_memory.keep else "")
            raise TrainingAborted(
                f"out of GPU memory at step {self.step + 1}: lower {self._micro_batch_knob()}, "
                f"rollout.prompts_per_step x rollout.group_size "
                f"(now {self.cfg.rollout.prompts_per_step} x {self.cfg.rollout.group_size}) or rollout.max_new_tokens "
                f"(now {self.cfg.rollout.max_new_tokens}){kept}; the last checkpoint is intact") from None

    # checkpoints ------------------------------------------------------------------------------

    def _agreed_stop(self, stop) -> int:
        """The signal number to stop on (0 = go on), the same on every rank: a signal seen by any rank stops
        all of them at the same step boundary."""
        signum = torch.tensor([float(stop.signum or 0)], device=self.dist.device)
        if self.dist.enabled:
            torch.distributed.all_reduce(signum, op=torch.distributed.ReduceOp.MAX)
        return int(signum.item())

    def save_checkpoint(self) -> Path:
        """Rank 0 writes; every rank waits until the checkpoint is complete."""
        path = self.run_dir / "checkpoints" / f"step-{self.step:06d}"
        if self.dist.is_main:
            path = self._write_checkpoint()
        barrier(self.dist)
        return path

    def _write_checkpoint(self) -> Path:
        state = {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                 "data": self.stream.state(), "rng": rng_state(self.generator), "bad_total": self.bad_total,
                 "aqn_multiplier": self.controller.multiplier if self.controller else 1.0,
                 "best_reward": self.best_reward, "reward_ever_scored": dict(self.reward_ever_scored),
                 "config": to_dict(self.cfg)}
        path = save_checkpoint(self.run_dir, self.step, self.model, state, self.cfg.keep_last)
        recent = self._rewards_since_save
        if self.cfg.keep_best and recent and sum(recent) / len(recent) > self.best_reward:
            self.best_reward = sum(recent) / len(recent)
            state["best_reward"] = self.best_reward
            save_checkpoint(self.run_dir, self.step, self.model, state, self.cfg.keep_last, name="best")
        self._rewards_since_save = []
        return path

    def _plan_resume(self, resume: str, override: tuple[str, ...]):
        """Before the model loads: the checkpoint to continue from and its state, checked against the config ->
        (state, checkpoint, accepted config changes), or None when the run starts again from step 0. Any corrupt
        file of the newest checkpoint (its trainer state or its adapter) falls back to the newest intact one."""
        checkpoints = list_checkpoints(self.run_dir) if resume == "auto" else [Path(resume)]
        started = any((self.run_dir / name).exists() for name in ("metrics.jsonl", "config.yaml"))
        if not checkpoints and resume == "auto" and started:
            # stopped before its first checkpoint (e.g. save_every 0 and killed): nothing to continue, so the run
            # starts again at step 0; refusing would leave a directory neither --resume nor a new run accepts
            if override:
                raise ValueError("--override: the run has no checkpoint yet, so it starts again from step 0 with "
                                 "the new config; drop --override")
            self._truncate_metrics(0)  # first: a metrics.jsonl qerl did not write is refused, not emptied
            self.console.print(f"[yellow]{self.run_dir} has no complete checkpoint yet: starting again from step 0")
            return None
        if not checkpoints:
            raise FileNotFoundError(f"{self.run_dir}: no complete checkpoint to resume from")
        state, checkpoint = None, None
        for candidate in reversed(checkpoints):  # newest first; fall back past an unreadable one
            try:
                state = load_trainer_state(candidate)
                check_adapter_files(candidate / "adapter")  # loaded after the model: checked now, to fall back
                checkpoint = candidate
                break
            except ValueError as e:
                state = None
                if resume != "auto":
                    raise ValueError(f"--resume {candidate}: {e}; name an intact checkpoint, or --resume alone "
                                     "takes the run's newest intact one") from None
                self.console.print(f"[yellow]skipping checkpoint {candidate}: {e}; falling back to the one before",
                                   highlight=False, soft_wrap=True)
        if state is None:
            raise ValueError(f"{self.run_dir}: no readable checkpoint to resume from")
        changes = check_resume_changes(state["config"], to_dict(self.cfg), checkpoint, override)
        return state, checkpoint, changes

    def _resume(self, state: dict, checkpoint: Path, changes) -> None:
        load_adapter(self.model, checkpoint / "adapter", original_base=False)
        self._build_optimizer()  # load_adapter attached fresh LoRA parameters
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.stream.load_state(state["data"])
        set_rng_state(state["rng"], self.generator)
        if self.dist.rank > 0:  # the checkpoint holds rank 0's sampler; the others derive theirs
            self.generator.manual_seed(self.cfg.seed + 1_000_003 * self.dist.rank + state["step"])
        self.step, self.bad_total, self.best_reward = state["step"], state["bad_total"], state["best_reward"]
        # written before this was kept: unknown, so assumed scored (no false alarm)
        self.reward_ever_scored.update(state.get("reward_ever_scored", dict.fromkeys(self.rewards.names, True)))
        if self.controller is not None:
            self.controller.multiplier = state["aqn_multiplier"]
        if self.dist.is_main and self._source_run is not None and self._source_run != self.run_dir.resolve():
            # another run's checkpoint continued here: its history up to the checkpoint starts this run's
            copy_metrics(self._source_run / "metrics.jsonl", self.run_dir / "metrics.jsonl", self.step)
            self.console.print(f"continuing {self._source_run}'s run in {self.run_dir} (its metrics up to step "
                               f"{self.step} copied)", highlight=False, soft_wrap=True)
        self._truncate_metrics(self.step)
        if self.dist.is_main:
            record_config_changes(self.run_dir, self.step, changes, self._override)
        for key, old, new in changes:
            self.console.print(f"{key}: {old!r} -> {new!r} from step {self.step + 1} (recorded in "
                               f"{CONFIG_CHANGES_FILE})", highlight=False)
        self.console.print(f"resumed from {checkpoint} at step {self.step}", highlight=False, soft_wrap=True)

    def _truncate_metrics(self, step: int) -> None:
        """Drop metric lines written after the checkpoint (the steps about to be redone); name the steps up to it
        that have no line (a file cut short or edited: the resumed run cannot redo them)."""
        path = self.run_dir / "metrics.jsonl"
        kept = truncate_metrics(path, step)  # also drops a line a kill left unfinished
        missing = sorted(set(range(1, step + 1)) - set(kept))
        if missing and self.dist.is_main:
            shown = ", ".join(map(str, missing[:10])) + (f", ... ({len(missing)} steps)" if len(missing) > 10 else "")
            self.console.print(f"[yellow]{path}: no line for step {shown} of the {step} before the checkpoint (the "
                               "file was cut or edited); those steps stay missing from it, the run goes on",
                               highlight=False, soft_wrap=True)
