"""lora.init: loftq / eora adapters fitted to the quantization residual (qerl.models.lora_init)."""

import copy

import pytest
import torch
from peft import PeftModel
from tiny import tiny_model
from tiny_moe import fill_dense_twin, tiny_moe

from qerl.config import ConfigError, TrainConfig, validate
from qerl.models import dequantize_model, quant_experts, quant_layers, quantize_model, save_adapter
from qerl.models.lora_init import init_expert_lora_, init_linear_lora_, residual_factors
from qerl.nn import LoraConfig, QuantLinear
from qerl.quant.awq import FOLDED_SCALES
from qerl.rl.checkpointing import check_same_run

FORMATS = ("nvfp4", "mxfp4", "nf4")


def _delta(layer: QuantLinear) -> torch.Tensor:
    return layer.scaling * layer.lora_B.weight @ layer.lora_A.weight


def _inputs(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Activations with a few dominant directions and outlier channels, as LLM inputs have."""
    g = torch.Generator().manual_seed(seed)
    scales = torch.logspace(1, -2, k)
    x = torch.randn(n, k, generator=g) * scales
    q, _ = torch.linalg.qr(torch.randn(k, k, generator=g))
    return x @ q.t()


def test_residual_factors_are_the_truncated_svd():
    g = torch.Generator().manual_seed(0)
    res = torch.randn(24, 40, generator=g)
    a, b = residual_factors(res, 5, scaling=2.0)
    assert a.shape == (5, 40) and b.shape == (24, 5)
    u, s, vh = torch.linalg.svd(res, full_matrices=False)
    torch.testing.assert_close(2.0 * b @ a, (u[:, :5] * s[:5]) @ vh[:5], rtol=1e-4, atol=1e-4)
    a, b = residual_factors(res, 64, scaling=0.5)  # rank above min(N, K): exact, zero padding
    torch.testing.assert_close(0.5 * b @ a, res, rtol=1e-4, atol=1e-4)
    assert a[24:].abs().sum() == 0 and b[:, 24:].abs().sum() == 0


def test_eora_equals_the_svd_in_the_eigenspace_of_the_inputs():
    """The Cholesky square root gives the optimum the symmetric one (eigenvectors, sqrt eigenvalues) gives."""
    g = torch.Generator().manual_seed(0)
    res = torch.randn(24, 40, generator=g, dtype=torch.float64).float()
    x = _inputs(200, 40)
    cov = x.t() @ x / 200
    a, b = residual_factors(res, 5, scaling=2.0, covariance=cov, damp=1e-2)
    damped = (cov + 1e-2 * torch.diagonal(cov).mean() * torch.eye(40)).double()
    lam, q = torch.linalg.eigh(damped)
    root = q * lam.sqrt() @ q.t()
    u, s, vh = torch.linalg.svd(res.double() @ root, full_matrices=False)
    best = (u[:, :5] * s[:5]) @ vh[:5] @ torch.linalg.inv(root)
    torch.testing.assert_close((2.0 * b @ a).double(), best, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("fmt", FORMATS)
def test_loftq_reduces_the_weight_residual(fmt):
    dense = tiny_model("llama")
    weights = {n: m.weight.detach().clone() for n, m in dense.named_modules() if isinstance(m, torch.nn.Linear)}
    model = quantize_model(tiny_model("llama"), fmt, LoraConfig(r=8, alpha=16, init="loftq"))
    layers = quant_layers(model)
    assert layers
    for name, layer in layers.items():
        w, wq = weights[name], layer.dequantized_weight()
        before = (w - wq).norm()
        after = (w - wq - _delta(layer)).norm()
        assert after < 0.95 * before, (name, float(after), float(before))
        assert layer.lora_A.weight.requires_grad and layer.lora_B.weight.requires_grad


@pytest.mark.parametrize("fmt", FORMATS)
def test_eora_reduces_the_activation_weighted_residual_more_than_loftq(fmt):
    torch.manual_seed(0)
    lin = torch.nn.Linear(128, 48, bias=False)
    x = _inputs(512, 128)
    cov = x.t() @ x / x.shape[0]
    errors = {}
    for init in ("zero", "loftq", "eora"):
        torch.manual_seed(1)
        layer = QuantLinear.from_linear(lin, fmt, LoraConfig(r=8, alpha=16, init=init))
        init_linear_lora_(layer, lin.weight, cov)
        d = (lin.weight - layer.dequantized_weight() - _delta(layer)).detach()
        errors[init] = float((x @ d.t()).norm())
        with torch.no_grad():  # the layer computes it: its output is nearer the 16-bit layer's
            out_err = float((layer(x) - lin(x)).norm())
        assert out_err == pytest.approx(errors[init], rel=1e-3)
    assert errors["eora"] < errors["loftq"] < errors["zero"], errors
    assert errors["eora"] < 0.9 * errors["loftq"], errors


@pytest.mark.parametrize("fmt", FORMATS)
def test_eora_through_calibrated_quantization_brings_logits_nearer(fmt):
    ids = torch.randint(3, 160, (4, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = torch.log_softmax(tiny_model("qwen3")(input_ids=ids).logits, -1)
    kl = {}
    for init in ("zero", "loftq", "eora"):
        model = quantize_model(tiny_model("qwen3"), fmt, LoraConfig(r=8, alpha=16, init=init), calibration=ids
                               if init == "eora" else None)
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits, -1)
        kl[init] = float((ref.exp() * (ref - logp)).sum(-1).mean())
    assert kl["eora"] < kl["zero"] and kl["loftq"] < kl["zero"], kl


def test_eora_needs_calibration():
    with pytest.raises(ValueError, match="eora needs calibration"):
        quantize_model(tiny_model("llama"), "nvfp4", LoraConfig(r=4, init="eora"))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_eora_on_an_awq_base_brings_logits_nearer_than_zero_init(arch):
    # the fit is to the folded weights on the folded inputs; a fit on the unfolded inputs would be off by s
    ids = torch.randint(3, 160, (4, 32), generator=torch.Generator().manual_seed(0))
    dense = tiny_model(arch, num_key_value_heads=4)
    with torch.no_grad():  # channels of very different size, as in real models (AWQ has something to fold)
        for layer in dense.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.mul_(torch.linspace(0.2, 4.0, norm.weight.numel())[torch.randperm(norm.weight.numel())])
        ref = torch.log_softmax(dense(input_ids=ids).logits, -1)
    kl = {}
    for init in ("zero", "eora"):
        model = quantize_model(copy.deepcopy(dense), "nvfp4", LoraConfig(r=8, alpha=16, init=init), method="awq",
                               calibration=ids)
        assert getattr(model, FOLDED_SCALES)  # something was folded
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits, -1)
        kl[init] = float((ref.exp() * (ref - logp)).sum(-1).mean())
    assert kl["eora"] < 0.8 * kl["zero"], kl


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("init", ["loftq", "eora"])
def test_expert_stacks(fmt, init):
    dense = tiny_moe("qwen3_moe")
    stacks = {n: {"gate_up_proj": m.gate_up_proj.detach().clone(), "down_proj": m.down_proj.detach().clone()}
              for n, m in dense.named_modules() if hasattr(m, "gate_up_proj")}
    model = quantize_model(tiny_moe("qwen3_moe"), fmt, LoraConfig(r=4, alpha=8, experts=True))
    experts = quant_experts(model)
    assert experts.keys() == stacks.keys()
    for name, m in experts.items():
        covs = None
        if init == "eora":
            covs = {}
            for w in ("gate_up_proj", "down_proj"):
                k = stacks[name][w].shape[2]
                xs = [_inputs(128, k, seed=e) for e in range(m.num_experts)]
                covs[w] = torch.stack([x.t() @ x / x.shape[0] for x in xs])
        init_expert_lora_(m, stacks[name], init, covs)
        delta = {w: m.lora_delta(w) for w in ("gate_up_proj", "down_proj")}
        for w, stack in stacks[name].items():
            for e in range(m.num_experts):
                res = stack[e] - m.dequantized_expert(w, e, torch.float32)
                if init == "loftq":
                    assert (res - delta[w][e]).norm() < 0.95 * res.norm()
                else:
                    x = _inputs(128, stack.shape[2], seed=e)
                    assert (x @ (res - delta[w][e]).t()).norm() < 0.95 * (x @ res.t()).norm()


@pytest.mark.parametrize("fmt", FORMATS)
def test_loftq_adapter_reloads_through_peft_with_equal_logits(tmp_path, fmt):
    model = quantize_model(tiny_model("llama"), fmt, LoraConfig(r=4, alpha=8, init="loftq"))
    save_adapter(model, tmp_path / "adapter", base_model_name_or_path="tiny")
    ids = torch.randint(3, 160, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(input_ids=ids).logits
        plain = quantize_model(tiny_model("llama"), fmt)(input_ids=ids).logits
    assert (ours - plain).abs().max() > 1e-4, "the adapter is not zero"
    base = dequantize_model(quantize_model(tiny_model("llama"), fmt))
    peft_model = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        theirs = peft_model(input_ids=ids).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)


def test_eora_adapter_reloads_through_peft_with_equal_logits(tmp_path):
    ids = torch.randint(3, 160, (2, 16), generator=torch.Generator().manual_seed(0))
    model = quantize_model(tiny_model("qwen2"), "nvfp4", LoraConfig(r=4, alpha=8, init="eora"), calibration=ids)
    save_adapter(model, tmp_path / "adapter", base_model_name_or_path="tiny")
    with torch.no_grad():
        ours = model(input_ids=ids).logits
    base = dequantize_model(quantize_model(tiny_model("qwen2"), "nvfp4"))
    peft_model = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        theirs = peft_model(input_ids=ids).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)


def test_config_choices_and_resume():
    with pytest.raises(ValueError, match="LoRA init"):
        LoraConfig(init="pissa")
    cfg = TrainConfig()
    assert cfg.lora.init == "zero"
    cfg.lora.init = "eora"
    cfg.model.quant_method = "awq"
    validate(cfg)  # eora fits the folded weights
    cfg = TrainConfig()
    cfg.lora.init, cfg.lora.experts = "eora", True
    with pytest.raises(ConfigError, match="experts"):
        validate(cfg)
    from qerl.config import to_dict

    saved = to_dict(TrainConfig())
    saved["lora"].pop("init")  # a checkpoint from before the key: zero
    check_same_run(saved, to_dict(TrainConfig()), "ckpt")
    cfg = TrainConfig()
    cfg.lora.init = "loftq"
    with pytest.raises(ValueError, match="lora.init"):
        check_same_run(saved, to_dict(cfg), "ckpt")


@pytest.mark.parametrize("fmt", FORMATS)
def test_loftq_on_expert_lora_through_quantize_model(fmt):
    dense = tiny_moe("qwen3_moe")
    stacks = {n: {"gate_up_proj": m.gate_up_proj.detach().clone(), "down_proj": m.down_proj.detach().clone()}
              for n, m in dense.named_modules() if hasattr(m, "gate_up_proj")}
    model = quantize_model(tiny_moe("qwen3_moe"), fmt, LoraConfig(r=4, alpha=8, experts=True, init="loftq"))
    for name, m in quant_experts(model).items():
        assert not hasattr(m, "_lora_init_factors")
        for w, stack in stacks[name].items():
            assert m.lora_A[w].requires_grad
            delta = m.lora_delta(w)
            for e in range(m.num_experts):
                res = stack[e] - m.dequantized_expert(w, e, torch.float32)
                assert (res - delta[e]).norm() < 0.95 * res.norm()
    ids = torch.randint(3, 160, (2, 8))
    with pytest.raises(ValueError, match="eora"):
        quantize_model(tiny_moe("qwen3_moe"), "nvfp4", LoraConfig(r=4, alpha=8, experts=True, init="eora"),
                       calibration=ids)


@pytest.mark.parametrize("init", ["loftq", "eora"])
def test_streamed_equals_load_then_quantize(tmp_path, init):
    from tiny import tiny_tokenizer

    from qerl.models import Quantization, load_causal_lm
    from qerl.models.stream import stream_quantized

    tiny_model("qwen2", tie_word_embeddings=True).save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    lora = LoraConfig(r=4, alpha=8, init=init)
    ids = torch.randint(3, 150, (2, 16), generator=torch.Generator().manual_seed(0))
    cal = ids if init == "eora" else None
    torch.manual_seed(3)
    expected, _ = load_causal_lm(tmp_path, dtype=torch.float32, device="cpu")
    quantize_model(expected, "nvfp4", lora, calibration=cal)
    torch.manual_seed(3)
    got, _ = stream_quantized(tmp_path, Quantization.of("nvfp4", lora=lora, calibration=cal), dtype=torch.float32,
                              device="cpu")
    a, b = expected.state_dict(), got.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=0, msg=k)
    assert any(".lora_B" in k and a[k].abs().sum() > 0 for k in a)


@pytest.mark.parametrize("method", ["rtn", "4over6", "gptq"])
def test_eora_keeps_the_base_of_its_method(method):
    """eora runs the calibrated pass, but the 4-bit base is what the method alone gives (gptq: its first layer; the
    later layers' Hessians come from inputs that the earlier layers' fitted adapters already correct)."""
    ids = torch.randint(3, 160, (2, 16), generator=torch.Generator().manual_seed(0))
    cal = ids if method == "gptq" else None
    plain = quantize_model(tiny_model("llama"), "nvfp4", LoraConfig(r=4, alpha=8), method=method, calibration=cal)
    fitted = quantize_model(tiny_model("llama"), "nvfp4", LoraConfig(r=4, alpha=8, init="eora"), method=method,
                            calibration=ids)
    a = {k: v for k, v in plain.state_dict().items() if ".lora_" not in k}
    b = {k: v for k, v in fitted.state_dict().items() if ".lora_" not in k}
    assert a.keys() == b.keys()
    for k in a:
        if method != "gptq" or k.startswith("model.layers.0."):
            assert torch.equal(a[k], b[k]), k


def test_loftq_expert_adapter_reloads_through_peft_with_equal_logits(tmp_path):
    import copy

    dense = tiny_moe("qwen3_moe", experts_implementation="eager")
    reference = copy.deepcopy(dense)
    model = quantize_model(dense, "nvfp4", LoraConfig(r=4, alpha=8, experts=True, init="loftq"))
    fill_dense_twin(reference, model)
    adapter = save_adapter(model, tmp_path / "adapter", base_model_name_or_path="tiny")
    peft_model = PeftModel.from_pretrained(reference, adapter).eval()
    ids = torch.randint(3, 160, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ours = torch.log_softmax(model(ids).logits, -1)
        theirs = torch.log_softmax(peft_model(ids).logits, -1)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("init", ["loftq", "eora"])
def test_load_policy_fits_the_adapter(tiny_dir, tmp_path, init):
    """The one loader every command uses: a streamed 16-bit directory gets fitted adapters (eora reads the
    calibration text)."""
    from qerl.models.loader import ModelSpec, load_policy

    text = tmp_path / "cal.txt"
    text.write_text("\n".join(f"{a} plus {b} is {a + b}." for a in range(40) for b in range(10)))
    spec = ModelSpec(name=str(tiny_dir), format="nvfp4", lora=LoraConfig(r=4, alpha=8, init=init),
                     calibration_source=str(text), calibration_samples=4, calibration_max_tokens=256, device="cpu")
    model, _ = load_policy(spec)
    b = [p for n, p in model.named_parameters() if ".lora_B" in n]
    assert b and all(p.abs().sum() > 0 for p in b) and all(p.requires_grad for p in b)


def test_an_output_weight_fits_the_two_sided_norm_and_a_uniform_one_changes_nothing():
    g = torch.Generator().manual_seed(3)
    res = torch.randn(40, 64, generator=g)
    x = _inputs(256, 64)
    cov = x.t() @ x / x.shape[0]
    grads = torch.randn(256, 40, generator=g) * torch.logspace(0, -2, 40)  # a few sensitive output channels
    out_cov = grads.t() @ grads / grads.shape[0]
    lo = torch.linalg.cholesky(out_cov + 1e-3 * torch.diagonal(out_cov).mean() * torch.eye(40))
    li = torch.linalg.cholesky(cov + 1e-2 * torch.diagonal(cov).mean() * torch.eye(64))

    def two_sided_error(a, b):
        return float((lo.t() @ (res - 0.5 * b @ a) @ li).norm())

    one = residual_factors(res, 4, 0.5, cov)
    two = residual_factors(res, 4, 0.5, cov, output_covariance=out_cov, output_damp=1e-3)
    assert two_sided_error(*two) < 0.97 * two_sided_error(*one)
    uniform = residual_factors(res, 4, 0.5, cov, output_covariance=3.0 * torch.eye(40))
    torch.testing.assert_close(0.5 * uniform[1] @ uniform[0], 0.5 * one[1] @ one[0], rtol=1e-4, atol=1e-5)
