"""What tests/xla/test_xla.py runs in fresh processes (torch_xla's runtime is per process and sticky).

    python _xla_job.py prepare DIR          seeded fp32 MiniMax-H3 -> DIR/src, converted DIR/tp1 and DIR/tp2,
                                            the unsharded CPU outputs in DIR/reference.pt
    python _xla_job.py load-tp1 DIR         load DIR/tp1 on xla, forward, print the max abs diff vs reference
    python _xla_job.py detect               device=None after importing the diffusers model class
    torchrun ... _xla_job.py load DIR/tp2   load on xla under torchrun (user-level errors: one line, exit 2)
    torchrun ... _xla_job.py load-env DIR/tp2   the same after the user created the group with env://

Every result is one JSON line on stdout prefixed with RESULT.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from preshard.errors import PreshardError

SEQ_LEN = 13


def _result(**values) -> None:
    print("RESULT " + json.dumps(values), flush=True)


def prepare(root: Path) -> None:
    from preshard.converter.convert import convert_checkpoint
    from preshard.examples.minimax_h3 import build_model, make_inputs, reference_forward, save_checkpoint, tiny_config

    model = build_model(dtype="float32")
    source = save_checkpoint(model, root / "src")
    for tp in (1, 2):
        convert_checkpoint(source, root / f"tp{tp}", tp=tp, progress=False)
    inputs = make_inputs(tiny_config(), SEQ_LEN)
    torch.save({"inputs": inputs, "outputs": reference_forward(model, inputs)}, root / "reference.pt")
    _result(ok=True)


def load_tp1(root: Path) -> None:
    from diffusers import MiniMaxH3Transformer3DModel

    from preshard.runtime.load import load_sharded

    model = load_sharded(MiniMaxH3Transformer3DModel, root / "tp1", device="xla")
    saved = torch.load(root / "reference.pt")
    device = next(model.parameters()).device
    inputs = {k: v.to(device) for k, v in saved["inputs"].items()}
    with torch.no_grad():
        outputs = [o.cpu() for o in model(**inputs, return_dict=False)]
    diffs = [(o - r).abs().max().item() for o, r in zip(outputs, saved["outputs"])]
    report = model.preshard_report
    _result(
        device=str(device),
        backend=report.backend,
        max_abs_diff=max(diffs),
        shapes_match=all(o.shape == r.shape for o, r in zip(outputs, saved["outputs"])),
    )


def detect() -> None:
    import os

    from diffusers import MiniMaxH3Transformer3DModel  # noqa: F401  imports torch_xla, which sets PJRT_DEVICE

    from preshard.runtime.devices import init_rank_device

    rd = init_rank_device(None)
    _result(
        kind=rd.kind,
        backend=rd.backend,
        device=str(rd.device),
        pjrt_device=os.environ.get("PJRT_DEVICE"),
        torch_xla_imported="torch_xla" in sys.modules,
    )


def load(checkpoint: Path, user_env_group: bool) -> None:
    import torch.distributed as dist
    from diffusers import MiniMaxH3Transformer3DModel

    from preshard.runtime.load import load_sharded

    if user_env_group:
        import torch_xla.distributed.xla_backend  # noqa: F401  registers the backend

        dist.init_process_group("xla")  # env://, as the reproduction did
    model = load_sharded(MiniMaxH3Transformer3DModel, checkpoint, device="xla")
    _result(loaded=True, rank=model.preshard_report.rank)  # reaching this on PJRT CPU at tp=2 is the bug


def main(argv: list[str]) -> int:
    command, *args = argv
    try:
        if command == "prepare":
            prepare(Path(args[0]))
        elif command == "load-tp1":
            load_tp1(Path(args[0]))
        elif command == "detect":
            detect()
        elif command in ("load", "load-env"):
            load(Path(args[0]), user_env_group=command == "load-env")
        else:
            raise SystemExit(f"unknown command {command!r}")
    except PreshardError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
