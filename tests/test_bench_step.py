"""The end-to-end step benchmark's pieces on CPU: layer-by-layer random model build, one full RL step
(rollout, reference, loss + backward, optimizer) with per-phase timings in forced-length and length-profile
modes, counterbalanced rounds over variants x modes, the table with OOM rows and the new columns.

The step calls two APIs that are being built beside this benchmark: `RolloutEngine.generate(force_lengths=...)`
with `Rollout.stats` and a `scheduler` attribute, and `UpdateSettings(packing=..., max_tokens_per_micro_batch=...)`
with `policy_update` returning loss_tokens_computed / loss_tokens_needed. The `apis` fixture uses them when
they exist and otherwise stands in for them (`Forcing`, `PackingSettings`, `packing_update`) on the real engine
and update, so the benchmark's own logic is tested either way; `test_the_real_apis_are_used_once_they_exist`
skips until both exist.
"""

import dataclasses
import inspect

import pytest
import torch
from transformers import Qwen2Config

import qerl.rl.update as update_module
import qerl.rollout.engine as engine_module
from qerl.bench.step import StepRunner, ceiling_table, parse_args, table
from qerl.models import Quantization
from qerl.models.random_weights import random_policy
from qerl.nn import LoraConfig, QuantLinear
from qerl.rl.distributed import DistContext


def build_random_policy(config, fmt, lora_r, device):
    """The random-weight policy the bench builds (`qerl.models.random_weights`), for a config of any size."""
    return random_policy(config, Quantization.of(fmt, lora=LoraConfig(r=lora_r, alpha=2 * lora_r)), device)


ENGINE_READY = "force_lengths" in inspect.signature(engine_module.RolloutEngine.generate).parameters
UPDATE_READY = "packing" in {f.name for f in dataclasses.fields(update_module.UpdateSettings)}
RealEngine, RealSettings, real_update = (engine_module.RolloutEngine, update_module.UpdateSettings,
                                         update_module.policy_update)


class Forcing(RealEngine):
    """Stand-in for the engine API: `scheduler` is recorded, `force_lengths` runs the real engine for
    max(force_lengths) tokens and cuts each row to its length; stats as a static batch decodes them."""

    calls: list = []  # (scheduler, max_new_tokens, force_lengths) of every generate, shared by the instances

    def generate(self, prompts, max_new_tokens, sampling=None, seed=None, stop=(), ignore_eos=False,
                 attention_mask=None, generator=None, aqn=None, force_lengths=None, scheduler=None):
        Forcing.calls.append((scheduler, max_new_tokens, None if force_lengths is None else list(force_lengths)))
        steps = max_new_tokens if force_lengths is None else max(force_lengths)
        r = super().generate(prompts, steps, sampling, seed, stop, ignore_eos, attention_mask, generator, aqn)
        if force_lengths is not None:
            keep = torch.arange(r.completion_mask.shape[1]) < torch.tensor(force_lengths)[:, None]
            r.completion_mask = r.completion_mask & keep.to(r.completion_mask.device)
            r.logprobs, r.entropies = r.logprobs * r.completion_mask, r.entropies * r.completion_mask
        r.stats = dict(decoded_row_steps=len(r.completion_mask) * steps, kept_tokens=int(r.completion_mask.sum()),
                       prefill_tokens=int(r.prompt_mask.sum()))
        return r


@dataclasses.dataclass(frozen=True)
class PackingSettings(RealSettings):
    """Stand-in for the update settings' packing fields."""

    packing: bool = True
    max_tokens_per_micro_batch: int = 4096


def packing_update(model, exp, optimizer, params, settings, **kw):
    """The real update (padded micro-batches) plus stand-in token counts: needed = prompt + completion tokens,
    computed = those when packing, else every padded position."""
    real = RealSettings(**{f.name: getattr(settings, f.name) for f in dataclasses.fields(RealSettings)})
    out = real_update(model, exp, optimizer, params, real, **kw)
    needed = int(exp.prompt_mask.sum() + exp.completion_mask.sum())
    padded = exp.prompt_ids.numel() + exp.completion_ids.numel()
    return dict(out, loss_tokens_needed=needed, loss_tokens_computed=needed if settings.packing else padded)


@pytest.fixture
def apis(monkeypatch):
    """The engine / update APIs the step uses: the real ones where they exist, the stand-ins otherwise."""
    Forcing.calls.clear()
    if not ENGINE_READY:
        monkeypatch.setattr(engine_module, "RolloutEngine", Forcing)
    if not UPDATE_READY:
        monkeypatch.setattr(update_module, "UpdateSettings", PackingSettings)
        monkeypatch.setattr(update_module, "policy_update", packing_update)


def _args(*extra):
    """Tiny-model step arguments (prompt 5, G 2, micro-batch 3, forced completion 6 unless --lengths)."""
    base = ["--models", "7b", "--prompt", "5", "--group", "2", "--micro-batch", "3", "--warmup-completion", "3"]
    if "--lengths" not in extra and "--completion" not in extra:
        base += ["--completion", "6"]
    return parse_args(base + list(extra))[1]

TINY = dict(vocab_size=1200, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False, pad_token_id=0,
            eos_token_id=1)


@pytest.mark.parametrize("fmt", ["nvfp4", "bf16"])
def test_random_policy_is_quantized_layer_by_layer_and_finite(fmt):
    model = build_random_policy(Qwen2Config(**TINY), fmt, lora_r=4, device=torch.device("cpu"))
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 2 * 7 and all(m.weight_format == fmt for m in layers)
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    logits = model(torch.randint(0, 1000, (2, 7))).logits
    assert torch.isfinite(logits).all() and logits.float().std() > 0


def test_one_step_runs_every_phase_and_moves_the_adapter(apis):
    model = build_random_policy(Qwen2Config(**TINY), "nvfp4", lora_r=4, device=torch.device("cpu"))
    runner = StepRunner(model, _args(), DistContext(), sigma=1e-2)
    before = [p.detach().clone() for p in runner.params]
    t = runner.step(prompts=2, completion=6)
    assert {"rollout", "reference", "loss_backward", "optimizer", "step"} <= set(t)
    assert t["tokens"] == 2 * 2 * 6 and t["step"] >= t["rollout"] > 0
    assert t["decoded_row_steps"] >= t["tokens"] and t["rollout_efficiency"] >= 1.0
    assert t["loss_tokens_computed"] >= t["loss_tokens_needed"] >= t["tokens"]
    assert t["kept_tok_s"] == pytest.approx(t["tokens"] / t["step"])
    # the update's useful FLOPs (qerl.rl.flops, tested in test_flops) per second of the update
    assert t["update_flops"] > 0 and "busy" not in t
    assert t["update_tflops"] == pytest.approx(t["update_flops"] / (t["step"] - t["rollout"]) / 1e12)
    assert any(not torch.equal(a, b) for a, b in zip(before, runner.params))
    assert runner.engine.cache is None  # freed for the backward


def test_a_w4a8_step_runs_rollout_and_update_on_fp8_compute(apis):
    """+w4a8 (model.compute fp8): the layers hold the routing (the step also runs inside it, for the rollout; that the
    engine then samples the loss pass's policy is tests/test_fp8_compute.py's)."""
    model = build_random_policy(Qwen2Config(**TINY), "nvfp4", lora_r=4, device=torch.device("cpu"))
    runner = StepRunner(model, _args(), DistContext(), sigma=0.0, compute="fp8")
    assert runner.routing.compute == "fp8"
    assert all(m.routing_policy is runner.routing for m in model.modules() if hasattr(m, "routing_policy"))
    t = runner.step(prompts=2, completion=6)
    assert t["tokens"] == 2 * 2 * 6 and t["update_flops"] > 0


@pytest.mark.parametrize("dense", ["update", "all"])
def test_a_step_with_dense_weight_copies_keeps_them_and_counts_them_resident(apis, dense):
    model = build_random_policy(Qwen2Config(**TINY), "nvfp4", lora_r=4, device=torch.device("cpu"))
    runner = StepRunner(model, _args(), DistContext(), sigma=0.0, dense_weights=dense)
    runner.step(prompts=2, completion=6)
    store = runner.dense_store
    assert store  # made by the loss pass (and, with all, the rollout)
    assert (runner.engine.dense_weights is store) == (dense == "all")
    copies = sum(w.numel() * w.element_size() for _, w in store.values())
    with_copies = runner.resident_bytes()
    runner.dense_store = None
    assert with_copies - runner.resident_bytes() == copies  # every copy counted, once


def test_a_profile_step_forces_each_row_and_counts_only_kept_tokens(apis, tmp_path):
    """--lengths: the rollout gets the budget as max_new_tokens and each row's length; kept tokens are their sum,
    the scheduler is the mode's."""
    (tmp_path / "p.txt").write_text("# max_new_tokens: 9\n2\n9\n4\n1\n")
    args = _args("--lengths", str(tmp_path / "p.txt"), "--packing", "off", "--schedulers", "static")
    model = build_random_policy(Qwen2Config(**TINY), "nvfp4", lora_r=4, device=torch.device("cpu"))
    runner = StepRunner(model, args, DistContext(), sigma=0.0)
    t = runner.step(prompts=2, completion=None, lengths=[2, 9, 4, 1], mode=("static", False))
    assert t["tokens"] == 16 and t["decoded_row_steps"] >= 16 and t["loss_tokens_needed"] >= 16
    if not ENGINE_READY:
        assert Forcing.calls == [("static", 9, [2, 9, 4, 1])]
        assert t["decoded_row_steps"] == 4 * 9 and t["rollout_efficiency"] == pytest.approx(36 / 16)
    if not UPDATE_READY:
        assert t["loss_tokens_needed"] == 4 * 5 + 16 and t["loss_tokens_computed"] == 4 * (5 + 9)  # padded
    with pytest.raises(ValueError, match="3 forced lengths for 4 rows"):
        runner.step(prompts=2, completion=None, lengths=[2, 9, 4])


_OK = dict(rollout=2.0, reference=0.5, loss_backward=1.0, optimizer=0.01, step=4.0, tokens=4096, peak_gb=30.0,
           weights_gb=15.0, world=1, model="7b", prompts=2, kept_tok_s=1024.0, rollout_efficiency=1.0,
           loss_efficiency=1.0, mode="continuous+packed")


def _cells(text: str, row: str) -> list[str]:
    """The cells of the table row that starts with `row`."""
    line = next(line for line in text.splitlines() if line.startswith(row))
    return [c.strip() for c in line.split("|")[1:-1]]


def test_table_marks_oom_and_speedup_vs_bf16():
    _, args = parse_args(["--models", "7b", "--variants", "bf16,nvfp4", "--prompts", "2"])
    rows = [dict(_OK, variant="bf16"), dict(_OK, variant="nvfp4", step=2.0),
            dict(model="7b", variant="nf4", prompts=2, world=1, error="OOM")]
    text = table(rows, "cpu", args)
    assert "| 7b | nvfp4 | continuous+packed | 2 x 8 |" in text and "2.00x" in text and "OOM" in text
    assert "lengths: forced lengths (2048)" in text


def test_table_gives_speedups_vs_the_old_mode_and_bf16_and_the_efficiency_columns():
    """Synthetic cells of a --modes new,old run: vs old compares a variant's two modes, vs bf16 two variants in one
    mode; kept tok/s, row-steps / kept and loss computed / needed are the cells' own values."""
    _, args = parse_args(["--variants", "bf16,nvfp4", "--prompts", "2", "--modes", "new,old"])
    new, old = "continuous+packed", "static+padded"
    rows = [dict(_OK, variant="bf16", mode=new, step=4.0), dict(_OK, variant="bf16", mode=old, step=6.0),
            dict(_OK, variant="nvfp4", mode=new, step=2.0, kept_tok_s=2048.0, rollout_efficiency=1.04,
                 loss_efficiency=1.1),
            dict(_OK, variant="nvfp4", mode=old, step=5.0, rollout_efficiency=2.71, loss_efficiency=2.5)]
    text = table(rows, "cpu", args)
    header = _cells(text, "| model |")
    cell = dict(zip(header, _cells(text, f"| 7b | nvfp4 | {new} |")))
    assert cell["vs old"] == "2.50x" and cell["vs bf16"] == "2.00x" and cell["kept tok/s"] == "2048"
    assert cell["row-steps / kept"] == "1.04" and cell["loss tokens computed / needed"] == "1.10"
    cell = dict(zip(header, _cells(text, f"| 7b | nvfp4 | {old} |")))
    assert cell["vs old"] == "-" and cell["vs bf16"] == "1.20x" and cell["row-steps / kept"] == "2.71"
    assert dict(zip(header, _cells(text, f"| 7b | bf16 | {new} |")))["vs old"] == "1.50x"


def test_table_gives_the_update_flops_and_the_busy_shares():
    """update TFLOP / TFLOP/s from the row's update_flops / update_tflops; the GPU-busy shares of a --busy row per
    phase ("-" for a phase that did not run, and for a row without them)."""
    _, args = parse_args(["--variants", "bf16,nvfp4", "--prompts", "2"])
    busy = {p: dict(wall_ms=100.0, busy_ms=b, share=b / 100.0) for p, b in (("rollout", 34.0), ("loss_backward", 71.5),
                                                                              ("optimizer", 10.0))}
    rows = [dict(_OK, variant="bf16", update_flops=1.8432e15, update_tflops=351.6),
            dict(_OK, variant="nvfp4", update_flops=3.7e14, update_tflops=150.2, busy=busy),
            dict(model="7b", variant="nf4", prompts=2, world=1, error="OOM")]
    text = table(rows, "cpu", args)
    header = _cells(text, "| model |")
    assert header[-3:] == ["update TFLOP", "update TFLOP/s", "GPU busy rollout / ref / loss"]
    cell = dict(zip(header, _cells(text, "| 7b | bf16 |")))
    got = (cell["update TFLOP"], cell["update TFLOP/s"], cell["GPU busy rollout / ref / loss"])
    assert got == ("1843.2", "352", "-")
    cell = dict(zip(header, _cells(text, "| 7b | nvfp4 |")))
    assert (cell["update TFLOP"], cell["update TFLOP/s"]) == ("370.0", "150")
    assert cell["GPU busy rollout / ref / loss"] == "34% / - / 72%"
    assert len(_cells(text, "| 7b | nf4 |")) == len(header)  # the OOM row keeps the columns
    assert "- | -" in table([dict(_OK, variant="bf16")], "cpu", args)  # a model the count does not know


def test_bad_variant_or_size_is_refused():
    for bad in ("fp6", "nvfp4+dense+denseall", "bf16+dense", "nvfp4+aqn+aqn", "nvfp4+fast", "nf4+w4a8",
                "bf16+w4a8", "nvfp4+dense+w4a8"):
        with pytest.raises(SystemExit):
            parse_args(["--variants", bad])
    _, args = parse_args(["--variants", "nvfp4+aqn+dense,nf4+denseall,mxfp4+aqn+w4a8,fp8"])
    assert args.variants == ["nvfp4+aqn+dense", "nf4+denseall", "mxfp4+aqn+w4a8", "fp8"]
    with pytest.raises(ValueError, match="unknown model size"):
        parse_args(["--models", "9b"])


def test_gradient_check_in_one_process_is_exact_and_reports_a_noise_floor(apis):
    """With one rank the 'distributed' gradient is the single-process one (error 0); the noise floor compares
    two micro-batch sizes of the same batch, which differ only by bf16 rounding."""
    from qerl.bench.step import check_distributed

    model = build_random_policy(Qwen2Config(**TINY), "nvfp4", lora_r=4, device=torch.device("cpu"))
    args = _args("--micro-batch", "4")
    runner = StepRunner(model, args, DistContext(), sigma=0.0)
    err, floor = check_distributed(runner, prompts=4)
    assert err == 0.0
    assert 0.0 <= floor < 0.05


class _Recorded(StepRunner):
    """A real runner that also notes, in a list shared by the runners, which variant stepped."""

    def __init__(self, name, log, *a, **kw):
        super().__init__(*a, **kw)
        self.name, self.log = name, log

    def step(self, prompts, completion, others_bytes=0, lengths=None, mode=("continuous", True)):
        self.log.append((self.name, completion if lengths is None else tuple(lengths), mode))
        return super().step(prompts, completion, others_bytes, lengths, mode)


def test_interleaved_rounds_alternate_the_order_and_report_each_order(apis):
    """Two resident variants: one warm-up step each, then counterbalanced rounds A B, B A per repetition; each row
    carries the median per rotation, and the table gives the speedup vs bf16 in every order."""
    from qerl.bench.step import time_cells

    _, args = parse_args(["--models", "7b", "--variants", "bf16,nvfp4", "--prompts", "2", "--steps", "2",
                          "--completion", "6", "--warmup-completion", "3", "--prompt", "5", "--group", "2",
                          "--micro-batch", "2", "--order", "interleaved"])
    assert parse_args(["--models", "7b"])[1].order == "sequential"  # the default: one policy at a time, as a run
    log, runners, cells = [], {}, {}
    for fmt in args.variants:
        model = build_random_policy(Qwen2Config(**TINY), fmt, lora_r=4, device=torch.device("cpu"))
        runners[fmt] = _Recorded(fmt, log, model, args, DistContext(), sigma=0.0)
        cells[fmt] = dict(model="7b", variant=fmt, world=1, weights_gb={"bf16": 15.6, "nvfp4": 6.2}[fmt])
    rows = time_cells(runners, cells, 2, args, DistContext())
    new = ("continuous", True)
    assert [(v, n) for v, n, _ in log] == [("bf16", 3), ("nvfp4", 3)] + [("bf16", 6), ("nvfp4", 6), ("nvfp4", 6),
                                                                         ("bf16", 6)] * 2
    assert all(m == new for _, _, m in log)
    for row in rows:
        assert row["orders"] == ["bf16,nvfp4", "nvfp4,bf16"] and row["steps_timed"] == 4
        assert len(row["step_by_order"]) == 2 and all(t > 0 for t in row["step_by_order"])
        assert [o for o, _ in row["step_samples"]] == [0, 1, 0, 1]
        assert row["step"] == sorted(t for _, t in row["step_samples"])[2]  # upper median of 4
    assert runners["nvfp4"].resident_bytes() > 0
    text = table(rows, "cpu", args)
    by_order = dict(zip(_cells(text, "| model |"), _cells(text, "| 7b | nvfp4 |")))["vs bf16 by order"]
    assert by_order.count("x") == 2 and " / " in by_order
    assert "orders (rounds alternate between them): 1: bf16,nvfp4; 2: nvfp4,bf16" in text
    bound = ceiling_table(rows, "cpu", args)  # the 7b shapes' byte ratio on the tiny models' timings
    assert "this run (cpu," in bound and bound.count("| 7b |") == 1 and "**measured**" in bound
    assert ceiling_table([r for r in rows if r["variant"] == "bf16"], "cpu", args) == ""


def test_resident_bytes_count_optimizer_state_once_it_exists(apis):
    model = build_random_policy(Qwen2Config(**TINY), "nvfp4", lora_r=4, device=torch.device("cpu"))
    args = _args("--micro-batch", "2", "--kl-beta", "0", "--completion", "4")
    runner = StepRunner(model, args, DistContext(), sigma=0.0)
    before = runner.resident_bytes()
    runner.step(prompts=1, completion=4)
    lora_bytes = sum(p.numel() * p.element_size() for p in runner.params)
    assert runner.resident_bytes() >= before + 2 * lora_bytes  # AdamW's two moments per LoRA parameter


def test_order_and_steps_are_checked():
    with pytest.raises(SystemExit):
        parse_args(["--order", "random"])
    with pytest.raises(SystemExit):
        parse_args(["--steps", "0"])
    with pytest.raises(SystemExit):
        parse_args(["--variants", "bf16,bf16"])


def test_profile_rounds_time_every_variant_and_mode_on_the_same_draws(apis, tmp_path):
    """--lengths with two variants x --modes new,old: four cells, warm-up on a whole draw that no timed step
    uses (seed - 1, so every compaction width compiles before timing), then per repetition one draw (whole
    groups of the profile) given to every cell in every rotation."""
    from qerl.data.length_profiles import draw, load_profile, to_json, LengthProfile
    from qerl.bench.step import time_cells

    path = tmp_path / "prof.json"
    path.write_text(to_json(LengthProfile("toy", 8, (1, 2, 7, 8, 3, 3, 5, 6), "test", group_size=2)))
    args = _args("--variants", "bf16,nvfp4", "--prompts", "2", "--steps", "2", "--lengths", str(path),
                 "--modes", "new,old", "--seed", "5")
    log, runners, cells = [], {}, {}
    for fmt in args.variants:
        model = build_random_policy(Qwen2Config(**TINY), fmt, lora_r=4, device=torch.device("cpu"))
        runners[fmt] = _Recorded(fmt, log, model, args, DistContext(), sigma=0.0)
        cells[fmt] = dict(model="7b", variant=fmt, world=1, weights_gb=1.0)
    rows = time_cells(runners, cells, 2, args, DistContext())
    new, old = ("continuous", True), ("static", False)
    profile = load_profile(path)
    warm = tuple(draw(profile, 4, 2, 5 - 1))
    assert log[:4] == [("bf16", warm, new), ("bf16", warm, old), ("nvfp4", warm, new), ("nvfp4", warm, old)]
    assert warm not in {tuple(draw(profile, 4, 2, 5 + rep)) for rep in range(2)}  # this toy's draws differ
    timed = log[4:]
    assert len(timed) == 2 * 4 * 4  # repetitions x rotations x cells
    for rep in range(2):
        part = timed[rep * 16:(rep + 1) * 16]
        assert {lengths for _, lengths, _ in part} == {tuple(draw(profile, 4, 2, 5 + rep))}
        assert [(v, m) for v, _, m in part[:4]] == [("bf16", new), ("bf16", old), ("nvfp4", new), ("nvfp4", old)]
        assert [(v, m) for v, _, m in part[4:8]] == [("bf16", old), ("nvfp4", new), ("nvfp4", old), ("bf16", new)]
    assert len(rows) == 4 and {(r["variant"], r["mode"]) for r in rows} == {
        (v, m) for v in ("bf16", "nvfp4") for m in ("continuous+packed", "static+padded")}
    for r in rows:
        assert r["steps_timed"] == 8 and r["lengths"] == "toy (max 8)" and len(r["step_by_order"]) == 4
        assert r["orders"][0] == "bf16 continuous+packed,bf16 static+padded,nvfp4 continuous+packed,nvfp4 static+padded"
    text = table(rows, "cpu", args)
    assert "lengths: toy (max 8): 8 rows, 4 groups of 2" in text and "seed 5 + repetition" in text
    assert text.count("| 7b |") == 4 and ceiling_table(rows, "cpu", args) == ""  # no bound for drawn lengths


def test_data_parallel_ranks_take_whole_groups_of_the_draw():
    from qerl.bench.step import rank_lengths

    whole = [1, 2, 3, 4, 5, 6, 7, 8]  # 4 groups of 2
    assert rank_lengths(whole, 2, DistContext(rank=0, world=2)) == [1, 2, 5, 6]
    assert rank_lengths(whole, 2, DistContext(rank=1, world=2)) == [3, 4, 7, 8]
    assert rank_lengths(whole, 2, DistContext()) == whole


@pytest.mark.skipif(not (ENGINE_READY and UPDATE_READY), reason="the engine's force_lengths / stats and the "
                    "update's packing are not in this checkout yet")
def test_the_real_apis_are_used_once_they_exist(tmp_path):
    """No stand-ins: a packed continuous step and a padded static one on forced per-row lengths."""
    (tmp_path / "p.txt").write_text("# max_new_tokens: 7\n2\n7\n5\n1\n")
    args = _args("--lengths", str(tmp_path / "p.txt"), "--modes", "new,old")
    model = build_random_policy(Qwen2Config(**TINY), "nvfp4", lora_r=4, device=torch.device("cpu"))
    runner = StepRunner(model, args, DistContext(), sigma=0.0)
    for mode in args.modes:
        t = runner.step(prompts=2, completion=None, lengths=[2, 7, 5, 1], mode=mode)
        assert t["tokens"] == 15 and t["decoded_row_steps"] >= 15 and t["loss_tokens_needed"] >= 15
        assert t["loss_tokens_computed"] >= t["loss_tokens_needed"]


def test_a_mixture_of_experts_builds_layer_by_layer_and_steps():
    """A Qwen3-MoE shape through the bench's random build (experts quantized layer by layer to QuantExperts,
    LoRA on attention only) and one real step (rollout without CUDA graphs, packed update) that moves the adapter;
    the named 30B-A3B shape resolves to that architecture."""
    from transformers import Qwen3MoeConfig

    from qerl.bench.step import model_config
    from qerl.nn.quant_experts import QuantExperts

    config = model_config("qwen3-30b-a3b", layers=1)
    assert config.model_type == "qwen3_moe" and config.num_experts == 128 and config.num_hidden_layers == 1
    assert parse_args(["--models", "qwen3-30b-a3b"])[1].models == ["qwen3-30b-a3b"]
    tiny = Qwen3MoeConfig(**{**TINY, "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2,
                             "head_dim": 16, "output_router_logits": False})
    model = build_random_policy(tiny, "nvfp4", lora_r=4, device=torch.device("cpu"))
    experts = [m for m in model.modules() if isinstance(m, QuantExperts)]
    assert len(experts) == 2 and all(e.weight_format == "nvfp4" for e in experts)
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n and ".self_attn." in n for n in trainable)
    runner = StepRunner(model, _args(), DistContext(), sigma=1e-2)
    assert runner.engine.runner.moe_layers == [True, True]
    before = [p.detach().clone() for p in runner.params]
    t = runner.step(prompts=2, completion=6)
    assert t["tokens"] == 2 * 2 * 6 and t["loss_tokens_computed"] >= t["tokens"]
    assert any(not torch.equal(a, b) for a, b in zip(before, runner.params))


def test_a_gpt_oss_shape_builds_layer_by_layer_and_steps():
    """The gpt-oss-20b shape resolves to a GptOssConfig with alternating sliding / full layers; a tiny gpt-oss
    through the bench's random build gets MXFP4 experts with biases (GptOssQuantExperts), finite RoPE tables and
    sinks, and one real step moves the adapter."""
    from transformers import GptOssConfig

    from qerl.bench.step import model_config
    from qerl.nn.quant_experts import QuantExperts

    config = model_config("gpt-oss-20b", layers=2)
    assert config.model_type == "gpt_oss" and config.num_local_experts == 32 and config.num_experts_per_tok == 4
    assert config.layer_types == ["sliding_attention", "full_attention"] and config.hidden_size == 2880
    tiny = GptOssConfig(**{**TINY, "intermediate_size": 64, "num_local_experts": 4, "num_experts_per_tok": 2,
                           "head_dim": 16, "sliding_window": 4, "output_router_logits": False,
                           "layer_types": ["sliding_attention", "full_attention"]})
    model = build_random_policy(tiny, "mxfp4", lora_r=4, device=torch.device("cpu"))
    experts = [m for m in model.modules() if isinstance(m, QuantExperts)]
    assert len(experts) == 2 and all(e.weight_format == "mxfp4" for e in experts)
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert all(torch.isfinite(t).all() for t in model.buffers() if t.is_floating_point())
    runner = StepRunner(model, _args(), DistContext(), sigma=1e-2)
    before = [p.detach().clone() for p in runner.params]
    t = runner.step(prompts=2, completion=6)
    assert t["tokens"] == 2 * 2 * 6
    assert any(not torch.equal(a, b) for a, b in zip(before, runner.params))
