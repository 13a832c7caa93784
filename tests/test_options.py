import dataclasses

import pytest

from kareus.errors import KareusError
from kareus.options import KareusOptionError, KareusOptions

parse_options = KareusOptions.from_dict


def test_defaults():
    assert parse_options(None) == KareusOptions()
    assert parse_options({}) == KareusOptions(lowering="inductor", explain=False)


@pytest.mark.parametrize(
    "device", ["auto", "nvml", "nvml-dry-run", "sim:h200", "sim:a100-sxm4-40gb"]
)
def test_valid_dict_round_trips(device):
    opts = parse_options({
        "lowering": "eager", "explain": True, "device": device, "profile": "refresh",
        "search_budget": 8, "seed": 3, "cache_dir": "/tmp/kareus-cache",
    })
    assert (opts.lowering, opts.explain, opts.device) == ("eager", True, device)
    assert (opts.profile, opts.search_budget, opts.seed, opts.cache_dir) == (
        "refresh", 8, 3, "/tmp/kareus-cache"
    )
    assert parse_options(opts.to_dict()) == opts


def test_custom_gpu_file_is_a_device(tmp_path):
    path = tmp_path / "gpu.json"
    path.write_text("{}")  # existence is checked here; the contents when the device opens
    assert parse_options({"device": str(path)}).device == str(path)


@pytest.mark.parametrize(
    "options, message",
    [
        (
            {"lowerin": "eager"},
            (
                "unknown kareus option 'lowerin'; "
                "accepted options: agreement_timeout_s, autotune, cache_dir, device, "
                "energy_budget, energy_time_tradeoff, explain, lowering, microbatches, "
                "nanobatches, pipeline_schedule, plan, profile, profile_budget_s, search, "
                "search_budget, seed, time_budget, verify, zeusd_socket"
            ),
        ),
        (
            {"agreement_timeout_s": 0},
            "kareus option 'agreement_timeout_s': got 0 (int); must be finite and > 0",
        ),
        (
            {"agreement_timeout_s": "5"},
            "kareus option 'agreement_timeout_s': got '5' (str); not a number",
        ),
        ({"a": 1, "b": 2}, "unknown kareus options 'a', 'b'"),
        (
            {"profile": "on"},
            "kareus option 'profile': got 'on' (str); accepted: 'auto' | 'off' | 'refresh'",
        ),
        ({"search_budget": 0}, "kareus option 'search_budget': got 0 (int); must be >= 1"),
        ({"profile_budget_s": 0}, ("kareus option 'profile_budget_s': got 0 (int); must be "
                                  "finite and > 0")),
        (
            {"search": "random"},
            "kareus option 'search': got 'random' (str); accepted: 'bayesian' | 'grid'",
        ),
        ({"search_budget": 8.0}, "kareus option 'search_budget': got 8.0 (float); not an integer"),
        ({"seed": "1"}, "kareus option 'seed': got '1' (str); accepted: int"),
        ({"cache_dir": ""}, "kareus option 'cache_dir': got '' (str); empty"),
        ({"cache_dir": 3}, "kareus option 'cache_dir': got 3 (int); not a string"),
        (
            {"cache_dir": "/tmp/a\0b"},
            ("kareus option 'cache_dir': got '/tmp/a\\x00b' (str); holds a NUL byte, which no "
            "path can; accepted: None | a directory path"),
        ),
        (
            {"plan": "p\0.json"},
            "kareus option 'plan': got 'p\\x00.json' (str); holds a NUL byte",
        ),
        ({"energy_budget": "-5 J"}, "kareus option 'energy_budget': got '-5 J'; must be positive"),
        ({"energy_budget": "0 J"}, "kareus option 'energy_budget': got '0 J'; must be positive"),
        ({"energy_budget": "1e400 J"}, "kareus option 'energy_budget': got '1e400 J'; not finite"),
        (
            {"time_budget": "1.1"},
            ("kareus option 'time_budget': got '1.1'; a fraction is a number (1.1, not a "
            'string); an amount needs a unit ("1.1 s")'),
        ),
        (
            {"plan": "p.json", "nanobatches": 4},
            ("kareus options: nanobatches=4 and plan='p.json' contradict: the plan says each "
            "graph's nanobatch count, variant and clock; give one"),
        ),
        (
            {"plan": "p.json", "energy_budget": 0.9},
            "kareus options: a budget needs a plan, and none is made with plan='p.json'",
        ),
        (
            {"lowering": "aot_eager"},
            "kareus option 'lowering': got 'aot_eager' (str); accepted: 'inductor' | 'eager'",
        ),
        ({"lowering": None}, "kareus option 'lowering': got None (NoneType)"),
        ({"explain": "yes"}, "kareus option 'explain': got 'yes' (str); accepted: bool"),
        ({"explain": 1}, "kareus option 'explain': got 1 (int); accepted: bool"),
        (["lowering"], "kareus options must be a dict, got list"),
        (
            {"device": "sim:a100"},
            (
                "kareus option 'device': got 'sim:a100' (str); no simulated preset of that name; "
                "presets: sim:a100-sxm4-40gb"
            ),
        ),
        ({"device": "cuda:0"}, "kareus option 'device': got 'cuda:0' (str); no such file: cuda:0"),
        (
            {"device": 0},
            (
                "kareus option 'device': got 0 (int); expected a string, got int; "
                'accepted: "auto" | "nvml"'
            ),
        ),
    ],
)
def test_bad_options_name_key_value_and_accepted(options, message):
    with pytest.raises(KareusOptionError) as info:
        parse_options(options)
    assert message in str(info.value)


def test_options_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        KareusOptions().lowering = "eager"


def test_every_option_is_described():
    described = KareusOptions.describe()
    assert set(described) == set(KareusOptions().to_dict())
    assert "'inductor' | 'eager'" in described["lowering"]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"nanobatches": 3},
         "kareus option 'nanobatches': got 3 (int); accepted: 1 | 2 | 4 | 'auto'"),
        ({"lowering": "cuda"}, "kareus option 'lowering': got 'cuda'"),
        ({"agreement_timeout_s": -1.0}, "must be finite and > 0"),
    ],
)
def test_options_built_directly_are_checked_too(kwargs, message):
    with pytest.raises(KareusOptionError, match=message) as info:
        KareusOptions(**kwargs)
    assert isinstance(info.value, KareusError)


def test_a_plan_beside_what_it_would_override_is_refused():
    assert KareusOptions(plan="p.json", nanobatches=1).plan == "p.json"
    with pytest.raises(KareusOptionError, match="a chooser or clock_mhz given in code and "
                       "plan='p.json' contradict"):
        KareusOptions(plan="p.json").check_planning(policy_in_code=True)
