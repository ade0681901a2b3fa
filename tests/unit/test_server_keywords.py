"""``DiLoCoServer`` also takes its settings as keywords, after an optional model/output folder,
as the reference's ``DiLoCoServer("path/to/model", num_workers=3, ...)`` does (issue 27); names
that are no setting are a TypeError naming them."""

from __future__ import annotations

from pathlib import Path

import pytest

from diloco.server.config import ServerConfig
from diloco.server.server import config_of


def test_the_reference_form_builds_the_same_config(tmp_path: Path) -> None:
    config = config_of(
        str(tmp_path),
        {
            "num_workers": 3,
            "port": 0,
            "async_mode": True,
            "dn_buffer_size": 3,
            "dylu_enabled": True,
            "dylu_base_sync_every": 500,
            "dashboard_enabled": False,
        },
    )
    assert config == ServerConfig(
        output_dir=str(tmp_path),
        num_workers=3,
        port=0,
        mode="async",
        dn_buffer_size=3,
        dylu=True,
        dylu_base_sync_every=500,
        dashboard_enabled=False,
    )
    # The folder is the output dir: checkpoints under it, as with `-o`.
    assert config.save_dir == str(tmp_path / "checkpoints")
    assert config.delayed_nesterov is True
    assert config_of(tmp_path, {"async_mode": False}).mode == "sync"


def test_keywords_alone_and_a_config_alone() -> None:
    assert config_of(None, {"num_workers": 2}) == ServerConfig(num_workers=2)
    config = ServerConfig(num_workers=5)
    assert config_of(config, {}) is config
    assert config_of(None, {}) == ServerConfig()


def test_unknown_or_doubled_settings_are_named() -> None:
    with pytest.raises(TypeError, match="unknown setting.*max_sync_retries.*migrating"):
        config_of(None, {"max_sync_retries": 3})
    with pytest.raises(TypeError, match="num_workers in the ServerConfig"):
        config_of(ServerConfig(), {"num_workers": 2})
    with pytest.raises(TypeError, match="ServerConfig or a model/output folder"):
        config_of(3, {})  # type: ignore[arg-type]
