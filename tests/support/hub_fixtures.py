"""Pytest fixtures that point huggingface_hub at a temporary HF_HOME and at a FakeHub, never at the internet.

huggingface_hub reads most of its settings from the environment once, at import (`huggingface_hub.constants`):
HF_ENDPOINT (-> ENDPOINT and HUGGINGFACE_CO_URL_TEMPLATE), HF_HOME / HF_HUB_CACHE (-> HF_HUB_CACHE, HF_TOKEN_PATH,
...), HF_HUB_OFFLINE, HF_HUB_DISABLE_XET, HF_HUB_DISABLE_TELEMETRY. Tests share one process, so setting the
environment is not enough: `configure_hf` sets the variables (for subprocesses, and for those read at call time such
as HF_TOKEN) *and* patches the constants, both undone by monkeypatch at the end of the test.

tests/conftest.py makes both fixtures available to every test module.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from fake_hub import FakeHub
from huggingface_hub import close_session, constants
from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

TOKEN_VARS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE", "HF_OIDC_ID_TOKEN")
CACHE_VARS = ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_ASSETS_CACHE", "HUGGINGFACE_ASSETS_CACHE", "HF_XET_CACHE")
OFFLINE_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


def closed_port_endpoint() -> str:
    """An http endpoint on 127.0.0.1 where nothing listens: connecting to it fails at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def configure_hf(monkeypatch: pytest.MonkeyPatch, hf_home: Path, endpoint: str, offline: bool = False) -> None:
    """Make huggingface_hub (already imported) behave as if started with this HF_HOME, HF_ENDPOINT and offline flag."""
    hf_home = Path(hf_home)
    env = {
        "HF_HOME": str(hf_home),
        "HF_ENDPOINT": endpoint,
        "HF_HUB_DISABLE_XET": "1",  # plain HTTP only: the fake server speaks no Xet
        "HF_HUB_DISABLE_TELEMETRY": "1",  # no /api/agent-harnesses look-up, no extra user-agent probing
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "HF_HUB_DISABLE_UPDATE_CHECK": "1",
        "HF_HUB_DISABLE_SYMLINKS_WARNING": "1",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    for name in TOKEN_VARS + CACHE_VARS + OFFLINE_VARS + ("HUGGINGFACE_CO_STAGING", "HF_HUB_DISABLE_IMPLICIT_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    hub_cache = str(hf_home / "hub")
    patches = {
        "ENDPOINT": endpoint,
        "HUGGINGFACE_CO_URL_TEMPLATE": endpoint + "/{repo_id}/resolve/{revision}/{filename}",
        "HF_HOME": str(hf_home),
        "HF_HUB_CACHE": hub_cache,
        "HUGGINGFACE_HUB_CACHE": hub_cache,
        "default_cache_path": hub_cache,
        "HF_ASSETS_CACHE": str(hf_home / "assets"),
        "HUGGINGFACE_ASSETS_CACHE": str(hf_home / "assets"),
        "HF_TOKEN_PATH": str(hf_home / "token"),
        "HF_STORED_TOKENS_PATH": str(hf_home / "stored_tokens"),
        "HF_XET_CACHE": str(hf_home / "xet"),
        "AGENT_HARNESSES_PATH": str(hf_home / ".agent_harnesses.json"),
        "CHECK_FOR_UPDATE_DONE_PATH": str(hf_home / ".check_for_update_done"),
        "HF_HUB_OFFLINE": offline,
        "HF_HUB_DISABLE_XET": True,
        "HF_HUB_DISABLE_TELEMETRY": True,
        "HF_HUB_DISABLE_IMPLICIT_TOKEN": False,
        "HF_HUB_DISABLE_SHARED_BLOBS": True,
        "HF_HUB_DISABLE_UPDATE_CHECK": True,
    }
    for name, value in patches.items():
        if name in ("ENDPOINT", "HUGGINGFACE_CO_URL_TEMPLATE", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "HF_TOKEN_PATH"):
            monkeypatch.setattr(constants, name, value)  # these must exist: fail loudly if a release renames them
        elif hasattr(constants, name):
            monkeypatch.setattr(constants, name, value)
    set_offline(monkeypatch, offline)


def set_offline(monkeypatch: pytest.MonkeyPatch, offline: bool = True) -> None:
    """HF_HUB_OFFLINE on or off, in the environment and in huggingface_hub.constants."""
    if offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    else:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)


@dataclass
class HfEnv:
    """A test's HF setup: its HF_HOME (cache in `home / "hub"`) and endpoint."""

    home: Path
    endpoint: str
    monkeypatch: pytest.MonkeyPatch

    @property
    def cache(self) -> Path:
        return self.home / "hub"

    def offline(self, flag: bool = True) -> None:
        set_offline(self.monkeypatch, flag)

    def use_endpoint(self, endpoint: str) -> None:
        self.endpoint = endpoint
        configure_hf(self.monkeypatch, self.home, endpoint, offline=constants.HF_HUB_OFFLINE)

    def subprocess_env(self) -> dict[str, str]:
        """The environment for a child process: the same settings, read fresh by its own huggingface_hub import."""
        return dict(os.environ)


@pytest.fixture
def hf_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[HfEnv]:
    """A private HF_HOME, online, with HF_ENDPOINT on a closed local port: nothing can reach the internet."""
    bars_were_disabled = are_progress_bars_disabled()
    disable_progress_bars()
    close_session()  # no pooled connection from an earlier test
    env = HfEnv(tmp_path / "hf_home", closed_port_endpoint(), monkeypatch)
    configure_hf(monkeypatch, env.home, env.endpoint)
    yield env
    close_session()
    if not bars_were_disabled:
        enable_progress_bars()


@pytest.fixture
def fake_hub(hf_env: HfEnv) -> Iterator[FakeHub]:
    """A running FakeHub that huggingface_hub talks to (HF_ENDPOINT), with `hf_env`'s private cache."""
    with FakeHub() as hub:
        hf_env.use_endpoint(hub.endpoint)
        yield hub
        close_session()
