"""Calibrated quantization at the model level: calibration sources and their errors, the layer-by-layer
GPTQ / AWQ paths (whole model == streamed), exports other tools load, and `qerl train` / `qerl quantize`
with a method."""

import copy
import json

import pytest
import torch
from tiny import tiny_config, tiny_model, tiny_tokenizer

from qerl.cli import main
from qerl.config import load_config
from qerl.data.calibration import CalibrationError, check_source, pack_tokens
from qerl.models import Quantization, quantize_model, save_quantized
from qerl.models.calibration import calibration_ids
from qerl.models.targets import quant_layers
from qerl.models.stream import build_layer_by_layer
from qerl.rl.trainer import Trainer

TEXT = "\n\n".join(f"{a} plus {b} is {a + b}. Then {a} times {b} is {a * b}." for a in range(40) for b in range(3))


@pytest.fixture()
def text_file(tmp_path):
    path = tmp_path / "calib.txt"
    path.write_text(TEXT)
    return path


@pytest.mark.parametrize("source", ["gsm8k-offline", "gsm8k", "aime2025", "reasoning-gym:gsm_symbolic"])
def test_evaluation_sets_are_refused_as_calibration(source):
    with pytest.raises(CalibrationError, match="evaluation set"):
        check_source(source)


def test_bad_sources_give_one_line_errors(tmp_path):
    tok = tiny_tokenizer()
    with pytest.raises(CalibrationError, match="unknown calibration source"):
        calibration_ids("wikipedia", tok)
    with pytest.raises(CalibrationError, match="no such file"):
        calibration_ids(str(tmp_path / "missing.txt"), tok)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(CalibrationError, match="empty"):
        calibration_ids(str(tmp_path / "empty.txt"), tok)
    (tmp_path / "short.txt").write_text("1 plus 1 is 2.")
    with pytest.raises(CalibrationError, match="fewer than"):
        calibration_ids(str(tmp_path / "short.txt"), tok)
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\nnot json\n')
    with pytest.raises(CalibrationError, match="line 2"):
        calibration_ids(str(tmp_path / "bad.jsonl"), tok)
    with pytest.raises(CalibrationError, match="qerl train"):
        calibration_ids("train", tok)
    with pytest.raises(CalibrationError, match="16-bit model"):
        calibration_ids("self", tok)


def test_file_source_packs_rows_of_equal_length(text_file):
    ids = calibration_ids(str(text_file), tiny_tokenizer(), samples=8, max_tokens=128)
    assert ids.dtype == torch.long and ids.shape == (8, 128)
    assert (ids == tiny_tokenizer().eos_token_id).any()  # texts joined by EOS


def test_reasoning_gym_mixture_is_deterministic_and_chat_formatted():
    tok = tiny_tokenizer()
    a = calibration_ids("reasoning-gym", tok, samples=4, max_tokens=256)
    b = calibration_ids("reasoning-gym", tok, samples=4, max_tokens=256)
    assert torch.equal(a, b) and a.shape == (4, 256)
    assert "####" in tok.decode(a[0])


def test_pack_tokens_keeps_only_full_rows():
    tok = tiny_tokenizer()
    ids = pack_tokens(["x" * 1500], tok, samples=10, max_tokens=512, where="t")
    assert ids.shape == (2, 512)


def _kl(ref, model, ids):
    with torch.no_grad():
        p = torch.log_softmax(ref(ids).logits.float(), -1)
        q = torch.log_softmax(model(ids).logits.float(), -1)
    return float((p.exp() * (p - q)).sum(-1).mean())


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_calibrated_methods_beat_round_to_nearest_on_held_out_tokens(method):
    base = tiny_model("llama", hidden_size=128, intermediate_size=256)
    with torch.no_grad():  # heavy-tailed weights and an outlier channel, as real LLMs have
        for name, p in base.named_parameters():
            if p.ndim == 2 and "embed" not in name:
                p.copy_(torch.distributions.StudentT(3.0).sample(p.shape) * 0.02)
        for layer in base.model.layers:
            layer.input_layernorm.weight[5] = 8.0
    g = torch.Generator().manual_seed(0)
    cal, held_out = torch.randint(3, 160, (16, 64), generator=g), torch.randint(3, 160, (4, 64), generator=g)
    rtn = quantize_model(copy.deepcopy(base), "nvfp4")
    ours = quantize_model(copy.deepcopy(base), "nvfp4", method=method, calibration=cal)
    assert _kl(base, ours, held_out) < _kl(base, rtn, held_out)


@pytest.mark.parametrize("method,keep", [("4over6", ()), ("gptq", ()), ("awq", ()),
                                         ("gptq", ("model.layers.1.self_attn.q_proj", "model.layers.0.mlp.*"))])
def test_streamed_build_equals_whole_model_quantization(method, keep):
    base = tiny_model("llama")
    state = base.state_dict()
    cal = torch.randint(3, 160, (8, 32), generator=torch.Generator().manual_seed(1))
    whole = quantize_model(copy.deepcopy(base), "nvfp4", method=method, calibration=cal, keep_bf16=keep)
    assert [n for n, p in whole.named_parameters() if p.requires_grad] == []
    kept = [n for n, m in quant_layers(whole).items() if m.weight_format == "bf16"]
    assert len(kept) == (4 if keep else 0)

    def fill(module, prefix):
        module.to_empty(device="cpu")
        with torch.no_grad():
            for n, t in module.state_dict(keep_vars=True).items():
                t.copy_(state[prefix + n])

    q = Quantization.of("nvfp4", method, calibration=cal if method != "4over6" else None, keep_bf16=keep)
    streamed = build_layer_by_layer(tiny_config("llama"), q, fill, dtype=torch.float32)
    for (name, a), (_, b) in zip(quant_layers(whole).items(), quant_layers(streamed).items()):
        for t in a.quantized_tensors():
            assert torch.equal(getattr(a, t).view(torch.uint8), getattr(b, t).view(torch.uint8)), (name, t)
    x = torch.randint(3, 160, (2, 16))
    torch.testing.assert_close(whole(x).logits, streamed(x).logits, rtol=0, atol=0)


@pytest.mark.parametrize("arch,method", [("llama", "gptq"), ("llama", "awq"), ("qwen2", "gptq")])
def test_a_bf16_model_calibrates_in_float32_on_the_cpu_and_keeps_its_dtypes(arch, method):
    base = tiny_model(arch, dtype=torch.bfloat16)
    cal = torch.randint(3, 160, (8, 32), generator=torch.Generator().manual_seed(2))
    seen = []
    hook = base.model.layers[1].register_forward_pre_hook(lambda _m, args: seen.append(args[0].dtype))
    keep = ("model.layers.0.mlp.down_proj",)
    ours = quantize_model(copy.deepcopy(base), "nvfp4", method=method, calibration=cal, keep_bf16=keep)
    hook.remove()
    assert seen and set(seen) == {torch.float32}
    rtn = quantize_model(copy.deepcopy(base), "nvfp4", keep_bf16=keep)
    dtypes = {n: t.dtype for n, t in rtn.state_dict().items()}
    assert {n: t.dtype for n, t in ours.state_dict().items()} == dtypes
    assert ours.model.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16  # the kept layer's weight
    x = torch.randint(3, 160, (2, 16))
    assert ours(x).logits.dtype == torch.bfloat16 and torch.isfinite(ours(x).logits).all()


def test_methods_are_refused_where_they_do_not_apply():
    with pytest.raises(ValueError, match="needs calibration"):
        quantize_model(tiny_model("llama"), "nvfp4", method="gptq")
    with pytest.raises(ValueError, match="works on"):
        quantize_model(tiny_model("llama"), "nf4", method="gptq")
    with pytest.raises(ValueError, match="unknown quantization method"):
        quantize_model(tiny_model("llama"), "nvfp4", method="best")


@pytest.mark.parametrize("method", ["4over6", "gptq", "awq"])
def test_every_method_loads_in_transformers_with_compressed_tensors(tmp_path, method):
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    cal = torch.randint(3, 160, (8, 32), generator=torch.Generator().manual_seed(2))
    model = quantize_model(tiny_model("llama", dtype=torch.bfloat16), "nvfp4", method=method, calibration=cal)
    save_quantized(model, None, tmp_path / "q")
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "q", dtype=torch.bfloat16,
                                                  quantization_config=CompressedTensorsConfig(dequantize=True))
    for name, layer in quant_layers(model).items():
        torch.testing.assert_close(theirs.get_submodule(name).weight, layer.dequantized_weight(torch.bfloat16),
                                   rtol=0, atol=0)
    x = torch.randint(3, 160, (1, 12))
    torch.testing.assert_close(theirs(x).logits, model(x).logits, rtol=0, atol=0)


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_train_with_a_calibrated_method(tiny_dir, tmp_path, method):
    data = tmp_path / "arith.jsonl"
    data.write_text("".join(json.dumps({"question": f"{a}+{b}=?", "answer": str(a + b)}) + "\n"
                            for a in range(1, 9) for b in range(1, 9)))
    cfg = load_config(None, [f"model.name={tiny_dir}", "model.format=nvfp4", f"model.quant_method={method}",
                             "model.calibration.source=train", "model.calibration.samples=4",
                             "model.calibration.max_tokens=256", f"data.train={data}", "data.max_prompt_tokens=32",
                             "data.suffix=none", "rollout.prompts_per_step=2", "rollout.group_size=2",
                             "rollout.max_new_tokens=4", "lora.r=4", "lora.alpha=8", "steps=1",
                             f"output_dir={tmp_path / 'run'}", "tensorboard=false", "plots=false"])
    trainer = Trainer(cfg)
    assert all(m.weight_format == "nvfp4" for m in quant_layers(trainer.model).values())
    trainer.train()
    saved = (tmp_path / "run" / "config.yaml").read_text()
    assert f"quant_method: {method}" in saved


def test_cli_quantize_with_gptq_and_bad_method(tiny_dir, tmp_path, text_file, capsys):
    assert main(["quantize", str(tiny_dir), "--method", "gptq", "--calibration", str(text_file),
                 "--calibration-samples", "4", "--calibration-max-tokens", "256", "--out", str(tmp_path / "q")]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["method"] == "gptq"
    assert main(["quantize", str(tiny_dir), "--method", "gptq", "--calibration", "gsm8k-offline",
                 "--out", str(tmp_path / "q2")]) == 2
    assert not (tmp_path / "q2").exists()
    with pytest.raises(SystemExit):
        main(["quantize", str(tiny_dir), "--method", "best", "--out", str(tmp_path / "q3")])


def test_cli_quantize_keeps_layers_in_bf16_and_config_checks_the_syntax(tiny_dir, tmp_path):
    from qerl.config import ConfigError
    from qerl.models import load_quantized

    assert main(["quantize", str(tiny_dir), "--method", "4over6", "--keep-bf16", "last:1",
                 "--out", str(tmp_path / "q")]) == 0
    model, _ = load_quantized(tmp_path / "q")
    formats = {n: m.weight_format for n, m in quant_layers(model).items()}
    assert {f for n, f in formats.items() if n.startswith("model.layers.1.")} == {"bf16"}
    assert {f for n, f in formats.items() if n.startswith("model.layers.0.")} == {"nvfp4"}
    with pytest.raises(ConfigError, match="keep_bf16"):
        load_config(None, ["model.keep_bf16=[last:0]"])


def test_an_awq_directory_reloads_with_its_channel_scales_so_aqn_draws_the_same_policy(tmp_path):
    from qerl.models import ModelLoadError, load_causal_lm
    from qerl.models.checkpoint import CHANNEL_SCALES_FILE
    from qerl.nn.noisy_norm import NoisyNorms
    from qerl.quant.awq import channel_scales

    cal = torch.randint(3, 160, (8, 32), generator=torch.Generator().manual_seed(2))
    model = quantize_model(tiny_model("llama"), "nvfp4", method="awq", calibration=cal)
    scales = channel_scales(model)
    assert scales and any(not torch.equal(s, torch.ones_like(s)) for s in scales.values())
    save_quantized(model, None, tmp_path / "q")
    assert (tmp_path / "q" / CHANNEL_SCALES_FILE).is_file()
    reloaded, _ = load_causal_lm(tmp_path / "q", dtype=torch.float32)
    assert channel_scales(reloaded).keys() == scales.keys()
    assert all(torch.equal(channel_scales(reloaded)[k], s) for k, s in scales.items())
    x = torch.randint(3, 160, (2, 12))
    with torch.no_grad(), NoisyNorms(model, 0.1, seed=3), NoisyNorms(reloaded, 0.1, seed=3):
        torch.testing.assert_close(reloaded(x).logits, model(x).logits, rtol=0, atol=0)
    # a directory without awq has no scales file; a broken one names the file
    save_quantized(quantize_model(tiny_model("llama"), "nvfp4"), None, tmp_path / "rtn")
    assert not (tmp_path / "rtn" / CHANNEL_SCALES_FILE).exists()
    from safetensors.torch import save_file

    save_file({"model.layers.0.input_layernorm": torch.zeros(3)}, tmp_path / "q" / CHANNEL_SCALES_FILE)
    with pytest.raises(ModelLoadError, match="awq_channel_scales.*finite positive"):
        load_causal_lm(tmp_path / "q")


def test_self_source_generates_in_float32_on_the_cpu_and_leaves_the_model_as_it_was(tmp_path):
    from qerl.models.calibration import greedy_answers

    model, tok = tiny_model("qwen2", dtype=torch.bfloat16), tiny_tokenizer()  # tied embeddings
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    seen = []
    hook = model.model.layers[0].register_forward_pre_hook(lambda _m, args: seen.append(args[0].dtype))
    rows = [{"question": f"{a}+{a}=?", "answer": str(2 * a)} for a in range(3)]
    answers = greedy_answers(model, tok, rows, max_new_tokens=4)
    hook.remove()
    assert len(answers) == 3 and set(seen) == {torch.float32}
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.lm_head.weight is model.model.embed_tokens.weight  # the cast round trip keeps the tie


def test_calibration_samples_default_depends_on_where_the_model_is_quantized(tiny_dir, tmp_path, monkeypatch,
                                                                            capsys):
    """model.calibration.samples: null -> 64 sequences on the CPU (128 on a GPU); a number is kept; 0 is refused."""
    from qerl.config import ConfigError
    from qerl.models import calibration
    from qerl.models.calibration import default_samples

    assert (default_samples("cpu"), default_samples("cuda"), default_samples(torch.device("cuda", 1))) == (64, 128, 128)
    seen = []

    class Stop(Exception):
        pass

    def record(source, tokenizer, samples, *args, **kwargs):
        seen.append(samples)
        raise Stop

    monkeypatch.setattr(calibration, "calibration_ids", record)
    data = tmp_path / "arith.jsonl"
    data.write_text("".join(json.dumps({"question": f"{a}+{a}=?", "answer": str(2 * a)}) + "\n" for a in range(9)))
    base = [f"model.name={tiny_dir}", "model.format=nvfp4", "model.quant_method=gptq",
            "model.calibration.source=train", f"data.train={data}", "data.suffix=none",
            f"output_dir={tmp_path / 'run'}", "tensorboard=false", "plots=false"]
    for extra, want in (([], 64), (["model.calibration.samples=7"], 7)):
        with pytest.raises(Stop):
            Trainer(load_config(None, base + extra))
        assert seen[-1] == want
    with pytest.raises(ConfigError, match="model.calibration.samples"):
        load_config(None, base + ["model.calibration.samples=0"])
    with pytest.raises(SystemExit) as e:  # a usage error, before anything loads
        main(["quantize", str(tiny_dir), "--method", "gptq", "--calibration-samples", "0",
              "--out", str(tmp_path / "q")])
    assert e.value.code == 2
    assert "argument --calibration-samples: must be >= 1" in capsys.readouterr().err
    assert not (tmp_path / "q").exists()


def test_cli_quantize_device_choice(tiny_dir, tmp_path, monkeypatch):
    from qerl.cli import quantize_device

    assert quantize_device("cpu") == torch.device("cpu")
    assert quantize_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="--device 'gpu0'"):
        quantize_device("gpu0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert quantize_device("auto") == torch.device("cpu")
    with pytest.raises(ValueError, match="no CUDA device"):
        quantize_device("cuda")
    assert main(["quantize", str(tiny_dir), "--device", "cuda", "--out", str(tmp_path / "q")]) == 2
    assert not (tmp_path / "q").exists()


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["gptq", "rtn"])
def test_cli_quantize_on_cuda_writes_the_same_format_as_on_cpu(tiny_dir, tmp_path, text_file, method):
    """Calibration and quantization on the GPU give a directory with the same tensors (names, shapes, dtypes) as
    the CPU one; round-to-nearest gives the same bytes."""
    from qerl.models import load_quantized

    outs = {}
    for device in ("cpu", "cuda"):
        out = tmp_path / device
        args = ["quantize", str(tiny_dir), "--method", method, "--device", device, "--out", str(out)]
        if method == "gptq":
            args += ["--calibration", str(text_file), "--calibration-samples", "4"]
        assert main(args) == 0
        outs[device] = out
    a, _ = load_quantized(outs["cpu"])
    b, _ = load_quantized(outs["cuda"])
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].shape == sb[k].shape and sa[k].dtype == sb[k].dtype, k
    if method == "rtn":  # no calibration arithmetic: the bytes agree
        for k in sa:
            assert torch.equal(sa[k], sb[k]), k
