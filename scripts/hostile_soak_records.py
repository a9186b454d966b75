"""Hostile soak, issue 36 items 2 and 3: a converted pipeline and its record are untrusted input.

    python scripts/hostile_soak.py --classes records,tampered,piperanks
    python scripts/hostile_soak.py --classes piperanks --case-timeout 480   # on a heavily loaded host

Each piperanks case starts two ranks (the killed-rank case two fresh interpreters): at a load average of 40 on 2
cores a case took up to ~200 s, past the default 120 s watchdog.

- records: a pipeline index naming a library other than diffusers or transformers (a module on sys.path whose
  import writes a marker file, `os`, `subprocess`, a path, an empty name) or a class that is no plain identifier,
  converted with the component sharded (`NAME:tp=2`), whole or skipped: one line, nothing written, the marker
  never made; records edited and re-sealed (a hostile editor who knows the format) with such a library or class, a
  bad treatment, TP degree, manifest digest, file name (`../x`, an absolute path, a repeat), size or hash, an
  unknown field, another format version, no digest: `load_pipeline` one line, marker never made; `verify` exit 1.
- tampered: each file of a converted pipeline changed after conversion (the VAE's weights at the same size, its
  config, the scheduler's config, the tokenizer, the text encoder's weights, the index, the record, a treatment
  edited to `skipped`, an unlisted weights file, a random byte of a random listed file): `load_pipeline` refuses by
  default naming the file, `verify` exits 1 naming it; the controls load, verify and inspect; `verify=False`
  loads a same-size edit but still refuses an edited record and a missing file.
- piperanks: two gloo ranks of `load_pipeline` where one rank's VAE file differs, one rank lacks its VAE folder,
  one rank's VAE config is garbage under `verify=False` (diffusers' own error), `components=` differs (scheduler
  shift 3.0 against 9.0), the ranks see different records, or a rank is killed while reading its shard: every
  surviving rank fails with one preshard line; the control loads on both.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import xxhash
from hostile_soak import Case, Outcome, Soak, one_line, run_cli, run_library

from preshard.format.jsonio import canonical_json

MARKER = "preshard_soak_marker"
_built: dict[str, dict[str, Path]] = {}


def _inputs(soak: Soak) -> dict[str, Path]:
    """The tiny Wan pipeline folder and its conversions at tp=1 and tp=2, built once per soak root."""
    key = str(soak.root)
    if key not in _built:
        from tiny_pipelines import CASES

        from preshard.converter.pipeline_folder import convert_pipeline

        base = soak.root / "pipeline-records"
        wan = CASES["wan"]()
        wan.pipeline(wan.transformer(), wan.components()).save_pretrained(base / "wan")
        for tp in (1, 2):
            convert_pipeline(base / "wan", base / f"tp{tp}", tp=tp, progress=False)
        modules = base / "modules"
        modules.mkdir()
        (modules / f"{MARKER}.py").write_text(
            "import os\nopen(os.environ['PRESHARD_SOAK_MARKER'], 'w').write('ran')\nclass X: pass\n"
        )
        sys.path.insert(0, str(modules))
        _built[key] = {"source": base / "wan", "tp1": base / "tp1", "tp2": base / "tp2"}
    return _built[key]


def _marked(folder: Path) -> Path:
    """Where the marker module would write when imported during this case (nothing may write it)."""
    flag = folder / "imported.flag"
    os.environ["PRESHARD_SOAK_MARKER"] = str(flag)
    sys.modules.pop(MARKER, None)
    return flag


def _edit_record(folder: Path, edit: Callable[[dict], None], reseal: bool) -> None:
    path = folder / "preshard_pipeline.json"
    data = json.loads(path.read_text())
    edit(data)
    if reseal:
        data["digest"] = xxhash.xxh3_128_hexdigest(canonical_json({k: v for k, v in data.items() if k != "digest"}))
    path.write_text(json.dumps(data, indent=1))


def _load(folder: Path, **kwargs) -> Outcome:
    from preshard.runtime.pipeline_load import load_pipeline

    return run_library(lambda: load_pipeline(folder, **kwargs))


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at % len(data)] ^= 0x01
    path.write_bytes(bytes(data))


# ---------------------------------------------------------------------------------------------------------
# records


LIBRARIES = [MARKER, "os", "subprocess", "../evil", "/tmp/evil", "", "diffusers.pipelines", "builtins"]
CLASSES = ["__class__", "os.path", "X Y", "", "_private"]


def record_cases(soak: Soak) -> list[Case]:
    def convert(component: str, entry: list, choice: list[str]) -> Callable[[Path], str | None]:
        def case(folder: Path) -> str | None:
            inputs = _inputs(soak)
            flag = _marked(folder)
            source = Path(shutil.copytree(inputs["source"], folder / "src"))
            index = json.loads((source / "model_index.json").read_text())
            index[component] = entry
            (source / "model_index.json").write_text(json.dumps(index))
            out = folder / "out"
            why = one_line(run_cli("convert", source, out, "--tp", "2", "--no-progress", *choice), component)
            if flag.exists():
                return "the module the index names was imported"
            if out.exists() or list(folder.glob(".out*")):
                return "something was written"
            return why

        return case

    def loaded(edit: Callable[[dict], None], fragment: str, reseal: bool = True) -> Callable[[Path], str | None]:
        def case(folder: Path) -> str | None:
            out = Path(shutil.copytree(_inputs(soak)["tp1"], folder / "out"))
            flag = _marked(folder)
            _edit_record(out, edit, reseal)
            why = one_line(_load(out), fragment)
            if flag.exists():
                return "the module the record names was imported"
            verify = run_cli("verify", out)
            if why is None and (verify.status != 1 or "Traceback" in verify.stderr + verify.stdout):
                return f"verify: exit {verify.status}: {(verify.stdout + verify.stderr)[-300:]}"
            return why

        return case

    def component(name: str, **fields) -> Callable[[dict], None]:
        return lambda d: d["components"][name].update(fields)

    def first_file(**fields) -> Callable[[dict], None]:
        return lambda d: d["files"][0].update(fields)

    choices = [
        ("transformer", ["--component", "transformer:tp=2"]),
        ("vae", []),
        ("text_encoder", ["--component", "text_encoder:tp=2"]),
        ("scheduler", ["--component", "scheduler:skip"]),
    ]
    cases = []
    for library in LIBRARIES:
        for comp, choice in choices:
            name = f"index {comp} [{library!r}, X] {choice}"
            cases.append(Case("records", name, convert(comp, [library, "X"], choice)))
        for comp in ("transformer", "vae"):
            edit = component(comp, library=library)
            cases.append(
                Case("records", f"record {comp} library {library!r}", loaded(edit, "diffusers or transformers"))
            )
    for name in CLASSES:
        cases.append(Case("records", f"index class {name!r}", convert("vae", ["diffusers", name], [])))
        edit = component("transformer", **{"class": name})
        cases.append(Case("records", f"record class {name!r}", loaded(edit, "not a plain class name")))
    edits: dict[str, tuple[Callable[[dict], None], str]] = {
        "treatment bogus": (component("vae", treatment="bogus"), "treatment must be one of"),
        "tp '2'": (component("transformer", tp="1"), "tp must be a degree"),
        "tp 0": (component("transformer", tp=0), "tp must be a degree"),
        "tp true": (component("transformer", tp=True), "tp must be a degree"),
        "tp on a whole one": (component("vae", tp=1), "tp must be a degree"),
        "manifest digest of another": (component("transformer", manifest_digest="0" * 32), "not the one"),
        "no manifest digest": (component("transformer", manifest_digest=None), "manifest_digest must be"),
        "file ../x": (first_file(name="../x"), "not a relative path"),
        "file /etc/passwd": (first_file(name="/etc/passwd"), "not a relative path"),
        "file vae/../../x": (first_file(name="vae/../../x"), "not a relative path"),
        "file repeated": (lambda d: d["files"].append(dict(d["files"][0])), "repeats"),
        "file size -1": (first_file(size=-1), "size must be"),
        "file size 1e400 digits": (first_file(size=10**30), "model_index.json is"),
        "file hash not hex": (first_file(xxh3_128="z" * 32), "xxh3_128 must be"),
        "file hash of another": (first_file(xxh3_128="0" * 32), "differs from the file converted"),
        "file dropped": (lambda d: d["files"].pop(), "does not list it"),
        "unknown field": (lambda d: d.update(extra=1), "unknown field"),
        "no files": (lambda d: d.pop("files"), "no 'files'"),
        "component name ..": (lambda d: d["components"].update({"..": d["components"]["vae"]}), "not a plain folder"),
        "pipeline class os.system": (lambda d: d.update(pipeline_class="os.system"), "not a plain class name"),
    }
    for name, (edit, fragment) in edits.items():
        cases.append(Case("records", f"record resealed: {name}", loaded(edit, fragment)))
    versions = {
        "format version 1": (lambda d: d.update(format_version=1), "before records were sealed"),
        "format version 3": (lambda d: d.update(format_version=3), "format version 3"),
        "format version '2'": (lambda d: d.update(format_version="2"), "format version '2'"),
        "no digest": (lambda d: d.pop("digest"), "digest is missing"),
        "unsealed edit": (component("vae", treatment="skipped"), "does not match its digest"),
    }
    for name, (edit, fragment) in versions.items():
        cases.append(Case("records", f"record: {name}", loaded(edit, fragment, reseal=False)))
    return cases


# ---------------------------------------------------------------------------------------------------------
# tampered


def _json_edit(key: str, value) -> Callable[[Path], None]:
    def edit(path: Path) -> None:
        data = json.loads(path.read_text())
        data[key] = value
        path.write_text(json.dumps(data, indent=2))

    return edit


TAMPERS: dict[str, tuple[str, Callable[[Path], None]]] = {
    "vae weights, same size": ("vae/diffusion_pytorch_model.safetensors", lambda p: _flip(p, -20)),
    "vae config.json": ("vae/config.json", _json_edit("z_dim", 17)),
    "scheduler_config.json": ("scheduler/scheduler_config.json", _json_edit("shift", 9.0)),
    "tokenizer.json": ("tokenizer/tokenizer.json", lambda p: _flip(p, 40)),
    "text encoder weights": ("text_encoder/model.safetensors", lambda p: _flip(p, -20)),
    "model_index.json": ("model_index.json", _json_edit("vae", ["diffusers", "AutoencoderKL"])),
    "unlisted weights": ("vae/diffusion_pytorch_model.bin", lambda p: p.write_bytes(b"\0" * 64)),
    "unlisted config": ("text_encoder/generation_config.json", lambda p: p.write_text("{}")),
    "vae weights truncated": ("vae/diffusion_pytorch_model.safetensors", lambda p: os.truncate(p, 100)),
    "vae weights removed": ("vae/diffusion_pytorch_model.safetensors", lambda p: p.unlink()),
    "vae weights a link out": ("vae/diffusion_pytorch_model.safetensors", lambda p: _link_out(p)),
    "vae weights a FIFO": ("vae/diffusion_pytorch_model.safetensors", lambda p: (p.unlink(), os.mkfifo(p))),
}


def _link_out(path: Path) -> None:
    outside = path.parent.parent.parent / "outside.safetensors"
    shutil.copy(path, outside)
    path.unlink()
    path.symlink_to(outside)


def tampered_cases(soak: Soak) -> list[Case]:
    def refused(apply: Callable[[Path], str]) -> Callable[[Path], str | None]:
        def case(folder: Path) -> str | None:
            out = Path(shutil.copytree(_inputs(soak)["tp1"], folder / "out"))
            named = apply(out)
            why = one_line(_load(out), named)
            if why is not None:
                return f"load: {why}"
            verify = run_cli("verify", out)
            lines = verify.stdout.splitlines()
            if verify.status != 1 or not any(named in line for line in lines[:-1]) or "Traceback" in verify.stderr:
                return f"verify: exit {verify.status}: {(verify.stdout + verify.stderr)[-300:]}"
            return None

        return case

    def file_tamper(relative: str, edit: Callable[[Path], None]) -> Callable[[Path], str]:
        def apply(out: Path) -> str:
            edit(out / relative)
            return str(out / relative)

        return apply

    def record_tamper(edit: Callable[[dict], None]) -> Callable[[Path], str]:
        def apply(out: Path) -> str:
            _edit_record(out, edit, reseal=False)
            return "preshard_pipeline.json"

        return apply

    def random_byte(seed: int) -> Callable[[Path], str]:
        def apply(out: Path) -> str:
            from preshard.format.pipeline_record import read_pipeline_record

            record = read_pipeline_record(out)
            assert record is not None
            f = soak.rng.choice([f for f in record.files if f.size])
            _flip(out / f.name, soak.rng.randrange(f.size))
            return str(out / f.name)

        return apply

    cases = [Case("tampered", name, refused(file_tamper(*t))) for name, t in TAMPERS.items()]
    cases += [
        Case("tampered", "the record's source edited", refused(record_tamper(lambda d: d.update(source="x")))),
        Case("tampered", "vae treatment -> skipped", refused(record_tamper(
            lambda d: d["components"]["vae"].update(treatment="skipped")))),  # fmt: skip
        Case("tampered", "transformer treatment -> whole", refused(record_tamper(
            lambda d: d["components"]["transformer"].update(treatment="whole", tp=None, manifest_digest=None)))),
    ]  # fmt: skip
    cases += [Case("tampered", f"a random byte of a listed file ({i})", refused(random_byte(i))) for i in range(8)]

    def control(folder: Path) -> str | None:
        out = Path(shutil.copytree(_inputs(soak)["tp1"], folder / "out"))
        (out / ".gitattributes").write_text("* text=auto\n")  # unlisted, outside the components: not read
        outcome = _load(out)
        if outcome.status != 0:
            return f"control load: {outcome.stderr[-300:]}"
        verify, inspect = run_cli("verify", out), run_cli("inspect", out, "--json")
        if verify.status != 0 or not verify.stdout.startswith("OK "):
            return f"control verify: {verify.stdout[-300:]} {verify.stderr[-300:]}"
        if inspect.status != 0 or json.loads(inspect.stdout).get("kind") != "pipeline":
            return f"control inspect: {inspect.stdout[-300:]} {inspect.stderr[-300:]}"
        return None

    def unverified(what: str) -> Callable[[Path], str | None]:
        def case(folder: Path) -> str | None:
            out = Path(shutil.copytree(_inputs(soak)["tp1"], folder / "out"))
            if what == "same size":
                _flip(out / "vae/diffusion_pytorch_model.safetensors", -20)
                outcome = _load(out, verify=False)
                return None if outcome.status == 0 else f"verify=False refused: {outcome.stderr[-300:]}"
            if what == "record":
                _edit_record(out, lambda d: d["components"]["vae"].update(treatment="skipped"), reseal=False)
                return one_line(_load(out, verify=False), "does not match its digest")
            shutil.rmtree(out / "vae")
            return one_line(_load(out, verify=False), "vae/config.json is missing")

        return case

    cases.append(Case("tampered", "the control loads, verifies and inspects", control))
    cases += [Case("tampered", f"verify=False: {w}", unverified(w)) for w in ("same size", "record", "missing")]
    return cases


# ---------------------------------------------------------------------------------------------------------
# piperanks


def _scheduler(shift: float):
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(shift=shift)


def pipe_rank(rank: int, world: int, root: str, scenario: str) -> str | None:
    from multiproc import error_of, init_gloo

    from preshard.runtime.pipeline_load import load_pipeline

    init_gloo(120)
    os.chdir(Path(root) / f"r{rank}")  # the same relative path on every rank; the folders differ per rank
    kwargs: dict = {"timeout": 60}
    if scenario == "diffusers-error":
        kwargs["verify"] = False
    if scenario == "components":
        kwargs["components"] = {"scheduler": _scheduler(3.0 if rank == 0 else 9.0)}
    return error_of(lambda: load_pipeline("out", **kwargs))


def pipe_rank_cases(soak: Soak) -> list[Case]:
    want = {
        "control": (None, ""),
        "vae-differs": ("CorruptCheckpointError", "vae/diffusion_pytorch_model.safetensors differs"),
        "vae-missing": ("CheckpointFileMissingError", "vae/config.json is missing"),
        "diffusers-error": ("CorruptCheckpointError", "could not be loaded"),
        "components": ("MismatchError", "called load_pipeline with different components="),
        "records": ("MismatchError", "opened different checkpoints"),
    }

    def job(scenario: str) -> Callable[[Path], str | None]:
        def case(folder: Path) -> str | None:
            from multiproc import run_ranks

            from preshard.converter.pipeline_folder import convert_pipeline

            inputs = _inputs(soak)
            for rank in (0, 1):
                shutil.copytree(inputs["tp2"], folder / f"r{rank}" / "out")
            r1 = folder / "r1" / "out"
            if scenario == "vae-differs":
                _flip(r1 / "vae/diffusion_pytorch_model.safetensors", -20)
            elif scenario == "vae-missing":
                shutil.rmtree(r1 / "vae")
            elif scenario == "diffusers-error":
                config = r1 / "vae/config.json"
                config.write_bytes(b"{" * config.stat().st_size)
            elif scenario == "records":
                other = Path(shutil.copytree(inputs["source"], folder / "other-source"))
                shutil.rmtree(r1)
                convert_pipeline(other, r1, tp=2, progress=False)
            results = run_ranks(pipe_rank, 2, str(folder), scenario, timeout=300)
            kind, fragment = want[scenario]
            if kind is None:
                return None if results == [None, None] else f"control: {results}"
            for rank, error in enumerate(results):
                if error is None or not error.startswith(kind) or fragment not in error or "\n" in error:
                    return f"rank {rank}: {error}"
            return None

        return case

    def killed(folder: Path) -> str | None:
        from multiproc import free_port

        script = (
            "import os, sys\nfrom datetime import timedelta\nimport torch.distributed as dist\n"
            "dist.init_process_group('gloo', timeout=timedelta(seconds=120))\n"
            "from preshard.runtime import reader\nfrom preshard.runtime.pipeline_load import load_pipeline\n"
            "if os.environ['RANK'] == '1':\n    reader.ShardReader.read_all = lambda *a, **k: os._exit(7)\n"
            "try:\n    load_pipeline(sys.argv[1], timeout=60)\n    print('loaded')\n"
            "except Exception as exc:\n    print('caught: ' + type(exc).__name__ + ': ' + str(exc))\n"
        )
        port, procs = free_port(), []
        try:
            for rank in (0, 1):
                env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}  # fmt: skip
                command = [sys.executable, "-c", script, str(_inputs(soak)["tp2"])]
                procs.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                              text=True))  # fmt: skip
            (out0, err0), _ = (p.communicate(timeout=soak.case_timeout) for p in procs)
        finally:
            for proc in procs:
                proc.kill()
        caught = [line for line in out0.splitlines() if line.startswith("caught: ")]
        if procs[1].returncode != 7 or len(caught) != 1 or "another rank of this job left" not in caught[0]:
            return f"rank 0: {out0[-300:]} {err0[-300:]}"
        return None

    return [Case("piperanks", name, job(name)) for name in want] + [
        Case("piperanks", "a rank killed while reading its shard", killed)
    ]


CASES = {"records": record_cases, "tampered": tampered_cases, "piperanks": pipe_rank_cases}
