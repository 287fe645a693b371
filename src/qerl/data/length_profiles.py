"""Completion-length profiles: the ragged lengths of a real RL step, for benchmarks that force each row's length.

A profile is a list of per-row completion lengths (ints in [1, max_new_tokens]) and the budget they were
sampled under. Rows measured together may be stored in groups (`group_size` G_p: rows [k G_p, (k + 1) G_p)
answered the same prompt), so that a draw keeps a prompt's rows together: an easy prompt's completions are
all short, a hard one's all long, which is what makes a real step's batch ragged per group.

Files:
  JSON  {"name": str, "max_new_tokens": int, "source": str, "lengths": [int, ...], "group_size": int (optional)}
  text  one int per line; blank lines and "#" comments ignored; "# max_new_tokens: N" sets the budget
        (default: the longest length)

Named profiles are JSON files shipped in `qerl/data/profiles/` (package data). `load_profile` takes a name
or a path; `draw` resamples whole groups for a benchmark batch.
"""

import json
import random
import statistics
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

# name -> how its file is made (what the error says while the file is not shipped yet)
NAMED = {
    "gsm8k-qwen2.5-coder-1.5b": "recorded on a GPU from Qwen2.5-Coder-1.5B-Instruct on GSM8K (16 prompts x 8, "
                                "<= 512 new tokens, temperature 1): python benchmarks/record_lengths.py "
                                "Qwen/Qwen2.5-Coder-1.5B-Instruct --out src/qerl/data/profiles/"
                                "gsm8k-qwen2.5-coder-1.5b.json",
    "long-reasoning-4096": "generated from published statistics: python benchmarks/make_long_profile.py",
}


class ProfileError(ValueError):
    """A length profile that cannot be used: missing, malformed, or with lengths outside [1, max_new_tokens]."""


@dataclass(frozen=True)
class LengthProfile:
    """lengths: per-row completion lengths, each in [1, max_new_tokens]; group_size: rows per measured prompt
    (the lengths are whole groups in order), or None when the rows are independent draws."""

    name: str
    max_new_tokens: int
    lengths: tuple[int, ...]
    source: str = ""
    group_size: int | None = None

    def __post_init__(self):
        where = self.name or "profile"
        if not self.lengths:
            raise ProfileError(f"{where}: no lengths")
        for i, n in enumerate(self.lengths):
            if isinstance(n, bool) or not isinstance(n, int):
                raise ProfileError(f"{where}: length #{i} is not an int: {n!r}")
            if n < 1:
                raise ProfileError(f"{where}: length #{i} = {n} is outside [1, max_new_tokens]")
        budget = self.max_new_tokens
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise ProfileError(f"{where}: max_new_tokens must be a positive int, got {budget!r}")
        longest = max(self.lengths)
        if longest > budget:
            i = self.lengths.index(longest)
            raise ProfileError(f"{where}: length #{i} = {longest} is outside [1, max_new_tokens = {budget}]")
        g = self.group_size
        if g is not None and (isinstance(g, bool) or not isinstance(g, int) or g < 1 or len(self.lengths) % g):
            raise ProfileError(f"{where}: group_size {g!r} must be a positive int dividing the {len(self.lengths)} "
                               "lengths")

    @property
    def groups(self) -> list[tuple[int, ...]]:
        """The measured groups (one per prompt), or one-row groups when the rows are independent."""
        g = self.group_size or 1
        return [self.lengths[i:i + g] for i in range(0, len(self.lengths), g)]

    def label(self) -> str:
        """How tables name it: "NAME (max M)"."""
        return f"{self.name} (max {self.max_new_tokens})"


def forced_label(completion: int) -> str:
    """How tables name the old mode: every row forced to the same length."""
    return f"forced lengths ({completion})"


# loading ----------------------------------------------------------------------------------------------------


def lengths_label(profile: LengthProfile | None, forced: int) -> str:
    """How results name their completion lengths: the profile's label, or `forced_label(forced)` without one."""
    return forced_label(forced) if profile is None else profile.label()


def profile_record(profile: LengthProfile | None) -> dict | None:
    """A profile as a run's JSON record names it: name, budget, source, row count, group size (None: none)."""
    if profile is None:
        return None
    return dict(name=profile.name, max_new_tokens=profile.max_new_tokens, source=profile.source,
                rows=len(profile.lengths), group_size=profile.group_size)


def _from_json(text: str, where: str) -> LengthProfile:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ProfileError(f"{where}: not JSON ({e.msg}, line {e.lineno})") from None
    if not isinstance(data, dict) or "lengths" not in data or "max_new_tokens" not in data:
        raise ProfileError(f"{where}: a JSON profile is an object with \"max_new_tokens\" and \"lengths\"")
    if not isinstance(data["lengths"], list):
        raise ProfileError(f"{where}: \"lengths\" must be a list of ints")
    return LengthProfile(str(data.get("name") or Path(where).stem), data["max_new_tokens"], tuple(data["lengths"]),
                         str(data.get("source", "")), data.get("group_size"))


def _from_text(text: str, where: str) -> LengthProfile:
    lengths, budget = [], None
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if line.startswith("#"):
            key, _, value = line[1:].partition(":")
            if key.strip() == "max_new_tokens":
                try:
                    budget = int(value)
                except ValueError:
                    raise ProfileError(f"{where}: line {n}: max_new_tokens is not an int: {value.strip()!r}") from None
            continue
        if not line:
            continue
        try:
            lengths.append(int(line))
        except ValueError:
            raise ProfileError(f"{where}: line {n} is not an int: {line!r}") from None
    if not lengths:
        raise ProfileError(f"{where}: no lengths (one int per line)")
    return LengthProfile(Path(where).stem, budget if budget is not None else max(lengths), tuple(lengths),
                         f"lengths file {where}")


def read_profile(path) -> LengthProfile:
    """A profile file: JSON when it ends in .json or starts with "{", else one int per line."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ProfileError(f"{path}: cannot read it ({e.strerror or e})") from None
    if path.suffix == ".json" or text.lstrip().startswith("{"):
        return _from_json(text, str(path))
    return _from_text(text, str(path))


def packaged_path(name: str):
    """Where a named profile's file lives inside the installed package (it may not exist)."""
    return resources.files("qerl.data") / "profiles" / f"{name}.json"


def load_profile(name_or_path) -> LengthProfile:
    """A named profile (NAMED) or a profile file. Raises ProfileError naming how to make a named profile whose
    file is not shipped yet, and the known names for an unknown one."""
    spec = str(name_or_path)
    if Path(spec).is_file():
        return read_profile(spec)
    if spec in NAMED:
        path = packaged_path(spec)
        if not path.is_file():
            raise ProfileError(f"length profile {spec!r} is not recorded yet (no {spec}.json in qerl/data/profiles); "
                               f"it is {NAMED[spec]}")
        return _from_json(path.read_text(), spec)
    raise ProfileError(f"{spec!r} is neither a file nor a named length profile ({', '.join(sorted(NAMED))})")


# drawing ----------------------------------------------------------------------------------------------------


def resolve_lengths(ap, lengths: str | None, forced: int | None, flag: str, default: int, minimum: int):
    """The CLI choice between `--lengths NAME|FILE` and one forced length (`flag`, e.g. "--new"): returns
    (profile or None, forced length or None, the budget max_new_tokens); bad input is `ap.error`."""
    if lengths is None:
        forced = default if forced is None else forced
        if forced < minimum:
            ap.error(f"{flag} must be >= {minimum}")
        return None, forced, forced
    if forced is not None:
        ap.error(f"--lengths draws each row's length; {flag} forces one length for all: give one of them")
    try:
        profile = load_profile(lengths)
    except ProfileError as e:
        ap.error(str(e))
    return profile, None, profile.max_new_tokens


def draw(profile: LengthProfile, n_rows: int, group_size: int, seed: int) -> list[int]:
    """n_rows lengths for a batch of n_rows / group_size prompts x group_size rows (each prompt's rows adjacent),
    the same for the same arguments.

    Every batch group resamples one measured group (uniformly, with replacement over groups): its rows in a
    random order when group_size <= G_p, whole copies plus a random subset when larger. A profile of
    independent rows (no group_size) gives each row an independent draw."""
    if group_size < 1 or n_rows < 1 or n_rows % group_size:
        raise ValueError(f"n_rows ({n_rows}) must be a positive multiple of group_size ({group_size})")
    rng = random.Random(seed)
    if profile.group_size is None:
        return rng.choices(profile.lengths, k=n_rows)
    measured, out = profile.groups, []
    for _ in range(n_rows // group_size):
        g = list(rng.choice(measured))
        rows = g * (group_size // len(g)) + rng.sample(g, group_size % len(g))
        rng.shuffle(rows)
        out.extend(rows)
    return out


def to_json(profile: LengthProfile) -> str:
    """The JSON file text: the fields first, then the lengths one measured group (or 16 rows) per line."""
    head = dict(name=profile.name, max_new_tokens=profile.max_new_tokens, source=profile.source)
    if profile.group_size:
        head["group_size"] = profile.group_size
    per_line = profile.group_size or 16
    lines = [", ".join(map(str, profile.lengths[i:i + per_line])) for i in range(0, len(profile.lengths), per_line)]
    body = ",\n  ".join(lines)
    return json.dumps(head, indent=1)[:-2] + f',\n "lengths": [\n  {body}\n ]\n}}\n'


def summary(lengths, max_new_tokens: int) -> dict:
    """mean / median / p90 / max of `lengths`, and the fraction at the budget (truncated)."""
    s = sorted(lengths)
    return dict(mean=statistics.fmean(s), median=statistics.median(s), p90=s[min(len(s) - 1, int(0.9 * len(s)))],
                max=s[-1], truncated=sum(n >= max_new_tokens for n in s) / len(s))


def describe(profile: LengthProfile) -> str:
    """One line: name, budget, rows, groups, mean / median / p90 / truncated share."""
    st = summary(profile.lengths, profile.max_new_tokens)
    g = profile.group_size
    groups = f", {len(profile.lengths) // g} groups of {g}" if g else ""
    return (f"{profile.label()}: {len(profile.lengths)} rows{groups}; mean {st['mean']:.0f}, "
            f"median {st['median']:.0f}, p90 {st['p90']}, at the budget {100 * st['truncated']:.1f}%")
