"""Sustained load: does the NVFP4 decode cost the tensor cores clock speed? SM clock and power per variant.

`PYTHONPATH=$PWD/src python benchmarks/ws_clocks.py [--layers gate_up,gate_up_72b] [--m 1024,4096] [--seconds 6]`
replays one CUDA graph per variant (cuBLAS bf16, the routed NVFP4 product, the warp-specialized kernel with its
decode, and the same kernel with zero weights instead of the decode: `--no-decode` of `wgmma_ws_ab.py`, wrong
results by design) back to back for `--seconds`, while `nvidia-smi` samples the SM clock, board power and
throttle reasons every 100 ms. Prints one markdown table: microseconds per call, TFLOP/s, the median clock
and power of the samples taken inside each variant's window, and TFLOP/s per GHz of SM clock (the work a
kernel does per cycle: at the power cap a kernel that draws less power runs at a higher clock). Weights rotate
through more than twice the L2 (as in `qerl bench kernels`). GPU-only.
"""

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime

import torch
import torch.nn.functional as F

LAYERS = {"gate_up": (37888, 3584), "down": (3584, 18944), "qkv": (4608, 3584),
          "gate_up_72b": (59136, 8192), "down_72b": (8192, 29568)}  # Qwen2.5-7B / -72B (N, K)
L2 = 50 * 2**20
FIELDS = ["timestamp", "clocks.sm", "power.draw", "temperature.gpu", "clocks_throttle_reasons.active"]


def _args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default="gate_up,gate_up_72b", help=f"subset of {','.join(LAYERS)}")
    ap.add_argument("--m", default="4096", help="activation rows, comma-separated")
    ap.add_argument("--seconds", type=float, default=6.0, help="sustained replay time per variant")
    a = ap.parse_args(argv)
    a.layers = [v for v in a.layers.split(",") if v]
    try:
        a.m = [int(v) for v in a.m.split(",") if v]
    except ValueError:
        ap.error("--m takes comma-separated integers")
    bad = [v for v in a.layers if v not in LAYERS]
    if bad:
        ap.error(f"unknown layers {bad}")
    if not a.m or min(a.m) < 1 or a.seconds <= 0:
        ap.error("--m and --seconds must be positive")
    return a


def parse_samples(text: str) -> list[tuple[float, float, float, float, str]]:
    """nvidia-smi CSV lines (FIELDS, no header, no units) -> (unix time, SM MHz, W, deg C, throttle bitmask);
    lines that do not parse (a field the driver reports as [N/A], a cut-off last line) are skipped."""
    out = []
    for ln in text.strip().splitlines():
        parts = [p.strip() for p in ln.split(",")]
        if len(parts) != len(FIELDS):
            continue
        try:
            ts = datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            out.append((ts, float(parts[1]), float(parts[2]), float(parts[3]), parts[4]))
        except ValueError:
            continue
    return out


class Sampler:
    """nvidia-smi in the background, one CSV line per 100 ms; `window(t0, t1)` returns the samples in between."""

    def __init__(self):
        # a file, not a pipe: nobody reads until the end, and a full pipe would stop nvidia-smi mid-run
        self.log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(["nvidia-smi", "-i", "0", f"--query-gpu={','.join(FIELDS)}",
                                      "--format=csv,noheader,nounits", "-lms", "100"],
                                     stdout=self.log, stderr=subprocess.STDOUT, text=True)
        self.lines = None

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=10)
        self.log.seek(0)
        out = self.log.read()
        self.log.close()
        self.lines = parse_samples(out)
        if not self.lines:
            raise RuntimeError(f"nvidia-smi gave no samples: {out.strip()[:300]}")

    def window(self, t0: float, t1: float):
        return [s for s in self.lines if t0 <= s[0] <= t1]


def _sustain(fn, calls: int, seconds: float):
    """Capture `calls` invocations of fn(i) in a graph, replay it for `seconds`; (median s per call, t0, t1)."""
    from qerl.bench.kernels import _capture_calls, _replay_seconds

    g = _capture_calls(fn, calls)
    for _ in range(2):
        g.replay()
    torch.cuda.synchronize()
    per, t0 = [], time.time()
    while time.time() - t0 < seconds:
        per.append(_replay_seconds(g, calls))
    return statistics.median(per), t0, time.time()


def main(argv=None) -> int:
    a = _args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    from qerl.bench.kernels import _decode_inputs, _rotated_weights
    from qerl.kernels import gluon_nvfp4_wgmma_ws as ws
    from qerl.kernels.nvfp4_matmul import nvfp4_linear
    from qerl.kernels.operands import global_scale_f32, scale_bytes

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"device: {torch.cuda.get_device_name()}, {sms} SMs, torch {torch.__version__}", flush=True)
    results = []
    sampler = Sampler()
    try:
        for layer in a.layers:
            n, k = LAYERS[layer]
            fp4_bytes, copies, bf, q = _rotated_weights(n, k, L2)
            ops = [(e["weight_packed"], scale_bytes(e["weight_scale"]), global_scale_f32(e["weight_global_scale"]))
                   for e in q]
            for m in a.m:
                xs, calls = _decode_inputs(m, k, fp4_bytes, copies)

                def ws_call(i, no_decode, xs=xs):
                    p, s, g = ops[i % copies]
                    return ws.nvfp4_linear_ws(xs[i % 2], p, s, g, None, sms, no_decode=no_decode)

                variants = [
                    ("cuBLAS bf16", lambda i, xs=xs: F.linear(xs[i % 2], bf[i % copies])),
                    ("NVFP4 routed", lambda i, xs=xs: nvfp4_linear(xs[i % 2], **q[i % copies])),
                    ("WS kernel", lambda i: ws_call(i, False)),
                    ("WS kernel, no decode", lambda i: ws_call(i, True)),
                ]
                for name, fn in variants:
                    t, t0, t1 = _sustain(fn, calls, a.seconds)
                    results.append((layer, m, name, t, t0, t1))
                    print(f"{layer} M={m} {name}: {t * 1e6:.1f} us", flush=True)
            bf = q = ops = None
            torch.cuda.empty_cache()
    finally:
        sampler.stop()
    print(f"\nper variant: median of {a.seconds:g} s of back-to-back graph replays; clock and power: median of the "
          "nvidia-smi samples inside that window (throttle reasons: the bitmasks seen; 0x4 = software power cap)\n")
    print("| layer (N, K) | M | variant | us per call | TFLOP/s | SM MHz | W | TFLOP/s per GHz | samples | "
          "throttle reasons |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---|")
    for layer, m, name, t, t0, t1 in results:
        n, k = LAYERS[layer]
        smp = sampler.window(t0 + 0.5, t1)  # the first half second still ramps
        clk = statistics.median(s[1] for s in smp) if smp else float("nan")
        pw = statistics.median(s[2] for s in smp) if smp else float("nan")
        reasons = ",".join(sorted({s[4] for s in smp})) or "-"
        tflops = 2 * m * n * k / t / 1e12
        print(f"| {layer} {n}x{k} | {m} | {name} | {t * 1e6:.1f} | {tflops:.0f} | {clk:.0f} | {pw:.0f} | "
              f"{tflops / (clk / 1e3):.0f} | {len(smp)} | {reasons} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
