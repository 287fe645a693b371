"""benchmarks/lora_init_kl.py's `--lm-head nvfp4`: the output head rounded through NVFP4 in place, a tied input
embedding left 16-bit. Tiny random models, CPU."""

import torch
from bench_scripts import load_benchmark
from tiny import tiny_model

from qerl.formats.nvfp4 import dequantize_nvfp4, quantize_nvfp4

kl = load_benchmark("lora_init_kl")


def test_the_head_is_rounded_through_nvfp4_and_a_tied_embedding_is_not():
    for tied in (False, True):
        model = tiny_model("llama", tie_word_embeddings=tied)
        head, embed = model.get_output_embeddings(), model.get_input_embeddings()
        w, e = head.weight.detach().clone(), embed.weight.detach().clone()
        assert (head.weight is embed.weight) == tied
        kl.nvfp4_head_(model)
        want = dequantize_nvfp4(**quantize_nvfp4(w)).to(w.dtype)
        assert torch.equal(model.get_output_embeddings().weight, want) and not torch.equal(want, w)
        assert torch.equal(model.get_input_embeddings().weight, e if tied else embed.weight)
        if tied:  # the embedding keeps its 16-bit values
            assert torch.equal(model.get_input_embeddings().weight, w)
