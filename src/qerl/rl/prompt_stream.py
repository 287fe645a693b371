"""An endless, seeded stream of training problems: reshuffled each epoch, resumable from its position."""

import random


class PromptStream:
    """Yields rows of `rows` in a per-epoch shuffled order; `state()` / `load_state()` resume exactly."""

    def __init__(self, rows: list[dict], seed: int = 0):
        if not rows:
            raise ValueError("the training set is empty")
        self.rows, self.seed = rows, seed
        self.epoch, self.index = 0, 0
        self._order = self._shuffled(0)

    def _shuffled(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def take(self, n: int) -> list[dict]:
        out = []
        while len(out) < n:
            if self.index == len(self._order):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._shuffled(self.epoch)
            out.append(self.rows[self._order[self.index]])
            self.index += 1
        return out

    def state(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "size": len(self.rows)}

    def load_state(self, state: dict) -> None:
        if state["size"] != len(self.rows):
            raise ValueError(f"the checkpoint's data position is for {state['size']} problems, "
                             f"this dataset has {len(self.rows)}")
        self.seed, self.epoch, self.index = state["seed"], state["epoch"], state["index"]
        self._order = self._shuffled(self.epoch)
