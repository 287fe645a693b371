"""Run outputs: `metrics.jsonl` (one line per step, flushed), TensorBoard when installed, PNG plots."""

import json
import math
from pathlib import Path

PLOTTED = (("reward/sampled", "reward"), ("entropy", "policy entropy (nats/token)"), ("aqn_sigma", "AQN sigma"),
           ("response_length", "response length (tokens)"))


class RunLog:
    def __init__(self, run_dir: Path, tensorboard: bool = True):
        self.path = run_dir / "metrics.jsonl"
        self.writer = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(str(run_dir / "tensorboard"))
            except ImportError:  # tensorboard is optional
                self.writer = None

    def log(self, metrics: dict) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}
        with open(self.path, "a") as f:
            f.write(json.dumps(clean) + "\n")
            f.flush()
        if self.writer is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.writer.add_scalar(k, v, metrics["step"])
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def is_run_metrics(path: Path) -> bool:
    """Whether `path` is a metrics.jsonl a qerl run wrote: its first line is a JSON object with an integer "step"
    and a "reward" (a file of the user's by that name is not, and must not be resumed or rewritten)."""
    try:
        with open(path, encoding="utf-8") as f:
            first = json.loads(f.readline())
    except (OSError, ValueError):
        return False
    return isinstance(first, dict) and isinstance(first.get("step"), int) and "reward" in first


def truncate_metrics(path: Path, step: int) -> list[int]:
    """Keep the lines of steps <= `step` (a resumed run redoes the later ones) -> the steps kept.

    A run killed (or out of disk space) in the middle of appending a line leaves it unfinished, without its
    newline: that line is dropped, its step is redone. Any other line that is not JSON, or not a step's row,
    is an error naming it.
    """
    path = Path(path)
    if not path.exists():
        return []
    text = path.read_text()
    complete = text[: text.rfind("\n") + 1]  # "" when not even the first line was finished
    kept, steps = [], []
    for n, line in enumerate(complete.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: line {n} is not JSON ({e.msg}); remove it to resume") from None
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            raise ValueError(f"{path}: line {n} is not a qerl step record (no integer \"step\"): qerl did not write "
                             "this file; move it away, or choose another output_dir")
        if row["step"] <= step:
            kept.append(line + "\n")
            steps.append(row["step"])
    path.write_text("".join(kept))
    return steps


def copy_metrics(source: Path, dest: Path, step: int) -> None:
    """Start `dest` with `source`'s complete lines of steps <= `step` (a run continued from another run's
    checkpoint in a new directory); nothing when `source` is missing."""
    source, dest = Path(source), Path(dest)
    if not source.is_file():
        return
    text = source.read_text()
    lines = [line for line in text[: text.rfind("\n") + 1].splitlines() if line.strip()]
    rows = []
    for line in lines:
        try:
            if json.loads(line).get("step", step + 1) <= step:
                rows.append(line + "\n")
        except (ValueError, AttributeError):
            continue
    dest.write_text("".join(rows))


def _running_mean(values, window: int) -> list[float]:
    """Mean of the last `window` values at each point (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_metrics(metrics_path: Path, out_dir: Path) -> list[Path]:
    """One PNG per plotted quantity (reward, entropy, sigma, length) over steps; [] without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    rows = read_metrics(metrics_path)
    written = []
    for key, label in PLOTTED:
        points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        if not points:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5))
        steps, values = zip(*points)
        ax.plot(steps, values, marker="o", markersize=3, alpha=0.5 if len(points) >= 5 else 1.0, label="per step")
        if len(points) >= 5:  # per-step RL metrics are noisy: show the trend too
            ax.plot(steps, _running_mean(values, max(3, len(points) // 6)), linewidth=2, label="running mean")
            ax.legend()
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = out_dir / f"{key.replace('/', '_')}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written
