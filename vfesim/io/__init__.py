"""Run stores: Zarr trajectories and checkpoints (:mod:`.store`), and reading them (:mod:`.reader`)."""

from .reader import open_run
from .store import Checkpoint, RunStore, StoreError

__all__ = ["Checkpoint", "RunStore", "StoreError", "open_run"]
