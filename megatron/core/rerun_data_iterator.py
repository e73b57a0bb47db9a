"""The data iterator of the rerun state machine: it keeps the micro-batches of the current
iteration so that a re-run of the iteration sees exactly the same data."""

from __future__ import annotations

from typing import Any, Iterable, Iterator, List


class RerunDataIterator:
    """A data iterator that records the micro-batches of the current iteration and can replay
    them (``rewind``) for a re-run; ``advance`` forgets them at the next iteration."""

    def __init__(self, iterable: Iterable[Any], record: bool = True) -> None:
        self.iterable: Iterator[Any] = iter(iterable)
        self.record = record
        """False with ``--rerun-mode disabled``: nothing is kept."""
        self.saved_microbatches: List[Any] = []
        self.replaying = False
        self.replay_pos = 0

    def __iter__(self):
        return self

    def __next__(self) -> Any:
        if self.replaying:
            if self.replay_pos >= len(self.saved_microbatches):
                raise RuntimeError(
                    "the re-run asked for more micro-batches than the initial run used "
                    "(the iteration's control flow is not deterministic)"
                )
            batch = self.saved_microbatches[self.replay_pos]
            self.replay_pos += 1
            return batch
        batch = next(self.iterable)
        if self.record:
            self.saved_microbatches.append(batch)
        return batch

    def rewind(self) -> None:
        self.replaying = True
        self.replay_pos = 0

    def advance(self) -> None:
        self.replaying = False
        self.saved_microbatches = []

    def state_dict(self) -> dict:
        return {
            "saved_microbatches": self.saved_microbatches,
            "replaying": self.replaying,
            "replay_pos": self.replay_pos,
        }

    def load_state_dict(self, state: dict) -> None:
        self.saved_microbatches = list(state["saved_microbatches"])
        self.replaying = bool(state["replaying"])
        self.replay_pos = int(state["replay_pos"])
