"""Server settings a user of the reference writes, read so that none is accepted and then
silently does something else (issue 27): a Delayed Nesterov buffer size turns Delayed Nesterov
on (0 turns it off), and saving every N rounds needs a place to save."""

from __future__ import annotations

import pytest

from diloco.server.config import ServerConfig


def test_a_buffer_size_turns_delayed_nesterov_on_as_in_the_reference() -> None:
    config = ServerConfig(mode="async", num_workers=4, dn_buffer_size=3)
    assert config.delayed_nesterov is True and config.dn_buffer_size == 3


def test_a_buffer_size_of_0_turns_it_off() -> None:
    config = ServerConfig(mode="async", num_workers=4, dn_buffer_size=0)
    assert config.delayed_nesterov is False and config.dn_buffer_size is None
    with pytest.raises(ValueError, match="turns Delayed Nesterov off"):
        ServerConfig(mode="async", dn_buffer_size=0, delayed_nesterov=True)


def test_a_buffer_size_in_sync_mode_says_it_needs_async() -> None:
    with pytest.raises(ValueError, match="also turned on by dn_buffer_size.*--async"):
        ServerConfig(dn_buffer_size=3)


def test_without_a_buffer_size_nothing_changes() -> None:
    assert ServerConfig(mode="async").delayed_nesterov is False
    config = ServerConfig(mode="async", delayed_nesterov=True)
    assert config.delayed_nesterov is True and config.dn_buffer_size is None


def test_save_every_needs_a_save_dir(tmp_path: object) -> None:
    with pytest.raises(ValueError, match="save_every 5 needs save_dir"):
        ServerConfig(save_every=5)
    assert ServerConfig(save_every=5, save_dir=str(tmp_path)).save_every == 5
    # All-reduce mode: rank 0 of a quorum saves into its own save_dir; the server has none.
    assert ServerConfig(save_every=5, allreduce=True).save_every == 5


def test_dylu_base_sync_every_needs_dylu_and_a_positive_value() -> None:
    # The reference's `--async --dylu --dylu-base-sync-every 500` is accepted as written ...
    assert (
        ServerConfig(mode="async", dylu=True, dylu_base_sync_every=500).dylu_base_sync_every == 500
    )
    # ... and given without --dylu it would do nothing, so it is refused, naming the fix.
    with pytest.raises(ValueError, match="needs --dylu"):
        ServerConfig(mode="async", dylu_base_sync_every=500)
    with pytest.raises(ValueError, match="dylu_base_sync_every must be >= 1"):
        ServerConfig(dylu=True, dylu_base_sync_every=0)
