"""What separates two models' scores on the same problems, from their kept completions: `qerl eval --out` files
(per-problem JSONL: question, answer, completions, rewards, lengths) of several models on one problem set.

    qerl eval qwen2.5-coder-1.5b-instruct --dataset gsm8k-offline:heldout --greedy --out bf16.jsonl
    qerl eval ... --format nvfp4 --keep-bf16 last:2 --out rtn.jsonl       (and an AWQ model: --out awq.jsonl)
    python benchmarks/completion_forms.py bf16.jsonl rtn.jsonl awq.jsonl --names bf16,rtn,awq --max-new-tokens 512

Every completion is scored again here (`qerl.rewards.scores.score`: flexible and strict, an answer extracted at
all, the requested format followed) with the answer style the prompt asked for (--style, default gsm8k: "####").
Per model: pass@1 both ways, no-answer and format shares, the final answer's marker (`####`, `\\boxed{}`,
`<answer>`, none), mean length and the share cut at --max-new-tokens; and the solution's form: the share of
completions that write a code block (a coder model often answers by writing a program it cannot run and then
stating its output), with pass@1 among those that do and those that do not; per pair, the problems by the form
each model used (code or prose) and how many each got right in each kind, so a gain that comes from switching
form on the same problems is told from one within a form. Per pair of models, on the first completion
of each problem (the greedy one): how often both, one or neither are right, and for the problems only the
first is right, what the second did instead: no answer because it was cut off, no answer otherwise, a wrong
answer in the same marker, a wrong answer in another marker. The tables go to stdout, everything to --out (JSON).
"""

import argparse
import json
import re
import sys
from collections import Counter
from itertools import combinations
from pathlib import Path

MARKERS = ("gsm8k", "boxed", "answer_tag", "none")
CODE_FENCE = re.compile(r"^[ \t]*```[ \t]*([A-Za-z0-9_+-]*)[^\n`]*$", re.M)  # a fence line and its language
PYTHON_FENCES = ("python", "py", "python3", "")
FORM = {True: "code", False: "prose"}
FAILURES = ("cut off, no answer", "no answer", "wrong, same marker", "wrong, other marker")


def read_run(path: Path) -> list[dict]:
    """The problems of one `qerl eval --out` file, in file order; ValueError naming the file and line when a line
    is not such a record."""
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
            if not isinstance(row, dict) or not {"question", "answer", "completions"} <= row.keys():
                raise ValueError(f"{path}:{n}: not a `qerl eval --out` record (question, answer, completions)")
            rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no problems")
    return rows


def marker_of(text: str) -> str:
    """The style of the completion's final answer marker, "none" without one."""
    from qerl.rewards.extract import final_answer

    found = final_answer(text)
    return "none" if found is None else found.style


def writes_code(text: str) -> bool:
    """Whether the completion opens a fenced block of Python: ```python / ```py / ```python3, or a bare ``` fence
    (the model's usual way to start a program). Fences pair up in order, so a block's closing ``` never counts,
    and a ```json / ```text / ```bash block is not code here."""
    openings = [m.group(1).lower() for m in CODE_FENCE.finditer(text)][::2]
    return any(lang in PYTHON_FENCES for lang in openings)


def completion_facts(row: dict, style: str | None, max_new_tokens: int | None) -> list[dict]:
    """Per completion of a problem: flexible, strict, extractable, follows_format, marker, length, cut."""
    from qerl.rewards.scores import score

    lengths = row.get("lengths") or [None] * len(row["completions"])
    out = []
    for text, n in zip(row["completions"], lengths):
        s = score(text, row["answer"], style)
        out.append(dict(flexible=bool(s.flexible), strict=bool(s.strict), extractable=s.extractable,
                        follows_format=s.follows_format, marker=marker_of(text), code=writes_code(text), length=n,
                        cut=max_new_tokens is not None and n is not None and n >= max_new_tokens))
    return out


def run_summary(facts: list[list[dict]]) -> dict:
    """One model's shares over all completions (pass@1 as the mean over problems of the mean over samples)."""
    flat = [c for cs in facts for c in cs]
    lengths = [c["length"] for c in flat if c["length"] is not None]
    per = lambda key: sum(sum(c[key] for c in cs) / len(cs) for cs in facts) / len(facts)  # noqa: E731
    markers = Counter(c["marker"] for c in flat)
    coded = [c for c in flat if c["code"]]
    prose = [c for c in flat if not c["code"]]
    right = lambda cs: sum(c["flexible"] for c in cs) / len(cs) if cs else None  # noqa: E731
    return {"problems": len(facts), "completions": len(flat), "pass@1": per("flexible"),
            "pass@1_strict": per("strict"), "no_answer": sum(not c["extractable"] for c in flat) / len(flat),
            "format_followed": sum(c["follows_format"] for c in flat) / len(flat),
            "markers": {m: markers.get(m, 0) / len(flat) for m in MARKERS},
            "mean_length": sum(lengths) / len(lengths) if lengths else None,
            "cut": sum(c["cut"] for c in flat) / len(flat),
            "code": len(coded) / len(flat), "pass@1_code": right(coded), "pass@1_prose": right(prose)}


def failure_kind(winner: dict, loser: dict) -> str:
    """What a model did on a problem another model got right (first completions of each)."""
    if not loser["extractable"]:
        return FAILURES[0] if loser["cut"] else FAILURES[1]
    return FAILURES[2] if loser["marker"] == winner["marker"] else FAILURES[3]


def pair_table(a: list[list[dict]], b: list[list[dict]]) -> dict:
    """Agreement of two models' first completions, and what each did where only the other was right (with the
    problem indices of each kind)."""
    both = neither = 0
    only = {"a": Counter(), "b": Counter()}
    left_code = {"a": 0, "b": 0}  # only this side right, and it wrote prose where the other wrote code
    where = {"a": {k: [] for k in FAILURES}, "b": {k: [] for k in FAILURES}}
    for i, (ca, cb) in enumerate(zip(a, b)):
        x, y = ca[0], cb[0]
        if x["flexible"] and y["flexible"]:
            both += 1
        elif not x["flexible"] and not y["flexible"]:
            neither += 1
        else:
            side, win, lose = ("a", x, y) if x["flexible"] else ("b", y, x)
            kind = failure_kind(win, lose)
            only[side][kind] += 1
            where[side][kind].append(i)
            left_code[side] += lose["code"] and not win["code"]
    forms = {}  # by (A's form -> B's form): problems, right by A, right by B (first completions)
    for ca, cb in zip(a, b):
        x, y = ca[0], cb[0]
        cell = forms.setdefault(f"{FORM[x['code']]} -> {FORM[y['code']]}", [0, 0, 0])
        cell[0], cell[1], cell[2] = cell[0] + 1, cell[1] + x["flexible"], cell[2] + y["flexible"]
    return {"both": both, "neither": neither, "only_a": dict(only["a"]), "only_b": dict(only["b"]),
            "only_a_prose_over_code": left_code["a"], "only_b_prose_over_code": left_code["b"],
            "forms": {k: dict(zip(("problems", "right_a", "right_b"), v)) for k, v in sorted(forms.items())},
            "problems": where}


def check_same_problems(runs: dict[str, list[dict]]) -> None:
    """Every run must hold the same questions in the same order (a pair compares problem by problem)."""
    names = list(runs)
    first = [r["question"] for r in runs[names[0]]]
    for name in names[1:]:
        other = [r["question"] for r in runs[name]]
        if other != first:
            n = next((i for i, (p, q) in enumerate(zip(first, other)) if p != q), min(len(first), len(other)))
            raise ValueError(f"{name}: not the problems of {names[0]} in the same order ({len(other)} vs "
                             f"{len(first)} problems; first difference at problem {n})")


def tables(summaries: dict[str, dict], pairs: dict[tuple[str, str], dict]) -> str:
    lines = ["| model | problems | pass@1 | strict | no answer | format followed | #### / boxed / tag / none | "
             "mean tokens | cut | writes code | pass@1 code / prose |",
             "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---|"]
    share = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    for name, s in summaries.items():
        m = " / ".join(f"{s['markers'][k]:.2f}" for k in MARKERS)
        length = "-" if s["mean_length"] is None else f"{s['mean_length']:.1f}"
        lines.append(f"| {name} | {s['problems']} | {s['pass@1']:.3f} | {s['pass@1_strict']:.3f} | "
                     f"{s['no_answer']:.3f} | {s['format_followed']:.3f} | {m} | {length} | {s['cut']:.3f} | "
                     f"{s['code']:.3f} | {share(s['pass@1_code'])} / {share(s['pass@1_prose'])} |")
    lines += ["", "| A vs B | both right | neither | only A | only B | where only A is right, B: "
              + " / ".join(FAILURES) + " | where only B is right, A: (same) | of only A / only B: the right one in "
              "prose, the other in code |", "|---|---:|---:|---:|---:|---|---|---|"]
    for (a, b), p in pairs.items():
        kinds_a = " / ".join(str(p["only_a"].get(k, 0)) for k in FAILURES)
        kinds_b = " / ".join(str(p["only_b"].get(k, 0)) for k in FAILURES)
        lines.append(f"| {a} vs {b} | {p['both']} | {p['neither']} | {sum(p['only_a'].values())} | "
                     f"{sum(p['only_b'].values())} | {kinds_a} | {kinds_b} | "
                     f"{p['only_a_prose_over_code']} / {p['only_b_prose_over_code']} |")
    lines += ["", "| A vs B | A's form -> B's form: problems, right by A -> right by B (each kind) |", "|---|---|"]
    for (a, b), p in pairs.items():
        cells = "; ".join(f"{k}: {v['problems']}, {v['right_a']} -> {v['right_b']}" for k, v in p["forms"].items())
        lines.append(f"| {a} vs {b} | {cells} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="`qerl eval --out` files, one per model, same problems")
    ap.add_argument("--names", help="comma list, one per file (default: the file names)")
    ap.add_argument("--style", default="gsm8k", help="the answer style the prompt asked for: gsm8k, boxed, "
                                                     "answer_tag, or none")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="the eval's token budget (cut completions)")
    ap.add_argument("--out", type=Path, help="write everything as JSON here")
    args = ap.parse_args(argv)
    names = args.names.split(",") if args.names else [p.stem for p in args.runs]
    if len(names) != len(args.runs) or len(set(names)) != len(names):
        ap.error(f"--names: {len(args.runs)} distinct names needed, got {names}")
    style = None if args.style == "none" else args.style
    try:
        runs = {name: read_run(path) for name, path in zip(names, args.runs)}
        check_same_problems(runs)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    facts = {name: [completion_facts(r, style, args.max_new_tokens) for r in rows] for name, rows in runs.items()}
    summaries = {name: run_summary(f) for name, f in facts.items()}
    pairs = {(a, b): pair_table(facts[a], facts[b]) for a, b in combinations(names, 2)}
    print(tables(summaries, pairs))
    if args.out:
        args.out.write_text(json.dumps({"style": args.style, "max_new_tokens": args.max_new_tokens,
                                        "summaries": summaries,
                                        "pairs": {f"{a} vs {b}": p for (a, b), p in pairs.items()}}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
