"""What the runtime did to a model, attached to it as `model.preshard_report`.

Output values alone cannot show that a hook is in place (a rank missing its CP hooks still computes
the whole sequence and returns the right answer), so tests assert this description instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

REPORT_ATTRIBUTE = "preshard_report"


@dataclass
class LoadReport:
    rank: int
    world_size: int
    mesh: dict[str, Any]
    coords: dict[str, int]
    groups: dict[str, list[int]]
    device: str
    backend: str
    checkpoint: str
    manifest_digest: str = ""  # the digest of the manifest this load read (a pipeline checks it against its record)
    hooks: dict[str, list[str]] = field(default_factory=dict)
    heads_divided: dict[str, list[str]] = field(default_factory=dict)
    buffers_placed: list[str] = field(default_factory=list)
    bytes_read: int = 0
    chunks_read: int = 0
    files_read: list[str] = field(default_factory=list)
    verified: bool = False
    attention_rows: Mapping[str, int] = field(default_factory=dict)  # query rows each CP attention saw, last forward
    input_check: str | None = None  # what every forward does with the inputs across ranks (None: one rank)
    read_seconds: float = 0.0
    total_seconds: float = 0.0
    # Everything load_sharded changed on the model, each with its undo (`runtime/changes.ModelChanges`).
    changes: Any = field(default=None, repr=False)

    def to_dict(self) -> dict[str, Any]:
        """The report as plain data; `read_bytes_per_rank` is this rank's reads, as `plan` and `inspect` count them."""
        data = {k: v for k, v in vars(self).items() if k != "bytes_read"}
        data["attention_rows"] = dict(self.attention_rows)  # CP reads it from the attention routers
        data["changes"] = self.list_changes()
        return {"read_bytes_per_rank": self.bytes_read, **data}

    def list_changes(self) -> list[str]:
        """One line per change load_sharded made on the model (a hook, a swapped class, an attribute, a wrapped
        method and its layers), in the order made; `model.preshard_changes.undo()` takes them back."""
        if self.changes is None or isinstance(self.changes, list):
            return list(self.changes or [])
        return self.changes.describe()

    def __getstate__(self) -> dict[str, Any]:
        """A report sent to another process carries the list of changes, not their undo (bound to this model)."""
        return {**vars(self), "changes": self.list_changes()}

    def add_hook(self, module: str, description: str) -> None:
        self.hooks.setdefault(module, []).append(description)

    def modules_with(self, text: str) -> list[str]:
        """Modules that carry a hook whose description contains `text`."""
        return sorted(m for m, hooks in self.hooks.items() if any(text in h for h in hooks))

    def summary(self) -> str:
        from preshard.units import human_bytes, plural

        return (
            f"rank {self.rank}/{self.world_size} {self.coords} on {self.device}: read {human_bytes(self.bytes_read)} "
            f"from {plural(len(self.files_read), 'file')} in {self.read_seconds:.2f}s "
            f"(load {self.total_seconds:.2f}s), "
            f"{plural(sum(len(h) for h in self.hooks.values()), 'hook')} on {plural(len(self.hooks), 'module')}"
        )
