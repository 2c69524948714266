"""`steadyrl replay` without a broker: time parsing, the shift report against scipy, the
scorer timeline, the PNG, and the CLI's argument errors (exit 2, naming the argument)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import ks_2samp

from steadyrl import replay as rp
from steadyrl.cli import build_parser, main
from steadyrl.wire.contracts import ScoredGroup
from tests.helpers import rollout_group

NOW = 1_777_636_800_000  # 2026-05-01T12:00:00Z


@pytest.mark.parametrize("text, want", [
    ("2026-05-01T12:00:00Z", NOW),
    ("2026-05-01T12:00:00", NOW),                   # no zone: UTC
    ("2026-05-01 12:00:00", NOW),
    ("2026-05-01T14:00:00+02:00", NOW),
    ("2026-05-01T12:00:00.123Z", NOW + 123),
    ("2026-05-01T12:00:00.999999Z", NOW + 999),     # microseconds floor to the millisecond
    ("2026-05-01", NOW - 12 * 3600_000),
    ("1777636800", NOW),
    ("1777636800.5", NOW + 500),
    ("1777636800.001", NOW + 1),                    # exact, no float rounding
    ("now", NOW),
    (" NOW ", NOW),
    ("-30m", NOW - 30 * 60_000),
    ("-2h", NOW - 2 * 3600_000),
    ("-45s", NOW - 45_000),
    ("-1d", NOW - 86400_000),
    ("-1w", NOW - 7 * 86400_000),
    ("-1h30m", NOW - 90 * 60_000),
    ("-0.5h", NOW - 30 * 60_000),
    ("-1.5s", NOW - 1500),
])
def test_parse_time(text, want):
    assert rp.parse_time(text, now_ms=NOW) == want


@pytest.mark.parametrize("text, says", [
    ("yesterday", "cannot read 'yesterday' as a time"),
    ("", "empty time"),
    ("-5", "needs a unit"),
    ("-30x", "cannot read"),
    ("30m", "cannot read"),
    ("1777636800000", "looks like milliseconds; give unix seconds (1777636800)"),
    ("2026-13-01T00:00:00", "cannot read"),
])
def test_parse_time_refuses_with_the_forms_it_accepts(text, says):
    with pytest.raises(ValueError) as e:
        rp.parse_time(text, now_ms=NOW)
    assert says in str(e.value)
    if "cannot read" in says:
        assert "ISO-8601" in str(e.value) and "-30m" in str(e.value)


def test_parse_time_defaults_to_the_clock():
    import time

    before = int(time.time() * 1000)
    got = rp.parse_time("-1m")
    assert before - 60_000 - 5 <= got <= int(time.time() * 1000) - 60_000


def test_format_ms_round_trips():
    for ms in (NOW, NOW + 1, NOW + 999, 0):
        assert rp.parse_time(rp.format_ms(ms)) == ms
    assert rp.format_ms(NOW + 7) == "2026-05-01T12:00:00.007Z"


@pytest.mark.parametrize("flag, value, says", [
    ("--from", "yesterday", "error: --from 'yesterday': cannot read"),
    ("--to", "-5", "error: --to '-5': relative time '-5' needs a unit"),
])
def test_cli_bad_time_exits_2_naming_the_argument(capsys, flag, value, says):
    argv = ["replay", "--from", "-1h", "--to", "now", "--bootstrap", "127.0.0.1:1"]
    argv[argv.index(flag) + 1] = value
    assert main(argv) == 2
    assert says in capsys.readouterr().err


def test_cli_from_after_to_and_bad_scorer_exit_2(capsys):
    assert main(["replay", "--from", "-1h", "--to", "-2h", "--bootstrap", "127.0.0.1:1"]) == 2
    assert "error: --from '-1h'" in capsys.readouterr().err
    assert main(["replay", "--from", "-1h", "--rescore", "no_such_rule", "--bootstrap", "127.0.0.1:1"]) == 2
    assert "error: --rescore 'no_such_rule': unknown scorer" in capsys.readouterr().err
    assert main(["replay", "--from", "-1h", "--top", "-1", "--bootstrap", "127.0.0.1:1"]) == 2
    assert "error: --top -1" in capsys.readouterr().err


def test_cli_takes_relative_times_that_start_with_a_dash():
    args = build_parser().parse_args(["replay", "--from", "-1h30m", "--to", "-5m", "--topic", "rl.scored"])
    assert (args.t_from, args.t_to, args.top) == ("-1h30m", "-5m", 10)
    args = build_parser().parse_args(["replay", "--from", "-2.5d"])
    assert args.t_from == "-2.5d" and args.t_to == "now"


def _groups(rewards_per_group, scorer="rule:tiny_copy@1", source="rule"):
    out = []
    for i, rewards in enumerate(rewards_per_group):
        g = rollout_group(i)
        g.samples = [g.samples[0].model_copy(update={"text": f"s{i}-{j}"}) for j in range(len(rewards))]
        out.append(ScoredGroup(group=g, rewards=rewards, reward_source=source, scorer=scorer))
    return out


def test_shift_report_paired_matches_scipy_and_numpy():
    before = _groups([[0.0, 0.25, 0.5], [1.0, 0.75, 0.0], [0.5, 0.5, 0.25]])
    after = _groups([[0.0, 0.0, 1.0], [1.0, 0.0, 0.0], [0.5, 1.0, 0.0]], scorer="rule:strict@1")
    rep = rp.shift_report(before, after, paired=True, top=3, labels=("recorded", "rescored"))
    b, a = [r for g in before for r in g.rewards], [r for g in after for r in g.rewards]
    ks = ks_2samp(b, a)
    assert rep["ks_statistic"] == pytest.approx(ks.statistic, rel=1e-12)
    assert rep["ks_pvalue"] == pytest.approx(ks.pvalue, rel=1e-12)
    assert rep["mean"] == pytest.approx([np.mean(b), np.mean(a)])
    assert rep["std"] == pytest.approx([np.std(b), np.std(a)])
    assert rep["delta_mean"] == pytest.approx(np.mean(a) - np.mean(b))
    assert rep["delta_std"] == pytest.approx(np.std(a) - np.std(b))
    assert rep["n"] == [9, 9] and rep["groups"] == [3, 3]
    assert rep["changed"] == 5
    assert rep["scorers"] == [{"rule:tiny_copy@1 (rule)": 9}, {"rule:strict@1 (rule)": 9}]
    assert rep["by_recorded_scorer"]["rule:tiny_copy@1 (rule)"]["changed"] == 5
    # |delta|: 0.75 (g1 s1), 0.5 (g0 s2, g2 s1), then 0.25 ...; ties keep time order
    top = [(c["prompt_id"], c["sample"], c["delta"]) for c in rep["largest_changes"]]
    assert top == [("e0-i1", 1, -0.75), ("e0-i0", 2, 0.5), ("e0-i2", 1, 0.5)]
    assert rep["largest_changes"][0]["response"] == "s1-1"


def test_shift_report_unpaired_and_empty_side():
    rep = rp.shift_report(_groups([[1.0, 1.0]]), [], labels=("first half", "second half"))
    assert rep["ks_statistic"] is None and rep["delta_mean"] is None and rep["n"] == [2, 0]
    assert "largest_changes" not in rep
    with pytest.raises(ValueError, match="paired"):
        rp.shift_report(_groups([[1.0]]), _groups([[1.0, 0.0]]), paired=True)


def test_timeline_halves_and_text(tmp_path):
    groups = _groups([[0.5]] * 3) + _groups([[1.0]] * 2, scorer="rule:other@1") + _groups([[0.0]], source="cache")
    records = [rp.Record(partition=i % 2, offset=i, timestamp_ms=NOW + i * 1000, group=g) for i, g in enumerate(groups)]
    tl = rp.scorer_timeline(records)
    assert [(s["scorer"], s["source"], s["groups"], s["mean"]) for s in tl] == [
        ("rule:tiny_copy@1", "rule", 3, 0.5), ("rule:other@1", "rule", 2, 1.0), ("rule:tiny_copy@1", "cache", 1, 0.0)]
    assert (tl[1]["first_ms"], tl[1]["last_ms"]) == (NOW + 3000, NOW + 4000)
    first, second = rp.halves(records)
    assert [r.offset for r in first] == [0, 1, 2] and [r.offset for r in second] == [3, 4, 5]
    window = rp.Window("rl.scored", NOW, NOW + 10_000, records, {0: (0, 6), 1: (1, 6)})
    rep = rp.build_report(window, top=5)
    assert rep["mode"] == "halves" and rep["split"] == "2026-05-01T12:00:03.000Z"
    ks = ks_2samp([0.5] * 3, [1.0, 1.0, 0.0])
    assert rep["shift"]["ks_pvalue"] == pytest.approx(ks.pvalue)
    text = rp.format_report(rep)
    assert "replay of rl.scored from 2026-05-01T12:00:00.000Z to 2026-05-01T12:00:10.000Z" in text
    assert "rule:other@1 (rule)" in text and "KS statistic" in text and "split at 2026-05-01T12:00:03.000Z" in text
    png = tmp_path / "h.png"
    rp.plot_report(rep, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "_before" not in rp.report_json(rep)


def test_bin_edges_centre_discrete_rewards():
    edges = rp._bin_edges(np.array([0.0, 0.25, 0.5, 1.0]))
    assert list(edges) == [-0.125, 0.125, 0.375, 0.75, 1.25]
    assert list(rp._bin_edges(np.array([1.0, 1.0]))) == [0.5, 1.5]
    assert len(rp._bin_edges(np.linspace(0, 1, 1000))) <= 61
