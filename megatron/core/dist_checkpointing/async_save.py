"""Write a sharded checkpoint in the background while training goes on.

:class:`AsyncSave` copies the chunks this rank saves into private CPU tensors (so the training
step may change the parameters at once) and runs :func:`serialization.save_shards` in a thread. The
thread's collectives run on the process group given, which must be used by nothing else
meanwhile (a dedicated gloo group): the training thread keeps using the others.

The caller decides when the save is over: :meth:`done` is local; every rank must call
:meth:`wait` before the checkpoint is marked complete (metadata.json, tracker).
"""

from __future__ import annotations

import copy
import threading
from typing import Dict, Optional

from .mapping import Chunk, ShardedObject, ShardedTensor


def stage(sharded_state_dict: Dict[str, ShardedTensor]) -> Dict[str, ShardedTensor]:
    """Private CPU copies of the chunks (and objects) this rank writes (replicas are left out).

    Each chunk becomes its own compact entry (named ``<entry name>@<global offset>``), so the
    copy holds only what is written; the planner finds chunks by checkpoint key and offset.
    """
    staged = {}
    for name, entry in sharded_state_dict.items():
        if entry.replica:
            continue
        if isinstance(entry, ShardedObject):
            staged[name] = copy.deepcopy(entry)
            continue
        for chunk in entry.chunks:
            data = entry.view(chunk).detach().to("cpu", copy=True).contiguous()
            zeros = (0,) * len(chunk.shape)
            staged[f"{name}@{chunk.global_offset}"] = ShardedTensor(
                entry.key,
                data,
                entry.global_shape,
                (Chunk(chunk.global_offset, zeros, chunk.shape),),
            )
    return staged


class AsyncSave:
    """One checkpoint being written by a background thread."""

    def __init__(
        self, sharded_state_dict: Dict[str, ShardedTensor], directory: str, process_group=None
    ):
        self.directory = directory
        self.error: Optional[BaseException] = None
        self._staged = stage(sharded_state_dict)
        # Imported here (in the caller's thread, before the writer starts), not at module level:
        # torch.distributed.checkpoint is start-up time a run saving no torch_dist checkpoint skips.
        from .serialization import save_shards

        self._thread = threading.Thread(
            target=self._run,
            args=(save_shards, process_group),
            name="async-checkpoint-save",
            daemon=True,
        )
        self._thread.start()

    def _run(self, save_shards, process_group) -> None:
        try:
            save_shards(self._staged, self.directory, process_group=process_group)
        except BaseException as exc:  # re-raised in the training thread by wait()
            self.error = exc
        finally:
            self._staged = None

    def done(self) -> bool:
        """True once this rank's part is written (or failed)."""
        return not self._thread.is_alive()

    def wait(self) -> None:
        """Block until this rank's part is written; re-raise a failure of the writer thread."""
        self._thread.join()
        if self.error is not None:
            raise self.error
