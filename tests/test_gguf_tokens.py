"""A GGUF's special tokens reach the converted tokenizer whatever transformers' GGUF conversion keeps (5.17 kept 3
of Qwen2.5's 22 control tokens as special and took `<|endoftext|>` for eos), and `check_tokenizer_eos` refuses a
directory written the old way (its cache rebuild: tests/test_cli_sharp_edges.py). Real SmolLM2 GGUF and
tokenizer; CPU."""

import json
import shutil

import pytest
from transformers import AutoTokenizer

from qerl.models.gguf import gguf_special_tokens, with_gguf_special_tokens
from qerl.models.registry import check_tokenizer_eos, embedded_gguf, embedded_hf_dir
from qerl.models.sources import ModelLoadError, check_gguf

NAME = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def special():
    return gguf_special_tokens(check_gguf(embedded_gguf(NAME)).fields)


def test_the_file_names_its_eos_pad_and_control_tokens(special):
    assert special["eos"] == "<|im_end|>" and special["pad"] == "<|im_end|>"
    assert {"<|endoftext|>", "<|im_start|>", "<|im_end|>", "<jupyter_code>"} <= set(special["special"])
    assert len(special["special"]) == len(set(special["special"])) == 17


def _as_an_older_conversion_wrote_it(good, out):
    """A copy of the converted tokenizer with one added token left and `<|endoftext|>` as eos (what 5.17 wrote)."""
    shutil.copytree(good, out, ignore=shutil.ignore_patterns("*.safetensors"))
    tok = json.loads((out / "tokenizer.json").read_text())
    tok["added_tokens"] = [t for t in tok["added_tokens"] if t["content"] == "<|endoftext|>"]
    (out / "tokenizer.json").write_text(json.dumps(tok))
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg.pop("added_tokens_decoder", None)
    cfg.pop("extra_special_tokens", None)
    cfg.update(eos_token="<|endoftext|>", pad_token="<|endoftext|>", bos_token=None)
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return out


def test_a_tokenizer_that_lost_its_control_tokens_gets_them_back(special, tmp_path):
    good_dir = embedded_hf_dir(NAME)
    good = AutoTokenizer.from_pretrained(good_dir)
    text = "<|im_start|>user\nrun<jupyter_code>x=1<|im_end|>\n"
    want = good.encode(text, add_special_tokens=False)
    old = AutoTokenizer.from_pretrained(_as_an_older_conversion_wrote_it(good_dir, tmp_path / "old"))
    assert old.eos_token == "<|endoftext|>" and old.encode(text, add_special_tokens=False) != want  # it is broken

    fixed = with_gguf_special_tokens(old, special)
    assert fixed.eos_token == "<|im_end|>" and fixed.eos_token_id == good.eos_token_id
    assert fixed.pad_token == "<|im_end|>" and len(fixed) == len(good)
    assert fixed.encode(text, add_special_tokens=False) == want
    for token in special["special"]:  # each keeps its id and is one token
        assert fixed.encode(token, add_special_tokens=False) == [good.convert_tokens_to_ids(token)]
    fixed.save_pretrained(tmp_path / "saved")
    again = AutoTokenizer.from_pretrained(tmp_path / "saved")
    assert again.eos_token == "<|im_end|>" and again.encode(text, add_special_tokens=False) == want
    check_tokenizer_eos(good_dir)
    with pytest.raises(ModelLoadError, match="eos '<\\|endoftext\\|>' is not the config's eos_token_id"):
        check_tokenizer_eos(_as_an_older_conversion_wrote_it(good_dir, tmp_path / "cached"))


def test_a_tokenizer_that_has_them_is_left_as_it_is(special):
    good = AutoTokenizer.from_pretrained(embedded_hf_dir(NAME))
    before = (len(good), good.eos_token, good.pad_token, dict(good.added_tokens_decoder))
    fixed = with_gguf_special_tokens(good, special)
    assert (len(fixed), fixed.eos_token, fixed.pad_token, dict(fixed.added_tokens_decoder)) == before

