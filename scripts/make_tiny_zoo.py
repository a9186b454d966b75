"""Write tests/support/tiny_zoo.json: a tiny config and forward inputs for every diffusers transformer class, taken
from diffusers' own model tests (run from a checkout of diffusers' repository, which the tests import from).

    python scripts/make_tiny_zoo.py DIFFUSERS_REPO tests/support/tiny_zoo.json

Each entry: the class, its init kwargs, and its inputs as data (a tensor of at most 64 entries, an integer tensor or
a mask by value; a larger float tensor by shape and dtype, drawn again from a seed by tests/support/tiny_zoo.py).
Entries whose model does not run on the inputs as decoded are left out. Not run in CI: the JSON is committed, so
the tests need neither the repository nor its test helpers.
"""

from __future__ import annotations

import importlib
import inspect
import json
import sys
from pathlib import Path
from typing import Any

import torch

SMALL = 64
# Tests' configs with one head (or one KV head) where TP needs two: more heads of the same width, so that tp=2
# can be proven on them (the published configs have many).
OVERRIDES: dict[str, dict[str, Any]] = {
    "ErnieImageTransformer2DModel": {"num_attention_heads": 2, "hidden_size": 32, "ffn_hidden_size": 32},
    "Krea2Transformer2DModel": {"text_num_key_value_heads": 2},
    "Lumina2Transformer2DModel": {"num_attention_heads": 4, "num_kv_heads": 2, "hidden_size": 32},
    "ZImageTransformer2DModel": {"dim": 48, "n_heads": 2, "n_kv_heads": 2, "axes_dims": [8, 8, 8]},
    "Cosmos3OmniTransformer": {"num_key_value_heads": 2},
}


def encode(value: Any, keep: bool = False) -> Any:
    """`value` as JSON data; `keep`: a float tensor by value whatever its size (an attention mask)."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu()
        data: dict[str, Any] = {"tensor": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
        if keep or t.numel() <= SMALL or not t.is_floating_point():
            data["values"] = t.flatten().tolist()
        return data
    if isinstance(value, tuple):
        return {"tuple": [encode(v) for v in value]}
    if isinstance(value, list):
        return [encode(v) for v in value]
    if isinstance(value, dict) and value and all(isinstance(k, int) for k in value):
        return {"int_keys": {str(k): encode(v) for k, v in value.items()}}
    if isinstance(value, dict):
        return {"dict": {k: encode(v, keep or "mask" in k) for k, v in value.items()}}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(type(value).__name__)


def plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return [plain(v) for v in value]
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(type(value).__name__)


def cases(module) -> list[tuple[str, dict, dict]]:
    found = []
    for _, cls in inspect.getmembers(module, inspect.isclass):
        if cls.__module__ != module.__name__:
            continue
        try:
            obj = cls.__new__(cls)
            if hasattr(cls, "get_init_dict") and hasattr(cls, "get_dummy_inputs"):
                model_class = obj.model_class
                init, inputs = obj.get_init_dict(), obj.get_dummy_inputs()
            elif hasattr(cls, "prepare_init_args_and_inputs_for_common") and hasattr(cls, "dummy_input"):
                model_class = cls.model_class
                init, inputs = obj.prepare_init_args_and_inputs_for_common()
            else:
                continue
        except Exception as exc:  # noqa: BLE001
            print(f"  skip {cls.__name__}: {type(exc).__name__}: {exc}"[:200], file=sys.stderr)
            continue
        if isinstance(model_class, type):
            found.append((model_class.__name__, init, inputs))
    return found


def runs(entry: dict) -> str | None:
    """Why the entry's model does not run on its inputs as tiny_zoo.py decodes them (None: it runs)."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "support"))
    from tiny_zoo import build_entry

    try:
        model, inputs = build_entry(json.loads(json.dumps(entry)))  # as the JSON gives it back
        with torch.no_grad():
            model(**inputs)
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return None


def main(repo: str, out: str) -> None:
    sys.path.insert(0, repo)
    torch.manual_seed(0)
    zoo: dict[str, Any] = {}
    for path in sorted(Path(repo, "tests/models/transformers").glob("test_*.py")):
        name = f"tests.models.transformers.{path.stem}"
        try:
            module = importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001
            print(f"skip {path.stem}: {type(exc).__name__}: {exc}"[:200], file=sys.stderr)
            continue
        for class_name, init, inputs in cases(module):
            key = class_name
            n = 2
            while key in zoo:
                if zoo[key]["init"] == plain(init) | OVERRIDES.get(class_name, {}):
                    break
                key, n = f"{class_name}#{n}", n + 1
            if key in zoo:
                continue
            try:
                init = plain(init) | (OVERRIDES.get(key, {}) if key == class_name else {})
                entry = {"class": class_name, "test": path.stem, "init": init, "inputs": encode(inputs)}
            except TypeError as exc:
                print(f"skip {key}: cannot encode {exc}", file=sys.stderr)
                continue
            why = runs(entry)
            if why:
                print(f"skip {key}: its forward fails from the JSON: {why}"[:200], file=sys.stderr)
                continue
            zoo[key] = entry
    Path(out).write_text(json.dumps(zoo, sort_keys=True, separators=(",", ":")).replace('},"', '},\n"') + "\n")
    print(f"{len(zoo)} cases, {len({v['class'] for v in zoo.values()})} classes")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
