"""The study runner: several arms x several seeds of `qerl train` on one model, side by side (docs/results.md).

`qerl bench study` / `python -m qerl.study` runs it (`main`). What scripts that read a study's results use:

    parse_arm / parse_arms, Arm, StudyError     an arm spelled FORMAT[-METHOD][/INIT][+aqn[=SIGMA]][:DECAY][@LR]
    aggregate, markdown_table, plot_study       runs -> mean and spread over seeds, the table, the plots
    claims, claims_markdown, compare, ...       the paper's claims checked seed by seed
    lr_groups, best_lrs, lr_sweep_markdown      a learning-rate sweep read from the runs
    run_jobs, write_json_atomic                 subprocess jobs under a deadline; result files written atomically
    config_diffs, scoped_override               comparing resolved configs; a --set item's arm scope

Inside: `arms` (parsing), `runner` (the jobs and the command), `jobs` (processes), `report`, `claims`, `lr`.
"""

from .arms import Arm, StudyError, parse_arm, parse_arms
from .claims import Claim, claims, claims_markdown, compare, diff_text, pooled_std
from .jobs import run_jobs, write_json_atomic
from .lr import best_lrs, lr_groups, lr_sweep_markdown
from .report import aggregate, markdown_table, plot_study
from .runner import config_diffs, main, scoped_override

__all__ = [
    "Arm", "Claim", "StudyError", "aggregate", "best_lrs", "claims", "claims_markdown", "compare", "config_diffs",
    "diff_text", "lr_groups", "lr_sweep_markdown", "main", "markdown_table", "parse_arm", "parse_arms",
    "plot_study", "pooled_std", "run_jobs", "scoped_override", "write_json_atomic",
]
