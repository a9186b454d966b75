"""A pipeline folder and Hub arguments as a hostile user writes them (issue 36, items 1, 4 and 7, and the Hub's
`revision`): nothing is removed or written outside the output's partial folder, the output and the HF cache's own
repo folder; no link leads a copy out of the pipeline folder; every edge is one line.

Pipelines here are made by hand (an index, small files, a fake safetensors file): everything refused is refused
while planning, before a conversion would read a tensor, and the accepted ones copy their components whole.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from pathlib import Path

import pytest
from clitools import assert_one_line, cli_runner
from hostile_pipelines import INDEX, safetensors_bytes, tree, write_pipeline
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.quick


def convert(source: Path, out: Path, **kwargs):
    from preshard.converter.pipeline_folder import convert_pipeline

    return convert_pipeline(source, out, tp=2, progress=False, **kwargs)


def no_output_left(out: Path) -> None:
    assert not out.exists()
    assert not (out.parent / f".{out.name}.partial").exists()
    assert not (out.parent / f".{out.name}.lock").exists()


# -- item 1: component names are one plain path component


@pytest.mark.parametrize("name", ["..", "../victim", "ABSOLUTE", ".", "", "a/b", "a\\b", ".hidden", "x\x00y", "x\ny"])
@pytest.mark.parametrize("out_elsewhere", [False, True])
def test_a_hostile_component_name_is_refused_and_nothing_outside_changes(tmp_path, name, out_elsewhere):
    from preshard.errors import SourceError

    work = tmp_path / "work"
    victim = work / "victim"
    victim.mkdir(parents=True)
    (victim / "precious.txt").write_text("keep me")
    elsewhere = tmp_path / "elsewhere-abs"
    elsewhere.mkdir()
    (elsewhere / "config.json").write_text("{}")
    name = str(elsewhere) if name == "ABSOLUTE" else name
    index = {**INDEX, name: ["diffusers", "AutoencoderKLWan"]}
    source = write_pipeline(work / "src", index)
    (source / "a").mkdir()
    (source / "a" / "b").mkdir()
    out = (tmp_path / "other" / "out") if out_elsewhere else (work / "out")
    before = tree(tmp_path)
    with pytest.raises(SourceError, match="component name") as info:
        convert(source, out)
    assert "\n" not in str(info.value) and repr(name) in str(info.value)
    assert tree(tmp_path) == before  # the source, the sibling, the folder holding OUT: all as they were
    no_output_left(out)


def test_cli_component_and_keep_layers_names_are_checked(tmp_path):
    from preshard.cli import convert_checkpoint_command

    source = write_pipeline(tmp_path / "src")
    for option, value in [
        ("--component", "../vae:whole"),
        ("--component", ".:skip"),
        ("--component", "a/b:tp=2"),
        ("--keep-layers", "../x:3"),
        ("--keep-layers", "..:all"),
    ]:
        run = cli_runner().invoke(
            convert_checkpoint_command, [str(source), str(tmp_path / "out"), "--tp", "2", option, value]
        )
        assert_one_line(run.exit_code, run.stderr, 2, "component name")
        no_output_left(tmp_path / "out")


def test_every_removal_is_proven_inside_its_folder(tmp_path):
    from preshard.converter.contained import inside, remove_inside
    from preshard.errors import OutputError

    work = tmp_path / "work"
    work.mkdir()
    (tmp_path / "victim").mkdir()
    (tmp_path / "victim" / "f").write_text("x")
    for path in [work / "..", work / "../victim", tmp_path / "victim", work, work / ".", Path("/")]:
        with pytest.raises(OutputError, match="refusing to remove"):
            remove_inside(work, path)
    (work / "link").symlink_to(tmp_path / "victim")
    with pytest.raises(OutputError):
        remove_inside(work, work / "link" / "f")  # through a link out of the folder: its parent resolves outside
    remove_inside(work, work / "link")  # the link itself is removed, never its target
    assert not (work / "link").is_symlink() and (tmp_path / "victim" / "f").read_text() == "x"
    assert inside(work, work / "a" / "b") == work.resolve() / "a" / "b"


NAME_PARTS = st.sampled_from([*"ab_-.", "/", "\\", "\x00", "\n", " ", "..", "é", "../", "/tmp"])
NAMES = st.lists(NAME_PARTS, max_size=5).map("".join)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(names=st.lists(NAMES, min_size=1, max_size=3, unique=True))
def test_fuzzed_component_names_change_nothing_outside_the_output(names):
    """Any component names in the index: refused in one line, or converted (copied whole) into OUT alone."""
    from preshard.errors import PreshardError

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "sibling" / "deep").mkdir(parents=True)
        (root / "sibling" / "deep" / "data.txt").write_text("sibling")
        source = write_pipeline(
            root / "job" / "src", {**INDEX, **{n: ["diffusers", "AutoencoderKLWan"] for n in names}}
        )
        for name in names:  # each name's folder, wherever the name points (inside the source or not)
            try:
                folder = source / name
                folder.mkdir(parents=True, exist_ok=True)
                if folder.resolve().is_relative_to(source.resolve()) and folder.resolve() != source.resolve():
                    (folder / "config.json").write_text("{}")
                    (folder / "diffusion_pytorch_model.safetensors").write_bytes(safetensors_bytes())
            except (OSError, ValueError):
                pass
        out = root / "job" / "out"
        before = {k: v for k, v in tree(root).items()}
        try:
            record = convert(source, out)
        except PreshardError as exc:
            assert "\n" not in str(exc)
            assert tree(root) == before
            no_output_left(out)
            return
        after = tree(root)
        assert {k: v for k, v in after.items() if not k.startswith("job/out")} == before
        for name in (n for n in names if not n.startswith("_")):  # "_..." keys are the index's settings
            assert record.components[name].treatment == "whole"
            assert (out / name / "config.json").is_file()


# -- item 4: no link leaves the pipeline folder


@pytest.fixture
def secret(tmp_path) -> Path:
    folder = tmp_path / "outside"
    folder.mkdir()
    (folder / "secret.txt").write_text("SECRET")
    (folder / "config.json").write_text('{"_class_name": "AutoencoderKLWan"}')
    (folder / "diffusion_pytorch_model.safetensors").write_bytes(safetensors_bytes())
    return folder


def _link_out(source: Path, secret: Path, case: str) -> Path:
    """Make `case`'s link out of the pipeline folder; returns the link."""
    if case == "component folder":
        shutil.rmtree(source / "vae")
        link, target = source / "vae", secret
    elif case == "weights file":
        link, target = (
            source / "vae" / "diffusion_pytorch_model.safetensors",
            secret / "diffusion_pytorch_model.safetensors",
        )
    elif case == "file in a copied component":
        link, target = source / "scheduler" / "notes.txt", secret / "secret.txt"
    elif case == "file in a subfolder":
        (source / "scheduler" / "sub").mkdir()
        link, target = source / "scheduler" / "sub" / "notes.txt", secret / "secret.txt"
    elif case == "folder in a component":
        link, target = source / "scheduler" / "more", secret
    elif case == "top-level README.md":
        (source / "README.md").unlink()
        link, target = source / "README.md", secret / "secret.txt"
    elif case == "sharded component's weights":
        link, target = (
            source / "transformer" / "diffusion_pytorch_model.safetensors",
            secret / "diffusion_pytorch_model.safetensors",
        )
    else:
        raise AssertionError(case)
    if link.exists() or link.is_symlink():
        link.unlink()
    link.symlink_to(target)
    return link


@pytest.mark.parametrize(
    "case",
    [
        "component folder", "weights file", "file in a copied component", "file in a subfolder",
        "folder in a component", "top-level README.md", "sharded component's weights",
    ],
)  # fmt: skip
def test_a_link_out_of_the_pipeline_folder_is_refused_naming_it(tmp_path, secret, case):
    from preshard.cli import convert_checkpoint_command

    transformer = {"transformer": {"config.json": b'{"_class_name": "WanTransformer3DModel"}'}}
    index = {**INDEX, "transformer": ["diffusers", "WanTransformer3DModel"]}
    source = write_pipeline(tmp_path / "src", index, transformer)
    (source / "transformer" / "diffusion_pytorch_model.safetensors").write_bytes(safetensors_bytes())
    link = _link_out(source, secret, case)
    out = tmp_path / "out"
    run = cli_runner().invoke(convert_checkpoint_command, [str(source), str(out), "--tp", "2", "--no-progress"])
    assert_one_line(run.exit_code, run.stderr, 2, f"{link} is a symbolic link to", "outside the pipeline folder")
    no_output_left(out)


def test_links_inside_the_folder_are_copied_as_their_targets_bytes(tmp_path):
    source = write_pipeline(tmp_path / "src")
    (source / "shared").mkdir()
    (source / "shared" / "vocab.txt").write_text("vocab")
    (source / "vae" / "vocab.txt").symlink_to(source / "shared" / "vocab.txt")  # a file link inside
    (source / "scheduler" / "shared").symlink_to("../shared")  # a folder link inside, relative
    (source / "LICENSE").symlink_to(source / "shared" / "vocab.txt")
    out = tmp_path / "out"
    convert(source, out)
    for copy in [out / "vae" / "vocab.txt", out / "scheduler" / "shared" / "vocab.txt", out / "LICENSE"]:
        assert not copy.is_symlink() and copy.read_text() == "vocab"
    assert not (out / "scheduler" / "shared").is_symlink()
    found = [p for p in out.rglob("*") if p.is_symlink()]
    assert not found


def test_a_link_cycle_and_a_fifo_are_refused_in_one_line(tmp_path):
    from preshard.errors import SourceError

    source = write_pipeline(tmp_path / "src")
    (source / "vae" / "loop").symlink_to("..")
    with pytest.raises(SourceError, match="a cycle"):
        convert(source, tmp_path / "out")
    (source / "vae" / "loop").unlink()
    os.mkfifo(source / "scheduler" / "pipe")
    with pytest.raises(SourceError, match="is a FIFO"):
        convert(source, tmp_path / "out")  # never opened, never waited on
    no_output_left(tmp_path / "out")


def test_a_pipeline_in_the_hf_cache_may_link_into_the_cache(tmp_path, hf_env):
    """A snapshot folder's files are links to the cache's blobs, outside the snapshot folder: allowed there only."""
    snapshot = hf_env.cache / "models--org--pipe" / "snapshots" / ("0" * 40)
    source = write_pipeline(snapshot)
    blobs = hf_env.cache / "models--org--pipe" / "blobs"
    blobs.mkdir(parents=True)
    for f in [p for p in source.rglob("*") if p.is_file()]:
        blob = blobs / f"{abs(hash(str(f)))}"
        shutil.move(f, blob)
        f.symlink_to(os.path.relpath(blob, f.parent))
    out = tmp_path / "out"
    convert(source, out)
    assert (out / "vae" / "config.json").read_text() == '{"_class_name": "AutoencoderKLWan"}'
    assert not any(p.is_symlink() for p in out.rglob("*"))


# -- item 7: edges


def test_an_over_long_integer_in_any_json_is_one_line(tmp_path):
    from preshard.errors import CorruptCheckpointError, SourceError
    from preshard.format.jsonio import parse_json_text
    from preshard.sources.safetensors_file import parse_header

    long = "9" * 5000
    with pytest.raises(CorruptCheckpointError, match="manifest.json holds a number too long to read"):
        parse_json_text(f'{{"tp": {long}}}', "manifest.json", CorruptCheckpointError, "convert again")
    source = write_pipeline(tmp_path / "src")
    (source / "model_index.json").write_text(json.dumps(INDEX)[:-1] + f', "x": {long}}}')
    with pytest.raises(SourceError, match="model_index.json holds a number too long") as info:
        convert(source, tmp_path / "out")
    assert "\n" not in str(info.value)
    header = f'{{"w": {{"dtype": "F32", "shape": [{long}], "data_offsets": [0, 4]}}}}'.encode()
    with pytest.raises(SourceError, match="number too long"):
        parse_header(tmp_path / "x.safetensors", 8 + len(header) + 4, header)
    no_output_left(tmp_path / "out")


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--component", "vae:tp=\u00b2"], "is not NAME:tp=N"),
        (["--component", "vae:tp=\u0661"], "is not NAME:tp=N"),  # an Arabic-Indic one
        (["--keep-layers", "vae:\u00b2"], "is not NAME:K"),
        (["--component", "vae:whole", "--component", "vae:skip"], "choose differently for vae"),
        (["--keep-layers", "vae:2", "--keep-layers", "vae:3"], "differ for vae"),
    ],
)
def test_option_values_are_ascii_integers_and_conflicts_are_refused(tmp_path, args, says):
    from preshard.cli import convert_checkpoint_command

    source = write_pipeline(tmp_path / "src")
    run = cli_runner().invoke(convert_checkpoint_command, [str(source), str(tmp_path / "out"), "--tp", "2", *args])
    assert_one_line(run.exit_code, run.stderr, 2, says)
    no_output_left(tmp_path / "out")


def test_identical_duplicate_choices_are_one(tmp_path):
    source = write_pipeline(tmp_path / "src")
    record = convert(source, tmp_path / "out", components=["vae:skip", "vae:skip"])
    assert record.components["vae"].treatment == "skipped"


def test_what_load_pipeline_cannot_load_is_refused_before_anything_is_written(tmp_path):
    from preshard.errors import UsageError

    index = {**INDEX, "transformer": ["diffusers", "WanTransformer3DModel"]}
    extra = {"transformer": {"config.json": b"{}", "diffusion_pytorch_model.safetensors": safetensors_bytes()}}
    source = write_pipeline(tmp_path / "src", index, extra)
    with pytest.raises(UsageError, match="differs from the pipeline's --tp 2"):
        convert(source, tmp_path / "out", components=["transformer:tp=1"])
    no_output_left(tmp_path / "out")
    (source / "vae" / "diffusion_pytorch_model.safetensors").unlink()  # config.json, no weights: a useless copy
    with pytest.raises(UsageError, match="has a config.json but no weights"):
        convert(source, tmp_path / "out", components=["transformer:whole"])
    no_output_left(tmp_path / "out")


def _text_encoder() -> dict[str, bytes]:
    tensors = {
        f"model.layers.{i}.w": {"dtype": "F32", "shape": [2], "data_offsets": [8 * i, 8 * i + 8]} for i in range(2)
    }
    header = json.dumps(tensors).encode()
    config = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "num_hidden_layers": 2}
    return {
        "config.json": json.dumps(config).encode(),
        "model.safetensors": struct.pack("<Q", len(header)) + header + bytes(16),
    }


def test_a_usage_error_mid_conversion_removes_the_partial_copies(tmp_path):
    from preshard.errors import UsageError

    index = {**INDEX, "text_encoder": ["transformers", "Qwen3ForCausalLM"]}
    source = write_pipeline(tmp_path / "src", index, {"text_encoder": _text_encoder()})
    out = tmp_path / "out"
    with pytest.raises(UsageError, match="keep at most 2"):  # found while copying, after the VAE was copied
        convert(source, out, keep_layers=["text_encoder:99"])
    no_output_left(out)


def test_another_failure_keeps_the_partial_and_says_where(tmp_path, monkeypatch):
    from preshard.converter import pipeline_copy
    from preshard.errors import SourceError

    source = write_pipeline(tmp_path / "src")
    out = tmp_path / "out"
    real = pipeline_copy.copy_file

    def failing(src, shown, work, dst):
        if "vae" in str(dst):
            raise SourceError(f"{shown} changed while it was copied")
        return real(src, shown, work, dst)

    monkeypatch.setattr("preshard.converter.pipeline_copy.copy_file", failing)
    with pytest.raises(
        SourceError, match=r"the partial conversion is kept in .*\.out\.partial: re-run the same"
    ) as info:
        convert(source, out)
    assert "\n" not in str(info.value)
    assert (tmp_path / ".out.partial" / "scheduler" / "scheduler_config.json").is_file()  # kept for the resume
    monkeypatch.setattr("preshard.converter.pipeline_copy.copy_file", real)
    convert(source, out)
    assert (out / "vae" / "config.json").is_file() and not (tmp_path / ".out.partial").exists()


# -- Hub arguments


HOSTILE_REVISIONS = [
    "/abs",
    "ABSOLUTE",
    "../../../../x",
    "refs/../../../x",
    "main/../../x",
    "a//b",
    "main/",
    "m\\x",
    "ma\x00in",
    "m\nx",
    "",
]


def _hub_repo(fake_hub) -> str:
    config = json.dumps({"_class_name": "WanTransformer3DModel"}).encode()
    commit = fake_hub.add_repo("org/model", {"config.json": config, "model.safetensors": safetensors_bytes()})
    fake_hub.set_ref("org/model", "feature/x", commit)
    return commit


@pytest.mark.parametrize("revision", HOSTILE_REVISIONS)
def test_a_hostile_revision_is_refused_before_any_hub_call(tmp_path, fake_hub, hf_env, revision):
    from preshard.errors import UsageError
    from preshard.sources import hub

    _hub_repo(fake_hub)
    revision = str(tmp_path / "abs-target") if revision == "ABSOLUTE" else revision
    before, requests = tree(tmp_path), len(fake_hub.log())
    calls = [
        lambda: hub.download_source("org/model", revision=revision),
        lambda: hub.source_headers("org/model", revision=revision),
        lambda: hub.download_files("org/model", ["config.json"], revision=revision),
    ]
    for call in calls:
        with pytest.raises(UsageError, match="--revision") as info:
            call()
        assert "\n" not in str(info.value) and "branch, tag or commit" in str(info.value)
    from preshard.runtime.pipeline_load import load_pipeline

    with pytest.raises(UsageError, match="revision="):
        load_pipeline("org/model", revision=revision, timeout=5)
    assert len(fake_hub.log()) == requests  # no request at all
    assert tree(tmp_path) == before  # nothing written anywhere: no refs file beside or outside the cache


def test_a_hostile_revision_on_the_command_line_is_one_line(tmp_path, fake_hub, hf_env):
    from preshard.cli import convert_checkpoint_command

    _hub_repo(fake_hub)
    before = tree(tmp_path)
    for revision in ["../../../../x", "refs/../../../x", "main/../../x", str(tmp_path / "abs")]:
        run = cli_runner().invoke(
            convert_checkpoint_command, ["org/model", str(tmp_path / "out"), "--tp", "1", "--revision", revision]
        )
        assert_one_line(run.exit_code, run.stderr, 2, "--revision", "pass a branch, tag or commit sha")
    assert tree(tmp_path) == before
    assert not fake_hub.log()


def test_revisions_with_a_slash_are_allowed(fake_hub, hf_env):
    from preshard.format.hub_names import check_revision
    from preshard.sources import hub

    commit = _hub_repo(fake_hub)
    for ok in ["main", "refs/pr/1", "feature/x", "v1.0", commit, "release-2.x"]:
        assert check_revision(ok) == ok
    assert hub.download_source("org/model", revision="feature/x").commit == commit


@pytest.mark.parametrize(
    ("repo", "subfolder", "says"),
    [
        ("org/model", "../x", "--subfolder '../x' holds a '.' or '..'"),
        ("org/model", "/transformer", "is an absolute path"),
        ("org/model", "a//b", "empty component"),
        ("org/model", "a\\b", "backslash"),
        ("org/model", "tr\x00x", "control character"),
        ("org/../x", None, "repo id 'org/../x'"),
        ("org/a/b", None, "more than one '/'"),
    ],
)
def test_hostile_repo_ids_and_subfolders_are_refused_before_any_hub_call(
    tmp_path, fake_hub, hf_env, repo, subfolder, says
):
    from preshard.errors import UsageError
    from preshard.sources import hub

    _hub_repo(fake_hub)
    before, requests = tree(tmp_path), len(fake_hub.log())
    with pytest.raises(UsageError, match=says.replace("\\", "\\\\").replace("(", r"\(").replace(")", r"\)")):
        hub.download_source(repo, subfolder=subfolder)
    assert len(fake_hub.log()) == requests and tree(tmp_path) == before


def test_a_lora_path_in_a_repo_is_checked(tmp_path, fake_hub, hf_env):
    from preshard.converter.lora import _local_file
    from preshard.errors import SourceError

    with pytest.raises(SourceError, match="'..' component"):
        _local_file("org/model/../../x.safetensors", None)
    assert not fake_hub.log()
