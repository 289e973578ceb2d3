"""Every class of bad native config raises ConfigError naming key, value and what is allowed."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tierzero import engine


def error_of(data: Any, **kwargs: Any) -> str:
    with pytest.raises(engine.ConfigError) as err:
        engine.load_config(data, **kwargs)
    return str(err.value)


def test_misspelt_key_with_suggestion() -> None:
    msg = error_of({"zero": {"stag": 3}})
    assert msg.startswith("zero.stag: unknown key (did you mean 'stage'?)")
    assert "allowed here: stage, units," in msg


def test_misspelt_top_level_key() -> None:
    msg = error_of({"optimiser": {"lr": 1e-3}})
    assert msg.startswith("optimiser: unknown key (did you mean 'optimizer'?)")


def test_misspelt_key_without_close_match() -> None:
    msg = error_of({"nvme": {"frobnicate": 1}})
    assert msg.startswith("nvme.frobnicate: unknown key; allowed here: block_size,")


@pytest.mark.parametrize("data", [
    {"offload": {"optimizer": {"ratio": 0.5}}},
    {"offload": {"optimizer": {"pipeline_read": True}}},
    {"offload": {"optimizer": {"pipeline_write": True}}},
    {"zero": {"gather_16bit_weights_on_model_save": True}},
])
def test_keys_that_did_nothing_are_gone(data: dict[str, Any]) -> None:
    """Issue 19: keys parsed but never acted on were removed from the native schema (their
    DeepSpeed spellings are accepted and reported as ignored, test_config_deepspeed)."""
    (section, body), = data.items()
    (cls, inner), = body.items()
    key = f"{section}.{cls}" if not isinstance(inner, dict) else (
        f"{section}.{cls}.{next(iter(inner))}")
    assert error_of(data).startswith(f"{key}: unknown key")


def test_wrong_type() -> None:
    msg = error_of({"nvme": {"queue_depth": "deep"}})
    assert msg == ("nvme.queue_depth: 'deep' is not allowed; allowed: an integer > 0 and "
                   "<= 65536")


def test_section_must_be_mapping() -> None:
    msg = error_of({"zero": 3})
    assert msg.startswith("zero: 3 is not allowed; allowed: a mapping")


@pytest.mark.parametrize(("data", "start"), [
    ({"optimizer": {"lr": -1e-4}}, "optimizer.lr: -0.0001 is out of range; allowed: a number > 0"),
    ({"zero": {"stage": 4}}, "zero.stage: 4 is out of range; allowed: an integer >= 0 and <= 3"),
    ({"optimizer": {"betas": [0.9, 1.2]}}, "optimizer.betas[1]: 1.2 is out of range"),
    ({"gradient_clipping": -1}, "gradient_clipping: -1.0 is out of range; allowed: a number >= 0"),
])
def test_out_of_range(data: Any, start: str) -> None:
    assert error_of(data).startswith(start)


def test_bad_choice_with_suggestion() -> None:
    msg = error_of({"offload": {"device": "disk"}})
    assert msg == ("offload.params.device: 'disk' is not allowed; allowed: one of 'none', "
                   "'cpu', 'nvme', 'auto'")
    assert "did you mean 'bf16'" in error_of({"precision": "bf61"})
    assert "did you mean 'nvme'" in error_of({"offload": {"device": "nvmee"}})


def test_nvme_without_path() -> None:
    msg = error_of({"offload": {"optimizer": {"device": "nvme"}}})
    assert msg.startswith("offload.optimizer.path: required when offload.optimizer.device is "
                          "'nvme'")


def test_nvme_path_missing(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    msg = error_of({"offload": {"device": "nvme", "path": str(missing)}})
    assert msg.startswith(f"offload.params.path: '{missing}' does not exist (errno 2, ENOENT)")
    assert f"mkdir -p '{missing}'" in msg


def test_nvme_path_is_a_file(tmp_path: Path) -> None:
    target = tmp_path / "file"
    target.write_text("x")
    msg = error_of({"offload": {"device": "nvme", "path": str(target)}})
    assert "is not a directory (errno 20, ENOTDIR)" in msg


def test_nvme_path_not_writable(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        target = tmp_path / "ro"
        target.mkdir()
        target.chmod(0o500)
    else:  # mode bits do not stop root; sysfs refuses new files even to root
        target = Path("/sys")
        if not target.is_dir():
            pytest.skip("no directory root cannot write to (no /sys)")
    msg = error_of({"offload": {"device": "nvme", "path": str(target)}})
    assert f"offload.params.path: '{target}' is not writable (errno 13, EACCES" in msg
    assert "choose a directory you own" in msg


def test_nvme_path_checked_for_auto_not_for_cpu(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope")
    assert "does not exist" in error_of({"offload": {"device": "auto", "path": missing}})
    config = engine.load_config({"offload": {"device": "cpu", "path": missing}})
    assert config.offload.params.path == missing


def test_nvme_path_probe_leaves_nothing(tmp_path: Path) -> None:
    engine.load_config({"offload": {"device": "nvme", "path": str(tmp_path)}})
    assert list(tmp_path.iterdir()) == []


def test_batch_sizes_that_do_not_multiply() -> None:
    msg = error_of({"batch": {"micro_batch_size": 3, "gradient_accumulation_steps": 2,
                              "global_batch_size": 16}})
    assert msg.startswith("batch.global_batch_size: 16 is not a multiple of micro_batch_size x "
                          "gradient_accumulation_steps = 3 x 2 = 6")


def test_check_world_size() -> None:
    config = engine.load_config({"batch": {"micro_batch_size": 2,
                                           "gradient_accumulation_steps": 4,
                                           "global_batch_size": 32}})
    resolved = config.check_world_size(4)
    assert (resolved.batch.micro_batch_size, resolved.batch.gradient_accumulation_steps,
            resolved.batch.global_batch_size) == (2, 4, 32)
    with pytest.raises(engine.ConfigError) as err:
        config.check_world_size(3)
    assert str(err.value).startswith("batch.global_batch_size: 32 != micro_batch_size x "
                                     "gradient_accumulation_steps x world size = 2 x 4 x 3 = 24")
    with pytest.raises(engine.ConfigError, match="world_size: 0 is not allowed"):
        config.check_world_size(0)


@pytest.mark.parametrize(("batch", "world", "expected"), [
    ({}, 8, (1, 1, 8)),
    ({"micro_batch_size": 4}, 2, (4, 1, 8)),
    ({"gradient_accumulation_steps": 4}, 2, (1, 4, 8)),
    ({"global_batch_size": 64, "micro_batch_size": 4}, 4, (4, 4, 64)),
    ({"global_batch_size": 64, "gradient_accumulation_steps": 2}, 4, (8, 2, 64)),
    ({"global_batch_size": 64}, 8, (8, 1, 64)),
])
def test_batch_derivation(batch: dict[str, int], world: int, expected: tuple[int, ...]) -> None:
    b = engine.load_config({"batch": batch}).check_world_size(world).batch
    assert (b.micro_batch_size, b.gradient_accumulation_steps, b.global_batch_size) == expected


def test_batch_not_derivable() -> None:
    config = engine.load_config({"batch": {"global_batch_size": 64, "micro_batch_size": 4}})
    with pytest.raises(engine.ConfigError) as err:
        config.check_world_size(3)
    assert str(err.value).startswith("batch.gradient_accumulation_steps: cannot be derived: "
                                     "global_batch_size 64 is not divisible by 12")


@pytest.mark.parametrize(("data", "start"), [
    ({"zero": {"stage": 2}, "offload": {"params": {"device": "cpu"}}},
     "offload.params.device: 'cpu' needs zero.stage 3"),
    ({"zero": {"stage": 0}, "offload": {"optimizer": {"device": "cpu"}}},
     "offload.optimizer.device: 'cpu' needs zero.stage 1, 2 or 3"),
    ({"scheduler": {"type": "warmup_cosine"}}, "scheduler.total_steps: required by "
     "scheduler.type 'warmup_cosine'"),
    ({"scheduler": {"type": "warmup_linear", "warmup_steps": 10, "total_steps": 9}},
     "scheduler.total_steps: 9 is not allowed; allowed: at least scheduler.warmup_steps (10)"),
    ({"scheduler": {"min_lr": 1.0}}, "scheduler.min_lr: 1.0 is above optimizer.lr (0.001)"),
    ({"scheduler": {"warmup_start_lr": 1.0}}, "scheduler.warmup_start_lr: 1.0 is above"),
    ({"nvme": {"block_size": 1000}}, "nvme.block_size: 1000 is not allowed; allowed: a "
     "multiple of 4096"),
    ({"offload": {"budgets": {"host_bytes": "8GiB", "host_reserve_bytes": "8GiB"}}},
     "offload.budgets.host_reserve_bytes: 8589934592 is not below offload.budgets.host_bytes"),
])
def test_cross_field_rules(data: Any, start: str) -> None:
    assert error_of(data).startswith(start)


def test_direct_construction_is_validated() -> None:
    with pytest.raises(engine.ConfigError, match=r"zero\.stage: 7 is out of range"):
        engine.Config(zero=engine.config.ZeroConfig(stage=7))
    with pytest.raises(engine.ConfigError, match=r"nvme\.threads: '2' is not allowed"):
        engine.Config(nvme=engine.config.NvmeConfig(threads="2"))  # type: ignore[arg-type]


def test_internal_fields_are_not_user_keys() -> None:
    assert error_of({"ignored_keys": ["x"]}).startswith("ignored_keys: unknown key")


def test_file_errors(tmp_path: Path) -> None:
    missing = tmp_path / "missing.yaml"
    assert error_of(str(missing)) == (f"{missing}: cannot read config file '{missing}' "
                                      "(errno 2: No such file or directory); check the path")
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("zero:\n  stage: [3\n")
    msg = error_of(bad_yaml)
    assert msg.startswith(f"{bad_yaml}: not valid YAML:") and "line 3" in msg
    bad_json = tmp_path / "bad.json"
    bad_json.write_text('{"zero": {"stage": 3,}}')
    assert error_of(bad_json).startswith(f"{bad_json}: not valid JSON: ")
    listed = tmp_path / "list.yaml"
    listed.write_text("- 1\n- 2\n")
    assert "the top level is list [1, 2]; allowed: a mapping" in error_of(listed)


def test_error_in_file_names_file_and_key(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("zero: {stage: 5}\n")
    with pytest.raises(engine.ConfigError) as err:
        engine.load_config(path)
    assert str(err.value).startswith(f"{path}: zero.stage: 5 is out of range")
    assert err.value.key == "zero.stage"
    assert err.value.file == str(path)


def test_bad_source_type() -> None:
    assert "cannot load a config from 42" in error_of(42)


def test_key_given_twice(tmp_path: Path) -> None:
    yaml_file = tmp_path / "dup.yaml"
    yaml_file.write_text("zero: {stage: 3}\nseed: 1\nzero: {stage: 1}\n")
    assert error_of(yaml_file) == (f"{yaml_file}: zero: given twice in one mapping (second at "
                                   "line 3); keep one")
    json_file = tmp_path / "dup.json"
    json_file.write_text('{"fp16": {"enabled": true, "enabled": false}}')
    assert error_of(json_file) == f"{json_file}: enabled: given twice in one JSON object; keep one"


def test_choice_suggestion_ignores_case() -> None:
    assert "(did you mean 'bf16'?)" in error_of({"precision": "BF16"})
