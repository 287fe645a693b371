"""A/B of the decode's fused-launch switches on one engine: the same model and engine for every setting, its CUDA
graphs recaptured per setting, the settings alternated `--rounds` times per (model, rows), so that a difference of
a few per cent is not the machine drifting between two processes.

    python benchmarks/decode_fuse_ab.py --models 1.5b,7b --batches 1,8 \
        --settings "default;COMBINE=1;LORA_A_O=1;SILU_LORA_A=1;COMBINE=1,LORA_A_O=1,SILU_LORA_A=1"

A setting is `default` (the library's switches) or a comma list of NAME=0|1 (the names of
`python -m qerl.bench.decode_profile --fuse`); each setting starts from the defaults. Prints one JSON line per cell
(µs per decode step; step_pdl is what the engine runs), the full per-kernel table of each setting's first cell, and
last a table of the medians per setting with the ratio to the first setting. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time


def parse_settings(text: str, flags: dict[str, str]) -> list[tuple[str, dict[str, bool]]]:
    """'default;A=1,B=0' -> [('default', {}), ('A=1,B=0', {'A': True, 'B': False})]; unknown names raise."""
    out = []
    for item in filter(None, (s.strip() for s in text.split(";"))):
        switches = {}
        if item != "default":
            for pair in item.split(","):
                name, _, value = pair.strip().partition("=")
                if name not in flags or value not in ("0", "1"):
                    raise SystemExit(f"bad setting {pair!r}: expected NAME=0|1 with NAME one of {', '.join(flags)}")
                switches[name] = value == "1"
        out.append((item, switches))
    if not out:
        raise SystemExit("no settings given")
    return out


def summary_table(lines: list[dict], settings: list[str]) -> str:
    """Median step (PDL on) per (model, rows, setting) and its ratio to the first setting's."""
    rows = ["| model | rows | setting | step µs (PDL on), median | ratio to first | launches |",
            "|---|---:|---|---:|---:|---:|"]
    for model, batch in dict.fromkeys((c["model"], c["rows"]) for c in lines):
        first = None
        for name in settings:
            cells = [c for c in lines if (c["model"], c["rows"], c["setting"]) == (model, batch, name)]
            if not cells:
                continue
            med = statistics.median(c["step_pdl"] for c in cells)
            first = first or med
            rows.append(f"| {model} | {batch} | {name} | {med:.1f} | {med / first:.3f} | {cells[0]['calls']:.0f} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    from qerl.bench.decode_profile import FUSE_FLAGS

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="1.5b,7b")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--variant", default="nvfp4", help="the base format of the policy (nvfp4 or bf16)")
    ap.add_argument("--settings", default="default;COMBINE=1;LORA_A_O=1;SILU_LORA_A=1")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--out", default=None, help="write every cell's roles as JSON here")
    args = ap.parse_args(argv)
    settings = parse_settings(args.settings, FUSE_FLAGS)

    import torch

    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    from qerl.bench.decode_profile import build_model, format_cell, profile_cell
    from qerl.bench.graph_timing import copy_bandwidth
    from qerl.bench.options import free_gpu
    from qerl.rollout.engine import RolloutEngine

    modules = {name: importlib.import_module(f"qerl.kernels.{mod}") for name, mod in FUSE_FLAGS.items()}
    defaults = {name: getattr(modules[name], "FUSED_" + name) for name in FUSE_FLAGS}
    bw = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}; copy bandwidth {bw / 1e12:.2f} TB/s; torch {torch.__version__}; "
          f"defaults {defaults}", flush=True)
    lines, full = [], []
    for size in args.models.split(","):
        model = build_model(size, None, None if args.variant == "bf16" else args.variant, 16)
        engine = RolloutEngine(model, max_seq_len=args.prompt + args.steps + 8, cuda_graphs=True)
        for batch in map(int, args.batches.split(",")):
            for rnd in range(args.rounds):
                for name, switches in settings:
                    for flag, value in {**defaults, **switches}.items():
                        setattr(modules[flag], "FUSED_" + flag, value)
                    engine.decode_graphs.reset()
                    t = time.time()
                    cell = profile_cell(engine, batch, args.prompt, args.steps, bw)
                    line = dict(model=size, rows=batch, setting=name, round=rnd, step_pdl=cell["step_us_pdl"],
                                step_nopdl=cell["step_us_no_pdl"], kernels=cell["kernel_us_no_pdl"],
                                calls=sum(r["calls"] for r in cell["roles"]), floor=cell["floor_us"],
                                s=round(time.time() - t, 1))
                    print(json.dumps(line), flush=True)
                    lines.append(line)
                    full.append(dict(line, roles=[{k: v for k, v in r.items() if k != "kernels"}
                                                  for r in cell["roles"]]))
                    if rnd == 0:
                        print(format_cell(f"{size} {args.variant}+lora, {batch} rows, {name}", cell, bw), flush=True)
        for flag, value in defaults.items():
            setattr(modules[flag], "FUSED_" + flag, value)
        del engine, model
        free_gpu()
    print(summary_table(lines, [name for name, _ in settings]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), copy_bw=bw, args=vars(args), cells=full), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
