"""The "dsx" section: every bad key or value fails at start-up naming the key path, the value and what is allowed."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsx.config import DsxConfig, DsxConfigError, parse_dsx_config, split_config


def _err(section: object) -> str:
    with pytest.raises(DsxConfigError) as info:
        parse_dsx_config(section)
    return str(info.value)


def test_absent_section_is_all_off() -> None:
    cfg = parse_dsx_config(None)
    assert isinstance(cfg, DsxConfig) and not cfg.any_enabled
    ds, cfg2 = split_config({"train_batch_size": 4})
    assert ds == {"train_batch_size": 4} and not cfg2.any_enabled


def test_split_removes_dsx_and_does_not_touch_input() -> None:
    raw = {"train_batch_size": 4, "dsx": {"rgnn": {"enabled": True}}}
    ds, cfg = split_config(raw)
    assert "dsx" not in ds and "dsx" in raw
    assert cfg.rgnn.enabled and cfg.any_enabled


def test_unknown_key_lists_valid_keys() -> None:
    msg = _err({"activation_offload": {"enabled": True, "tierz": ["host"]}})
    assert "dsx.activation_offload.tierz: unknown key" in msg
    for valid in ("tiers", "ssd_path", "memory_budget_gb", "policy", "io_backend"):
        assert valid in msg
    msg = _err({"offload": {}})
    assert "dsx.offload: unknown key" in msg and "activation_offload, unified, rgnn, scheduler" in msg


@pytest.mark.parametrize(
    ("section", "path", "value", "allowed"),
    [
        ({"unified": {"enabled": "yes"}}, "dsx.unified.enabled", '"yes"', "true or false"),
        ({"scheduler": {"io_workers": 2.5}}, "dsx.scheduler.io_workers", "2.5", "an integer"),
        ({"activation_offload": {"policy": "fast"}}, "dsx.activation_offload.policy", '"fast"', "'auto'"),
        (
            {"activation_offload": {"tiers": ["host", "disk"]}},
            "dsx.activation_offload.tiers[1]",
            '"disk"',
            "'ssd'",
        ),
        ({"rgnn": {"precision": 16}}, "dsx.rgnn.precision", "16", "'fp32'"),
    ],
)
def test_wrong_type_or_choice(section: dict, path: str, value: str, allowed: str) -> None:
    msg = _err(section)
    line = next(ln for ln in msg.splitlines() if path in ln)
    assert f"value {value}" in line and allowed in line


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("host_pool_gb", -1),
        ("ssd_capacity_gb", -0.5),
        ("memory_budget_gb", -2),
        ("min_tensor_bytes", -4096),
        ("moved_tensor_host_us", -1.0),
    ],
)
def test_negative_sizes(key: str, value: float) -> None:
    msg = _err({"activation_offload": {key: value}})
    assert f"dsx.activation_offload.{key}: value {value}" in msg and ">= 0" in msg


def _ao(**kw: object) -> dict:
    return {"activation_offload": {"enabled": True, **kw}}


def test_missing_directory(tmp_path) -> None:
    missing = tmp_path / "nope"
    msg = _err(_ao(ssd_path=str(missing)))
    assert msg.splitlines()[1].strip() == (
        f'dsx.activation_offload.ssd_path: "{missing}" does not exist: create it, or point ssd_path at an '
        "existing directory"
    )


def test_directories_of_disabled_sections_are_not_checked(tmp_path) -> None:
    # a shared config may name a directory that exists only where the feature is used
    missing = str(tmp_path / "nope")
    cfg = parse_dsx_config(
        {"activation_offload": {"ssd_path": missing}, "unified": {"shared_memory_dir": missing}}
    )
    assert cfg.activation_offload.ssd_path == missing and not cfg.activation_offload.enabled


def test_path_is_a_file(tmp_path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    msg = _err({"unified": {"enabled": True, "shared_memory_dir": str(f)}})
    assert (
        f'dsx.unified.shared_memory_dir: "{f}" is not a directory: point shared_memory_dir at a directory'
        in msg
    )


def test_empty_ssd_path() -> None:
    assert 'ssd_path: "" is empty: give ssd_path a directory' in _err(_ao(ssd_path=""))


def test_empty_layer_classes() -> None:
    msg = _err(_ao(layer_classes=[]))
    assert (
        "dsx.activation_offload.layer_classes: value [] is not allowed; expected a list of at least 1" in msg
    )


def test_tier_named_twice() -> None:
    msg = _err(_ao(tiers=["host", "host"]))
    assert (
        'dsx.activation_offload.tiers: ["host", "host"] names a tier twice: each tier may appear once' in msg
    )


@pytest.mark.skipif(
    os.geteuid() == 0, reason="root can write to any directory; permission bits do not bind it"
)
def test_unwritable_directory(tmp_path) -> None:
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(stat.S_IRUSR | stat.S_IXUSR)
    assert "is not writable by this user" in _err(_ao(ssd_path=str(d)))


@pytest.mark.skipif(os.geteuid() != 0, reason="covered by test_unwritable_directory for non-root users")
def test_unwritable_directory_as_root(tmp_path) -> None:
    # Root may write anywhere except on a read-only filesystem, so mount a tiny read-only tmpfs.
    d = tmp_path / "ro"
    d.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(d)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        assert "is not writable by this user" in _err(_ao(ssd_path=str(d)))
    finally:
        subprocess.run(["umount", str(d)], check=True)


def test_ssd_tier_needs_path() -> None:
    msg = _err({"activation_offload": {"enabled": True, "tiers": ["ssd"]}})
    assert msg.splitlines()[1].strip() == (
        "dsx.activation_offload: ssd_path is not set, and tiers contains 'ssd': give ssd_path, a directory on "
        "the SSD"
    )


def test_profiling_with_inputs_on_the_host_needs_the_host_tier(tmp_path) -> None:
    msg = _err({"activation_offload": {"enabled": True, "tiers": ["ssd"], "ssd_path": str(tmp_path),
                                       "profile_mode": "recompute+host"}})  # fmt: skip
    assert "profile_mode 'recompute+host' moves the layers' inputs to the host tier" in msg
    assert "add 'host' to tiers, or profile with 'recompute'" in msg
    ok = {
        "enabled": True,
        "tiers": ["host", "ssd"],
        "ssd_path": str(tmp_path),
        "profile_mode": "recompute+host",
    }
    assert (
        DsxConfig.model_validate({"activation_offload": ok}).activation_offload.profile_mode
        == "recompute+host"
    )


def test_section_not_an_object() -> None:
    assert "expected an object" in _err([1, 2])


def test_config_file_errors(tmp_path) -> None:
    with pytest.raises(DsxConfigError, match="does not exist"):
        split_config(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(DsxConfigError, match="not valid JSON"):
        split_config(bad)
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"train_batch_size": 2, "dsx": {"scheduler": {"enabled": True}}}))
    ds, cfg = split_config(good)
    assert ds == {"train_batch_size": 2} and cfg.scheduler.enabled


_LINE = re.compile(
    r'^  dsx(\.[A-Za-z_]\w*|\[\d+\]|\["(?:[^"\\]|\\.)*"\])*: (unknown key; valid keys here are: .+|value .+ is not allowed; expected .+)$'
)

_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**6), 10**6)
    | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3)
    ),
    max_leaves=12,
)
_keys = st.sampled_from(
    ["activation_offload", "unified", "rgnn", "scheduler", "enabled", "tiers", "policy", "io_backend",
     "host_pool_gb", "memory_budget_gb", "ssd_path", "precision", "io_workers", "max_gather_sms", "bogus"]
)  # fmt: skip
_section = st.dictionaries(_keys, _json | st.dictionaries(_keys, _json, max_size=4), max_size=4)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(section=_section | _json)
def test_random_json_gives_only_config_errors(section: object) -> None:
    try:
        parse_dsx_config(section)
    except DsxConfigError as exc:
        lines = str(exc).splitlines()
        assert lines[0] == "invalid dsx config:"
        for line in lines[1:]:
            assert _LINE.match(line), line


def test_every_shipped_config_parses():
    """configs/*.json are what the README tells users to run: each must pass dsx's validation (directories
    they name are created here, as the README's commands do)."""
    import json
    from pathlib import Path

    from dsx.config import split_config

    found = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.json"))
    assert found
    for path in found:
        cfg = json.loads(path.read_text())
        off = cfg.get("dsx", {}).get("activation_offload", {})
        if off.get("ssd_path"):
            Path(off["ssd_path"]).mkdir(parents=True, exist_ok=True)
        _, section = split_config(str(path))
        assert section is not None, path


def test_readme_lists_every_key_with_its_default() -> None:
    """The README's "dsx" block is the reference users copy: every key of every section, with the default the
    models give it, and nothing else."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = re.search(r'```json\n"dsx": (\{.*?\n\})\n```', readme, re.S)
    assert block is not None, 'README.md has no ```json "dsx": {...}``` block'
    assert json.loads(block.group(1)) == DsxConfig().model_dump()


@pytest.mark.parametrize(
    ("section", "key", "value"),
    [
        ("activation_offload", "host_pool_gb", float("inf")),
        ("activation_offload", "ssd_capacity_gb", float("nan")),
        ("activation_offload", "memory_budget_gb", float("inf")),
        ("activation_offload", "ssd_endurance_tbw", float("inf")),
    ],
)
def test_sizes_are_finite(section: str, key: str, value: float) -> None:
    msg = _err({section: {key: value}})
    assert f"dsx.{section}.{key}: value" in msg and "a finite number" in msg


@pytest.mark.parametrize(
    ("section", "key", "value"),
    [
        ("activation_offload", "host_pool_gb", 1e308),
        ("activation_offload", "ssd_capacity_gb", 1e308),
        ("activation_offload", "memory_budget_gb", 1e308),
        ("activation_offload", "min_tensor_bytes", 1 << 62),
        ("activation_offload", "prefetch_depth", 1 << 40),
        ("activation_offload", "profile_warmup_steps", 1 << 40),
        ("unified", "max_gather_sms", 1 << 40),
        ("scheduler", "log_interval", 1 << 40),
        ("scheduler", "trace_steps", 1 << 40),
        ("scheduler", "bandwidth_probe_mb", 1 << 40),
    ],
)
def test_every_size_has_an_upper_bound(section: str, key: str, value: float) -> None:
    msg = _err({section: {key: value}})
    assert f"dsx.{section}.{key}: value" in msg and "<=" in msg


def test_a_host_pool_larger_than_the_machine_fails_at_parse() -> None:
    ram_gib = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    msg = _err({"activation_offload": {"enabled": True, "host_pool_gb": float(int(ram_gib) + 1)}})
    assert "dsx.activation_offload.host_pool_gb" in msg and "more than this machine's memory" in msg
    # a disabled section allocates nothing: not checked
    parse_dsx_config({"activation_offload": {"host_pool_gb": float(int(ram_gib) + 1)}})


def test_paths_too_long_for_the_filesystem_fail_at_parse(tmp_path) -> None:
    long_name = str(tmp_path / ("a" * 300))
    msg = _err({"activation_offload": {"enabled": True, "tiers": ["ssd"], "ssd_path": long_name}})
    assert "dsx.activation_offload.ssd_path" in msg and "names may have at most 255" in msg
    deep = str(tmp_path / "/".join(["b" * 200] * 21))
    msg = _err({"unified": {"enabled": True, "shared_memory_dir": deep}})
    assert "dsx.unified.shared_memory_dir" in msg and "point shared_memory_dir at a shorter path" in msg


def test_trace_path_is_checked_at_parse(tmp_path) -> None:
    assert "give trace_path a file name, or null" in _err({"scheduler": {"trace_path": ""}})
    assert "is a directory" in _err({"scheduler": {"trace_path": str(tmp_path)}})
    # a directory the writer will make (runs/gpt/trace.json on a fresh clone) is fine below a writable one
    assert parse_dsx_config(
        {"scheduler": {"enabled": True, "trace_path": str(tmp_path / "runs" / "g" / "t.json")}}
    )
    assert parse_dsx_config({"scheduler": {"enabled": True, "trace_path": str(tmp_path / "t.json")}})
    blocker = tmp_path / "file"
    blocker.write_text("x")
    msg = _err({"scheduler": {"enabled": True, "trace_path": str(blocker / "sub" / "t.json")}})
    assert "dsx.scheduler.trace_path" in msg and "which is not a directory" in msg
    parse_dsx_config(
        {"scheduler": {"trace_path": str(blocker / "sub" / "t.json")}}
    )  # disabled: nothing written


def test_a_moved_key_names_its_new_place() -> None:
    msg = _err({"activation_offload": {"io_threads": 4}})
    assert "dsx.activation_offload.io_threads: this key moved: use dsx.scheduler.io_workers instead" in msg
