"""benchmarks/decode_fuse_ab.py on the CPU: its settings parse to the decode_profile switches (bad names refused),
the summary takes the median per setting against the first one, and without a GPU it stops with a clear message."""

import pytest
from bench_scripts import load_benchmark

from qerl.bench.decode_profile import FUSE_FLAGS


def test_settings_parse_to_switches_and_refuse_unknown_names():
    ab = load_benchmark("decode_fuse_ab")
    got = ab.parse_settings("default; COMBINE=1,LORA_A_O=0 ;", FUSE_FLAGS)
    assert got == [("default", {}), ("COMBINE=1,LORA_A_O=0", {"COMBINE": True, "LORA_A_O": False})]
    for bad in ("NOPE=1", "COMBINE=2", "COMBINE", ";"):
        with pytest.raises(SystemExit):
            ab.parse_settings(bad, FUSE_FLAGS)


def test_summary_is_the_median_per_setting_against_the_first():
    ab = load_benchmark("decode_fuse_ab")
    cells = [dict(model="7b", rows=1, setting=s, step_pdl=t, calls=c)
             for s, t, c in (("default", 100, 348), ("default", 104, 348), ("default", 300, 348),
                             ("X=1", 90, 320), ("X=1", 92, 320))]
    table = ab.summary_table(cells, ["default", "X=1"]).splitlines()
    assert table[2] == "| 7b | 1 | default | 104.0 | 1.000 | 348 |"
    assert table[3] == "| 7b | 1 | X=1 | 91.0 | 0.875 | 320 |"


def test_without_a_gpu_it_says_so(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the message is for machines without one")
    ab = load_benchmark("decode_fuse_ab")
    with pytest.raises(SystemExit):
        ab.main(["--models", "1.5b"])
    assert "needs a CUDA GPU" in capsys.readouterr().err
