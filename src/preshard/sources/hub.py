"""TEMPORARY placeholder until the Hub module lands."""

from __future__ import annotations

import re

from preshard.errors import SourceError

_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?$")


def is_repo_id(text: str) -> bool:
    return bool(_REPO_ID.match(text)) and "/" in text


def download_source(repo_id, *, subfolder=None, revision=None, token=None):
    raise SourceError(f"source {repo_id} does not exist locally, and Hub downloads are not available yet")
