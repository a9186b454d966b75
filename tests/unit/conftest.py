"""Every unit test is in the quick tier (`pytest -m quick`) and in the XLA tier (`xla_api`): they run in moments,
in one process, and test preshard's own logic against the dependencies' APIs at whatever version is installed."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.quick)
            item.add_marker(pytest.mark.xla_api)
