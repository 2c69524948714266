"""The Arrow rollout cache: rows per sample, hourly parts, size cap, schema check, readers."""

import pyarrow as pa
import pyarrow.dataset as ds
import pytest

from steadyrl.run.rollout_cache import SCHEMA, SCHEMA_KEY, CacheSchemaError, RolloutCache, rows_of
from steadyrl.wire.contracts import Prompt, RewardSource, RolloutGroup, Sample, ScoredGroup


def _scored(i: int) -> ScoredGroup:
    p = Prompt(prompt_id=f"r1/e0-i{i}", epoch=0, index=i, n_samples=2, run_id="r1", ground_truth="4",
               messages=[{"role": "user", "content": f"What is {i}?"}], data_source="arith")
    g = RolloutGroup(prompt=p, samples=[Sample(text="4", token_ids=[5, 6], logprobs=[-0.1, -0.2]),
                                        Sample(text="5", token_ids=[7], logprobs=[-0.3])], policy_version=3)
    return ScoredGroup(group=g, rewards=[1.0, 0.0], reward_source=RewardSource.rule, scorer="rule:numeric_match@1")


def test_rows_are_readable_by_pyarrow_polars_and_duckdb(tmp_path):
    import duckdb
    import polars as pl

    cache = RolloutCache(tmp_path)
    for step in (1, 2):
        cache.append([r for i in range(3) for r in rows_of(_scored(10 * step + i), step)])
    cache.close()
    [f] = list(tmp_path.rglob("*.arrow"))
    assert f.parent.parent.parent == tmp_path  # <root>/<date>/<hour>/part
    table = ds.dataset(tmp_path, format="ipc").to_table()
    assert table.num_rows == 12 and table.schema.metadata[SCHEMA_KEY] == b"1.0"
    assert sorted(set(table.column("step").to_pylist())) == [1, 2]
    df = pl.read_ipc(f)
    assert df.filter(pl.col("reward") == 1.0).height == 6 and df["token_ids"][0].to_list() == [5, 6]
    arrow_table = table  # noqa: F841  (duckdb reads the Python variable)
    assert duckdb.sql("select avg(reward) from arrow_table").fetchall()[0][0] == pytest.approx(0.5)


def test_parts_close_at_the_size_cap_and_a_crash_leaves_nothing_half_read(tmp_path):
    cache = RolloutCache(tmp_path, max_file_bytes=1)  # every append fills a part
    cache.append(rows_of(_scored(1), 1))
    cache.append(rows_of(_scored(2), 2))
    assert len(list(tmp_path.rglob("*.arrow"))) == 2
    cache.append(rows_of(_scored(3), 3))  # this part is "open" when the process dies ...
    cache2 = RolloutCache(tmp_path, max_file_bytes=10 ** 9)  # ... a restart removes it
    assert not list(tmp_path.rglob("*.tmp")) and ds.dataset(tmp_path, format="ipc").to_table().num_rows == 6
    cache2.close()


def test_another_schema_version_is_refused_by_name(tmp_path):
    old = SCHEMA.with_metadata({SCHEMA_KEY: b"0.9"})
    (tmp_path / "2026-01-01" / "00").mkdir(parents=True)
    with pa.OSFile(str(tmp_path / "2026-01-01" / "00" / "part-000001.arrow"), "wb") as sink, \
            pa.ipc.new_file(sink, old) as w:
        w.write_batch(pa.RecordBatch.from_pylist(rows_of(_scored(1), 1), schema=old))
    with pytest.raises(CacheSchemaError, match=r"rollout cache schema mismatch: expected v1.0, got v0.9"):
        RolloutCache(tmp_path)


def test_rows_after_a_resumed_step_are_dropped(tmp_path):
    cache = RolloutCache(tmp_path)
    for step in range(1, 6):
        cache.append(rows_of(_scored(step), step))
    cache.close()
    assert cache.truncate_after(3) == 4  # steps 4 and 5, two samples each
    assert sorted(set(ds.dataset(tmp_path, format="ipc").to_table().column("step").to_pylist())) == [1, 2, 3]
    assert cache.truncate_after(3) == 0
