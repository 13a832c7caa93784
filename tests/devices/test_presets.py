"""The preset table and custom GPUs loaded from JSON."""

from __future__ import annotations

import dataclasses
import json
import math
import re

import pytest

from kareus.devices import GPUSpec, SimulatedGPU, load_preset, preset_names
from kareus.devices.errors import DeviceError, GPUSpecError
from kareus.devices.sim.presets import (
    _RANGES,
    COLLECTIVE_KINDS,
    MAX_CLOCKS,
    MAX_SPEC_BYTES,
    PRESETS,
    _validate,
)


@pytest.mark.regression
def test_preset_names():
    assert preset_names() == ("sim:a100-sxm4-40gb", "sim:h100-sxm", "sim:h200")


@pytest.mark.regression
def test_a100_clocks_are_the_methods():
    gpu = SimulatedGPU("sim:a100-sxm4-40gb")
    assert gpu.supported_clocks() == tuple(range(1410, 209, -15))
    assert gpu.search_clocks() == tuple(range(1410, 899, -30))
    assert len(gpu.search_clocks()) == 18
    assert gpu.static_power_w == 85.0


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_is_consistent(name):
    spec = load_preset(name)
    search, supported = spec.search_clocks(), spec.supported_clocks()
    assert len(search) == 18 and search[0] == supported[0] == spec.max_clock_mhz
    assert set(search) <= set(supported)
    assert list(supported) == sorted(supported, reverse=True)
    # The GEMM's power-capped clock lies inside the search range, above the knee.
    assert search[-1] < spec.knee_mhz < spec.sustained_gemm_mhz < spec.max_clock_mhz
    assert spec.voltage(spec.min_clock_mhz) == spec.voltage(spec.knee_mhz) == spec.v_floor
    assert spec.voltage(spec.max_clock_mhz) == pytest.approx(spec.v_max)
    assert set(spec.bus_bytes_per_s) == set(COLLECTIVE_KINDS)


@pytest.mark.fidelity
def test_derived_sustained_clocks_match_the_published_ones():
    # CALIBRATION: A100 DGEMM at 400 W sustains about 1305 MHz (thonking.ai's random-input
    # bf16 8192^3 implies ~1233); H200 sustains about 1500 MHz under heavy load.
    assert 1233 <= load_preset("sim:a100-sxm4-40gb").sustained_gemm_mhz <= 1305
    assert 1450 <= load_preset("sim:h200").sustained_gemm_mhz < 1830


def test_unknown_preset_lists_the_names():
    with pytest.raises(ValueError, match="sim:a100-sxm4-40gb, sim:h100-sxm, sim:h200"):
        load_preset("sim:b200")


def write(tmp_path, data) -> str:
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_full_json_spec_round_trips(tmp_path):
    data = dataclasses.asdict(PRESETS["sim:h200"]) | {"name": "my-h200"}
    spec = load_preset(write(tmp_path, data))
    assert spec == dataclasses.replace(PRESETS["sim:h200"], name="my-h200")


def test_json_spec_overrides_a_base_preset(tmp_path):
    gpu = SimulatedGPU(write(tmp_path, {"base": "sim:h100-sxm", "name": "h100-500w", "tdp_w": 500}))
    assert gpu.name == "h100-500w"
    assert gpu.spec == dataclasses.replace(PRESETS["sim:h100-sxm"], name="h100-500w", tdp_w=500)


@pytest.mark.parametrize(
    "data, message",
    [
        ({"base": "sim:h200", "name": "x", "tdp": 500}, r"unknown keys \['tdp'\]"),
        ({"name": "x", "sm_count": 10}, r"missing keys \['attention_block', 'attention_bwd_"),
        ({"base": "sim:h200", "tdp_w": 500}, r"missing key \['name'\]"),
        ({"base": "sim:x200", "name": "x"}, "unknown base 'sim:x200'"),
        ({"base": "sim:h200", "name": "x", "sm_count": 132.0}, "sm_count must be an integer"),
        ({"base": "sim:h200", "name": "x", "tdp_w": "700"}, "tdp_w must be a finite number"),
        (
            {"base": "sim:h200", "name": "x", "gemm_efficiency": 1.5},
            r"gemm_efficiency must be a finite number in \(0, 1\], got 1.5",
        ),
        (
            {"base": "sim:h200", "name": "x", "tdp_w": 100},
            r"invalid tdp_w=100: needs tdp_w > static_power_w \(static_power_w=",
        ),
        (
            {"base": "sim:h200", "name": "x", "search_step_mhz": 20},
            (r"invalid search_step_mhz=20: needs search_step_mhz % clock_step_mhz == 0 "
            r"\(clock_step_mhz=15\)"),
        ),
        (  # the relation a minimum clock above the maximum breaks, with both values
            {"base": "sim:h200", "name": "x", "min_clock_mhz": 2100},
            (r"invalid min_clock_mhz=2100: needs min_clock_mhz <= max_clock_mhz "
            r"\(max_clock_mhz=1980\)"),
        ),
        (
            {"base": "sim:h200", "name": "x", "bus_bytes_per_s": {"all_reduce": 1e9}},
            "bus_bytes_per_s must map each of",
        ),
        ([1, 2], "must be a JSON object"),
    ],
)
def test_bad_json_specs_name_the_problem(tmp_path, data, message):
    path = write(tmp_path, data)
    with pytest.raises(ValueError, match=message) as error:
        load_preset(path)
    assert "gpu.json" in str(error.value)


def test_unreadable_json_is_reported(tmp_path):
    path = tmp_path / "gpu.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="cannot read GPU spec"):
        load_preset(str(path))
    with pytest.raises(ValueError, match="cannot read GPU spec"):
        load_preset(str(tmp_path / "missing.json"))


def test_spec_validation_applies_to_code_built_specs():
    with pytest.raises(ValueError, match="invalid knee_mhz=2000"):
        dataclasses.replace(PRESETS["sim:h200"], knee_mhz=2000)
    assert isinstance(PRESETS["sim:h200"], GPUSpec)


def bus_json(kind: str, raw: str) -> str:
    """sim:h200's bus bandwidths as JSON text, with ``kind``'s replaced by ``raw``."""
    bus = PRESETS["sim:h200"].bus_bytes_per_s
    values = {k: raw if k == kind else repr(v) for k, v in bus.items()}
    return "{" + ", ".join(f'"{k}": {v}' for k, v in values.items()) + "}"


FRACTION = r"a finite number in \(0, 1\]"
POSITIVE = r"a finite number in \(0, \S+\]"
NON_NEGATIVE = r"a finite number in \[0, \S+\]"
COUNT = r"an integer in \[1, \d+\]"


@pytest.mark.parametrize(
    "key, raw, field, accepted",
    [
        ("kernel_floor_s", "0", "kernel_floor_s", POSITIVE),
        ("kernel_floor_s", "-1e-6", "kernel_floor_s", POSITIVE),
        ("ring_step_latency_s", "0", "ring_step_latency_s", POSITIVE),
        (
            "bus_bytes_per_s",
            bus_json("all_reduce", "Infinity"),
            "bus_bytes_per_s['all_reduce']",
            POSITIVE,
        ),
        (
            "bus_bytes_per_s",
            bus_json("all_gather", "true"),
            "bus_bytes_per_s['all_gather']",
            POSITIVE,
        ),
        (
            "bus_bytes_per_s",
            bus_json("all_to_all", "0"),
            "bus_bytes_per_s['all_to_all']",
            POSITIVE,
        ),
        ("hbm_bytes_per_s", "NaN", "hbm_bytes_per_s", POSITIVE),
        ("hbm_bytes_per_s", "Infinity", "hbm_bytes_per_s", POSITIVE),
        ("tdp_w", "true", "tdp_w", POSITIVE),
        ("static_power_w", "-5", "static_power_w", NON_NEGATIVE),
        ("sm_count", "-132", "sm_count", COUNT),
        ("default_comm_sms", "0", "default_comm_sms", COUNT),
        ("nccl_buffer_bytes", "true", "nccl_buffer_bytes", COUNT),
        ("hbm_efficiency", "1.2", "hbm_efficiency", FRACTION),
        ("memory_sm_activity", "NaN", "memory_sm_activity", FRACTION),
        ("gemm_efficiency", "0", "gemm_efficiency", FRACTION),
        # Absurd but finite: every field has an upper bound.
        ("tdp_w", "1e300", "tdp_w", r"a finite number in \(0, 5000\], got 1e\+300"),
        ("sm_count", "1000000000", "sm_count", r"an integer in \[1, 4096\], got 1000000000"),
        ("sm_count", "1" + "0" * 400, "sm_count", r"an integer in \[1, 4096\]"),
        ("max_clock_mhz", "20000001", "max_clock_mhz", r"an integer in \[1, 10000\]"),
        ("hbm_bytes_per_s", "1e20", "hbm_bytes_per_s", r"a finite number in \(0, 1e\+14\]"),
        ("v_max", "50", "v_max", r"a finite number in \(0, 2\]"),
        ("clock_switch_s", "1e9", "clock_switch_s", r"a finite number in \[0, 60\]"),
    ],
)
def test_out_of_range_fields_are_device_errors(tmp_path, key, raw, field, accepted):
    path = tmp_path / "gpu.json"
    path.write_text(f'{{"base": "sim:h200", "name": "x", "{key}": {raw}}}')
    with pytest.raises(GPUSpecError) as error:
        load_preset(str(path))
    message = str(error.value)
    assert isinstance(error.value, DeviceError) and isinstance(error.value, ValueError)
    assert "gpu.json" in message and f"{field} must be" in message
    assert re.search(accepted, message), message


def test_out_of_range_fields_are_rejected_in_code_too():
    with pytest.raises(GPUSpecError, match=r"kernel_floor_s must be a finite number in \(0, "):
        dataclasses.replace(PRESETS["sim:h200"], kernel_floor_s=0)


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_passes_the_checks(name):
    _validate(PRESETS[name])  # raises on any out-of-range or inconsistent field


def test_every_numeric_field_has_a_finite_upper_bound():
    assert all(math.isfinite(accepted.high) for accepted in _RANGES.values())


def test_a_spec_with_too_many_clocks_is_refused(tmp_path):
    # 1..10,000 MHz in 1 MHz steps: each field in range, 10,000 clocks together.
    path = write(tmp_path, {"base": "sim:h200", "name": "x", "min_clock_mhz": 1,
                            "max_clock_mhz": 10_000, "clock_step_mhz": 1, "knee_mhz": 1500,
                            "search_min_mhz": 1215, "search_step_mhz": 45})
    with pytest.raises(GPUSpecError, match=r"gpu.json.*10,000 clocks; at most 1,000"):
        load_preset(path)
    assert max(len(s.supported_clocks()) for s in PRESETS.values()) <= MAX_CLOCKS


@pytest.mark.parametrize(
    "raw, problem",
    [
        (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "can't decode byte 0x89"),
        (b"\xff\xfe{\x00}\x00", "can't decode byte 0xff"),
        (b"\x00\x01\x02", "Expecting value"),
        (b"1" * 5000, "Exceeds the limit"),
        (b"[" * 100_000, "maximum recursion depth"),
    ],
)
def test_a_binary_or_non_json_file_is_one_error_naming_it(tmp_path, raw, problem):
    path = tmp_path / "gpu.json"
    path.write_bytes(raw)
    with pytest.raises(GPUSpecError) as error:
        load_preset(str(path))
    message = str(error.value)
    assert f"cannot read GPU spec {str(path)!r}: not a UTF-8 JSON file" in message
    assert problem in message and "\n" not in message


def test_a_huge_file_is_not_read_whole(tmp_path):
    path = tmp_path / "gpu.json"
    path.write_bytes(b" " * (MAX_SPEC_BYTES + 1))
    with pytest.raises(GPUSpecError, match="gpu.json.*larger than 1,048,576 bytes"):
        load_preset(str(path))


def test_a_directory_named_like_a_spec_is_reported_as_one(tmp_path):
    (tmp_path / "gpu.json").mkdir()
    with pytest.raises(GPUSpecError, match="cannot read GPU spec .*gpu.json.*Is a directory"):
        load_preset(str(tmp_path / "gpu.json"))
