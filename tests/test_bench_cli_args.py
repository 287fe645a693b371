"""The GPU benchmarks' parts that run on CPU: `qerl bench rollout --disable`, `qerl bench step` / `rollout` flags,
`benchmarks/train_speed.py`, the kernel shapes, and `experiments/compile_wgmma_ws.py`, which compiles the kernels
offline and rewrites their setmaxnreg counts."""

import json
import re

import pytest

from qerl.bench.rollout import main as rollout_main

from bench_scripts import load_benchmark as _bench
from bench_scripts import load_experiment


def test_rollout_refuses_an_unknown_backend_to_disable(capsys):
    with pytest.raises(SystemExit) as e:
        rollout_main(["--disable", "gluon_wgmma_ws,no_such_kernel"])
    assert e.value.code == 2
    assert "unknown backends ['no_such_kernel']" in capsys.readouterr().err


def test_ws_kernel_compiles_for_sm90_without_a_gpu(capsys):
    """`experiments/compile_wgmma_ws.py` (the source of the docs' register and SASS figures) builds the routed
    tile with this Triton and its ptxas: no spills, one wgmma wait per step in the consumer loop."""
    pytest.importorskip("triton.experimental.gluon")
    mod = load_experiment("compile_wgmma_ws")
    assert mod.main(["BM=256", "NS=3"]) == 0
    out = capsys.readouterr().out
    assert " 0 bytes spilled" in out and "384 threads" in out
    assert "8 HGMMA, 1 WARPGROUP.DEPBAR" in out, out


def test_setmaxnreg_floor_raises_only_the_low_counts():
    """The diagnostic behind the docs' finding that ptxas serializes the wgmma pipeline when any warpgroup's
    `setmaxnreg` is below its accumulator + in-flight A registers: only counts below the floor change."""
    mod = load_experiment("compile_wgmma_ws")
    ptx = ("\tsetmaxnreg.inc.sync.aligned.u32 \t256;\n\tsetmaxnreg.dec.sync.aligned.u32 \t40;\n"
           "\tsetmaxnreg.dec.sync.aligned.u32 \t120;\n\tsetmaxnreg.inc.sync.aligned.u32 \t232;\n")
    out, n = mod.raise_setmaxnreg(ptx, 128)
    assert n == 2
    assert [int(v) for v in re.findall(r"u32\s+(\d+);", out)] == [256, 128, 128, 232]
    assert mod.raise_setmaxnreg(ptx, 0) == (ptx, 0)


@pytest.mark.parametrize("m,k", [(64, 3584), (128, 3584), (256, 3584), (256, 18944)])
def test_grad_input_kernel_compiles_for_sm90_without_a_gpu(capsys, m, k):
    """Each tile `gluon.nvfp4_grad_input.pick_config` routes to builds with this Triton and its ptxas: no spills,
    the step's wgmmas waited once (not serialized)."""
    pytest.importorskip("triton.experimental.gluon")
    from qerl.kernels.gluon.nvfp4_grad_input import pick_config

    bm, bnr, ns, nc, cregs = pick_config(m, k)
    mod = load_experiment("compile_wgmma_ws")
    assert mod.main(["--kernel", "grad_input", f"BM={bm}", f"BNR={bnr}", f"NS={ns}", f"NC={nc}", f"CREGS={cregs}"]) == 0
    out = capsys.readouterr().out
    assert " 0 bytes spilled" in out and f"{(4 * nc + 4) * 32} threads" in out, out
    assert f"{bnr // 16} HGMMA, 1 WARPGROUP.DEPBAR" in out, out


# --lengths / --schedulers / --packing / --modes (qerl bench step, qerl bench rollout) ----------------------


def _profile_file(tmp_path, text="# max_new_tokens: 100\n10\n20\n30\n100\n"):
    path = tmp_path / "lens.txt"
    path.write_text(text)
    return str(path)


def test_step_modes_are_the_product_of_schedulers_and_packing_or_the_named_pair():
    from qerl.bench.step import parse_args

    _, a = parse_args([])
    assert a.modes == [("continuous", True)] and a.completion == 2048 == a.budget and a.profile is None
    assert a.max_tokens_per_micro_batch is None  # chosen per model as qerl train does (token_budget)
    _, a = parse_args(["--schedulers", "continuous,static", "--packing", "on,off"])
    assert a.modes == [("continuous", True), ("continuous", False), ("static", True), ("static", False)]
    _, a = parse_args(["--modes", "new,old", "--max-tokens-per-micro-batch", "4096"])
    assert a.modes == [("continuous", True), ("static", False)] and a.max_tokens_per_micro_batch == 4096


@pytest.mark.parametrize("argv,message", [
    (["--modes", "new,old", "--packing", "off"], "--modes replaces --schedulers and --packing"),
    (["--modes", "newest"], "--modes 'newest'"),
    (["--modes", "new,new"], "--modes 'new,new'"),
    (["--schedulers", "greedy"], "--schedulers 'greedy'"),
    (["--packing", "yes"], "--packing 'yes'"),
    (["--lengths", "no-such-profile"], "neither a file nor a named length profile"),
    (["--completion", "0"], "--completion must be >= 1"),
])
def test_step_refuses_bad_mode_and_length_flags(capsys, argv, message):
    from qerl.bench.step import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_step_lengths_take_the_profiles_budget_and_exclude_completion(tmp_path, capsys):
    from qerl.bench.step import parse_args

    _, a = parse_args(["--lengths", _profile_file(tmp_path), "--max-tokens-per-micro-batch", "600"])
    assert a.budget == 100 and a.completion is None and a.profile.lengths == (10, 20, 30, 100)
    assert a.max_tokens_per_micro_batch == 600
    with pytest.raises(SystemExit):
        parse_args(["--lengths", _profile_file(tmp_path), "--completion", "512"])
    assert "give one of them" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--lengths", _profile_file(tmp_path, "12\nlots\n")])
    assert "line 2 is not an int" in capsys.readouterr().err


def test_rollout_lengths_flags(tmp_path, capsys):
    from qerl.bench.rollout import parse_args

    _, a = parse_args([])
    assert a.new == 512 == a.budget and a.schedulers == ["continuous"] and a.profile is None
    _, a = parse_args(["--variants", "bf16+lora,nvfp4+lora", "--batches", "16,64", "--group", "8", "--lengths",
                       _profile_file(tmp_path), "--schedulers", "static,continuous"])
    assert a.budget == 100 and a.schedulers == ["static", "continuous"] and a.new is None
    for argv, message in [
        (["--lengths", _profile_file(tmp_path)], "HF generate cannot force per-row lengths"),
        (["--variants", "bf16", "--batches", "12", "--lengths", _profile_file(tmp_path)], "multiples of --group (8)"),
        (["--variants", "bf16", "--new", "64", "--lengths", _profile_file(tmp_path)], "give one of them"),
        (["--schedulers", "continuous,continuous"], "--schedulers 'continuous,continuous'"),
        (["--new", "1"], "--new must be >= 2"),
    ]:
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert message in capsys.readouterr().err


def test_qerl_bench_passes_the_new_flags_through():
    from qerl.cli import build_parser

    args = build_parser().parse_args(["bench", "step", "--lengths", "long-reasoning-4096", "--modes", "new,old"])
    assert args.what == "step" and args.rest == ["--lengths", "long-reasoning-4096", "--modes", "new,old"]


def _rollout_row(**kw):
    row = dict(model="7b", variant="nvfp4+lora", batch=16, quantized_embeddings=False, policy_gb=6.0, seconds=10.0,
               kept_tok_s=1000.0, tok_s=2000.0, rollout_efficiency=2.0, peak_gb=20.0, scheduler="static")
    return dict(row, **kw)


def test_rollout_profile_table_gives_kept_and_decoded_rates_and_the_speedup_over_static(tmp_path):
    from qerl.data.length_profiles import read_profile
    from qerl.bench.rollout import parse_args, profile_table

    _, args = parse_args(["--variants", "nvfp4+lora", "--batches", "16", "--lengths", _profile_file(tmp_path),
                          "--schedulers", "continuous,static"])
    rows = [_rollout_row(scheduler="continuous", seconds=4.0, kept_tok_s=2500.0, tok_s=2600.0, rollout_efficiency=1.04),
            _rollout_row(), _rollout_row(batch=64, error="out of memory", scheduler="continuous,static")]
    text = profile_table(rows, "cpu", args)
    assert "| 7b | nvfp4+lora | continuous | 16 (2 x 8) | 4.00 | 2500 | 2600 | 1.04 | 2.50x | 20.0 | 6.00 |" in text
    assert "| 7b | nvfp4+lora | static | 16 (2 x 8) | 10.00 | 1000 | 2000 | 2.00 | - |" in text
    assert "out of memory" in text and "lens (max 100): 4 rows" in text
    assert read_profile(args.lengths).source in text


class _FakeEngine:
    """What bench_profile calls on the engine, recording each generate's (scheduler, lengths)."""

    class model:
        class config:
            vocab_size = 5000

    def __init__(self):
        self.calls = []

    def warmup(self, batch, max_len):
        self.calls.append(("warmup", batch, max_len))

    def generate(self, rows, max_new_tokens, sampling, seed=None, ignore_eos=False, force_lengths=None,
                 scheduler=None):
        import types

        self.calls.append((scheduler, max_new_tokens, tuple(force_lengths)))
        decoded = len(rows) * max(force_lengths) if scheduler == "static" else sum(force_lengths)
        return types.SimpleNamespace(stats=dict(kept_tokens=sum(force_lengths), decoded_row_steps=decoded,
                                                prefill_tokens=len(rows) // 8 * 256))


def test_rollout_profile_bench_alternates_schedulers_on_the_same_draws(tmp_path, monkeypatch):
    """The timing (CUDA) is stubbed: one second per rollout; the rest is the benchmark's own logic."""
    import torch

    import qerl.bench.rollout as rollout
    from qerl.data.length_profiles import draw

    monkeypatch.setattr(rollout, "timed", lambda fn: (fn(), 1.0)[1])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 3e9)
    _, args = rollout.parse_args(["--variants", "bf16", "--batches", "16", "--lengths", _profile_file(tmp_path),
                                  "--repeats", "3", "--seed", "7"])
    engine = _FakeEngine()
    out = rollout.bench_profile(engine, 16, args, ["continuous", "static"])
    assert engine.calls[0] == ("warmup", 16, 256 + 100)
    assert engine.calls[1:3] == [("continuous", 100, (2,) * 16), ("static", 100, (2,) * 16)]  # untimed
    timed_calls = engine.calls[3:]
    assert [c[0] for c in timed_calls] == ["continuous", "static", "static", "continuous", "continuous", "static"]
    for rep in range(3):
        drawn = tuple(draw(args.profile, 16, 8, 7 + rep))
        assert timed_calls[2 * rep][2] == timed_calls[2 * rep + 1][2] == drawn
    assert out["continuous"]["rollout_efficiency"] == 1.0 and out["static"]["rollout_efficiency"] > 1.0
    assert out["static"]["repeats"] == 3 and out["static"]["peak_gb"] == 3.0 and out["static"]["seconds"] == 1.0


def test_train_speed_arms_and_summaries_of_earlier_runs(tmp_path, capsys):
    ts = _bench("train_speed")
    assert ts.arm_overrides("nvfp4+aqn+dense:new") == {"model.format": "nvfp4", "aqn.enabled": True,
                                                        "model.dense_weights": "update"}
    assert ts.arm_overrides("nf4+denseall:old")["model.dense_weights"] == "all"
    for bad in ("nvfp4+dense+denseall:new", "nvfp4+fast:new", "nvfp4:newer"):
        with pytest.raises(ValueError):
            ts.arm_overrides(bad)
    step = dict(time_step=3.0, time_rollout=1.0, time_update=2.0, time_generate=0.5, rollout_decoded_row_steps=1000,
                loss_tokens_computed=4000, rollout_rows_per_kept=1.2, loss_tokens_per_needed=1.0, reward=0.5,
                response_length=100, memory_gb=8.0)
    rows = [dict(step, time_step=20.0), dict(step, time_update=1.0, loss_tokens_computed=1000), step]
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert ts.main(["--metrics", f"nvfp4+aqn:new={path}", "--device", "H200"]) == 0
    out = capsys.readouterr().out
    # steps 2-3: medians 3.0 s; update ms per 1k loss tokens (1 + 2) s / 5000 tokens = 600; decode 500 us
    assert "device: H200" in out and "| nvfp4+aqn:new | 3.00 | - | 1.00 | 1.50 | 600.0 | 500.0 |" in out


def test_kernel_shapes_are_the_linears_of_the_models_the_step_benchmark_builds():
    # `qerl bench kernels --models 1.5B` must time the linears `qerl bench step --models 1.5b` runs
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from qerl.bench.kernels import MODEL_SHAPES, layer_shapes
    from qerl.models.shapes import QWEN25, SMOLLM2_135M, qwen25_config

    configs = {size.upper(): qwen25_config(size, layers=1) for size in QWEN25}
    configs["SmolLM2"] = LlamaConfig(**dict(SMOLLM2_135M, num_hidden_layers=1))
    assert list(configs) == list(MODEL_SHAPES)
    for name, cfg in configs.items():
        with torch.device("meta"):
            layer = AutoModelForCausalLM.from_config(cfg).model.layers[0]
        attn, mlp = layer.self_attn, layer.mlp
        qkv = sum(m.out_features for m in (attn.q_proj, attn.k_proj, attn.v_proj))
        assert layer_shapes(name) == {"qkv": (qkv, attn.q_proj.in_features), "o": tuple(attn.o_proj.weight.shape),
                                      "gate_up": (2 * mlp.gate_proj.out_features, mlp.gate_proj.in_features),
                                      "down": tuple(mlp.down_proj.weight.shape)}, name


def test_kernel_policy_overrides_from_the_command_line(capsys):
    from qerl.bench.step import args_json, parse_args as step_args
    from qerl.kernels.route import KernelPolicy, kernel_policy, parse_policy_overrides, route

    got = parse_policy_overrides("permute_x=false, wgmma_max_m=64,triton=none,disabled=gluon_mma+gluon_wgmma_ws")
    assert got == {"permute_x": False, "wgmma_max_m": 64, "triton": None,
                   "disabled": frozenset({"gluon_mma", "gluon_wgmma_ws"})}
    assert parse_policy_overrides("") == {}
    assert parse_policy_overrides("compute=FP8") == {"compute": "fp8"}  # model.compute for a benchmark's products
    # the overrides change what routes where: the 1.5B qkv weight at 128 decode rows
    assert route("nvfp4", 128, 2048, 1536, (9, 0), lora_r=32) == "gluon_wgmma"
    with kernel_policy(**parse_policy_overrides("permute_x=true")):
        assert route("nvfp4", 128, 2048, 1536, (9, 0), lora_r=32) == "gluon_wgmma_xp"
    with kernel_policy(**parse_policy_overrides("permute_x_min_weight=0")):  # the earlier rule
        assert route("nvfp4", 128, 2048, 1536, (9, 0), lora_r=32) == "gluon_wgmma_xp"
    with kernel_policy(**parse_policy_overrides("wgmma_max_m=64")):
        assert route("nvfp4", 128, 2048, 1536, (9, 0), lora_r=32) == "triton_dequantize"
    for bad, message in (("permute_x", "expected FIELD=VALUE"), ("no_such=1", "expected FIELD=VALUE"),
                         ("wgmma_max_m=big", "expected an integer"), ("grad_input_no_temporary=none", "true or false"),
                         ("disabled=gluon_mma+nope", "unknown backends ['nope']"),
                         ("compute=fp4", "expected one of bf16, fp8")):
        with pytest.raises(ValueError, match=re.escape(message)):
            parse_policy_overrides(bad)
    assert set(KernelPolicy.__dataclass_fields__) >= set(got)
    # both benchmarks take it, refuse a bad one before looking for a GPU, and record it
    ap, args = step_args(["--policy", "permute_x=false"])
    assert args.policy == {"permute_x": False} and args_json(args)["policy"] == {"permute_x": False}
    with pytest.raises(SystemExit):
        step_args(["--policy", "permute_x=maybe"])
    with pytest.raises(SystemExit) as e:
        rollout_main(["--policy", "wgmma_max_m=x"])
    assert e.value.code == 2 and "expected an integer" in capsys.readouterr().err
