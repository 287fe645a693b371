"""The docs hold together: every relative link in README.md and docs/**/*.md names a file that exists, every
study archive in docs/results matches the manifest beside it, and docs/ stays under 4.5 MB (raw per-step and
per-problem data go into one archive per study: docs/results/README.md). Pure Python, no torch."""

import hashlib
import json
import re
import tarfile
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
RESULTS = DOCS / "results"
MAX_DOCS_BYTES = 4_500_000  # apparent size, as `du -sb docs` counts it

FENCED = re.compile(r"^ *(```|~~~).*?^ *\1", re.S | re.M)
INLINE_CODE = re.compile(r"(`+)(?:(?!\n[ \t]*\n).)*?(?<!`)\1(?!`)", re.S)  # may span lines, not paragraphs
# [text](target) and ![alt](target), text with at most one level of brackets; an optional "title"
LINK = re.compile(r"\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^()\s<>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.M)


def pages() -> list[Path]:
    return [ROOT / "README.md"] + sorted(DOCS.rglob("*.md"))


def links(text: str) -> list[tuple[int, str]]:
    """(line, target) of each relative link outside code (URLs with a scheme and bare anchors skipped)."""
    def blank(m: re.Match) -> str:  # code out, its line breaks kept (line numbers)
        return "\n" * m.group(0).count("\n")

    text = INLINE_CODE.sub(blank, FENCED.sub(blank, text))
    found = []
    for m in [*LINK.finditer(text), *REFERENCE.finditer(text)]:
        target = m.group(1)
        if re.match(r"[A-Za-z][A-Za-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        found.append((text.count("\n", 0, m.start()) + 1, target))
    return found


def test_link_parser():
    sample = ("[a](x.md) ![b](img/y.png \"t\") [`c`](z.tar.xz#frag) [d](https://e.org) [e](#anchor)\n"
              "`[f](not-a-link)` `a span\nover [two](lines)` ``[g](`double`)``\n```\n[h](in-a-fence)\n```\n"
              "[i](w.md) [j]: ref.md\n\n[k]: ref.md\n")
    assert links(sample) == [(1, "x.md"), (1, "img/y.png"), (1, "z.tar.xz#frag"), (7, "w.md"), (9, "ref.md")]


def test_links_resolve():
    broken = []
    for page in pages():
        for line, target in links(page.read_text(encoding="utf-8")):
            path = unquote(target.split("#", 1)[0].split("?", 1)[0])
            if not (page.parent / path).exists():
                broken.append(f"{page.relative_to(ROOT)}:{line}: {target}")
    assert not broken, "links to missing files:\n" + "\n".join(broken)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


ARCHIVES = sorted(RESULTS.glob("*.tar.xz"))


def test_every_manifest_has_its_archive():
    for manifest in RESULTS.glob("*.manifest.json"):
        archive = manifest.with_name(manifest.name.removesuffix(".manifest.json") + ".tar.xz")
        assert archive.exists(), f"{manifest.name}: no {archive.name}"


@pytest.mark.parametrize("archive", ARCHIVES, ids=[a.name for a in ARCHIVES])
def test_archive_matches_manifest(archive: Path):
    manifest_path = archive.with_name(archive.name.removesuffix(".tar.xz") + ".manifest.json")
    assert manifest_path.exists(), f"{archive.name}: no manifest {manifest_path.name}"
    manifest = json.loads(manifest_path.read_text())
    data = archive.read_bytes()
    assert manifest["archive"] == archive.name
    assert manifest["bytes"] == len(data)
    assert manifest["sha256"] == _sha256(data), f"{archive.name}: sha256 differs from {manifest_path.name}"
    study = archive.name.removesuffix(".tar.xz")
    members = []
    with tarfile.open(archive, "r:xz") as tar:
        for info in tar:
            assert info.isfile(), f"{archive.name}: {info.name} is not a plain file"
            assert info.name.startswith(study + "/") and ".." not in info.name.split("/"), info.name
            members.append({"name": info.name, "bytes": info.size,
                            "sha256": _sha256(tar.extractfile(info).read())})
    assert members == manifest["members"]
    assert archive.name in (RESULTS / "README.md").read_text(), f"docs/results/README.md does not list {archive.name}"


def test_docs_size():
    paths = [DOCS, *DOCS.rglob("*")]
    total = sum(p.lstat().st_size for p in paths)
    assert total <= MAX_DOCS_BYTES, (
        f"docs/ is {total:,} bytes (limit {MAX_DOCS_BYTES:,}); pack raw per-step / per-problem data into the "
        "study's archive (docs/results/README.md)")
