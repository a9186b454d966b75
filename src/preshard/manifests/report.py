"""Human-readable views of a manifest (for `preshard inspect` and the converter's last line)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from preshard.manifests.schema import Manifest
from preshard.mesh import MeshSpec


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def rank_read_bytes(manifest: Manifest, tp_rank: int) -> tuple[int, int]:
    """(bytes of this TP rank's own slices, bytes of replicated tensors it also reads)."""
    own = shared = 0
    for chunks in manifest.chunks_for_tp_rank(tp_rank).values():
        for c in chunks:
            if c.tp_rank is None:
                shared += c.data_length
            else:
                own += c.data_length
    return own, shared


def total_tensor_bytes(manifest: Manifest) -> int:
    return sum(c.data_length for t in manifest.tensors.values() for c in t.chunks)


def summary_line(manifest: Manifest, output: str | Path) -> str:
    mesh = MeshSpec.from_dict(manifest.mesh)
    size = sum(f.size for f in manifest.files)
    return (
        f"wrote {output}: {len(manifest.tensors)} tensors, {len(manifest.files)} data files, "
        f"{human_bytes(size)}, mesh {mesh.describe()}, plan {manifest.plan.get('name')}"
    )


def inspect_table(manifest: Manifest) -> str:
    mesh = MeshSpec.from_dict(manifest.mesh)
    total = total_tensor_bytes(manifest)
    styles = Counter(t.style for t in manifest.tensors.values())
    lines = [
        f"preshard checkpoint (manifest v{manifest.version}, preshard {manifest.preshard_version}, {manifest.created})",
        f"source:  {manifest.source.kind} {manifest.source.path} ({len(manifest.source.files)} files)",
        f"plan:    {manifest.plan.get('name')}  " + ", ".join(f"{n} {s}" for s, n in sorted(styles.items())),
        f"mesh:    {mesh.describe()}, world size {mesh.world_size}",
        f"tensors: {len(manifest.tensors)}, {human_bytes(total)}"
        + (f", cast to {manifest.dtype}" if manifest.dtype else ""),
        "",
        f"{'file':<16} {'tp rank':>7} {'size':>12}  xxh3_128",
    ]
    for f in manifest.files:
        lines.append(f"{f.name:<16} {f.tp_rank:>7} {human_bytes(f.size):>12}  {f.xxh3_128}")
    lines += [
        "",
        f"{'tp rank':>7} {'own slices':>12} {'replicated':>12} {'reads':>12} {'of total':>9}  ranks",
    ]
    for r in range(mesh.tp):
        own, shared = rank_read_bytes(manifest, r)
        ranks = [rec.rank for rec in manifest.ranks if rec.coords["tp"] == r]
        share = (own + shared) / total if total else 0.0
        lines.append(
            f"{r:>7} {human_bytes(own):>12} {human_bytes(shared):>12} {human_bytes(own + shared):>12} "
            f"{share:>8.1%}  {_ranges(ranks)}"
        )
    return "\n".join(lines)


def _ranges(ranks: list[int]) -> str:
    return ",".join(map(str, ranks)) if len(ranks) <= 8 else f"{','.join(map(str, ranks[:8]))},... ({len(ranks)})"
