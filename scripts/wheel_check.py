"""Drive an installed preshard (a wheel, no extras) from outside the source tree, as a new user would.

Run by `.ci/wheel` with the fresh venv's interpreter, in an empty temporary folder: it writes a small checkpoint of
a plain `nn.Module` (no diffusers) with real values, then runs every command through the installed console scripts
(`convert-checkpoint`, `preshard verify/inspect/plan/reshard/unshard`, `python -m preshard`) and a 2-rank
`load_sharded` under torchrun, and checks each: exit status 0, no traceback and no warning on stderr (torch's
"Failed to initialize NumPy" among them), outputs that agree (the 2-rank sharded forward equals the unsharded one,
unshard gives back the source bytes, a re-run is "already converted").

    python scripts/wheel_check.py [H3_SOURCE]   # one line per step, exit 1 at the first failure; H3_SOURCE: a
                                                # MiniMax-H3 checkpoint to convert and verify too
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

MODEL = textwrap.dedent(
    """
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, width=64, hidden=128):
            super().__init__()
            self.norm = nn.LayerNorm(width)
            self.fc1 = nn.Linear(width, hidden)
            self.fc2 = nn.Linear(hidden, width)

        def forward(self, x):
            return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))

    class Tiny(nn.Module):
        def __init__(self, layers=3, width=64):
            super().__init__()
            self.proj_in = nn.Linear(16, width)
            self.blocks = nn.ModuleList(Block(width) for _ in range(layers))
            self.proj_out = nn.Linear(width, 16)

        def forward(self, x):
            x = self.proj_in(x)
            for block in self.blocks:
                x = block(x)
            return self.proj_out(x)
    """
)

PLAN = {
    "format": 1,
    "name": "tiny",
    "linear": [{"match": "blocks.*.fc1", "style": "colwise"}, {"match": "blocks.*.fc2", "style": "rowwise"}],
}

WRITE = MODEL + textwrap.dedent(
    """
    import json, struct, sys
    from preshard.examples.synthetic import safetensors_header

    torch.manual_seed(0)
    state = {k: v.contiguous() for k, v in Tiny().state_dict().items()}
    specs = {k: ("F32", tuple(v.shape)) for k, v in state.items()}
    header, _ = safetensors_header(specs)
    meta = json.loads(header[8:])
    order = sorted((k for k in meta if k != "__metadata__"), key=lambda k: meta[k]["data_offsets"][0])
    folder = sys.argv[1]
    with open(f"{folder}/diffusion_pytorch_model.safetensors", "wb") as f:
        f.write(header)
        for k in order:
            f.write(state[k].numpy().tobytes())
    with open(f"{folder}/config.json", "w") as f:
        json.dump({"_class_name": "Tiny", "layers": 3}, f)
    torch.save({"inputs": torch.randn(2, 5, 16), "state": state}, f"{folder}/../reference.pt")
    """
)

LOAD = MODEL + textwrap.dedent(
    """
    import sys
    import torch.distributed as dist
    from preshard import load_sharded

    checkpoint, reference = sys.argv[1], sys.argv[2]
    data = torch.load(reference, weights_only=True)
    model = load_sharded(lambda: Tiny(), checkpoint, device="cpu")
    full = Tiny()
    full.load_state_dict(data["state"])
    with torch.no_grad():
        diff = (model(data["inputs"]) - full(data["inputs"])).abs().max().item()
    report = model.preshard_report
    hooks = len(report.modules_with("tp:"))
    assert dist.get_world_size() == 2 and hooks == 3, (dist.get_world_size(), report.hooks)  # the rowwise fc2s
    assert diff < 1e-5, diff
    print(f"rank {dist.get_rank()}: max abs diff {diff:.1e}, {hooks} TP hooks, read {report.bytes_read} B", flush=True)
    dist.destroy_process_group()
    """
)


def run(step: str, command: list[str], cwd: Path, env: dict[str, str], expect: int = 0) -> str:
    proc = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    problems = []
    if proc.returncode != expect:
        problems.append(f"exit status {proc.returncode}, expected {expect}")
    for bad in ("Traceback", "Warning", "warning:", "Failed to initialize NumPy"):
        if bad in proc.stderr:
            problems.append(f"{bad!r} on stderr")
    if problems:
        print(f"FAILED {step}: {'; '.join(problems)}\n$ {' '.join(command)}")
        print(proc.stdout[-3000:] + proc.stderr[-3000:])
        sys.exit(1)
    print(f"ok  {step}")
    return proc.stdout


def main() -> None:
    bindir = Path(sys.executable).parent
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONWARNINGS")}
    env |= {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "default"}  # warnings shown, so that one fails the step
    with tempfile.TemporaryDirectory(prefix="preshard-wheel-") as tmp:
        root = Path(tmp)
        (root / "src").mkdir()
        (root / "plan.json").write_text(json.dumps(PLAN))
        (root / "write.py").write_text(WRITE)
        (root / "load.py").write_text(LOAD)
        py, preshard, convert = str(sys.executable), str(bindir / "preshard"), str(bindir / "convert-checkpoint")

        where = run("import the installed wheel", [py, "-c", "import preshard; print(preshard.__file__)"], root, env)
        if "site-packages" not in where:
            sys.exit(f"FAILED: preshard imported from {where.strip()}, not from the installed wheel")
        run("python -m preshard --version", [py, "-m", "preshard", "--version"], root, env)
        run("write a plain nn.Module checkpoint", [py, "write.py", "src"], root, env)
        args = ["src", "tp2", "--tp", "2", "--plan", "plan.json", "--no-progress"]
        run("convert-checkpoint --dry-run", [convert, *args, "--dry-run"], root, env)
        done = json.loads(run("convert-checkpoint", [convert, *args, "--json"], root, env))
        assert done["status"] == "converted", done
        again = json.loads(run("convert-checkpoint again", [convert, *args, "--json"], root, env))
        assert again["status"] == "already converted", again
        run("preshard verify --source", [preshard, "verify", "tp2", "--source", "src"], root, env)
        inspected = json.loads(run("preshard inspect --json", [preshard, "inspect", "tp2", "--json"], root, env))
        plan = json.loads(
            run("preshard plan --json", [preshard, "plan", "src", "--plan", "plan.json", "--devices", "2", "--json"],
                root, env)
        )  # fmt: skip
        (mesh,) = [m for m in plan["meshes"] if m["tp"] == 2]
        assert mesh["read_bytes_per_rank"] == inspected["read_bytes_per_rank"], (mesh, inspected)
        run("preshard reshard --tp 1", [preshard, "reshard", "tp2", "tp1", "--tp", "1", "-q"], root, env)
        run("preshard unshard", [preshard, "unshard", "tp1", "back", "-q"], root, env)
        name = "diffusion_pytorch_model.safetensors"
        if (root / "back" / name).read_bytes() != (root / "src" / name).read_bytes():
            sys.exit("FAILED: unshard did not give back the source bytes")
        torchrun = [py, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1"]
        torchrun += ["--master-port", str(_free_port())]
        out = run("2-rank load_sharded under torchrun", [*torchrun, "load.py", "tp2", "reference.pt"], root, env)
        print(textwrap.indent(out.strip(), "    "))
        if len(sys.argv) > 1:  # a MiniMax-H3 checkpoint: the built-in plan, without diffusers
            h3 = sys.argv[1]
            run(
                "convert MiniMax-H3 (no diffusers)",
                [convert, h3, "h3-tp2", "--tp", "2", "--ulysses", "2", "-q"],
                root,
                env,
            )
            run("verify MiniMax-H3 against its source", [preshard, "verify", "h3-tp2", "--source", h3], root, env)
    print("wheel check: every step passed")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    main()
