"""`tierzero plan`: Llama-shaped 7B / 40B / 70B and a parameter count, bytes per tier checked
against hand arithmetic; traffic counted by the engine's dry run, checked by hand; what fits;
the CLI's table, --write and errors. (The dry run against a real run: test_cli_plan_engine.)"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from cli_helpers import BIG, GB, LLAMAS, MACHINE, llama_config, llama_params, plan_cli

from tierzero import engine
from tierzero.engine.plan import model_shape, plan_all, recommend
from tierzero.engine.shards.flat import shard_numel


@pytest.mark.parametrize("name", list(LLAMAS))
def test_llama_bytes_per_tier(name: str, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    shape = model_shape(llama_config(tmp_path, name))
    params = llama_params(LLAMAS[name])
    assert shape.parameters == params
    assert params == {"7b": 6_738_415_616, "70b": 68_976_648_192}.get(name, params)  # published
    assert len(shape.units) == LLAMAS[name][2] + 1  # one unit per decoder layer + the root
    plans = {p.choice: p for p in plan_all(shape, BIG, world_size=1, precision="bf16",
                                           traffic=False)}
    cpu = plans["cpu"]
    assert cpu.fits
    # Offload cpu: every class homed on the host; bf16 param = 2 bytes, the gradient too
    # (one rank, no accumulation: [Note: gradient precision]), the rest fp32.
    assert cpu.by_tier["host"] == {"param": 2 * params, "grad": 2 * params,
                                   "master": 4 * params, "exp_avg": 4 * params,
                                   "exp_avg_sq": 4 * params}
    assert sum(cpu.by_tier["device"].values()) == sum(cpu.by_tier["nvme"].values()) == 0
    # The device keeps room for one unit's gradient in flight: the largest unit's bf16 grad.
    assert cpu.overhead["device"] == 2 * max(n for _, n in shape.units)
    # Offload nvme, as the engine homes it: parameters and optimizer state on NVMe, the
    # gradient in host memory (written every micro-step).
    nvme = plans["nvme"]
    assert nvme.fits and nvme.by_tier["nvme"] == {"param": 2 * params, "grad": 0,
                                                  "master": 4 * params, "exp_avg": 4 * params,
                                                  "exp_avg_sq": 4 * params}
    assert nvme.by_tier["host"]["grad"] == 2 * params
    assert plans["none"].fits == (16 * params <= 80 * GB)


def test_llama_7b_traffic_counted_by_the_engine(tmp_path: Path) -> None:
    """The dry run's steady-state step, checked against what the engine's schedule does."""
    pytest.importorskip("transformers")
    shape = model_shape(llama_config(tmp_path, "7b"))
    p = llama_params(LLAMAS["7b"])
    plans = {x.choice: x for x in plan_all(shape, BIG, world_size=1, precision="bf16",
                                           nvme_path=str(tmp_path))}
    cpu = plans["cpu"].traffic
    # 80 GB of device memory holds every param cache from forward through backward:
    # one host->device copy per step (the optimizer rewrites param on the host, which
    # drops the device copy); each bf16 gradient goes to its host shard once.
    assert (cpu.host_to_device, cpu.device_to_host, cpu.grads_to_host) == (2 * p, 0, 2 * p)
    assert (cpu.nvme_read, cpu.nvme_written) == (0, 0) and cpu.adam_params == p
    assert plans["cpu"].peak["device"] == 2 * p  # those caches, at once
    nvme = plans["nvme"].traffic
    # Every NVMe-homed byte is rewritten once per step: param (2) + master, moments (12).
    assert nvme.nvme_written == 14 * p
    # Each is read at least once: the states by the CPU Adam, param for the forward.
    assert nvme.nvme_read >= 14 * p and nvme.adam_params == p
    # The step runs during backward (offload.optimizer.overlap_step; the dry run has no
    # clipping): each unit's Adam and its writes happen as its gradient turns final.
    backward = plans["nvme"].phases["backward"]
    assert backward.nvme_written == 14 * p and backward.adam_params == p
    # the first unit may already be prefetched, and the CPU Adam keeps the new param of
    # the step's last shards (the next forward's first) in up to offload.params.buffer_count
    # - 1 = 4 pool buffers of the largest param ([Note: param kept in host memory])
    assert plans["nvme"].phases["forward"].nvme_read >= 2 * p - (1 + 4) * 2 * max(
        n for _, n in shape.units)
    assert not plans["none"].fits and plans["none"].step_s is None  # 126 GB > 80 GB


def test_parameter_count_world_size_two() -> None:
    shape = model_shape("7e9", layers=32)
    assert shape.parameters == 7 * GB and len(shape.units) == 32
    plans = {p.choice: p for p in plan_all(shape, BIG, world_size=2, precision="bf16",
                                           traffic=False)}
    # each rank owns ceil(unit / world) elements, padded to the engine's 128-element grain
    per_unit = math.ceil(7 * GB / 32 / 2 / 128) * 128
    assert per_unit == shard_numel(7 * GB // 32, 2) == 109_375_104
    assert plans["cpu"].by_tier["host"]["master"] == 32 * per_unit * 4
    assert plans["cpu"].by_tier["host"]["param"] == 32 * per_unit * 2
    # Offload none: 18 bytes per element on the device, 3.5B elements per rank = 63 GB < 80 GB.
    assert plans["none"].fits and plans["none"].total("device") == 18 * 32 * per_unit
    one_rank = {p.choice: p for p in plan_all(shape, BIG, world_size=1, precision="bf16",
                                              traffic=False)}
    # 16 bytes per element of 32 padded shards, against 80 GB: one rank keeps its gradient
    # shards in bf16 ([Note: gradient precision])
    short = 16 * 32 * shard_numel(7 * GB // 32, 1) - 80 * GB
    assert short == 32_000_040_960
    assert f"tier device is short by {short} bytes" in (one_rank["none"].error or "")
    fp32 = {p.choice: p for p in plan_all(shape, BIG, world_size=2, precision="fp32",
                                          traffic=False)}
    # fp32 compute: the engine still keeps a param shard (in fp32) beside the master
    assert fp32["cpu"].by_tier["host"]["param"] == 32 * per_unit * 4
    assert recommend(list(plans.values())) is not None


def test_predicted_time_and_recommendation() -> None:
    shape = model_shape("1e9", layers=8)
    plans = {p.choice: p for p in plan_all(shape, BIG, world_size=1, precision="bf16")}
    assert plans["none"].fits and plans["none"].step_s == 0.0  # nothing moves
    assert recommend(list(plans.values())) is plans["none"]
    cpu = plans["cpu"]
    # [Note: plan step time]: forward copies param in (2 bytes each), backward sends the
    # bf16 gradients out (2 bytes each) while the CPU Adam updates each unit whose gradient
    # is final ([Note: in-place early step]; the dry run has no clipping), over 1e9 params;
    # phases in sequence, at 25 GB/s and 2e9 params/s. Shards are padded to 128 elements;
    # gradients leave the device per parameter, unpadded.
    n = 8 * shard_numel(10**9 // 8, 1)
    assert n == 1_000_000_512
    fwd, bwd, opt = (cpu.phases[k] for k in ("forward", "backward", "optimizer"))
    assert (fwd.host_to_device, bwd.grads_to_host, bwd.adam_params) == (2 * n, 2 * GB, n)
    assert opt.adam_params == 0
    assert cpu.step_s == pytest.approx(2 * n / 25e9 + max(2 * GB / 25e9, n / 2e9))


def test_cli_40b_table_and_write(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_file = tmp_path / "rec.yaml"
    code, out, _ = plan_cli(["--model", "40B", *MACHINE, "--nvme-path", str(tmp_path),
                             "--write", str(out_file)], capsys)
    assert code == 0
    assert "40.00B parameters" in out
    assert "none: does not fit: tier device is short by" in out
    assert "cpu: does not fit: tier host is short by" in out  # 720 GB > 512 GB of RAM
    assert "written/1,000 steps" in out and "predicted step" in out
    written: dict[str, Any] = yaml.safe_load(out_file.read_text())
    assert written["offload"]["device"] in ("auto", "nvme")
    assert engine.load_config(str(out_file)).zero.stage == 3  # loads as a real config


@pytest.mark.parametrize(("args", "needle"), [
    (["--model", "builtin:huge", *MACHINE], "unknown built-in size 'huge'"),
    (["--model", "/no/config.json", *MACHINE], "unknown model"),
    (["--model", "7B", "--world-size", "0", *MACHINE], "--world-size: 0 is not allowed"),
    (["--model", "7B", "--device-mem", "lots", "--host-mem", "1GB", "--nvme-size", "1GB"],
     "--device-mem"),
])
def test_cli_bad_arguments(args: list[str], needle: str,
                           capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = plan_cli(args, capsys)
    assert code == 1 and needle in err


def test_cli_fits_nowhere(capsys: pytest.CaptureFixture[str]) -> None:
    # accumulation keeps the gradients fp32 ([Note: gradient precision]): twice a param
    code, out, err = plan_cli(["--model", "70B", "--device-mem", "8GB", "--host-mem", "16GB",
                               "--nvme-size", "100GB", "--grad-accum", "2"], capsys)
    assert code == 1
    assert "fits under no offload choice" in err
    for choice in ("none", "cpu"):
        assert f"{choice}: does not fit: tier" in out
    for choice in ("nvme", "auto"):
        # the CPU Adam works in fixed-size pieces, so its buffers fit; the NVMe staging
        # pool still needs one whole 2.19B-parameter block's fp32 gradient shard
        assert f"{choice}: does not fit: tier host is short by" in out
        assert "the NVMe staging pool needs at least" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine detects its device memory")
def test_cli_needs_device_memory_without_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = plan_cli(["--model", "7B", "--host-mem", "64GB", "--nvme-size", "1TB"], capsys)
    assert code == 1
    assert "--device-mem: no CUDA device here to measure" in err
