"""The HYATLAS_* settings follow the reference's parsing rules."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from gateway.config import GatewayConfig
from services.consolidator.config import ConsolidatorConfig
from services.embedder.config import EmbedderConfig
from services.extractor.config import ExtractorConfig
from services.search.config import SearchConfig
from services.store.config import StoreConfig
from shared.aliases import Aliases
from shared.errors import ConfigError
from shared.runtime import OWN_LOGGERS, apply_log_level
from shared.settings import Settings, parse_go_duration, read_duration


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("15m", 900.0),
        ("6h", 21600.0),
        ("1h30m", 5400.0),
        ("300ms", 0.3),
        ("2160h", 7776000.0),
        ("1.5h", 5400.0),
        ("-2s", -2.0),
        ("0", 0.0),
    ],
)
def test_go_durations_are_read_as_seconds(text: str, seconds: float) -> None:
    assert parse_go_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["90d", "5 m", "m", "1h30", "", "h1"])
def test_strings_that_are_not_go_durations_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_go_duration(text)


def test_duration_setting_rules(caplog: pytest.LogCaptureFixture) -> None:
    env = {"A": "45", "B": "off", "C": "", "D": "2d", "E": "no", "F": "0", "G": "20m"}
    assert read_duration(env, "A", 10.0) == 45.0
    assert read_duration(env, "B", 10.0) is None
    assert read_duration(env, "C", 10.0) == 10.0
    assert read_duration(env, "E", 10.0) is None
    assert read_duration(env, "F", 10.0) is None
    assert read_duration(env, "G", 10.0) == 1200.0
    with caplog.at_level(logging.WARNING):
        assert read_duration(env, "D", 10.0) == 10.0
    assert "D='2d' is not a duration" in caplog.text


def test_a_negative_duration_logs_and_keeps_the_default(caplog: pytest.LogCaptureFixture) -> None:
    env = {"A": "-1h", "B": "-5"}
    with caplog.at_level(logging.WARNING):
        assert read_duration(env, "A", 10.0) == 10.0
        assert read_duration(env, "B", 10.0) == 10.0
    assert "A='-1h' is not a duration" in caplog.text
    assert "B='-5' is not a duration" in caplog.text


@pytest.mark.parametrize("value", ["off", "0"])
def test_a_duration_that_cannot_be_turned_off_logs_and_keeps_its_default(
    value: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    env = {"HYATLAS_GO_DATA": str(tmp_path), "HYATLAS_EXTRACT_TIMEOUT": value,
           "HYATLAS_LEASE_TTL": value}
    with caplog.at_level(logging.WARNING):
        assert Settings.from_env(env).llm.timeout_s == 300
        assert ExtractorConfig.from_env(env).lease_ttl_s == 60
        assert ConsolidatorConfig.from_env(env).lease_ttl_s == 60
    assert f"HYATLAS_EXTRACT_TIMEOUT={value!r} cannot be turned off" in caplog.text
    assert f"HYATLAS_LEASE_TTL={value!r} cannot be turned off" in caplog.text


def test_negative_schedules_keep_their_defaults(tmp_path: Path) -> None:
    env = {
        "HYATLAS_GO_DATA": str(tmp_path),
        "HYATLAS_SNAPSHOT_EVERY": "-1h",
        "HYATLAS_STORE_SAVE_EVERY": "-1s",
        "HYATLAS_CONSOLIDATE_EVERY": "-5m",
        "HYATLAS_BODY_TIMEOUT": "-5s",
    }
    assert StoreConfig.from_env(env).snapshots.every_s == 24 * 3600
    assert StoreConfig.from_env(env).save_every_s == 30
    settings = Settings.from_env(env)
    assert settings.consolidate_every_s == 6 * 3600
    assert settings.body_timeout_s == 60


def test_defaults_match_the_reference(tmp_path: Path) -> None:
    s = Settings.from_env({"HYATLAS_GO_DATA": str(tmp_path)})
    assert (s.mode, s.http_host, s.http_port) == ("ultra", "127.0.0.1", 19528)
    assert s.sync_extract is False
    assert s.min_score == 0.60 and s.dedupe_score == 0.92 and s.mmr_lambda == 0.75
    assert s.consolidate_every_s == 6 * 3600 and s.consolidate_batch == 50
    assert s.catchup_every_s == 600 and s.catchup_max_age_s == 168 * 3600
    assert s.episode_gap_s == 1800 and s.now_every_s == 900
    assert s.raw_retention_s is None and s.consolidate_recluster_s is None
    assert s.admin is False and s.recency is True and s.usage_learning is True
    assert s.llm.timeout_s == 300
    assert s.snapshot_dir == Path(str(tmp_path) + "-snapshots")
    assert s.address("store") == f"unix:{tmp_path / 'run' / 'store.sock'}"


def test_pro_mode_blocks_on_extraction_unless_told_otherwise() -> None:
    assert Settings.from_env({"HYATLAS_MODE": "pro"}).sync_extract is True
    assert (
        Settings.from_env({"HYATLAS_MODE": "pro", "HYATLAS_SYNC_EXTRACT": "off"}).sync_extract
        is False
    )
    assert (
        Settings.from_env({"HYATLAS_MODE": "ultra", "HYATLAS_SYNC_EXTRACT": "on"}).sync_extract
        is True
    )


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"HYATLAS_MODE": "max"}, "HYATLAS_MODE='max' is not one of lite, pro, ultra"),
        ({"HYATLAS_SYNC_EXTRACT": "sometimes"}, "HYATLAS_SYNC_EXTRACT='sometimes'"),
        ({"HYATLAS_CONSOLIDATE_EVERY": "off"}, "must be positive in ultra"),
        ({"HYATLAS_CONSOLIDATE_PARALLEL": "5"}, "HYATLAS_CONSOLIDATE_PARALLEL='5' is outside 1..4"),
        ({"HYATLAS_MIN_SCORE": "high"}, "HYATLAS_MIN_SCORE='high' is not a number"),
        ({"HYATLAS_MMR_LAMBDA": "0"}, "HYATLAS_MMR_LAMBDA"),
        ({"HYATLAS_GO_PORT": "70000"}, "HYATLAS_GO_PORT"),
        ({"HYATLAS_LLM_MAX_TOKENS": "0"}, "HYATLAS_LLM_MAX_TOKENS='0' is outside 16"),
        ({"HYATLAS_EMBED_RUNS": "0"}, "HYATLAS_EMBED_RUNS='0' is outside 1..8"),
    ],
)
def test_settings_that_cannot_run_are_fatal_and_name_the_variable(
    env: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        Settings.from_env(env)


def test_pro_mode_may_turn_consolidation_off() -> None:
    assert (
        Settings.from_env({"HYATLAS_MODE": "pro", "HYATLAS_CONSOLIDATE_EVERY": "off"}).mode == "pro"
    )


def test_aliases_group_ids_and_ignore_singletons() -> None:
    groups = Aliases.parse(" 221727702992945152, default ,hermes-memory-archive; solo ;a,b,a")
    assert groups.groups == (
        ("221727702992945152", "default", "hermes-memory-archive"), ("a", "b"))
    s = Settings.from_env({"HYATLAS_USER_ALIASES": "alice,al;bob,robert"})
    assert s.user_aliases.group("al") == ("al", "alice")
    assert s.user_aliases.group("carol") == ("carol",)
    assert s.user_aliases.canonical("robert") == "bob"


def test_an_id_in_two_alias_groups_is_refused() -> None:
    # Accepted, "a,b;b,c" let c read b's rows while b never saw c's.
    with pytest.raises(ConfigError, match=r"lists 'b' in two groups \('a,b' and 'b,c'\)"):
        Settings.from_env({"HYATLAS_USER_ALIASES": "a,b;b,c"})


def test_allowed_hosts_drop_ports_and_lowercase() -> None:
    s = Settings.from_env({"HYATLAS_ALLOWED_HOSTS": "NAS.local:8080, proxy.example ,[fe80::1]:9"})
    assert s.allowed_hosts == frozenset({"nas.local", "proxy.example", "fe80::1"})


def test_llm_is_configured_only_with_base_model_and_a_key() -> None:
    base = {"HYATLAS_LLM_BASE": "http://127.0.0.1:1/v1", "HYATLAS_LLM_MODEL": "m"}
    assert not Settings.from_env(base).llm.configured
    assert Settings.from_env({**base, "HYATLAS_LLM_KEY": "k"}).llm.configured
    assert Settings.from_env({**base, "HYATLAS_LLM_KEY_FILE": "/tmp/k"}).llm.configured


def test_every_service_takes_the_log_level(tmp_path: Path) -> None:
    env = {"HYATLAS_GO_DATA": str(tmp_path), "HYATLAS_LOG_LEVEL": "debug"}
    configs = [
        EmbedderConfig.from_env(env),
        StoreConfig.from_env(env),
        SearchConfig.from_env(env),
        ExtractorConfig.from_env(env),
        ConsolidatorConfig.from_env(env),
        GatewayConfig.from_env(env),
    ]
    assert [config.log_level for config in configs] == ["DEBUG"] * len(configs)


def test_debug_reaches_the_projects_own_lines_and_libraries_stay_at_info(
    caplog: pytest.LogCaptureFixture,
) -> None:
    names = ("", *OWN_LOGGERS)
    saved = {name: logging.getLogger(name).level for name in names}
    own, library = logging.getLogger("services.store.repo"), logging.getLogger("aiosqlite")
    try:
        with caplog.at_level(logging.NOTSET):  # the capture keeps what the loggers let through
            apply_log_level("DEBUG")
            own.debug("ours")
            library.debug("a statement and its parameters")
            library.info("theirs")
            apply_log_level("WARNING")
            own.info("ours, below the level")
        assert [r.getMessage() for r in caplog.records] == ["ours", "theirs"]
    finally:
        for name, level in saved.items():
            logging.getLogger(name).setLevel(level)
