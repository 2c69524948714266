"""The policy files' run binding (`check_run`) and pruning rule (`prune`), on plain folders."""

from pathlib import Path

import pytest

from steadyrl.run import policy_files
from steadyrl.run.policy_files import PolicyRefused, check_run, prune

A, B, C, D = ("r20261101T000000-aaaa", "r20261102T000000-bbbb", "r20261103T000000-cccc",
              "r20261104T000000-dddd")


def _tree(root: Path, layout: dict[str, list[int]]) -> None:
    """Version folders (an index file each; legacy files for negative numbers: -3 is v000003.safetensors)."""
    for run, versions in layout.items():
        for v in versions:
            if v < 0:
                (root / run).mkdir(parents=True, exist_ok=True)
                (root / run / f"v{-v:06d}.safetensors").write_bytes(b"x")
            else:
                (root / run / f"v{v:06d}").mkdir(parents=True)
                (root / run / f"v{v:06d}" / policy_files.INDEX).write_text("{}")


def _left(root: Path) -> dict[str, list[str]]:
    return {p.name: sorted(q.name for q in p.iterdir()) for p in sorted(root.iterdir()) if p.is_dir()}


def test_prune_keeps_the_runs_newest_versions_and_the_newest_of_recent_earlier_runs(tmp_path):
    _tree(tmp_path, {A: [0, 1, 2], B: [3, 4], C: [0, 5, -5], D: [0, 1, 2, 3, 7, 8]})
    (tmp_path / "base-model").mkdir()                 # not a run id: left alone
    (tmp_path / D / ".v000009.tmp-123").mkdir()       # a write in progress: left alone
    gone = prune(tmp_path, D, current=3, keep=2, keep_runs=2)
    assert _left(tmp_path) == {
        B: ["v000004"],                                # earlier, recent: its newest version only
        C: ["v000005", "v000005.safetensors"],         # both forms of its newest version
        D: [".v000009.tmp-123", "v000002", "v000003"],  # 7, 8: thrown away by a resume; 0, 1: beyond keep
        "base-model": []}
    assert tmp_path / A in gone and tmp_path / D / "v000008" in gone  # A, the oldest run: deleted whole


def test_prune_leaves_later_runs_and_can_keep_no_earlier_run(tmp_path):
    _tree(tmp_path, {A: [0, 1], B: [0, 1], C: [0, 1, 2]})
    prune(tmp_path, B, current=1, keep=2, keep_runs=0)
    assert _left(tmp_path) == {B: ["v000000", "v000001"], C: ["v000000", "v000001", "v000002"]}


@pytest.mark.parametrize("uri,run,version,reason", [
    (f"{A}/v000001", A, 1, None),
    (f"{A}/v000002.safetensors", A, 2, None),                   # a legacy file
    (f"{A}/v000001", D, 1, "wrong_run"),                        # an earlier run's folder, a later run id
    (f"{D}/../{A}/v000001", f"{D}/../{A}", 1, "wrong_run"),     # the run id itself walks out
    (f"{A}/v000001", A, 2, "wrong_run"),                        # another version's folder
    (f"{A}/v000001", "", 1, "no_run"),
    (f"{D}/v000001", D, 1, "missing")])
def test_check_run(tmp_path, uri, run, version, reason):
    _tree(tmp_path, {A: [1, -2], D: []})
    if reason is None:
        assert check_run(tmp_path, uri, run, version) == (tmp_path / uri).resolve()
    else:
        with pytest.raises(PolicyRefused) as e:
            check_run(tmp_path, uri, run, version)
        assert e.value.reason == reason, e.value.detail


def test_check_run_follows_links_to_where_they_lead(tmp_path):
    _tree(tmp_path, {A: [1]})
    (tmp_path / D).symlink_to(tmp_path / A)           # D/v000001 is A's folder
    with pytest.raises(PolicyRefused) as e:
        check_run(tmp_path, f"{D}/v000001", D, 1)
    assert e.value.reason == "wrong_run"


def test_a_run_id_that_is_not_a_folder_name_is_refused(tmp_path):
    """Review regression: pathlib folds `rOld/.` into `rOld`, so the folder check alone let a
    record name the earlier run's folder under another run id string."""
    import pytest

    from steadyrl.run.policy_files import PolicyRefused, check_run, version_dir

    folder = tmp_path / version_dir("r20260101T000000-abcd", 3)
    folder.mkdir(parents=True)
    (folder / "model.safetensors.index.json").write_text("{}")
    for bad in ("r20260101T000000-abcd/.", "..", "a/../r20260101T000000-abcd"):
        with pytest.raises(PolicyRefused) as info:
            check_run(tmp_path, "r20260101T000000-abcd/v000003", bad, 3)
        assert info.value.reason == "wrong_run", bad


def test_the_high_water_mark_outlives_the_versions_prune_deletes(tmp_path):
    """A resumed learner's first publish: the mark counts the thrown-away folders (no file yet),
    keeps their number after prune deletes them, rises with the run, and a file that does not
    hold an integer counts as absent (the folders and the version still count)."""
    _tree(tmp_path, {A: [1, 2, 3, -7]})
    assert policy_files.raise_high_water(tmp_path, A, 2) == 7
    prune(tmp_path, A, current=2, keep=2, keep_runs=0)
    assert _left(tmp_path)[A] == ["high_water", "v000001", "v000002"]
    assert policy_files.raise_high_water(tmp_path, A, 3) == 7
    assert policy_files.raise_high_water(tmp_path, A, 8) == 8
    assert (tmp_path / A / "high_water").read_text() == "8\n"
    (tmp_path / A / "high_water").write_text("eight")
    assert policy_files.raise_high_water(tmp_path, A, 4) == 4
    assert policy_files.raise_high_water(tmp_path, B, 0) == 0   # a new run: its own folder and mark
    assert (tmp_path / B / "high_water").read_text() == "0\n"


# new_run_id: runs sort by the runs present, not by the clock of the node a learner starts on
NOON = 1796299200.0   # 2026-12-03T12:00:00Z


def test_a_new_run_id_is_the_clocks_second_when_the_clock_is_ahead_of_every_run(tmp_path):
    (tmp_path / "state" / A).mkdir(parents=True)          # an earlier run (1 Nov)
    (tmp_path / "state" / "CURRENT").write_text(A + "\n")
    (tmp_path / "policies" / "base-model").mkdir(parents=True)
    run = policy_files.new_run_id(tmp_path / "state", tmp_path / "policies", tmp_path / "absent", now=NOON + 0.9)
    assert policy_files.RUN_ID.fullmatch(run) and run[:16] == "r20261203T120000"   # unchanged form
    assert policy_files.RUN_ID.fullmatch(policy_files.new_run_id())  # no place: the clock alone


def test_a_new_run_id_sorts_after_the_newest_run_when_the_clock_is_behind(tmp_path, caplog):
    later = "r20261203T130000-0000"   # started an hour after the skewed clock's now, random bits 0
    (tmp_path / "state" / A).mkdir(parents=True)
    (tmp_path / "policies" / later / "v000003").mkdir(parents=True)   # seen only in the policy root
    with caplog.at_level("WARNING", logger="steadyrl.run.policy_files"):
        run = policy_files.new_run_id(tmp_path / "state", tmp_path / "policies", now=NOON)
    assert run[:16] == "r20261203T130001" and run > later and policy_files.RUN_ID.fullmatch(run)
    (rec,) = caplog.records
    assert "the clock is behind the newest run present" in rec.getMessage() and rec.newest_run == later
    # and so on for each run after it while the clock stays behind: the ids only grow
    (tmp_path / "policies" / run).mkdir()
    assert policy_files.new_run_id(tmp_path / "state", tmp_path / "policies", now=NOON)[:16] == "r20261203T130002"


def test_two_runs_within_one_second_sort_in_start_order(tmp_path, caplog):
    """Before, the random bits ordered them: the second run sorted first half the time."""
    (tmp_path / "r20261203T120000-ffff").mkdir()
    with caplog.at_level("WARNING", logger="steadyrl.run.policy_files"):
        run = policy_files.new_run_id(tmp_path, now=NOON + 0.5)
    assert run[:16] == "r20261203T120001"
    assert not caplog.records   # the clock is not behind: nothing to warn about


def test_ids_of_earlier_mains_still_match_and_sort_below_a_new_run(tmp_path):
    """Ids written by main up to e844ab6 (the 4bba081 fixture's, `make run`'s) keep their place:
    the same pattern, and a run started after them sorts after them."""
    for old in ("r20261201T075848-5c73", "r20261203T091918-9e77"):
        assert policy_files.RUN_ID.fullmatch(old)
        (tmp_path / old).mkdir()
    run = policy_files.new_run_id(tmp_path, now=NOON)
    assert run[:16] == "r20261203T120000" and run > "r20261203T091918-9e77"


@pytest.mark.parametrize("name", ["r20261399T000000-aaaa", "r99991231T235959-ffff"])
def test_a_run_named_beyond_any_start_time_refuses_the_start(tmp_path, name):
    from steadyrl.config import ConfigError

    (tmp_path / name).mkdir()
    with pytest.raises(ConfigError) as e:
        policy_files.new_run_id(tmp_path, now=NOON)
    assert name in e.value.message and "rename or remove it" in e.value.message
