import pytest

from graphstep import policy
from graphstep.policy import MODES, WIDE_MODES, batch_table, modes_for, overlap_for


def test_defaults_one_rank_polls_the_others_fork():
    """One rank (TP 8, TP 1 unsplit): fork_poll at every size (measured faster, session 15);
    DCP, its split query and TP 1's split query: fork."""
    assert [overlap_for(b) for b in (1, 4, 16, 64)] == ["fork_poll"] * 4
    for dcp, wide, split in [(True, False, False), (False, True, False), (True, False, True)]:
        assert overlap_for(1, dcp=dcp, wide=wide, split=split) == "fork"


def test_a_mode_applies_to_every_batch():
    assert [overlap_for(b, "serial") for b in (1, 7, 128)] == ["serial"] * 3


def test_table_rows_and_missing_rows_take_the_topologys_default(monkeypatch):
    """A size a table does not name runs as with no policy (before: "fork", not TP 8's fork_poll)."""
    table = "1:serial, 2:fork_poll,16:serial"
    assert overlap_for(1, table) == "serial"
    assert overlap_for(2, table) == "fork_poll"
    assert overlap_for(16, table) == "serial"
    assert overlap_for(3, table) == "fork_poll"  # TP 8's default
    assert overlap_for(3, table, dcp=True) == "fork"  # DCP's
    monkeypatch.setattr(policy, "QUERY_OVERLAP", dict(policy.QUERY_OVERLAP, tp="3:serial"))
    assert overlap_for(3, "1:fork") == "serial" and overlap_for(4, "1:fork") == "fork"  # not in either: fork


@pytest.mark.parametrize("empty", ["", " "])
def test_an_empty_policy_is_an_error_not_the_default(empty):
    with pytest.raises(ValueError, match="expected one of .* or a 'rows:mode,...' table"):
        overlap_for(1, empty)


def test_modes_for_refuses_a_table_naming_no_captured_size_and_warns_of_unused_entries(monkeypatch):
    assert modes_for([1, 4], "1:serial") == {1: "serial", 4: "fork_poll"}
    with pytest.raises(ValueError, match=r"'3:serial': no entry names a captured size \(captured: \[1, 4\];"):
        modes_for([1, 4], "3:serial")
    with pytest.warns(UserWarning, match=r"entries 2:fork, 64:serial name no captured size \(captured: \[1, 4\]\)"):
        assert modes_for([1, 4], "1:serial,2:fork,4:fork,64:serial") == {1: "serial", 4: "fork"}
    # the default tables name the sizes tune measured: more than a step captures
    monkeypatch.setattr(policy, "QUERY_OVERLAP", dict(policy.QUERY_OVERLAP, tp="1:serial,64:fork"))
    assert modes_for([1, 4]) == {1: "serial", 4: "fork"}


def test_batch_table_parses():
    assert batch_table("1:serial,8:fork") == {1: "serial", 8: "fork"}


@pytest.mark.parametrize(
    "bad, quoted",
    [
        ("4:", "'4:'"),
        ("x:fork", "'x:fork'"),
        ("0:fork", "'0:fork'"),
        ("-1:fork", "'-1:fork'"),
        ("1:serial,1:fork", "'1:fork'"),
        ("2:warp", "'2:warp'"),
        (":fork", "':fork'"),
        ("1:fork,", "''"),
        ("\u00b2:serial", "'\u00b2:serial'"),  # a superscript two is a digit to str.isdigit
        ("\u0664:serial", "'\u0664:serial'"),  # an Arabic-Indic four is one to int()
    ],
)
def test_malformed_tables_quote_the_entry(bad, quoted):
    with pytest.raises(ValueError) as error:
        batch_table(bad)
    assert quoted in str(error.value)


def test_unknown_mode_names_mode_and_allowed_set():
    with pytest.raises(ValueError) as error:
        overlap_for(1, "bogus")
    assert "'bogus'" in str(error.value) and str(MODES) in str(error.value)


def test_wide_allows_only_wide_modes():
    assert overlap_for(4, "serial", wide=True) == "serial"
    with pytest.raises(ValueError) as error:
        overlap_for(4, "fork_poll", wide=True)
    assert "'fork_poll'" in str(error.value) and str(WIDE_MODES) in str(error.value)
    with pytest.raises(ValueError):
        overlap_for(4, "4:fork_poll", wide=True)
    with pytest.raises(ValueError, match="'fork_poll'"):  # any entry, not only the size asked (before: "fork")
        overlap_for(4, "3:fork_poll", wide=True)
    assert overlap_for(5, "4:fork_poll", dcp=True) == "fork"


def test_topologies_pick_their_own_tables(monkeypatch):
    tables = {"tp1": "1:serial", "tp": "1:fork_poll", "dcp": "2:serial", "dcp_split": "2:fork_poll"}
    monkeypatch.setattr(policy, "QUERY_OVERLAP", tables)
    assert overlap_for(1, wide=True) == "serial"
    assert overlap_for(1) == "fork_poll"
    assert overlap_for(2, dcp=True) == "serial"
    assert overlap_for(2, dcp=True, split=True) == "fork_poll"
    # split without DCP is the tp table; wide wins over split.
    assert overlap_for(1, split=True) == "fork_poll"
    assert overlap_for(1, wide=True, split=True, dcp=True) == "serial"


def test_side_stream_is_cached_per_device(monkeypatch):
    import torch

    made = []
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: made.append(device) or object())
    policy.side_stream.cache_clear()
    try:
        a, b, c = policy.side_stream(0), policy.side_stream(0), policy.side_stream(1)
        assert a is b and a is not c and made == [0, 1]
    finally:
        policy.side_stream.cache_clear()
