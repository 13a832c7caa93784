import pytest

from kareus.options import KareusOptionError, KareusOptions, parse_options


def test_defaults():
    assert parse_options(None) == KareusOptions()
    assert parse_options({}) == KareusOptions(lowering="inductor", explain=False)


def test_valid_dict_round_trips():
    opts = parse_options({"lowering": "eager", "explain": True})
    assert opts.lowering == "eager" and opts.explain is True
    assert parse_options(opts.to_dict()) == opts


@pytest.mark.parametrize(
    "options, message",
    [
        ({"lowerin": "eager"}, "unknown kareus option 'lowerin'; accepted options: explain, lowering"),
        ({"a": 1, "b": 2}, "unknown kareus options 'a', 'b'"),
        ({"lowering": "aot_eager"}, "kareus option 'lowering': got 'aot_eager' (str); accepted: 'inductor' | 'eager'"),
        ({"lowering": None}, "kareus option 'lowering': got None (NoneType)"),
        ({"explain": "yes"}, "kareus option 'explain': got 'yes' (str); accepted: bool"),
        ({"explain": 1}, "kareus option 'explain': got 1 (int); accepted: bool"),
        (["lowering"], "kareus options must be a dict, got list"),
    ],
)
def test_bad_options_name_key_value_and_accepted(options, message):
    with pytest.raises(KareusOptionError) as info:
        parse_options(options)
    assert message in str(info.value)


def test_options_are_frozen():
    with pytest.raises(Exception):
        KareusOptions().lowering = "eager"


def test_every_option_is_described():
    described = KareusOptions.describe()
    assert set(described) == set(KareusOptions().to_dict())
    assert "'inductor' | 'eager'" in described["lowering"]
