import pytest

from tierd.config import Config, load, resolve_budgets
from tierd.errors import InvalidArgument


def test_precedence_flags_over_env_over_file_over_defaults(tmp_path):
    toml = tmp_path / "tierd.toml"
    toml.write_text('host_budget = "1GiB"\ndisk_budget = "10GiB"\nhost_idle = 120\nmetrics = "off"\n')
    env = {"TIERD_HOST_BUDGET": "2GiB", "TIERD_DEVICE_IDLE": "5"}
    cfg = load({"host_budget": "3GiB"}, env=env, config_file=str(toml))
    assert cfg.host_budget == 3 << 30  # flag
    assert cfg.device_idle == 5.0  # environment
    assert cfg.disk_budget == 10 << 30 and cfg.host_idle == 120.0  # file
    assert cfg.metrics == "" and cfg.metrics_endpoint is None
    assert cfg.writeback_idle == 10.0  # default
    assert load({}, env={"TIERD_HOST_BUDGET": "2GiB"}).host_budget == 2 << 30


def test_defaults_work_anywhere(tmp_path):
    cfg = load({"data_dir": str(tmp_path)}, env={})
    assert cfg.socket.endswith("tierd.sock") and cfg.metrics_endpoint == ("127.0.0.1", 9464)
    cfg = resolve_budgets(cfg, total_ram=16 << 30, free_disk=100 << 30)
    assert cfg.host_budget == 4 << 30 and cfg.disk_budget == 50 << 30
    assert cfg.host_slab == 4 << 30  # one slab: snapshots are never split across slabs


@pytest.mark.parametrize("flags,words", [
    ({"host_budget": "lots"}, "host_budget"),
    ({"device_idle": "-1"}, "device_idle"),
    ({"metrics": "nowhere"}, "HOST:PORT"),
    ({"log_level": "chatty"}, "log_level"),
    ({"io_workers": "0"}, "io_workers"),
    ({"disk_slab": "1000"}, "multiple of 4096"),
    ({"no_such_thing": "1"}, "unknown setting"),
])
def test_bad_settings_are_refused_with_their_name(flags, words):
    with pytest.raises(InvalidArgument, match=words):
        load(flags, env={})


def test_bad_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("host_budget = [")
    with pytest.raises(InvalidArgument, match="not valid TOML"):
        load({}, env={}, config_file=str(bad))
    with pytest.raises(InvalidArgument, match="cannot read config file"):
        load({}, env={}, config_file=str(tmp_path / "missing.toml"))
    with pytest.raises(InvalidArgument, match="unknown setting"):
        (tmp_path / "unknown.toml").write_text("colour = 'blue'\n")
        load({}, env={}, config_file=str(tmp_path / "unknown.toml"))


def test_writeback_can_be_turned_off():
    assert load({"writeback_idle": "off"}, env={}).writeback_idle is None
    assert Config().disk_ttl is None


@pytest.mark.parametrize("flags, words", [
    ({"remote": "redis://127.0.0.1:\u00b2"}, "not HOST:PORT"),
    ({"remote": "redis://127.0.0.1:\uff16\uff13\uff17\uff19"}, "not HOST:PORT"),
    ({"remote": "redis://[::1:6379"}, "not HOST:PORT"),
    ({"remote": "redis://user:pw@127.0.0.1:6379"}, "carries no password"),
    ({"remote": "http://127.0.0.1:6379"}, "redis://"),
    ({"remote": "redis://127.0.0.1:6379", "remote_timeout": "nan"}, "finite"),
    ({"remote": "redis://127.0.0.1:6379", "remote_timeout": "0"}, "0.01 to 60"),
    ({"remote_prefix": "a{b}"}, "without braces"),
    ({"remote": "redis://127.0.0.1:6379", "remote_recheck": "-1"}, "seconds"),
    ({"remote": "redis://127.0.0.1:6379", "remote_recheck": "7200"}, "0 to 3600"),
    ({"remote": "redis://127.0.0.1:6379", "remote_replicas": "-1"}, "whole number"),
    ({"remote": "redis://127.0.0.1:6379", "remote_replicas": "17"}, "0 to 16"),
])
def test_bad_remote_settings_are_refused_clearly(flags, words):
    with pytest.raises(InvalidArgument, match=words):
        load(flags=flags, env={})


def test_the_remote_password_comes_from_a_file_or_the_environment_never_garbled(tmp_path):
    from tierd.config import remote_password

    good, bad = tmp_path / "pw", tmp_path / "bad"
    good.write_text("s3cret\n")
    bad.write_bytes(b"\xff\xfe\x00pw")
    assert remote_password(load(flags={"remote_password_file": str(good)}, env={}), env={}) == "s3cret"
    assert remote_password(load(env={}), env={"TIERD_REMOTE_PASSWORD": "e"}) == "e"
    with pytest.raises(InvalidArgument, match="not UTF-8"):
        remote_password(load(flags={"remote_password_file": str(bad)}, env={}), env={})
