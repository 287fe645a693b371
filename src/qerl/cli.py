"""`qerl` command line: quantize a model, RL-train a LoRA adapter on it, evaluate, merge, run benchmarks."""

import argparse
import difflib
import json
import logging
import os
import signal
import sys
import time
import warnings
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from .argtypes import positive_int
from .rl.stop import Interrupted, TrainingInterrupted, raise_on_stop_signals

console = Console(stderr=True)

# Libraries that announce, on import, optional native parts this machine does not have (torchao's CUDA
# extensions, bitsandbytes' CPU kernels from the `kernels` hub) or deprecations that are theirs to fix (torch's
# pytree registrations); none of it concerns a qerl user, and it came before every message the CLI printed.
_QUIET_LOGGERS = ("torchao", "bitsandbytes", "torch.utils._pytree")


def quiet_libraries() -> None:
    for name in _QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="torchao")


def _quantize(args) -> int:
    from .eval.fidelity import compare_logprobs, fidelity_text, next_token_logprobs
    from .formats import get_format
    from .models import memory_report, save_quantized
    from .models.atomic import check_output_dir
    from .models.pretrained import is_quantized_checkpoint
    from .models.loader import ModelSpec, check_spec, load_policy
    from .models.precision import describe_keep_bf16, parse_keep_bf16
    from .models.targets import quant_layers

    t0 = time.perf_counter()
    # everything that can be refused is, before the model loads
    out = check_output_dir(args.out, args.overwrite, inputs={"model": args.model, "--calibration": args.calibration})
    keep = parse_keep_bf16(args.keep_bf16)
    device = quantize_device(args.device)
    spec = ModelSpec(name=args.model, format=args.format, method=args.method, calibration_source=args.calibration,
                     calibration_samples=args.calibration_samples, calibration_max_tokens=args.calibration_max_tokens,
                     keep_bf16=tuple(keep), targets=tuple(args.targets.split(",")), dtype=args.dtype, device=device,
                     trust_remote_code=args.trust_remote_code)
    check_spec(spec)
    if is_quantized_checkpoint(args.model):
        raise ValueError(f"{args.model} is already quantized; quantize the 16-bit model it was made from")
    reference = {}

    def keep_reference(model, tokenizer) -> None:  # the 16-bit model's log-probs, for the fidelity check
        console.print(f"loaded {args.model} ({type(model).__name__}) on {device} in {time.perf_counter() - t0:.1f}s")
        if tokenizer is not None:
            ids = tokenizer(fidelity_text(), return_tensors="pt").input_ids.to(device)
            reference.update(ids=ids, logprobs=next_token_logprobs(model, ids))

    # --no-check: a 16-bit safetensors model streams, quantized layer by layer, never held whole
    model, tokenizer = load_policy(spec, show_progress=True, before_quantize=None if args.no_check else keep_reference)
    console.print(f"quantized {args.model} to {args.format} with {args.method} on {device}: "
                  f"{time.perf_counter() - t0:.1f}s in all")
    report = memory_report(model)
    model.config.qerl_source_model = str(args.model)  # an adapter trained on that model fits this one
    out = save_quantized(model, tokenizer, out, overwrite=args.overwrite)
    table = Table(title=f"{args.model} -> {args.format} ({args.method})", show_header=False)
    table.add_row("output", str(out))
    table.add_row("quantized linears", f"{report['quantized_params'] / 1e6:.1f} M weights")
    table.add_row("bytes per quantized weight", f"{report['base_bytes_per_param']:.4f} (incl. scales)")
    if keep:
        kept = [n for n, m in quant_layers(model).items() if m.weight_format == "bf16"]
        line = describe_keep_bf16(model, kept, get_format(args.format))
        table.add_row("kept in bf16", line.removeprefix("keep_bf16: "))
    table.add_row("model bytes (all tensors)", f"{report['total_bytes'] / 2**20:.1f} MiB")
    if reference:
        fid = compare_logprobs(reference["logprobs"], next_token_logprobs(model, reference["ids"]), reference["ids"])
        report.update(fid)
        table.add_row("KL(16-bit || quantized) per token", f"{fid['kl']:.4f} nats")
        table.add_row("top-1 agreement", f"{fid['top1_agreement']:.3f}")
        table.add_row("perplexity 16-bit -> quantized", f"{fid['ppl_ref']:.2f} -> {fid['ppl_quant']:.2f}")
    console.print(table)
    print(json.dumps({"output": str(out), "format": args.format, "method": args.method, **report}))
    return 0


def quantize_device(name: str):
    """`--device` of `qerl quantize` -> torch.device: "auto" is the first GPU when there is one, else the CPU."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"--device {name!r}: {e}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: no CUDA device is available here; use --device cpu")
    return device


def _train(args) -> int:
    from .config import config_help, load_config

    if args.help_config:
        print(config_help())
        sys.stdout.flush()  # a closed pipe (`| head`) is met here, where main turns it into a quiet exit
        return 0
    resume, overrides = args.resume, list(args.overrides)
    if resume not in (None, "auto") and "=" in resume and not Path(resume).exists():
        # `--resume steps=6`: argparse gave the override to --resume's optional value
        resume, overrides = "auto", [resume, *overrides]
    if resume not in (None, "auto") and not Path(resume).expanduser().is_dir():
        raise FileNotFoundError(f"--resume {resume}: no such checkpoint directory (RUN/checkpoints/step-NNNNNN; "
                                "--resume alone takes the run's newest)")
    config = args.config or (resume and _run_config(resume, args.output_dir, overrides))
    cfg = load_config(config, overrides)
    if args.output_dir:
        cfg.output_dir = args.output_dir
    from .rl.trainer import Trainer

    trainer = Trainer(cfg, resume=resume, console=console, override=tuple(args.override or ()))
    trainer.train()
    return 0


def _run_config(resume: str, output_dir: str | None, overrides: list[str]) -> str | None:
    """`--resume` without `--config`: the resumed run's own config.yaml (its settings in force), so that only
    the overrides given now count as changes; None (the defaults, said so) when the run has none."""
    from .config import load_config

    if resume != "auto":
        checkpoint = Path(resume).expanduser()
        run = checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else checkpoint.parent
    else:
        run = Path(output_dir or load_config(None, overrides).output_dir)
    config = run / "config.yaml"
    if not run.is_dir():
        return None  # no run there: the trainer says so
    if config.is_file():
        console.print(f"--resume without --config: the run's own {config}", highlight=False, soft_wrap=True)
        return str(config)
    console.print(f"[yellow]--resume without --config: {run} has no config.yaml, so the defaults are compared with "
                  "the checkpoint's config", highlight=False, soft_wrap=True)
    return None


def _eval(args) -> int:
    from .eval.evaluate import run_eval

    return run_eval(args)


def _merge(args) -> int:
    from .models.adapter import adapter_base_mismatch
    from .models.merge import adapter_base, merge_adapter

    model = args.model or adapter_base(args.adapter)
    mismatch = adapter_base_mismatch(args.adapter, model)  # as eval warns: shapes that fit are no proof
    if mismatch:
        console.print(Text(f"warning: {mismatch}", style="yellow"), soft_wrap=True)
    t0 = time.perf_counter()
    with console.status(f"merging {args.adapter} into {model}"):
        out = merge_adapter(args.adapter, args.out, model=model, dtype=args.dtype, device=args.device,
                            trust_remote_code=args.trust_remote_code, overwrite=args.overwrite)
    console.print(f"{args.adapter} merged into {model} ({args.dtype}) in {time.perf_counter() - t0:.1f}s: {out}",
                  soft_wrap=True)
    return 0


def _bench(args) -> int:
    import importlib

    module = importlib.import_module(f"qerl.bench.{args.what}")
    return module.main(args.rest) or 0


def build_parser() -> argparse.ArgumentParser:
    from .formats import FORMATS
    from .models.registry import DEFAULT_MODEL
    from .nn import DEFAULT_TARGETS
    from .quant import METHODS

    parser = argparse.ArgumentParser(prog="qerl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    q = sub.add_parser("quantize", help="quantize a causal LM and write a compressed-tensors / bnb directory")
    q.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                   help=f"embedded name, HF directory, GGUF file or hub id (default {DEFAULT_MODEL})")
    q.add_argument("--format", default="nvfp4", choices=[f for f in FORMATS if f != "bf16"])  # bf16: nothing to do
    q.add_argument("--method", default="rtn", choices=list(METHODS),
                   help="how codes and scales are chosen: rtn (round-to-nearest), 4over6 (NVFP4 scale search), "
                        "gptq / awq (calibrated; docs/formats.md)")
    q.add_argument("--calibration", default="auto",
                   help="calibration text for gptq / awq: auto, reasoning-gym, self (the model's own greedy "
                        "answers), or a .txt / .jsonl file; never an evaluation set")
    q.add_argument("--calibration-samples", type=positive_int,
                   help="calibration sequences (default 128 on a GPU, 64 on the CPU; see docs/formats.md)")
    q.add_argument("--device", default="auto",
                   help="where the model is loaded, calibrated and quantized: auto (a GPU when there is one), "
                        "cpu, cuda, cuda:N")
    q.add_argument("--calibration-max-tokens", type=positive_int, default=256,
                   help="tokens per calibration sequence")
    q.add_argument("--keep-bf16", default="",
                   help="comma-separated module names / patterns / last:N left in bf16 (e.g. last:2,*.down_proj)")
    q.add_argument("--out", required=True, help="output directory (checked before the model loads, written "
                                                "atomically)")
    q.add_argument("--targets", default=",".join(DEFAULT_TARGETS), help="comma-separated linear names to quantize")
    q.add_argument("--dtype", default="bf16", help="dtype of the unquantized tensors (bf16, fp16, fp32)")
    q.add_argument("--overwrite", action="store_true",
                   help="replace --out if it exists and qerl wrote it (anything else is refused, never deleted)")
    q.add_argument("--no-check", action="store_true", help="skip the KL / perplexity check against the original")
    q.add_argument("--trust-remote-code", action="store_true", help="allow code from the model directory to run")
    q.set_defaults(func=_quantize)

    t = sub.add_parser("train", help="RL-train a LoRA adapter on a quantized base (GRPO / DAPO / Dr. GRPO + AQN)")
    t.add_argument("--config", help="YAML config (see configs/); defaults are the small offline demo")
    t.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. rollout.group_size=16")
    t.add_argument("--output-dir", help="run directory (overrides output_dir)")
    t.add_argument("--resume", nargs="?", const="auto", help="continue from the last complete checkpoint (or DIR)")
    t.add_argument("--override", nargs="+", metavar="KEY",
                   help="with --resume: config keys the resumed run may change (e.g. optim.lr); other changes "
                        "than steps, save_every, keep_last, keep_best, logging and plots are refused without it")
    t.add_argument("--help-config", action="store_true", help="print every config key with its type, default and "
                                                             "meaning, then exit")
    t.set_defaults(func=_train)

    e = sub.add_parser("eval", help="pass@1 of a model (+ adapter) on a math dataset")
    from .eval.evaluate import add_eval_arguments

    add_eval_arguments(e)
    e.set_defaults(func=_eval)

    m = sub.add_parser("merge", help="merge a trained adapter into the 16-bit model (a Hugging Face directory)")
    m.add_argument("adapter", help="PEFT adapter directory (e.g. a `qerl train` run's adapter/)")
    m.add_argument("--out", required=True, help="output directory (written atomically)")
    m.add_argument("--model", help="the 16-bit model to merge into (default: the model qerl train loaded, which the "
                                   "adapter records as qerl_base_model; else its base_model_name_or_path)")
    m.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="dtype of the merged weights")
    m.add_argument("--device", default="cpu", help="where the merge runs (cpu, cuda, cuda:N)")
    m.add_argument("--overwrite", action="store_true",
                   help="replace --out if it exists and qerl wrote it (anything else is refused, never deleted)")
    m.add_argument("--trust-remote-code", action="store_true", help="allow code from the model directory to run")
    m.set_defaults(func=_merge)

    b = sub.add_parser("bench", help="benchmarks (GPU): kernels, rollout, step (one end-to-end RL step), study "
                                     "(a grid of training runs)")
    b.add_argument("what", choices=["kernels", "rollout", "step", "study"])
    b.add_argument("rest", nargs=argparse.REMAINDER,
                   help="arguments passed to the benchmark, e.g. rollout / step --lengths NAME|FILE (ragged "
                        "completion lengths from a profile) --schedulers continuous,static (step: --modes new,old)")
    b.set_defaults(func=_bench)
    parser.set_defaults(commands=sub.choices)
    return parser


def parse_args(parser: argparse.ArgumentParser, argv) -> argparse.Namespace:
    """Parse; an unknown option is refused by its command's parser (its usage, not the top level's) with the
    closest option of that command suggested."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        command = args.commands[args.command]
        known = [o for action in command._actions for o in action.option_strings]
        hints = []
        for item in extra:
            close = difflib.get_close_matches(item.split("=", 1)[0], known, n=1, cutoff=0.6)
            if close:
                hints.append(f"{item}: did you mean {close[0]}?")
        command.error(f"unrecognized arguments: {' '.join(extra)}" + (f" ({'; '.join(hints)})" if hints else ""))
    return args


def install_stack_dumps() -> None:
    """Where a long step that seems stuck is (a compile, a collective, a kernel wait): `kill -USR1 PID` prints every
    thread's Python stack to stderr and the command goes on; `QERL_STACKS_EVERY=SECONDS` prints them every SECONDS
    from a watchdog thread of faulthandler's own, which needs no signal to reach the process (a library that takes
    SIGUSR1 over, a main thread blocked in C code); `main` cancels it when the command ends. POSIX for the signal;
    only where stderr is a real file (not under a notebook's or a test runner's captured stream)."""
    import faulthandler

    every = os.environ.get("QERL_STACKS_EVERY", "").strip()
    seconds = None
    if every:
        try:
            seconds = float(every)
        except ValueError:
            pass
        if seconds is None or not 0 < seconds < 1e9:
            print(f"warning: QERL_STACKS_EVERY={every!r} is not a number of seconds in (0, 1e9); ignored",
                  file=sys.stderr)
            seconds = None
    try:
        if hasattr(signal, "SIGUSR1"):
            faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)
        if seconds is not None:
            faulthandler.dump_traceback_later(seconds, repeat=True)
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation: a stderr with no file descriptor
        pass


def main(argv=None) -> int:
    """Run one command; every failure a user can cause ends with one line and exit status 2, a stop signal
    (SIGINT / SIGTERM, at any point, imports included) with one line and 128 + its number; SIGUSR1 prints the
    Python stacks (`install_stack_dumps`)."""
    install_stack_dumps()
    quiet_libraries()
    from .models.registry import persist_compiled_kernels

    persist_compiled_kernels()
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    raise_on_stop_signals()
    try:
        args = parse_args(build_parser(), argv)
        from transformers.utils import logging as hf_logging

        # qerl shows its own progress; transformers' per-tensor bars and dtype advice are noise here.
        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
        return args.func(args)
    except BrokenPipeError:  # the reader went away (`qerl train --help-config | head`): end as a pipe's writer does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left to flush at exit
        return 128 + signal.SIGPIPE
    except TrainingInterrupted as e:
        console.print(Text(str(e), style="yellow"), soft_wrap=True)
        return 128 + e.signum
    except KeyboardInterrupt as e:  # Interrupted (SIGTERM, or a signal during training's clean stop) or Ctrl-C
        signum = e.signum if isinstance(e, Interrupted) else signal.SIGINT
        for sig in (signal.SIGINT, signal.SIGTERM):  # the line below is the last word, whatever comes now
            signal.signal(sig, signal.SIG_IGN)
        console.print(Text(f"stopped by {signal.Signals(signum).name}; nothing half-written was kept (outputs "
                           "appear only when complete; a run continues from its last checkpoint with --resume)",
                           style="yellow"), soft_wrap=True)
        return 128 + signum
    except (ValueError, OSError, RuntimeError) as e:  # OSError: FileExistsError, FileNotFoundError, PermissionError
        # soft_wrap: keep paths unbroken; Text: a message with [brackets] is not rich markup.
        console.print(Text("error: ", style="bold red") + Text(str(e)), soft_wrap=True)
        return 2
    finally:  # a caller in the same process (a test, a notebook) gets its own handlers back, and no more dumps
        for sig, handler in previous.items():
            if handler is not None:
                signal.signal(sig, handler)
        import faulthandler

        faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    sys.exit(main())
