"""bench/scaling.py's CI shape (`--quick`): it runs end to end, and the memory it reports for
the actor's generation stays flat in the answer length (full-vocabulary logits kept per token,
as before f70ced9, were 16 x 256 x 49 152 x 4 bytes = 805 MB a copy)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import scaling  # noqa: E402


def test_the_quick_grid_runs_and_generation_memory_stays_flat(tmp_path):
    out = tmp_path / "scaling.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "scaling.py"), "--quick", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [(r["phase"], r["T"]) for r in rows] == [(p, t) for p, _, t, _ in scaling.QUICK]
    assert not [r for r in rows if "error" in r], rows
    generate = [r for r in rows if r["phase"] == "generate"]
    assert all(r["rss_growth_mb"] < 400 for r in generate), generate
    train = [r for r in rows if r["phase"] == "train"]
    assert all(r["rows_per_micro_batch"] == 8 for r in train)   # 8 x (16 + 256) tokens fit 4 096
    record = next(r for r in rows if r["phase"] == "record")
    assert record["bytes"] > record["deflate_bytes"] > 0
    table = scaling.table(result)
    assert "| generate | tiny-v49k | 256 | 16 |" in table and "| N = 8 | 1024 |" in table
