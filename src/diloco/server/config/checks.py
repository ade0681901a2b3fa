"""The server settings' validation: which values each setting takes, and which combinations a
mode refuses. It must see every field at once, so it takes the whole config; ``ServerConfig``
runs it at construction. A few settings are resolved here too (``-o``'s checkpoint half, the
outer momentum from the rule, the fragmenting quorum rounds and relays fix), written with
``object.__setattr__`` since the config is frozen: everything after construction reads them
resolved."""

from __future__ import annotations

import math
from pathlib import Path

from diloco.core.codecs import codec_names
from diloco.core.fragments import PATTERNS
from diloco.core.outer_rules import SPARSELOCO, check_rule, outer_momentum
from diloco.core.staleness import policy_named
from diloco.server.config.declare import (
    DOWNLOAD_CODECS,
    GRACE_CEILING,
    GRACE_FLOOR,
    RELAY_CODECS,
)
from diloco.server.config.modes import ModeSettings


def check(config: ModeSettings) -> None:
    """Resolve the settings one flag implies for another, then refuse a bad value or a
    combination a mode cannot run (ValueError, naming the flags). In this order, which is
    the order the errors are met in."""
    _resolve_shorthands(config)
    _check_rounds(config)
    _check_liveness_and_codecs(config)
    _check_async(config)
    _check_download_codec(config)
    _check_quorum(config)
    _check_allreduce(config)
    _check_swarm(config)
    _check_relay(config)
    _check_dynamic(config)
    _check_access(config)


def _resolve_shorthands(config: ModeSettings) -> None:
    """Settings one flag implies for another, written into the config before any check."""
    if (
        config.output_dir is not None
        and config.save_dir is None
        and not config.allreduce
        and not config.swarm
    ):
        # -o's checkpoint half, resolved once here: everything after reads save_dir.
        object.__setattr__(config, "save_dir", str(Path(config.output_dir) / "checkpoints"))
    # The reference's async command line: a buffer size turns Delayed Nesterov on, 0 turns
    # it off. Read that way, so that its command does not run plain Nesterov in silence.
    if config.dn_buffer_size == 0:
        if config.delayed_nesterov:
            raise ValueError(
                "dn_buffer_size 0 turns Delayed Nesterov off; it cannot go with "
                "delayed_nesterov (drop one of --dn-buffer-size 0, --delayed-nesterov)"
            )
        object.__setattr__(config, "dn_buffer_size", None)
    elif config.dn_buffer_size is not None and config.dn_buffer_size > 0:
        object.__setattr__(config, "delayed_nesterov", True)


def _check_rounds(config: ModeSettings) -> None:
    """Ports, counts, the outer step, weighting and checkpoints."""
    if not 0 <= config.port <= 65535:
        raise ValueError(f"port must be in [0, 65535], got {config.port}")
    if config.num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {config.num_workers}")
    if not 1 <= config.min_workers <= config.num_workers:
        raise ValueError(f"min_workers must be in [1, num_workers], got {config.min_workers}")
    if not (math.isfinite(config.outer_lr) and config.outer_lr > 0):
        raise ValueError(f"outer_lr must be a finite positive number, got {config.outer_lr}")
    _check_outer_rule(config)
    if config.weighting not in ("equal", "samples", "tokens"):
        raise ValueError(
            f"weighting must be 'equal', 'samples' or 'tokens', got {config.weighting!r}"
        )
    if config.weighting == "tokens" and (config.allreduce or config.swarm):
        raise ValueError(
            "weighting='tokens' weights the uploads of server mode; all-reduce and swarm "
            "members weigh by samples (--weighting samples)"
        )
    if config.save_every < 0 or config.keep_checkpoints < 1:
        raise ValueError("save_every must be >= 0 and keep_checkpoints >= 1")
    if config.save_every and config.save_dir is None and not (config.allreduce or config.swarm):
        # Accepted, it would save nothing: a run that believes it can survive a crash.
        raise ValueError(
            f"save_every {config.save_every} needs save_dir (--save-dir DIR, or -o DIR): without a "
            "place to save, no checkpoint would be written"
        )


def _check_liveness_and_codecs(config: ModeSettings) -> None:
    """Eviction and upload timeouts, upload slots, the codecs allowed."""
    for name in ("heartbeat_timeout", "stuck_timeout", "join_timeout", "body_timeout"):
        value = getattr(config, name)
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be a finite number >= 0, got {value}")
    if not config.poll_timeout > 0:
        raise ValueError("poll_timeout must be positive")
    if config.upload_slots < 1:
        raise ValueError("upload_slots must be >= 1")
    unknown = [n for n in config.allowed_codecs if n not in codec_names()]
    if unknown or not config.allowed_codecs:
        raise ValueError(
            f"codecs must name some of {', '.join(codec_names())}, got {config.codecs!r}"
        )


def _check_async(config: ModeSettings) -> None:
    """Async mode's settings, and what a mode without rounds refuses."""
    if config.mode not in ("sync", "async"):
        raise ValueError(f"mode must be 'sync' or 'async', got {config.mode!r}")
    if config.max_staleness is not None and config.max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0, got {config.max_staleness}")
    policy_named(config.staleness_weighting, config.staleness_cutoff)  # ValueError if unfit
    if config.mode == "sync" and (
        config.delayed_nesterov
        or config.max_staleness is not None
        or config.staleness_weighting != "none"
    ):
        raise ValueError(
            "delayed_nesterov (also turned on by dn_buffer_size), max_staleness and "
            "staleness_weighting need mode='async' (--async)"
        )
    if config.mode == "async" and config.weighting != "equal":
        raise ValueError(
            f"weighting={config.weighting!r} averages one round's contributions; async mode "
            "has no rounds (weight by age with --staleness-weighting)"
        )
    if config.clip_norm_factor is not None and not (
        math.isfinite(config.clip_norm_factor) and config.clip_norm_factor > 0
    ):
        raise ValueError(f"clip_norm_factor must be positive, got {config.clip_norm_factor}")
    if not (math.isfinite(config.trim_fraction) and 0 <= config.trim_fraction < 0.5):
        raise ValueError(f"trim_fraction must be in [0, 0.5), got {config.trim_fraction}")
    if config.mode == "async" and config.robust:
        raise ValueError(
            "clip_norm_factor and trim_fraction aggregate one round's uploads; "
            "async mode has no rounds"
        )


def _check_dynamic(config: ModeSettings) -> None:
    """Delayed Nesterov's buffer, DyLU and the fragments."""
    buffer = config.dn_buffer_size if config.dn_buffer_size is not None else config.num_workers
    if buffer < 1:
        raise ValueError(f"dn_buffer_size must be >= 1, got {config.dn_buffer_size}")
    if not (math.isfinite(config.dn_activation) and 0 <= config.dn_activation <= 1 / buffer):
        raise ValueError(
            f"dn_activation must be in [0, 1/N] = [0, {1 / buffer:.4g}], got {config.dn_activation}"
        )
    if config.dylu_min_sync_every < 1:
        raise ValueError("dylu_min_sync_every must be >= 1")
    if config.dylu_base_sync_every is not None:
        if config.dylu_base_sync_every < 1:
            raise ValueError(
                f"dylu_base_sync_every must be >= 1, got {config.dylu_base_sync_every}"
            )
        if not config.dylu:
            # Accepted alone it would do nothing: the reference's command line gives both.
            raise ValueError("dylu_base_sync_every (--dylu-base-sync-every) needs --dylu")
    if config.num_fragments is not None and config.num_fragments < 1:
        raise ValueError(f"num_fragments must be >= 1, got {config.num_fragments}")
    if config.fragment_pattern not in (None, *PATTERNS):
        raise ValueError(
            f"fragment_pattern must be 'sequential' or 'strided', got {config.fragment_pattern!r}"
        )


def _check_access(config: ModeSettings) -> None:
    """Tokens, TLS, the authentication slowdown and the connection bounds."""
    if config.token is not None and len(config.token) < 8:
        raise ValueError("token must be at least 8 characters")
    if config.admin_token is not None and len(config.admin_token) < 8:
        raise ValueError("admin_token must be at least 8 characters")
    if config.admin_token is not None and config.admin_token == config.token:
        raise ValueError("admin_token must differ from token, or it guards nothing")
    if (config.tls_cert is None) != (config.tls_key is None):
        raise ValueError("tls_cert and tls_key go together: give both or neither")
    if config.auth_failure_limit < 0:
        raise ValueError(f"auth_failure_limit must be >= 0, got {config.auth_failure_limit}")
    if not (math.isfinite(config.auth_failure_window) and config.auth_failure_window > 0):
        raise ValueError(
            f"auth_failure_window must be a finite positive number, got {config.auth_failure_window}"
        )
    for name in ("header_timeout", "upload_rate_window"):
        value = getattr(config, name)
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a finite positive number, got {value}")
    if not (math.isfinite(config.min_upload_rate) and config.min_upload_rate >= 0):
        raise ValueError(
            f"min_upload_rate must be a finite number >= 0, got {config.min_upload_rate}"
        )
    if config.max_connections is not None and config.max_connections < 1:
        raise ValueError(f"max_connections must be >= 1, got {config.max_connections}")
    if config.max_connections_per_ip < 1:
        raise ValueError(
            f"max_connections_per_ip must be >= 1, got {config.max_connections_per_ip}"
        )


def _check_outer_rule(config: ModeSettings) -> None:
    """Resolve ``outer_momentum`` from the rule (``core/outer_rules.py``), refusing what
    contradicts it."""
    check_rule(config.outer_rule)
    momentum = outer_momentum(config.outer_rule, config.outer_momentum)
    if not (math.isfinite(momentum) and 0 <= momentum < 1):
        raise ValueError(f"outer_momentum must be in [0, 1), got {momentum}")
    object.__setattr__(config, "outer_momentum", momentum)
    if config.outer_rule == SPARSELOCO and config.delayed_nesterov:
        raise ValueError(
            "outer_rule sparseloco (--outer-rule sparseloco) keeps no outer momentum; it "
            "cannot go with delayed_nesterov (--delayed-nesterov, --dn-buffer-size)"
        )


def _check_download_codec(config: ModeSettings) -> None:
    if config.download_codec not in DOWNLOAD_CODECS:
        raise ValueError(
            f"download_codec (--download-codec) must be one of {', '.join(DOWNLOAD_CODECS)}, "
            f"got {config.download_codec!r}"
        )
    if not config.lossy_download:
        return
    if config.mode == "async":
        raise ValueError(
            f"download_codec={config.download_codec!r} (--download-codec) needs sync mode "
            "(mode='sync', no --async): an update takes a "
            "worker from one published round to the next, and in async mode a worker is "
            "rarely exactly one version behind, so it would download full parameters anyway; "
            "use --download-codec fp32 in async mode"
        )
    if config.num_fragments is not None and config.num_fragments > 1:
        raise ValueError(
            f"download_codec={config.download_codec!r} (--download-codec) publishes updates of "
            "the whole model; "
            "streaming fragments are downloaded piece by piece as full values: drop "
            "--num-fragments or use --download-codec fp32"
        )
    # Delayed Nesterov needs async mode, refused above.
    if config.sparse_download and config.momentum > 0:
        raise ValueError(
            "download_codec='sparse' (--download-codec sparse) needs plain averaged descent, "
            "whose step leaves every parameter its round's uploads did not touch unchanged: "
            "use --outer-rule sparseloco (or --outer-momentum 0)"
        )


def _check_quorum(config: ModeSettings) -> None:
    quorum, grace = config.quorum_value, config.grace_seconds  # parse errors are ValueErrors
    if config.max_lateness < 0:
        raise ValueError(f"max_lateness must be >= 0, got {config.max_lateness}")
    if not (
        math.isfinite(config.grace_ceiling) and 0 <= config.grace_floor <= config.grace_ceiling
    ):
        raise ValueError(
            f"need 0 <= grace_floor <= grace_ceiling, got {config.grace_floor}, "
            f"{config.grace_ceiling}"
        )
    if quorum is None:
        tuned = {
            "--grace": config.grace is not None,
            "--grace-floor": config.grace_floor != GRACE_FLOOR,
            "--grace-ceiling": config.grace_ceiling != GRACE_CEILING,
            "--max-lateness": config.max_lateness != 1,
        }
        given = [flag for flag, on in tuned.items() if on]
        if given:
            raise ValueError(f"{', '.join(given)} need --quorum (quorum rounds)")
        return
    if isinstance(quorum, int) and quorum < config.min_workers:
        raise ValueError(f"quorum {quorum} is below min_workers ({config.min_workers})")
    if grace is not None and (
        config.grace_floor != GRACE_FLOOR or config.grace_ceiling != GRACE_CEILING
    ):
        raise ValueError("--grace-floor and --grace-ceiling bound --grace auto only")
    clashes = {
        "--async": (config.mode == "async", "async mode has no rounds to close"),
        "--allreduce": (config.allreduce, "its quorums are formed before the round"),
        "--swarm": (config.swarm, "its stages run their own quorums"),
        "--num-fragments": (
            (config.num_fragments or 1) > 1,
            "streaming fragments keep the barrier (each fragment's round waits for all)",
        ),
    }
    refused = [f"{flag} ({why})" for flag, (on, why) in clashes.items() if on]
    if refused:
        raise ValueError("--quorum cannot go with " + "; ".join(refused))
    # The fragmenting is otherwise the first worker's choice: fixed at one unit here, so a
    # streaming worker is told at registration (409 fragments_mismatch), not mid-run.
    object.__setattr__(config, "num_fragments", 1)


def _check_swarm(config: ModeSettings) -> None:
    if config.stages < 2 or config.stages > 1024:
        raise ValueError(f"stages must be in [2, 1024], got {config.stages}")
    if config.min_replicas < 1:
        raise ValueError(f"min_replicas must be >= 1, got {config.min_replicas}")
    if not config.swarm:
        return
    none_held = "the server holds no parameters in swarm mode"
    clashes = {
        "--allreduce": (config.allreduce, "one mode per server"),
        "--async": (config.mode == "async", "the server runs no rounds"),
        "--download-codec": (config.lossy_download, "nothing is published by the server"),
        "--num-fragments": (config.num_fragments is not None, "the server runs no rounds"),
        "--init": (config.initial_params is not None, none_held),
        "--output-dir": (config.output_dir is not None, none_held),
        "--save-dir": (config.save_dir is not None, none_held),
        "--from-checkpoint": (config.from_checkpoint is not None, none_held),
        "--clip-norm-factor/--trim-fraction": (config.robust, "the server averages nothing"),
        "--outer-rule sparseloco": (
            config.outer_rule == SPARSELOCO,
            "its error feedback needs lossy uploads, which the stage quorums refuse",
        ),
    }
    refused = [f"{flag} ({why})" for flag, (on, why) in clashes.items() if on]
    if refused:
        raise ValueError("--swarm (swarm=True) cannot go with " + "; ".join(refused))


def _check_allreduce(config: ModeSettings) -> None:
    if not (math.isfinite(config.collective_timeout) and config.collective_timeout > 0):
        raise ValueError(f"collective_timeout must be positive, got {config.collective_timeout}")
    if not config.allreduce:
        return
    none_held = "the server holds no parameters in all-reduce mode"
    clashes = {
        "--async": (config.mode == "async", "quorums are synchronous rounds"),
        "--download-codec": (config.lossy_download, "nothing is published by the server"),
        "--init": (config.initial_params is not None, none_held),
        "--output-dir": (
            config.output_dir is not None,
            f"{none_held}; give the workers --save-dir for checkpoints",
        ),
        "--save-dir": (config.save_dir is not None, none_held),
        "--from-checkpoint": (config.from_checkpoint is not None, none_held),
        "--trim-fraction": (
            config.trim_fraction > 0,
            "a collective average has no trimmed variant",
        ),
    }
    refused = [f"{flag} ({why})" for flag, (on, why) in clashes.items() if on]
    if refused:
        raise ValueError("--allreduce (allreduce=True) cannot go with " + "; ".join(refused))


def _check_relay(config: ModeSettings) -> None:
    if config.upstream_codec not in RELAY_CODECS:
        raise ValueError(
            f"upstream_codec must be one of {', '.join(RELAY_CODECS)}, got {config.upstream_codec!r}"
        )
    if config.upstream is None:
        return
    if not config.upstream.strip():
        raise ValueError("upstream (--upstream) must be HOST:PORT or a URL, got ''")
    from_upstream = "a relay's parameters come from the upstream server"
    clashes = {
        "--allreduce": (config.allreduce, "a relay averages its region's uploads itself"),
        "--swarm": (config.swarm, "a relay runs rounds"),
        "--async": (config.mode == "async", "a relay closes one round per upstream round"),
        "--num-fragments": (
            config.num_fragments is not None and config.num_fragments > 1,
            "a relay sends the whole model upstream each round",
        ),
        "--download-codec": (config.lossy_download, "a relay publishes full parameters"),
        "--clip-norm-factor/--trim-fraction": (config.robust, "not supported by a relay yet"),
        "--outer-rule sparseloco": (
            config.outer_rule == SPARSELOCO,
            "the outer rule is the upstream's",
        ),
        "--init": (config.initial_params is not None, from_upstream),
        "--from-checkpoint": (
            config.from_checkpoint is not None,
            "a relay resumes from its own --save-dir",
        ),
    }
    refused = [f"{flag} ({why})" for flag, (on, why) in clashes.items() if on]
    if refused:
        raise ValueError("--upstream (a relay) cannot go with " + "; ".join(refused))
    # Whole-model rounds, fixed now: a worker that asks for fragments is refused at
    # registration (409 fragments_mismatch) instead of splitting the relay's rounds.
    object.__setattr__(config, "num_fragments", 1)
