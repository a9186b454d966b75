"""Hostile soak, pipeline folders and Hub arguments (issue 36, items 1, 4 and 7, and the Hub's revision):

- indexes: a model_index.json naming components `..`, `../victim`, an absolute path, `.`, `""`, `a/b`, a backslash,
  a hidden name, NUL or a newline (OUT beside the source or elsewhere), and seeded random names built from path
  pieces; `--component` / `--keep-layers` naming such a component; an integer of 5000 digits in the index: one
  line (exit 2) or a conversion that copies into OUT alone, and nothing outside OUT changed (the source, a sibling,
  the folder holding OUT: every entry compared, links as links).
- pipelinks: a component folder, a weights file, a file (or folder) inside a copied component, a top-level
  README.md and a sharded component's weights that are symbolic links out of the pipeline folder: one line naming
  the link, nothing written; a link cycle and a FIFO: one line, never waited on; links inside the folder: copied
  as their targets' bytes (the control).
- pipeedges: `--component NAME:tp=²`, `--keep-layers NAME:²`, conflicting duplicates, `--tp 2 --component
  transformer:tp=1`, a component with config.json and no weights: one line, nothing written (no OUT, partial or
  lock); a usage error found mid-copy (`--keep-layers` above the layer count) leaves no partial; identical
  duplicates convert (the control).
- hubargs: revisions `/abs`, `../../../../x`, `refs/../../../x`, `main/../../x`, empty components, backslashes,
  control characters, and hostile repo ids and subfolders, through `convert-checkpoint --revision`, the Hub source
  functions and `load_pipeline(revision=)`, on a fake Hub with a private HF_HOME: one line, no request made, nothing
  written anywhere; `feature/x` and `refs/pr/1`-style revisions resolve (the control).

- hubpipes: a Hub pipeline repo whose index names `..`, `../victim`, `.`, `""`, `a/b` or an absolute path: one
  line, nothing written outside the HF cache; the controls convert, fetching each file once and nothing the
  conversion does not read (a folder the index does not name, `.bin` and fp16 copies), a skipped component not at all.

    python scripts/hostile_soak.py --classes indexes,pipelinks,pipeedges,hubargs,hubpipes
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

from hostile_pipelines import INDEX, safetensors_bytes, write_pipeline  # tests/support, on the soak's path
from hostile_pipelines import tree as entries
from hostile_soak import Case, Outcome, Soak, hub_env, one_line, run_cli, run_library


def outside(root: Path, out: Path) -> dict[str, tuple[str, bytes | str]]:
    """What lies under `root` but not in OUT (its partial folder and lock included: they must be gone too)."""
    rel = str(out.relative_to(root))
    return {k: v for k, v in entries(root).items() if not (k == rel or k.startswith(rel + "/"))}


def left_behind(out: Path) -> str | None:
    for path in (out, out.parent / f".{out.name}.partial", out.parent / f".{out.name}.lock"):
        if os.path.lexists(path):
            return f"{path.name} left behind"
    return None


def refused(outcome: Outcome, out: Path, *fragments: str) -> str | None:
    return one_line(outcome, *fragments) or left_behind(out)


def convert_cli(source: Path, out: Path, *args: str) -> Outcome:
    return run_cli("convert", source, out, "--tp", "2", "--no-progress", *args)


# -- indexes

NAMES = ["..", "../victim", "ABSOLUTE", ".", "", "a/b", "a\\b", ".hidden", "x\x00y", "x\ny", "/", "victim/.."]
PIECES = [*"ab_-.", "/", "\\", "\x00", "\n", " ", "..", "../", "/abs", "é"]


def _name_case(name: str, elsewhere: bool, random_name: bool = False) -> Callable[[Path], str | None]:
    def run(folder: Path) -> str | None:
        job = folder / "job"
        (job / "victim").mkdir(parents=True)
        (job / "victim" / "precious.txt").write_text("keep me")
        absolute = folder / "abs"
        absolute.mkdir()
        (absolute / "config.json").write_text("{}")
        given = str(absolute) if name == "ABSOLUTE" else name
        source = write_pipeline(job / "src", {**INDEX, given: ["diffusers", "AutoencoderKLWan"]})
        try:
            (source / given).mkdir(parents=True, exist_ok=True)
        except (OSError, ValueError):
            pass
        out = (folder / "other" / "out") if elsewhere else (job / "out")
        before = outside(folder, out)
        outcome = run_library(lambda: _convert(source, out))
        after = outside(folder, out)
        if after != before:
            changed = sorted(set(before) ^ set(after)) or [k for k in before if before[k] != after.get(k)]
            return f"outside OUT changed: {changed[:3]}"
        if outcome.status == 0 and random_name and not given.startswith("_"):
            return None if (out / given).is_dir() else f"converted, but OUT/{given!r} is missing"
        if outcome.status == 0 and random_name:
            return None
        return refused(outcome, out, "component name")

    return run


def _convert(source: Path, out: Path, **kwargs: object) -> object:
    from preshard.converter.pipeline_folder import convert_pipeline

    return convert_pipeline(source, out, tp=2, progress=False, **kwargs)  # type: ignore[arg-type]


def index_cases(soak: Soak) -> list[Case]:
    cases = [
        Case("indexes", f"name {name!r}{' (OUT elsewhere)' if elsewhere else ''}", _name_case(name, elsewhere))
        for name in NAMES
        for elsewhere in (False, True)
    ]
    for i in range(24):
        name = "".join(soak.rng.choice(PIECES) for _ in range(soak.rng.randint(1, 5)))
        cases.append(Case("indexes", f"random name {i} {name!r}", _name_case(name, False, random_name=True)))

    def option(args: list[str]) -> Callable[[Path], str | None]:
        def run(folder: Path) -> str | None:
            source = write_pipeline(folder / "src")
            before = outside(folder, folder / "out")
            why = refused(convert_cli(source, folder / "out", *args), folder / "out", "component name")
            return why or (None if outside(folder, folder / "out") == before else "outside OUT changed")

        return run

    for args in [
        ["--component", "../vae:whole"], ["--component", ".:skip"], ["--component", "a/b:tp=2"],
        ["--component", f"{os.sep}abs:whole"], ["--keep-layers", "../x:3"], ["--keep-layers", "..:all"],
    ]:  # fmt: skip
        cases.append(Case("indexes", " ".join(args), option(args)))

    def long_integer(folder: Path) -> str | None:
        source = write_pipeline(folder / "src")
        (source / "model_index.json").write_text(json.dumps(INDEX)[:-1] + f', "x": {"9" * 5000}}}')
        return refused(convert_cli(source, folder / "out"), folder / "out", "model_index.json", "number too long")

    cases.append(Case("indexes", "a 5000-digit integer in model_index.json", long_integer))
    return cases


# -- pipelinks

LINKS = [
    "component folder", "weights file", "file in a copied component", "file in a subfolder", "folder in a component",
    "top-level README.md", "sharded component's weights", "relative link out", "link to a link out",
]  # fmt: skip


def _make_link(source: Path, secret: Path, case: str) -> Path:
    weights = "diffusion_pytorch_model.safetensors"
    if case == "component folder":
        shutil.rmtree(source / "vae")
        link, target = source / "vae", str(secret)
    elif case == "weights file":
        link, target = source / "vae" / weights, str(secret / weights)
    elif case == "file in a copied component":
        link, target = source / "scheduler" / "notes.txt", str(secret / "secret.txt")
    elif case == "file in a subfolder":
        (source / "scheduler" / "sub").mkdir()
        link, target = source / "scheduler" / "sub" / "notes.txt", str(secret / "secret.txt")
    elif case == "folder in a component":
        link, target = source / "scheduler" / "more", str(secret)
    elif case == "top-level README.md":
        link, target = source / "README.md", str(secret / "secret.txt")
    elif case == "sharded component's weights":
        link, target = source / "transformer" / weights, str(secret / weights)
    elif case == "relative link out":
        link, target = source / "vae" / "notes.txt", "../../outside/secret.txt"
    elif case == "link to a link out":
        (source / "inner").symlink_to(secret / "secret.txt")
        link, target = source / "vae" / "notes.txt", "../inner"
    else:
        raise ValueError(case)
    if os.path.lexists(link):
        link.unlink()
    link.symlink_to(target)
    return link


def link_cases(soak: Soak) -> list[Case]:
    def link_out(case: str) -> Callable[[Path], str | None]:
        def run(folder: Path) -> str | None:
            secret = folder / "outside"
            secret.mkdir()
            (secret / "secret.txt").write_text("SECRET")
            (secret / "diffusion_pytorch_model.safetensors").write_bytes(safetensors_bytes())
            index = {**INDEX, "transformer": ["diffusers", "WanTransformer3DModel"]}
            extra = {"transformer": {"config.json": b"{}", "diffusion_pytorch_model.safetensors": safetensors_bytes()}}
            source = write_pipeline(folder / "src", index, extra)
            _make_link(source, secret, case)
            out = folder / "out"
            why = refused(convert_cli(source, out), out, "is a symbolic link to", "outside the pipeline folder")
            return why

        return run

    cases = [Case("pipelinks", case, link_out(case)) for case in LINKS]

    def inside_links(folder: Path) -> str | None:
        source = write_pipeline(folder / "src")
        (source / "shared").mkdir()
        (source / "shared" / "vocab.txt").write_text("vocab")
        (source / "vae" / "vocab.txt").symlink_to(source / "shared" / "vocab.txt")
        (source / "scheduler" / "shared").symlink_to("../shared")
        (source / "LICENSE").symlink_to("shared/vocab.txt")
        out = folder / "out"
        outcome = convert_cli(source, out)
        if outcome.status != 0:
            return f"exit {outcome.status}: {outcome.stderr.strip()[-300:]}"
        copies = [out / "vae" / "vocab.txt", out / "scheduler" / "shared" / "vocab.txt", out / "LICENSE"]
        if any(c.is_symlink() or c.read_text() != "vocab" for c in copies):
            return "a link inside was not copied as its target's bytes"
        return "OUT holds a link" if any(p.is_symlink() for p in out.rglob("*")) else None

    def cycle(folder: Path) -> str | None:
        source = write_pipeline(folder / "src")
        (source / "vae" / "loop").symlink_to("..")
        return refused(convert_cli(source, folder / "out"), folder / "out", "a cycle")

    def fifo(folder: Path) -> str | None:
        source = write_pipeline(folder / "src")
        os.mkfifo(source / "scheduler" / "pipe")
        return refused(convert_cli(source, folder / "out"), folder / "out", "is a FIFO")

    cases += [
        Case("pipelinks", "links inside are copied as bytes (control)", inside_links),
        Case("pipelinks", "a link cycle", cycle),
        Case("pipelinks", "a FIFO in a component", fifo),
    ]
    return cases


# -- pipeedges


def _text_encoder(layers: int = 2) -> dict[str, bytes]:
    tensors = {
        f"model.layers.{i}.w": {"dtype": "F32", "shape": [2], "data_offsets": [8 * i, 8 * i + 8]} for i in range(layers)
    }
    header = json.dumps(tensors).encode()
    config = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "num_hidden_layers": layers}
    data = struct.pack("<Q", len(header)) + header + bytes(8 * layers)
    return {"config.json": json.dumps(config).encode(), "model.safetensors": data}


def edge_cases(soak: Soak) -> list[Case]:
    def refuse(args: list[str], *fragments: str, transformer: bool = False) -> Callable[[Path], str | None]:
        def run(folder: Path) -> str | None:
            index = {**INDEX, "transformer": ["diffusers", "WanTransformer3DModel"]} if transformer else None
            extra = (
                {"transformer": {"config.json": b"{}", "x.safetensors": safetensors_bytes()}} if transformer else None
            )
            source = write_pipeline(folder / "src", index, extra)
            return refused(convert_cli(source, folder / "out", *args), folder / "out", *fragments)

        return run

    cases = [
        Case("pipeedges", "--component vae:tp=²", refuse(["--component", "vae:tp=\u00b2"], "is not NAME:tp=N")),
        Case("pipeedges", "--component vae:tp=١", refuse(["--component", "vae:tp=\u0661"], "is not NAME:tp=N")),
        Case("pipeedges", "--keep-layers vae:²", refuse(["--keep-layers", "vae:\u00b2"], "is not NAME:K")),
        Case("pipeedges", "--component tp=10**7", refuse(["--component", "vae:tp=" + "9" * 5000], "is not NAME:tp=N")),
        Case(
            "pipeedges", "--component vae:whole --component vae:skip",
            refuse(["--component", "vae:whole", "--component", "vae:skip"], "choose differently for vae"),
        ),
        Case(
            "pipeedges", "--keep-layers vae:2 --keep-layers vae:3",
            refuse(["--keep-layers", "vae:2", "--keep-layers", "vae:3"], "differ for vae"),
        ),
        Case(
            "pipeedges", "--tp 2 --component transformer:tp=1",
            refuse(["--component", "transformer:tp=1"], "differs from the pipeline's --tp 2", transformer=True),
        ),
    ]  # fmt: skip

    def no_weights(folder: Path) -> str | None:
        source = write_pipeline(folder / "src")
        (source / "vae" / "diffusion_pytorch_model.safetensors").unlink()
        return refused(convert_cli(source, folder / "out"), folder / "out", "has a config.json but no weights")

    def mid_copy_usage_error(folder: Path) -> str | None:
        index = {**INDEX, "text_encoder": ["transformers", "Qwen3ForCausalLM"]}
        source = write_pipeline(folder / "src", index, {"text_encoder": _text_encoder()})
        return refused(
            convert_cli(source, folder / "out", "--keep-layers", "text_encoder:99"), folder / "out", "keep at most 2"
        )

    def identical_duplicates(folder: Path) -> str | None:
        source = write_pipeline(folder / "src")
        outcome = convert_cli(source, folder / "out", "--component", "vae:skip", "--component", "vae:skip")
        if outcome.status != 0:
            return f"exit {outcome.status}: {outcome.stderr.strip()[-300:]}"
        return None if not (folder / "out" / "vae").exists() else "vae was not skipped"

    cases += [
        Case("pipeedges", "a component with config.json and no weights", no_weights),
        Case("pipeedges", "a usage error mid-copy leaves no partial", mid_copy_usage_error),
        Case("pipeedges", "identical duplicates convert (control)", identical_duplicates),
    ]
    return cases


# -- hubargs

REVISIONS = [
    "/abs", "ABSOLUTE", "../../../../x", "refs/../../../x", "main/../../x", "a//b", "main/", "m\\x", "ma\x00in", "m\nx",
    ".", "", "refs/pr/..",
]  # fmt: skip


def _repo(hub: object) -> str:
    config = json.dumps({"_class_name": "WanTransformer3DModel"}).encode()
    commit = hub.add_repo("org/model", {"config.json": config, "model.safetensors": safetensors_bytes()})  # type: ignore[attr-defined]
    hub.set_ref("org/model", "feature/x", commit)  # type: ignore[attr-defined]
    hub.set_ref("org/model", "refs/pr/1", commit)  # type: ignore[attr-defined]
    return commit


def _hub_case(entry: str, revision: str | None = None, subfolder: str | None = None, repo: str = "org/model"):
    def run(folder: Path) -> str | None:
        with hub_env(folder) as hub:
            _repo(hub)
            rev = str(folder / "abs-target") if revision == "ABSOLUTE" else revision
            before = entries(folder)
            requests = len(hub.log())
            out = folder / "out"
            if entry == "cli":
                args = ["convert", repo, out, "--tp", "1", "--no-progress"]
                args += ["--revision", rev] if rev is not None else []
                args += ["--subfolder", subfolder] if subfolder is not None else []
                outcome = run_cli(*args)
            elif entry == "load_pipeline":
                from preshard.runtime.pipeline_load import load_pipeline

                outcome = run_library(lambda: load_pipeline(repo, revision=rev, timeout=5))
            else:
                from preshard.sources import hub as sources_hub

                call = {
                    "download_source": lambda: sources_hub.download_source(repo, revision=rev, subfolder=subfolder),
                    "source_headers": lambda: sources_hub.source_headers(repo, revision=rev, subfolder=subfolder),
                    "download_files": lambda: sources_hub.download_files(
                        repo, ["config.json"], revision=rev, subfolder=subfolder
                    ),
                }[entry]
                outcome = run_library(call)
            what = "revision" if revision is not None else "subfolder" if subfolder is not None else "repo id"
            why = one_line(outcome, what)
            if why is None and len(hub.log()) != requests:
                why = f"{len(hub.log()) - requests} Hub requests made"
            if why is None and entries(folder) != before:
                why = "something was written"
            return why

    return run


def hub_cases(soak: Soak) -> list[Case]:
    cases = [
        Case("hubargs", f"{entry} revision={revision!r}", _hub_case(entry, revision=revision))
        for revision in REVISIONS
        for entry in ("cli", "download_source", "source_headers", "download_files", "load_pipeline")
    ]
    for subfolder in ["../x", "/transformer", "a//b", "a\\b", "tr\x00x", "a/../../b"]:
        for entry in ("cli", "download_source", "download_files"):
            cases.append(Case("hubargs", f"{entry} subfolder={subfolder!r}", _hub_case(entry, subfolder=subfolder)))
    for repo in ["org/../x", "org/a/b", "org/m\x00x"]:
        cases.append(Case("hubargs", f"download_source repo {repo!r}", _hub_case("download_source", repo=repo)))

    def allowed(revision: str) -> Callable[[Path], str | None]:
        def run(folder: Path) -> str | None:
            from preshard.sources import hub as sources_hub

            with hub_env(folder) as hub:
                commit = _repo(hub)
                got = sources_hub.download_source("org/model", revision=revision)
                return None if got.commit == commit else f"resolved to {got.commit}, not {commit}"

        return run

    cases += [
        Case("hubargs", f"revision {r!r} resolves (control)", allowed(r)) for r in ("feature/x", "refs/pr/1", "main")
    ]
    return cases


# -- hubpipes


def _pipeline_files(index: dict | None = None) -> dict[str, bytes]:
    files = {
        "model_index.json": json.dumps(index or INDEX).encode(),
        "README.md": b"a pipeline\n",
        "scheduler/scheduler_config.json": b'{"_class_name": "FlowMatchEulerDiscreteScheduler"}',
        "vae/config.json": b"{}",
        "vae/diffusion_pytorch_model.safetensors": safetensors_bytes(),
    }
    return files


UNREAD = {"other/model.safetensors": b"x", "vae/diffusion_pytorch_model.bin": b"x", "vae/x.fp16.safetensors": b"x"}


def hub_pipeline_cases(soak: Soak) -> list[Case]:
    def hostile(name: str) -> Callable[[Path], str | None]:
        def run(folder: Path) -> str | None:
            with hub_env(folder) as hub:
                hub.add_repo("org/pipe", _pipeline_files({**INDEX, name: ["diffusers", "AutoencoderKLWan"]}))
                before = entries(folder)
                out = folder / "out"
                why = refused(run_cli("convert", "org/pipe", out, "--tp", "2", "--no-progress"), out, "component name")
                after = {k: v for k, v in entries(folder).items() if not k.startswith("hf_home")}
                if why is None and after != {k: v for k, v in before.items() if not k.startswith("hf_home")}:
                    why = f"written outside the cache: {sorted(set(after) ^ set(before))[:3]}"
                cache = [k for k in entries(folder) if k.startswith("hf_home/") and "models--org--pipe" not in k]
                stray = [k for k in cache if not k.startswith(("hf_home/hub", "hf_home/xet"))]
                if why is None and stray:
                    why = f"written in the HF home outside the hub cache: {stray[:3]}"
                return why

        return run

    def control(skip: bool) -> Callable[[Path], str | None]:
        def run(folder: Path) -> str | None:
            with hub_env(folder) as hub:
                hub.add_repo("org/pipe", {**_pipeline_files(), **UNREAD})
                out = folder / "out"
                args = ["--component", "vae:skip"] if skip else []
                outcome = run_cli("convert", "org/pipe", out, "--tp", "2", "--no-progress", *args)
                if outcome.status != 0:
                    return f"exit {outcome.status}: {outcome.stderr.strip()[-300:]}"
                fetched = hub.downloaded("org/pipe")
                if len(fetched) != len(set(fetched)) or set(fetched) & set(UNREAD):
                    return f"fetched {sorted(fetched)}"
                if skip and any(p.startswith("vae/") for p in fetched):
                    return "a skipped component was fetched"
                if not skip and (out / "vae" / "config.json").read_bytes() != b"{}":
                    return "the VAE was not copied"
                return "OUT holds a link" if any(p.is_symlink() for p in out.rglob("*")) else None

        return run

    cases = [
        Case("hubpipes", f"Hub index names {n!r}", hostile(n)) for n in ["..", "../victim", ".", "", "a/b", "/abs"]
    ]
    cases += [
        Case("hubpipes", "a Hub pipeline converts, nothing unread fetched (control)", control(False)),
        Case("hubpipes", "a skipped component is not fetched (control)", control(True)),
    ]
    return cases


CASES: dict[str, Callable[[Soak], list[Case]]] = {
    "indexes": index_cases,
    "pipelinks": link_cases,
    "pipeedges": edge_cases,
    "hubargs": hub_cases,
    "hubpipes": hub_pipeline_cases,
}
