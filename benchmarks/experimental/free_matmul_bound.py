"""How fast could the NVFP4 rollout engine be with a perfect FP4 matmul? A counterfactual measurement (GPU).

For each variant and batch the decode step is timed on the same engine (`qerl bench rollout`'s method) in
each of `--modes`:
  real         as is;
  free         the base matmuls of the decoder layers "free": the engine's `quantized_linear` is replaced by
               an allocation of its output (no kernel; the values are garbage, which no timing depends on).
               Everything else runs as before: the LoRA A launches, attention, norms, RoPE, SiLU, the bf16
               lm_head, sampling;
  free_lora_a  the LoRA A launches (`lora_a`) replaced the same way, the matmuls real;
  free_both    both.
real - free is what the base matmuls add to a step. From it, per batch:
  - the rate at which each variant's matmuls stream their linear weights (bytes / added time);
  - a bound for NVFP4+LoRA: "rest" (its free step; optimistic: its free_both step) + its FP4 weight bytes
    at the measured device copy bandwidth, the ratio bf16+LoRA / bound, and the FP4 streaming rate a 2.5x
    ratio would need. It assumes the matmul time adds to the rest (as it does in this engine, one kernel
    after another); a design that overlaps weight streaming with the small kernels (a persistent
    "megakernel") is not bounded by it.

    python benchmarks/experimental/free_matmul_bound.py --batches 8,16,32,64 --modes real,free,free_lora_a,free_both [--out r.json]
"""

import argparse
import datetime
import json

import torch

from qerl.bench import rollout as rb
from qerl.nn import QuantLinear
from qerl.rollout import engine as engine_mod


def free_linear(fmt, x, tensors, bias=None, lora=None):
    """The shape of quantized_linear's result, without computing it."""
    n = (tensors["weight_packed"] if "weight_packed" in tensors else tensors["weight"]).shape[0]
    return torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)


def free_lora_a(x, a):
    """The shape of lora_a's result (h [M, R]), without computing it."""
    return torch.empty(x.numel() // x.shape[-1], a.shape[0], dtype=x.dtype, device=x.device)


MODES = {  # name -> (quantized_linear free, lora_a free)
    "real": (False, False), "free": (True, False), "free_lora_a": (False, True), "free_both": (True, True)}


def linear_weight_bytes(model) -> int:
    """Bytes of the decoder layers' base weights (what the replaced matmuls read per step)."""
    return sum(t.numel() * t.element_size() for m in model.modules() if isinstance(m, QuantLinear)
               for t in m.quantized_tensors().values())


def measure(size, variant, batches, args) -> list[dict]:
    fmt = variant.split("+")[0]
    model = rb.build_model(size, args.layers, fmt, args.lora_r)
    wbytes = linear_weight_bytes(model)
    eng = engine_mod.RolloutEngine(model, max_seq_len=args.prompt + args.new)
    real, real_a = engine_mod.quantized_linear, engine_mod.lora_a
    rows = []
    for b in batches:
        r = dict(model=size, variant=variant, batch=b, linear_gb=wbytes / 1e9)
        for mode in args.modes:
            no_mm, no_a = MODES[mode]
            engine_mod.quantized_linear = free_linear if no_mm else real
            engine_mod.lora_a = free_lora_a if no_a else real_a
            eng.invalidate_graphs()  # the captured graphs hold the kernels of the other mode
            try:
                r[mode + "_ms"] = rb.bench_engine(eng, b, args)["step_ms"]
            finally:
                engine_mod.quantized_linear, engine_mod.lora_a = real, real_a
        r["matmul_ms"] = r["real_ms"] - r["free_ms"]
        r["matmul_tb_s"] = wbytes / (r["matmul_ms"] / 1e3) / 1e12
        print(json.dumps(r), flush=True)
        rows.append(r)
    del eng, model
    rb.free()
    return rows


def bound_table(rows, copy_bw, target: float = 2.5) -> str:
    """Per batch: NVFP4+LoRA bounded below by rest + FP4 bytes at the copy bandwidth, with rest = its step with
    free base matmuls ("free") and, optimistic, with the LoRA A launches free too ("free_both": as if they hid
    completely behind the weight streaming); and the FP4 streaming rate each would need for `target` x."""
    lines = ["| model | batch | bf16+LoRA ms | NVFP4+LoRA ms (ratio) | rest ms: free / free_both | FP4 GB | bound at copy "
             f"bw, rest: ms (ratio) | same, optimistic rest | FP4 TB/s needed for {target}x: rest / optimistic |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    by = {(r["model"], r["variant"], r["batch"]): r for r in rows}

    def needed(t_bf16, rest, gb):
        left = t_bf16 / target - rest
        return "unreachable" if left <= 0 else f"{gb / left:.2f}"

    for (size, variant, b), q in by.items():
        bf = by.get((size, "bf16+lora", b))
        if variant != "nvfp4+lora" or bf is None:
            continue
        t, gb = bf["real_ms"], q["linear_gb"]
        rest, core = q["free_ms"], q.get("free_both_ms")
        fp4_ms = gb * 1e9 / copy_bw * 1e3
        cells = [f"{size}", f"{b}", f"{t:.2f}", f"{q['real_ms']:.2f} ({t / q['real_ms']:.2f}x)",
                 f"{rest:.2f} / " + ("-" if core is None else f"{core:.2f}"), f"{gb:.2f}",
                 f"{rest + fp4_ms:.2f} ({t / (rest + fp4_ms):.2f}x)",
                 "-" if core is None else f"{core + fp4_ms:.2f} ({t / (core + fp4_ms):.2f}x)",
                 needed(t, rest, gb) + " / " + ("-" if core is None else needed(t, core, gb))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="7b")
    ap.add_argument("--variants", default="bf16+lora,nvfp4+lora")
    ap.add_argument("--batches", default="8,16,32,64")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=512)
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--modes", default="real,free",
                    help="comma list of: real, free (base matmuls free), free_lora_a (the LoRA A launches free), "
                         "free_both")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    args.modes = args.modes.split(",")
    if not {"real", "free"} <= set(args.modes) or not set(args.modes) <= set(MODES):
        ap.error(f"--modes must include real and free, from {sorted(MODES)}")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    batches = [int(b) for b in args.batches.split(",")]
    copy_bw = rb.copy_bandwidth()
    rows = []
    for size in args.models.split(","):
        for variant in args.variants.split(","):
            rows += measure(size, variant, batches, args)
    device = torch.cuda.get_device_name()
    print(f"\ndevice: {device}; copy bandwidth {copy_bw / 1e12:.2f} TB/s; torch {torch.__version__}; "
          f"{datetime.date.today()}")
    extra = [m for m in args.modes if m not in ("real", "free")]
    print("| model | variant | batch | step ms | step ms, free matmuls | " + "".join(f"step ms, {m} | " for m in extra)
          + "matmuls add ms | linear GB | matmul TB/s |")
    print("|---|---|---:|---:|---:|" + "---:|" * len(extra) + "---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['variant']} | {r['batch']} | {r['real_ms']:.2f} | {r['free_ms']:.2f} | "
              + "".join(f"{r[m + '_ms']:.2f} | " for m in extra)
              + f"{r['matmul_ms']:.2f} | {r['linear_gb']:.2f} | {r['matmul_tb_s']:.2f} |")
    print()
    print(bound_table(rows, copy_bw))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=device, date=str(datetime.date.today()), copy_bw=copy_bw, torch=torch.__version__,
                           args=vars(args), results=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
