"""`preshard demo`: the whole path on an embedded example, on this machine's CPU.

Generates a small seeded MiniMax-H3 checkpoint, converts it for a TP x CP mesh, launches a gloo job
with torchrun, loads each rank's shard with `load_sharded`, runs one forward pass on a packed
video/text/audio sequence, and compares it with the unsharded model.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from preshard.errors import PreshardError

TOLERANCE = 1e-5


def run_demo(
    tp: int = 2, ring: int = 1, ulysses: int = 2, seq_len: int = 37, workdir: str | Path | None = None,
    timeout: float = 600.0, echo=print,
) -> dict:  # fmt: skip
    from preshard.converter.convert import convert_checkpoint
    from preshard.examples.minimax_h3 import build_model, make_inputs, reference_forward, save_checkpoint
    from preshard.format.mesh import MeshSpec

    mesh = MeshSpec(tp=tp, ring=ring, ulysses=ulysses)
    with tempfile.TemporaryDirectory(prefix="preshard-demo-") as scratch:
        root = Path(workdir) if workdir else Path(scratch)
        root.mkdir(parents=True, exist_ok=True)
        model = build_model(dtype="float32", seed=0)
        source = save_checkpoint(model, root / "source")
        echo(f"1. wrote a random MiniMax-H3 checkpoint ({sum(p.numel() for p in model.parameters()):,} parameters)")
        ckpt = root / f"tp{tp}-ring{ring}-ulysses{ulysses}"
        convert_checkpoint(source, ckpt, tp=tp, ring=ring, ulysses=ulysses, overwrite=True, progress=False)
        echo(f"2. converted it for {mesh.describe()} into {ckpt.name}/")
        inputs = make_inputs(model.config, seq_len, seed=1)
        torch.save({"inputs": inputs, "reference": reference_forward(model, inputs)}, root / "reference.pt")
        echo(f"3. launching torchrun with {mesh.world_size} gloo ranks, packed sequence of {seq_len} rows")
        started = time.perf_counter()
        _torchrun(mesh.world_size, [str(ckpt), str(root / "reference.pt"), str(root / "result.json")], timeout)
        result = json.loads((root / "result.json").read_text())
        result["seconds"] = time.perf_counter() - started
    _print_result(result, echo)
    if result["max_abs_diff"] > TOLERANCE:
        raise PreshardError(f"demo: sharded output differs from the unsharded model by {result['max_abs_diff']:.2e}")
    return result


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(world_size: int, args: list[str], timeout: float) -> None:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(world_size),
        "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), "-m", "preshard.demo", *args,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    try:
        done = subprocess.run(command, env=env, timeout=timeout, capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        raise PreshardError(f"demo: the torchrun job did not finish within {timeout:.0f} s") from None
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
        raise PreshardError(f"demo: the torchrun job failed with exit status {done.returncode} (its output is above)")


def _print_result(result: dict, echo) -> None:
    echo("4. per rank:")
    for r in result["ranks"]:
        echo(
            f"   rank {r['rank']} {r['coords']}: read {r['bytes_read']:,} B of {result['checkpoint_bytes']:,} B, "
            f"{r['tp_hooks']} TP hooks, {r['cp_hooks']} CP hooks, attention saw {r['attention_rows']} query rows"
        )
    verdict = "OK" if result["max_abs_diff"] <= TOLERANCE else "MISMATCH"
    echo(
        f"5. sharded vs unsharded forward: max abs diff {result['max_abs_diff']:.2e} (tolerance {TOLERANCE:g}) "
        f"-> {verdict}; torchrun job took {result['seconds']:.1f} s"
    )


def _rank_main(checkpoint: str, reference: str, result_path: str) -> None:
    """Runs in each torchrun rank."""
    import torch.distributed as dist
    from diffusers import MiniMaxH3Transformer3DModel

    from preshard.runtime.load import load_sharded

    torch.set_num_threads(1)
    model = load_sharded(MiniMaxH3Transformer3DModel, checkpoint, device="cpu")
    data = torch.load(reference, weights_only=True)
    with torch.no_grad():
        outputs = model(**data["inputs"], return_dict=False)
    diff = max((o - r).abs().max().item() for o, r in zip(outputs, data["reference"]))
    report = model.preshard_report
    mine = {
        "rank": report.rank,
        "coords": report.coords,
        "bytes_read": report.bytes_read,
        "tp_hooks": len(report.modules_with("tp:")),
        "cp_hooks": sum(h.startswith("cp:") for hooks in report.hooks.values() for h in hooks),
        "attention_rows": sorted(set(report.attention_rows.values())) or "all",
        "max_abs_diff": diff,
    }
    gathered = [None] * dist.get_world_size() if dist.is_initialized() else [mine]
    if dist.is_initialized():
        dist.all_gather_object(gathered, mine)
    if report.rank == 0:
        total = sum(f.stat().st_size for f in Path(checkpoint).glob("*.distcp"))
        result = {
            "ranks": gathered,
            "max_abs_diff": max(r["max_abs_diff"] for r in gathered),
            "checkpoint_bytes": total,
        }
        Path(result_path).write_text(json.dumps(result))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    _rank_main(*sys.argv[1:4])
