"""The GPU benchmarks' parts that run on CPU: `qerl bench rollout --disable`, `benchmarks/wgmma_ws_ab.py` and
`benchmarks/ws_clocks.py` refuse what they cannot run before looking for a GPU (ws_clocks also parses nvidia-smi's
samples), and `benchmarks/compile_wgmma_ws.py` compiles the kernel offline and rewrites its setmaxnreg counts."""

import importlib.util
import re
from pathlib import Path

import pytest

from qerl.bench.rollout import main as rollout_main

ROOT = Path(__file__).resolve().parents[1]


def _bench(name: str):
    """benchmarks/NAME.py as a module (the scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_rollout_refuses_an_unknown_backend_to_disable(capsys):
    with pytest.raises(SystemExit) as e:
        rollout_main(["--disable", "gluon_wgmma_ws,no_such_kernel"])
    assert e.value.code == 2
    assert "unknown backends ['no_such_kernel']" in capsys.readouterr().err


def test_ws_ab_parses_tiles_and_refuses_unknown_layers(capsys):
    ab = _bench("wgmma_ws_ab")
    a = ab._args(["--configs", "256,64,3,232 128,64,4,200", "--ms", "256,1024", "--no-decode",
                  "--layers", "gate_up,down_72b"])
    assert a.configs == [(256, 64, 3, 232), (128, 64, 4, 200)] and a.ms == [256, 1024]
    names = [v[0] for v in ab._variants(a)]
    assert names == ["routed", "WS BM256 NS3 w1", "WS BM256 NS3 no-decode w1", "WS BM128 NS4 w1",
                     "WS BM128 NS4 no-decode w1"]
    with pytest.raises(SystemExit):
        ab._args(["--layers", "gate_up,lm_head"])
    assert "unknown layers ['lm_head']" in capsys.readouterr().err


def test_ws_kernel_compiles_for_sm90_without_a_gpu(capsys):
    """`benchmarks/compile_wgmma_ws.py` (the source of the docs' register and SASS figures) builds the routed
    tile with this Triton and its ptxas: no spills, one wgmma wait per step in the consumer loop."""
    pytest.importorskip("triton.experimental.gluon")
    mod = _bench("compile_wgmma_ws")
    assert mod.main(["BM=256", "NS=3"]) == 0
    out = capsys.readouterr().out
    assert " 0 bytes spilled" in out and "384 threads" in out
    assert "8 HGMMA, 1 WARPGROUP.DEPBAR" in out, out


def test_setmaxnreg_floor_raises_only_the_low_counts():
    """The diagnostic behind the docs' finding that ptxas serializes the wgmma pipeline when any warpgroup's
    `setmaxnreg` is below its accumulator + in-flight A registers: only counts below the floor change."""
    mod = _bench("compile_wgmma_ws")
    ptx = ("\tsetmaxnreg.inc.sync.aligned.u32 \t256;\n\tsetmaxnreg.dec.sync.aligned.u32 \t40;\n"
           "\tsetmaxnreg.dec.sync.aligned.u32 \t120;\n\tsetmaxnreg.inc.sync.aligned.u32 \t232;\n")
    out, n = mod.raise_setmaxnreg(ptx, 128)
    assert n == 2
    assert [int(v) for v in re.findall(r"u32\s+(\d+);", out)] == [256, 128, 128, 232]
    assert mod.raise_setmaxnreg(ptx, 0) == (ptx, 0)


def test_ws_clocks_parses_nvidia_smi_samples_and_its_arguments(capsys):
    mod = _bench("ws_clocks")
    text = ("2026/11/25 15:46:01.100, 1380, 698.51, 61, 0x0000000000000004\n"
            "2026/11/25 15:46:01.200, [N/A], 698.00, 61, 0x0000000000000004\n"
            "2026/11/25 15:46:01.300, 1770, 699.10, 62, 0x00000000000000")
    rows = mod.parse_samples(text)
    assert [(r[1], r[2], r[4]) for r in rows] == [(1380.0, 698.51, "0x0000000000000004"),
                                                   (1770.0, 699.1, "0x00000000000000")]
    assert rows[1][0] - rows[0][0] == pytest.approx(0.2)
    a = mod._args(["--m", "1024,4096", "--layers", "gate_up"])
    assert a.m == [1024, 4096] and a.layers == ["gate_up"]
    with pytest.raises(SystemExit):
        mod._args(["--m", "0"])
    with pytest.raises(SystemExit):
        mod._args(["--layers", "lm_head"])
    assert "unknown layers ['lm_head']" in capsys.readouterr().err


@pytest.mark.parametrize("m,k", [(64, 3584), (128, 3584), (256, 3584), (256, 18944)])
def test_grad_input_kernel_compiles_for_sm90_without_a_gpu(capsys, m, k):
    """Each tile `gluon_nvfp4_grad_input.pick_config` routes to builds with this Triton and its ptxas: no spills,
    the step's wgmmas waited once (not serialized)."""
    pytest.importorskip("triton.experimental.gluon")
    from qerl.kernels.gluon_nvfp4_grad_input import pick_config

    bm, bnr, ns, nc, cregs = pick_config(m, k)
    mod = _bench("compile_wgmma_ws")
    assert mod.main(["--kernel", "grad_input", f"BM={bm}", f"BNR={bnr}", f"NS={ns}", f"NC={nc}", f"CREGS={cregs}"]) == 0
    out = capsys.readouterr().out
    assert " 0 bytes spilled" in out and f"{(4 * nc + 4) * 32} threads" in out, out
    assert f"{bnr // 16} HGMMA, 1 WARPGROUP.DEPBAR" in out, out


def test_grad_input_ab_parses_tiles_and_refuses_bad_ones(capsys):
    ab = _bench("grad_input_ab")
    a = ab._args(["--configs", "64,64,4,4,112 256,128,3,2,232", "--ms", "128,512", "--layers", "gate_up,down_72b"])
    assert a.configs == [(64, 64, 4, 4, 112), (256, 128, 3, 2, 232)] and a.ms == [128, 512]
    assert [v[0] for v in ab._variants(a)] == ["routed", "deq+cuBLAS", "kernel BM64 BNR64 NS4 NC4 w1",
                                               "kernel BM256 BNR128 NS3 NC2 w1"]
    with pytest.raises(SystemExit):
        ab._args(["--configs", "256,64,4,232"])
    assert "each config is BM,BNR,NS,NC,CREGS" in capsys.readouterr().err
