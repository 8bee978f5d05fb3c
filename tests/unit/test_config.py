from __future__ import annotations

import pytest

from objcache.config import (
    MountConfig,
    parse_duration,
    parse_log_level,
    parse_size,
    parse_source,
    set_option,
)
from objcache.errors import UserError


@pytest.mark.parametrize("text,value", [("16M", 16 << 20), ("16MiB", 16 << 20), ("1g", 1 << 30),
                                        ("4096", 4096), ("1.5K", 1536), (5, 5)])
def test_parse_size(text, value):  # type: ignore
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "12X", "-1", "M", "1.2.3G"])
def test_parse_size_rejects(text):  # type: ignore
    with pytest.raises(UserError):
        parse_size(text)


def test_durations_and_source():  # type: ignore
    assert parse_duration("1m", "x") == 60 and parse_duration(2, "x") == 2.0
    assert parse_duration("250ms", "x") == 0.25
    assert parse_source("s3://b/some/prefix/") == ("b", "some/prefix")
    with pytest.raises(UserError):
        parse_source("b/x")


def test_log_levels_for_single_modules():  # type: ignore
    assert parse_log_level("INFO") == ("info", {})
    assert parse_log_level("warning, objcache.txn.flusher=debug,objcache.raft=ERROR") == (
        "warning", {"objcache.txn.flusher": "debug", "objcache.raft": "error"})
    for bad in ("loud", "info,objcache.txn", "info,=debug", "info,objcache=loud", ""):
        with pytest.raises(UserError, match="invalid log-level"):
            parse_log_level(bad)
    cfg = MountConfig(bucket="b", log_level="info,objcache.cluster")
    with pytest.raises(UserError, match="LOGGER=LEVEL"):
        cfg.validate()


def test_set_option_and_validate():  # type: ignore
    cfg = MountConfig(bucket="b")
    set_option(cfg, "chunk-size", "8M", "test")
    set_option(cfg, "writeback_delay", "2s", "test")
    assert cfg.chunk_size == 8 << 20 and cfg.writeback_delay == 2
    with pytest.raises(UserError, match="unknown config key"):
        set_option(cfg, "nope", 1, "test")
    with pytest.raises(UserError, match="expected true or false"):
        set_option(cfg, "read-only", "yes", "test")
    cfg.chunk_size = 1 << 20
    with pytest.raises(UserError, match="chunk-size"):
        cfg.validate()


def test_cluster_options_are_checked(tmp_path):  # type: ignore
    cfg = MountConfig(bucket="b", peers="127.0.0.1:7000")
    with pytest.raises(UserError, match="need --listen"):
        cfg.validate()
    cfg = MountConfig(bucket="b", listen="127.0.0.1:7000")
    with pytest.raises(UserError, match="--cluster-secret-file"):
        cfg.validate()
    cfg = MountConfig(bucket="b", listen="nonsense", cluster_secret_file="k")
    with pytest.raises(UserError, match="invalid --listen"):
        cfg.validate()
    cfg = MountConfig(bucket="b", listen="127.0.0.1:7000", cluster_secret_file="k",
                      peers="127.0.0.1:7001,bad")
    with pytest.raises(UserError, match="invalid peer address 'bad'"):
        cfg.validate()
    cfg = MountConfig(bucket="b", cache_size=10 << 30)
    set_option(cfg, "peers", ["127.0.0.1:1", "127.0.0.1:2"], "test")  # a TOML list
    assert cfg.peers == "127.0.0.1:1,127.0.0.1:2"
    set_option(cfg, "peer-timeout", "2s", "test")
    assert cfg.peer_timeout == 2


def test_cluster_secret_and_listen_port_errors(tmp_path):  # type: ignore
    from objcache.cluster.node import bind_listener, load_secret
    short = tmp_path / "short.key"
    short.write_text("abc\n")
    with pytest.raises(UserError, match="at least 16"):
        load_secret(str(short))
    with pytest.raises(UserError, match="not readable"):
        load_secret(str(tmp_path / "missing.key"))
    good = tmp_path / "good.key"
    good.write_text("0123456789abcdef0123\n")
    assert load_secret(str(good)) == b"0123456789abcdef0123"
    import socket
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        port = taken.getsockname()[1]
        with pytest.raises(UserError, match=f"cannot listen on 127.0.0.1:{port}"):
            bind_listener(f"127.0.0.1:{port}")
    finally:
        taken.close()


def test_replicas_from_the_command_line_and_a_config_file(tmp_path):  # type: ignore
    """--replicas 3 (an int from argparse), "3" and 3 from TOML are all accepted."""
    from objcache.cli import _parser, build_config

    args = _parser().parse_args(["mount", "s3://b", str(tmp_path), "--replicas", "3"])
    assert build_config(args).replicas == 3
    conf = tmp_path / "c.toml"
    conf.write_text("replicas = 2\n")
    args = _parser().parse_args(["mount", "s3://b", str(tmp_path), "--config", str(conf)])
    assert build_config(args).replicas == 2
    cfg = MountConfig(bucket="b")
    set_option(cfg, "replicas", "3", "test")
    assert cfg.replicas == 3
    with pytest.raises(UserError, match="expected an integer"):
        set_option(cfg, "replicas", "two", "test")
