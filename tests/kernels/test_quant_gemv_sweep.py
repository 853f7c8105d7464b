"""benchmarks/quant_gemv_sweep.py on tiny shapes: every variant within tolerance, and the table it
writes is what pick_config's lookup returns (on a CPU under the interpreter; on a GPU compiled)."""

import json

from rooflm.kernels.tuned_configs import lookup
from rooflm.kernels.w4a16 import W4Config, check_config


def test_sweep_fills_the_tile_table_that_pick_config_reads(tmp_path):
    from benchmarks.quant_gemv_sweep import main, merge_table
    table_path = tmp_path / "table.json"
    argv = ["--smoke", "--shapes", "tiny_odd", "--batches", "1,5", "--max-candidates", "2",
            "--table", str(table_path), "--out", str(tmp_path)]
    result = main(argv)
    rows = result["rows"]
    assert {(r["kernel"], r["variant"]) for r in rows} == {
        ("bf16", "F.linear"), ("w8a16", "heur"), ("w4a16", "heur"), ("w8a16", "cand"), ("w4a16", "cand")}
    failed = [(r["kernel"], r["variant"], r["config"], r.get("error", r.get("rel_err"))) for r in rows
              if "error" in r or not r["ok"]]
    assert not failed
    table = json.loads(table_path.read_text())
    n, k, group = 40, 448, 64
    for m in (1, 5):
        mine = [r for r in rows if r["kernel"] == "w4a16" and r["m"] == m]
        best = min(mine, key=lambda r: r["us"])
        tabled = lookup("w4a16", result["device"], n, k, m, group, table=table)
        assert tabled == best["config"]
        check_config(W4Config(**tabled), group)
        assert lookup("w8a16", result["device"], n, k, m, table=table) is not None
    # Merging the same sweep again replaces its entries rather than adding to them.
    merge_table(result, str(table_path))
    again = json.loads(table_path.read_text())[result["device"]]["w4a16"]
    assert len(again) == 2
    assert json.loads((tmp_path / "quant_gemv_sweep.json").read_text())["device"] == result["device"]
