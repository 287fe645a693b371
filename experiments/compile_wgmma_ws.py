"""Compile the warp-specialized NVFP4 kernel for sm_90 without a GPU and report what ptxas made of it.

`python experiments/compile_wgmma_ws.py [NAME=VALUE ...] [--src DIR] [--setmaxnreg-floor N]`: NAME=VALUE set
the kernel's constexprs (defaults BM=256 BKH=64 NS=3 CREGS=232 NC=2 where the kernel has them, the others 0);
--src imports qerl from another tree, e.g. `git worktree add /tmp/a6 a6cd4a0` for the schedules measured there
(`--src /tmp/a6/src MODE=4 BM=128 NS=4`). Uses the ptxas the installed Triton compiles sm_90 with (docs quote
Triton 3.6.0).
Prints ptxas's registers, spills and warnings, the shared memory, and for the consumer loop (the innermost
loop holding HGMMAs): its SASS instruction count, HGMMA and WARPGROUP.DEPBAR counts and an opcode histogram.
--setmaxnreg-floor N raises every `setmaxnreg` below N to N in the PTX before ptxas: a diagnostic of which
register budget makes ptxas serialize the wgmma pipeline (such a kernel could not be launched: its warpgroups
would ask for more than the 64K registers of an SM).
"""

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

DEFAULTS = {"BM": 256, "BKH": 64, "BNR": 64, "NS": 3, "CREGS": 232, "NC": 2}
# kernel -> (module, kernel name, {descriptor argument: (dtype, block shape from the constexprs)})
KERNELS = {
    "forward": ("gluon.nvfp4_wgmma_ws", "nvfp4_wgmma_ws_kernel",
                {"x_desc": ("bf16", lambda c: [c["BM"], c["BKH"]]), "w_desc": ("u8", lambda c: [64, c["BKH"]])}),
    "grad_input": ("gluon.nvfp4_grad_input", "nvfp4_grad_input_kernel",
                   {"g_desc": ("bf16", lambda c: [c["BM"], c["BNR"]]), "w_desc": ("u8", lambda c: [c["BNR"], 32])}),
}
POINTERS = {"s_ptr": "*u8", "gs_ptr": "*fp32", "b_ptr": "*bf16", "out_ptr": "*bf16", "ws_ptr": "*fp32",
            "cnt_ptr": "*i32", "h_ptr": "*bf16", "lb_ptr": "*bf16"}
ALIGNED = {"s_ptr", "gs_ptr", "b_ptr", "out_ptr", "M", "N", "K", "stride_s", "stride_om", "ws_ptr", "cnt_ptr", "lb_ptr"}


def _args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("constexprs", nargs="*", metavar="NAME=VALUE")
    ap.add_argument("--kernel", choices=sorted(KERNELS), default="forward",
                    help="forward: gluon.nvfp4_wgmma_ws; grad_input: gluon.nvfp4_grad_input")
    ap.add_argument("--src", default=None, help="directory holding the qerl package to import (default: installed)")
    ap.add_argument("--setmaxnreg-floor", type=int, default=0, metavar="N",
                    help="raise every setmaxnreg below N to N before ptxas (diagnostic; not launchable)")
    a = ap.parse_args(argv)
    try:
        a.constexprs = {k: int(v) for k, v in (c.split("=", 1) for c in a.constexprs)}
    except ValueError:
        ap.error("constexprs are NAME=INTEGER")
    return a


def raise_setmaxnreg(ptx: str, floor: int) -> tuple[str, int]:
    """PTX text with every `setmaxnreg.{inc,dec}.sync.aligned.u32 V` below floor set to floor (the inc/dec
    keyword is left as it was), and how many were raised."""
    count = 0

    def sub(m):
        nonlocal count
        if int(m.group(2)) >= floor:
            return m.group(0)
        count += 1
        return f"{m.group(1)}{floor};"

    return re.sub(r"(setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32\s+)(\d+);", sub, ptx), count


def _sass_lines(sass: str) -> list[tuple[int, str, str]]:
    """(address, opcode without predicate or modifiers, the instruction text) per SASS instruction."""
    out = []
    for ln in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", ln)
        if m:
            text = m.group(2).strip()
            op = re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]
            out.append((int(m.group(1), 16), op, text))
    return out


def consumer_loop(sass: str) -> list[tuple[int, str, str]]:
    """The instructions of the innermost backward-branch loop that holds an HGMMA (first such loop)."""
    ins = _sass_lines(sass)
    best = None
    for addr, op, text in ins:
        t = re.search(r"BRA\s+(?:`\(\.L_x_\d+\)|0x([0-9a-f]+))", text) if op == "BRA" else None
        if t is None or t.group(1) is None or int(t.group(1), 16) >= addr:
            continue
        lo = int(t.group(1), 16)
        body = [i for i in ins if lo <= i[0] <= addr]
        if any(i[1] == "HGMMA" for i in body) and (best is None or len(body) < len(best)):
            best = body
    return best or []


def main(argv=None) -> int:
    a = _args(argv)
    if a.src:
        sys.path.insert(0, a.src)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    import importlib

    module, name, descs = KERNELS[a.kernel]
    try:
        kernel_module = importlib.import_module(f"qerl.kernels.{module}")
    except ModuleNotFoundError:  # a --src tree from before kernels/ was split by backend (gluon_nvfp4_wgmma_ws.py)
        kernel_module = importlib.import_module(f"qerl.kernels.{module.replace('.', '_')}")
    kernel = getattr(kernel_module, name)
    names = [p.name for p in kernel.params if p.is_constexpr]
    cx = {n: a.constexprs.get(n, DEFAULTS.get(n, 0)) for n in names}
    if a.kernel == "grad_input" and "NS" not in a.constexprs:
        cx["NS"] = 4
    unknown = sorted(set(a.constexprs) - set(names))
    if unknown:
        print(f"unknown constexprs {unknown}; the kernel has {names}", file=sys.stderr)
        return 2
    sig = {}
    for n in kernel.arg_names:
        if n in cx:
            sig[n] = "constexpr"
        elif n in descs:
            dtype, block = descs[n][0], descs[n][1]({**DEFAULTS, **cx})
            layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16 if dtype == "bf16" else gl.uint8)
            sig[n] = f"tensordesc<{dtype}[{block[0]}, {block[1]}],{layout!r}>"
        else:
            sig[n] = POINTERS.get(n, "i32")
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names) if n in ALIGNED}
    c = triton.compile(GluonASTSource(kernel, sig, cx, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 4})
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(90).path  # the ptxas this Triton compiles sm_90 with
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as d:
        ptx, cubin = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        text, raised = raise_setmaxnreg(c.asm["ptx"], a.setmaxnreg_floor)
        with open(ptx, "w") as f:
            f.write(text)
        info = subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx, "-o", cubin],
                              capture_output=True, text=True)
        sass = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True,
                              text=True).stdout
    log = info.stdout + info.stderr
    if info.returncode:
        print(f"ptxas failed ({info.returncode}):\n{log[-2000:]}", file=sys.stderr)
        return 1
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores", log)
    maxreg = max((int(r) for r in re.findall(r"\bR(\d+)\b", sass)), default=0)
    threads = re.search(r"\.reqntid (\d+)", c.asm["ptx"]).group(1)
    print(f"triton {triton.__version__}, constexprs {cx}")
    if a.setmaxnreg_floor:
        print(f"setmaxnreg below {a.setmaxnreg_floor} raised to it in {raised} places (diagnostic, not launchable)")
    print(f"ptxas: {regs and regs.group(1)} registers (.maxnreg of the kernel), {spills and spills.group(1)} bytes "
          f"spilled; highest register used anywhere R{maxreg}; shared memory {c.metadata.shared} B; "
          f"{threads} threads")
    for ln in log.splitlines():
        if "Performance" in ln or "warning" in ln.lower():
            print("ptxas:", ln.strip())
    loop = consumer_loop(sass)
    hist = collections.Counter(op for _, op, _ in loop)
    print(f"consumer loop: {len(loop)} SASS instructions, {hist['HGMMA']} HGMMA, "
          f"{sum('WARPGROUP.DEPBAR' in t for *_, t in loop)} WARPGROUP.DEPBAR")
    print("opcodes: " + ", ".join(f"{op} {n}" for op, n in hist.most_common()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
