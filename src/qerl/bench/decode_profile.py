"""Where a decode step's GPU time goes, against the floor: each kernel of the engine's decode step by role, its
bytes and its distance from the device-copy bandwidth (docs/cli.md, "python -m qerl.bench.decode_profile").

    python -m qerl.bench.decode_profile --models 7b --variants bf16+lora,nvfp4+lora --batches 1,8,64
"""

import argparse
import datetime
import importlib
import json
import re

import torch

from .graph_timing import copy_bandwidth, event_ms
from .options import free_gpu, md_header
from .rollout import build_model, prompts_tensor
from .update_profile import union_ms

# first match wins; kernel names as CUPTI reports them
MATMUL = r"nvfp4_swap|bf16_swap|_fp4_|fp4_gemv|_gemv_kernel|gemm|nvjet|cutlass|sm90_xmma|ampere_|w4a8"
FUSE_FLAGS = {"ROPE_STORE": "decode_attention", "COMBINE": "decode_attention", "LORA_A_O": "decode_attention",
              "SILU_LORA_A": "fused_ops"}  # --fuse NAME=0|1: qerl.kernels.<module>.FUSED_<NAME>
MATMUL_AFTER = r"splitKreduce|_splitk_reduce"  # the second launch of a split-K product: charged to it
MATMUL_BEFORE = r"permute_x"  # x rewritten for the product that follows: charged to it
NAMED = (
    ("norm + LoRA A", r"_add_rms_norm_lora_a"),  # the norm launch that also does the next group's LoRA A
    ("LoRA A", r"_lora_a"),
    ("attention", r"_split_kernel|_combine_kernel|decode_attention|flash|fmha|attention|sdpa|efficient"),
    ("norm (+ residual)", r"_add_rms_norm|rms_norm"),
    ("RoPE + k/v write", r"_rope"),
    ("SwiGLU", r"_silu_mul|silu"),
    ("sampling", r"_sample_kernel|sort|topk|softmax|multinomial|exponential|cumsum|argmax"),
)
GROUP_NAMES = ("q/k/v", "o", "gate/up", "down")  # the runner's linear groups, in order within a layer


def name_role(name: str) -> str:
    """Role of a kernel from its name alone: "matmul", "matmul+" (a split-K reduce, charged to the product
    before it), "matmul-" (an x rewrite, charged to the product after it), a `NAMED` role, or "other"."""
    if re.search(MATMUL_AFTER, name, re.IGNORECASE):
        return "matmul+"
    if re.search(MATMUL_BEFORE, name, re.IGNORECASE):
        return "matmul-"
    for role, pat in NAMED:
        if re.search(pat, name, re.IGNORECASE):
            return role
    if re.search(MATMUL, name, re.IGNORECASE):
        return "matmul"
    return "other"


def expected_products(runner) -> tuple[list[str], list[str]] | None:
    """(the base products of one decode step in launch order, the LoRA A products in launch order) as role
    names, from the runner's groups (a fused sibling group is one product, else one per member), lm_head last;
    None for a model whose step is not one product per group (mixture-of-experts layers)."""
    if runner.has_moe:
        return None
    lora = runner.lora
    base, lora_a = [], []
    for gi, group in enumerate(lora.groups):
        role = GROUP_NAMES[gi % 4]
        if gi in lora.a:
            lora_a.append(f"LoRA A {role}")
        if gi in lora.fused or len(group) == 1:
            base.append(role)
        else:
            base += [f"{role} ({i})" for i in range(len(group))]
    return base + ["lm_head"], lora_a


def assign_roles(names: list[str], runner) -> tuple[list[str], bool]:
    """Role of each kernel of one decode step (names in launch order) and whether the order matched the
    runner's structure (`expected_products`); unmatched: name roles only."""
    roles = [name_role(n) for n in names]
    expected = expected_products(runner)
    heads = [i for i, r in enumerate(roles) if r == "matmul"]
    lora_at = [i for i, r in enumerate(roles) if r in ("LoRA A", "norm + LoRA A")]
    if expected is None or len(heads) != len(expected[0]) or len(lora_at) != len(expected[1]):
        return [r.rstrip("+-") for r in roles], False
    out = list(roles)
    for i, role in zip(heads, expected[0]):
        out[i] = role
    for i, role in zip(lora_at, expected[1]):
        out[i] = "norm + " + role if roles[i] == "norm + LoRA A" else role
    for i, r in enumerate(roles):  # helpers of a product take its role
        if r == "matmul+":
            out[i] = next((out[j] for j in range(i - 1, -1, -1) if roles[j] == "matmul"), "matmul")
        elif r == "matmul-":
            out[i] = next((out[j] for j in range(i + 1, len(roles)) if roles[j] == "matmul"), "matmul")
    return out, True


def _weight_bytes(mod) -> int:
    """Bytes of a linear's stored weight (a QuantLinear's format tensors, or a plain weight) and bias."""
    stored = list(mod.quantized_tensors().values()) if hasattr(mod, "quantized_tensors") else [mod.weight]
    return sum(t.numel() * t.element_size() for t in (*stored, getattr(mod, "bias", None)) if t is not None)


def role_bytes(runner, rows: int, attended: int) -> dict[str, int]:
    """The bytes each role of one decode step must move at least, summed over layers: every weight, scale and
    LoRA factor read once, the KV cache over `attended` slots per row read once, and each activation written
    and read once. rows: the batch; elements of activations in the runner's dtype."""
    e = torch.finfo(runner.dtype).bits // 8
    cfg = runner.config
    D, V, L = cfg.hidden_size, cfg.vocab_size, len(runner.layers)
    H, KV, hd = runner.n_heads, runner.n_kv, runner.head_dim
    out: dict[str, int] = {}

    def add(role, n):
        out[role] = out.get(role, 0) + int(n)

    lora = runner.lora
    for gi, group in enumerate(lora.groups):
        role = GROUP_NAMES[gi % 4]
        k = group[0].in_features
        r = lora.a[gi].shape[0] if gi in lora.a else 0
        if gi in lora.fused or len(group) == 1:  # one product: x read once, one [sum N, sum r] LoRA B block
            n = sum(m.out_features for m in group)
            add(role, sum(_weight_bytes(m) for m in group) + rows * k * e + rows * n * e + n * r * e + rows * r * e)
        else:
            for i, m in enumerate(group):
                ri = m.lora_A.weight.shape[0] if r and getattr(m, "lora_A", None) is not None else 0
                add(f"{role} ({i})", _weight_bytes(m) + rows * k * e + rows * m.out_features * e
                    + m.out_features * ri * e + rows * ri * e)
        if r:
            add(f"LoRA A {role}", r * k * e + rows * k * e + rows * r * e)
    head = runner.lm_head
    add("lm_head", _weight_bytes(head) + rows * D * e + rows * V * e)
    add("attention", L * (rows * attended * KV * hd * e * 2 + 2 * rows * H * hd * e))
    add("norm (+ residual)", (2 * L + 1) * (4 * rows * D * e + D * e))
    add("RoPE + k/v write", L * rows * (2 * (H + 2 * KV) * hd * e))
    inter = getattr(cfg, "intermediate_size", 0)
    add("SwiGLU", L * rows * 3 * inter * e)
    add("sampling", rows * V * e)
    return out


def prepared_steps(engine, batch: int, prompt: int, steps: int):
    """Prefill a batch of `prompt` random tokens, capture the graphs and fill the cache; returns run(), which
    performs `steps` decode steps (the engine's step at a fixed attended length) each followed by the
    engine's sampler (one launch, `triton.sampling`, where it applies; else `next_token`), without a sync."""
    from ..rollout.sampling import SamplingParams, fused_sampling_applies, next_token

    ids = prompts_tensor(batch, prompt, engine.model.config.vocab_size)
    engine.warmup(batch, prompt + steps + 1)
    engine.generate(ids, steps + 1, SamplingParams(temperature=1.0), seed=0, ignore_eos=True)  # cache filled
    sp = SamplingParams(temperature=1.0)
    kv = engine.attended_len(prompt + steps)
    # every row decodes at slot `prompt` (the step's cost does not depend on which slot it rewrites)
    engine.slot_base[:batch].fill_(prompt)
    engine.slot_lo[:batch].fill_(0)
    engine.step_index.fill_(0)
    state = {"logits": engine.decode(batch, kv)}
    torch.cuda.synchronize()
    fused = engine.fused_sampling and fused_sampling_applies(state["logits"], sp)
    if fused:
        from ..kernels.triton.sampling import sample_triton

    def run():
        for i in range(steps):
            if fused:
                tok, _, _ = sample_triton(state["logits"], sp.temperature, 2**32, i)
            else:
                tok, _, _ = next_token(state["logits"], sp, None)
            engine.step_tokens.copy_(tok)
            state["logits"] = engine.decode(batch, kv)

    return run


def kernel_events(run, steps: int) -> list[tuple[str, float, float]]:
    """(name, start us, duration us) of every CUDA kernel / memcpy of `steps` steps, in start order."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    ev = [(e.name, float(e.time_range.start), float(e.device_time if hasattr(e, "device_time") else e.cuda_time))
          for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sorted(ev, key=lambda x: x[1])


def busy_us(events: list[tuple[str, float, float]]) -> float:
    """Time at least one of `events` (name, start us, duration us) runs: the union of their intervals, us."""
    return 1e3 * union_ms([(start, start + dur) for _, start, dur in events])


def role_table(names_durs: list[tuple[str, float]], steps: int, runner, rows: int, attended: int,
               copy_bw: float) -> tuple[list[dict], bool]:
    """Per role of the step: calls, us per step, bytes, GB/s and % of its own floor (bytes / copy bandwidth / time).
    names_durs: (kernel name, duration us) of `steps` steps in launch order."""
    per = len(names_durs) // steps
    names = [n for n, _ in names_durs[:per]]
    roles, matched = assign_roles(names, runner)
    if len(names_durs) != per * steps or any(names_durs[s * per + i][0] != names[i] for s in range(steps)
                                             for i in range(per)):
        roles, matched = None, False  # steps differ: group each kernel by its name role
    bytes_ = role_bytes(runner, rows, attended) if matched else {}
    norm_call = bytes_.get("norm (+ residual)", 0) / (2 * len(runner.layers) + 1)  # one norm launch's bytes
    table: dict[str, dict] = {}
    for i, (name, dur) in enumerate(names_durs):
        role = roles[i % per] if roles is not None else name_role(name).rstrip("+-")
        r = table.setdefault(role, dict(role=role, calls=0.0, us=0.0, kernels=set()))
        r["calls"] += 1
        r["us"] += dur
        r["kernels"].add(name[:60])
    out = []
    for r in table.values():
        r["calls"] /= steps
        r["us"] /= steps
        role = r["role"]
        if role == "norm (+ residual)" or role.startswith("norm + "):  # per launch; a fused one adds its product
            b = norm_call * r["calls"] + bytes_.get(role[len("norm + "):], 0) if bytes_ else None
        else:
            b = bytes_.get(role)
        r["kernels"] = sorted(r["kernels"])
        if b is not None and r["us"] > 0:
            r.update(bytes=b, gb_s=b / (r["us"] * 1e-6) / 1e9, floor_pct=100 * b / copy_bw / (r["us"] * 1e-6))
        out.append(r)
    return sorted(out, key=lambda r: -r["us"]), matched


def profile_cell(engine, rows: int, prompt: int, steps: int, copy_bw: float) -> dict:
    """Everything the table of one (engine, rows) cell shows: the per-role rows (PDL off), the kernel sum,
    busy time and step time with PDL off and on, the step's floor."""
    pdl_default = engine.pdl
    cell = {}
    for pdl in (False, True):
        engine.pdl = pdl
        engine.decode_graphs.reset()  # recapture with or without programmatic launches
        run = prepared_steps(engine, rows, prompt, steps)
        ms = event_ms(run, 5) / steps  # per step (+ sampling): the median of 5 runs of `steps` steps
        ev = kernel_events(run, steps)
        key = "pdl" if pdl else "no_pdl"
        cell[f"step_us_{key}"] = 1e3 * ms
        cell[f"kernel_us_{key}"] = sum(d for _, _, d in ev) / steps
        cell[f"busy_us_{key}"] = busy_us(ev) / steps
        if not pdl:
            cell["roles"], cell["matched"] = role_table([(n, d) for n, _, d in ev], steps, engine.runner, rows,
                                                        prompt + 1, copy_bw)
    engine.pdl = pdl_default
    engine.decode_graphs.reset()
    cell["floor_bytes"] = sum(r.get("bytes", 0) for r in cell["roles"])
    cell["floor_us"] = 1e6 * cell["floor_bytes"] / copy_bw
    return cell


def format_cell(title: str, cell: dict, copy_bw: float) -> str:
    lines = [f"\n## {title}",
             md_header("role | calls/step | us/step | MB/step | GB/s | % own floor | kernels", "lrrrrrl")]
    for r in cell["roles"]:
        mb = f"{r['bytes'] / 1e6:.1f}" if "bytes" in r else "-"
        rate = f"{r['gb_s']:.0f}" if "gb_s" in r else "-"
        pct = f"{r['floor_pct']:.0f}" if "floor_pct" in r else "-"
        lines.append(f"| {r['role']} | {r['calls']:.0f} | {r['us']:.1f} | {mb} | {rate} | {pct} | "
                     f"{', '.join(r['kernels'])[:70]} |")
    k, s = cell["kernel_us_no_pdl"], cell["step_us_no_pdl"]
    lines.append(f"| **sum of kernels** | {sum(r['calls'] for r in cell['roles']):.0f} | {k:.1f} | "
                 f"{cell['floor_bytes'] / 1e6:.1f} | | {100 * cell['floor_us'] / k:.0f} | |")
    lines.append(f"| gaps between kernels (step - sum, PDL off) | | {s - k:.1f} | | | | |")
    lines.append(f"| **step, PDL off** | | {s:.1f} | | | {100 * cell['floor_us'] / s:.0f} | |")
    p = cell["step_us_pdl"]
    lines.append(f"| **step, PDL on (the engine)** | | {p:.1f} | | | {100 * cell['floor_us'] / p:.0f} | "
                 f"GPU busy {cell['busy_us_pdl']:.1f} us |")
    lines.append(f"step floor: {cell['floor_us']:.1f} us ({cell['floor_bytes'] / 1e9:.3f} GB at "
                 f"{copy_bw / 1e12:.2f} TB/s)" + ("" if cell["matched"] else
                                                 "; kernels grouped by name (order did not match): no bytes"))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="decode_profile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="7b")
    ap.add_argument("--variants", default="bf16+lora,nvfp4+lora")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--prompt", type=int, default=256, help="each row attends over prompt + 1 slots")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--fuse", action="append", default=[], metavar="FLAG=0|1",
                    choices=[f"{f}={v}" for f in FUSE_FLAGS for v in "01"], help="set a fused launch's switch")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    from ..rollout.engine import RolloutEngine
    for item in args.fuse:  # the rest keep the library's defaults
        setattr(importlib.import_module(f"qerl.kernels.{FUSE_FLAGS[item[:-2]]}"), "FUSED_" + item[:-2], item[-1] == "1")

    bw = copy_bandwidth()
    print(f"device: {torch.cuda.get_device_name()}; copy bandwidth {bw / 1e12:.2f} TB/s; {datetime.date.today()}")
    results = []
    for size in args.models.split(","):
        for variant in args.variants.split(","):
            fmt = None if variant == "bf16" else variant.split("+")[0]
            model = build_model(size, args.layers, fmt, args.lora_r)
            engine = RolloutEngine(model, max_seq_len=args.prompt + args.steps + 8, cuda_graphs=not args.eager)
            for batch in map(int, args.batches.split(",")):
                cell = profile_cell(engine, batch, args.prompt, args.steps, bw)
                results.append(dict(model=size, variant=variant, batch=batch, **cell))
                print(format_cell(f"{size} {variant}, {batch} rows", cell, bw), flush=True)
            del engine, model
            free_gpu()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), date=str(datetime.date.today()), copy_bw=bw,
                           torch=torch.__version__, args=vars(args), results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
