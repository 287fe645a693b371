"""What the benchmarks share: the completion-length profile and kernel-routing options, usage errors, the run's
arguments as its JSON record keeps them, freeing the GPU between models, and Markdown table headers."""

import gc

import torch

from ..data.length_profiles import NAMED, profile_record


def add_lengths_option(ap) -> None:
    ap.add_argument("--lengths", default=None,
                    help=f"completion-length profile: a name ({', '.join(NAMED)}) or a file (JSON, or one int per "
                         "line); rows are forced to lengths drawn from it, whole groups at a time")


def add_policy_option(ap, examples: str) -> None:
    ap.add_argument("--policy", default="",
                    help="kernel routing thresholds for this run, FIELD=VALUE,... (qerl.kernels.route.KernelPolicy, "
                         f"e.g. {examples})")


def or_error(ap, fn, *args):
    """fn(*args), a ValueError it raises reported as the parser's usage error (exit status 2)."""
    try:
        return fn(*args)
    except ValueError as e:
        ap.error(str(e))


def parse_policy(ap, args) -> None:
    """args.policy as the routing overrides it names (`kernels.route.parse_policy_overrides`); an error names it."""
    from ..kernels.route import parse_policy_overrides

    args.policy = or_error(ap, parse_policy_overrides, args.policy)


def args_json(args) -> dict:
    """The run's arguments as JSON values: the profile as its name, budget, source and row count."""
    from ..kernels.route import policy_overrides_json

    out = {k: v for k, v in vars(args).items() if k != "profile"}
    out["policy"] = policy_overrides_json(args.policy)
    out["profile"] = profile_record(args.profile)
    return out


def md_header(columns: str, align: str = "") -> str:
    """A Markdown table's header and rule lines: columns "a | b | c"; align one letter per column, "r" for a
    right-aligned column ("---:"), any other letter or none for the default."""
    rule = "".join("---:|" if a == "r" else "---|" for a in align.ljust(len(columns.split(" | "))))
    return f"| {columns} |\n|{rule}"


def free_gpu() -> None:
    gc.collect()
    torch.cuda.empty_cache()
