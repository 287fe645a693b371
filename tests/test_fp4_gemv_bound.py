"""benchmarks/fp4_gemv_bound.py on the CPU: the bytes it charges a product are the NVFP4 tensors' own, its SASS
reader counts opcodes (predicated ones too) and finds the K loop, the decode kernel compiles here for sm_90 (Triton's
own ptxas) with the instruction mix its design says, and without a GPU it stops with a clear message."""

import pytest
import torch
from bench_scripts import load_benchmark

from qerl.formats.nvfp4 import quantize_nvfp4


def test_the_bytes_charged_are_the_stored_weight_and_scales():
    bound = load_benchmark("fp4_gemv_bound")
    w = torch.randn(48, 256)
    q = quantize_nvfp4(w)
    stored = q["weight_packed"].numel() * q["weight_packed"].element_size() + q["weight_scale"].numel()
    assert bound.fp4_bytes(48, 256) == stored


def test_the_sass_reader_counts_opcodes_and_finds_the_loop():
    bound = load_benchmark("fp4_gemv_bound")
    sass = ("        /*0070*/                   IMAD.MOV.U32 R1, RZ, RZ, c[0x0][0x28] ;\n"
            "        /*0080*/              @!P0 LOP3.LUT R2, R3, 0xf000f, RZ, 0xc0, !PT ;\n"
            "        /*0090*/                   HMUL2 R4, R2, R5 ;\n"
            "        /*00a0*/               @P1 BRA 0x80 ;\n"
            "        /*00b0*/                   BRA 0x70 ;\n"
            "        /*00c0*/                   EXIT ;\n")
    assert [m.group(2).split(".")[0] for m in bound.SASS_INS.finditer(sass)] == [
        "IMAD", "LOP3", "HMUL2", "BRA", "BRA", "EXIT"]
    assert bound.main_loop(sass) == ["IMAD.MOV.U32", "LOP3.LUT", "HMUL2", "BRA", "BRA"]  # the longer of two loops
    assert bound.main_loop("        /*0070*/                   EXIT ;\n") == []


def test_the_decode_kernel_compiles_here_with_its_designed_loop():
    """The 1-row q/k/v product of a 7B model, as the route sends it on an H100/H200: one K tile per iteration is
    64 weight rows x 256 columns, so per thread 128 weights, 16 mma.sync, 64 packed bf16 multiplies (the decode's
    scaling, two weights each) and 4 E4M3-pair converts (8 scales); no subnormal-prone fp32 path."""
    pytest.importorskip("triton.experimental.gluon._runtime", reason="a Triton without Gluon's compile entry")
    bound = load_benchmark("fp4_gemv_bound")
    form, weights, sass = bound.offline_sass(1, 4608, 3584)
    ops = bound.main_loop(sass)
    count = {op: sum(o == op for o in ops) for op in set(ops)}
    assert form == "gluon_mma" and weights == 128
    assert count["HMMA.16816.F32.BF16"] == 16 and count["HMUL2.BF16_V2"] == 64
    assert count["F2FP.F16.E4M3.UNPACK_B"] == 4
    assert 2.0 < len(ops) / weights < 4.0, f"{len(ops)} instructions for {weights} weights"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without a GPU gets")
def test_without_a_gpu_it_says_so(capsys):
    with pytest.raises(SystemExit) as e:
        load_benchmark("fp4_gemv_bound").main([])
    assert e.value.code == 2 and "needs a CUDA GPU" in capsys.readouterr().err
