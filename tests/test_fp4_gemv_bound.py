"""benchmarks/fp4_gemv_bound.py on the CPU: the bytes it charges a product are the NVFP4 tensors' own, its SASS
reader counts opcodes (predicated ones too), and without a GPU it stops with a clear message."""

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


def test_the_sass_reader_counts_opcodes():
    bound = load_benchmark("fp4_gemv_bound")
    sass = ("        /*0070*/                   IMAD.MOV.U32 R1, RZ, RZ, c[0x0][0x28] ;\n"
            "        /*0080*/              @!P0 LOP3.LUT R2, R3, 0xf000f, RZ, 0xc0, !PT ;\n"
            "        /*0090*/                   HMUL2 R4, R2, R5 ;\n")
    assert [m.group(1).split(".")[0] for m in bound.SASS_OP.finditer(sass)] == ["IMAD", "LOP3", "HMUL2"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without a GPU gets")
def test_without_a_gpu_it_says_so(capsys):
    with pytest.raises(SystemExit) as e:
        load_benchmark("fp4_gemv_bound").main([])
    assert e.value.code == 2 and "needs a CUDA GPU" in capsys.readouterr().err
