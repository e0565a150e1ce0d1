"""`dustin bench attention --smoke`: the whole breakdown on tiny shapes through the Triton interpreter."""
from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede any triton kernel definition

from dustin.bench import attention as bench


def _args(*argv):
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    return p.parse_args(list(argv))


def test_smoke_run_writes_table_json_and_plot(tmp_path, capsys):
    json_out, plot_out = tmp_path / "b.json", tmp_path / "b.png"
    assert bench.run(_args("--smoke", "--json-out", str(json_out), "--plot-out", str(plot_out))) == 0
    res = json.loads(json_out.read_text())
    assert res["smoke"] and res["checks"]["ok"] and len(res["rows"]) == 2 and not res["skipped"]
    for r in res["rows"]:
        for key in ("full_us", "dustin_sparse_us", "s_target_us", "s_draft_us", "select_us",
                    "dustin_est_step_us", "dustin_est_layer_us", "quest_score_us", "quest_est_us", "quest_sparse_us",
                    "naive_est_layer_us", "speedup_dustin", "speedup_quest", "full_frac_copy_bw"):
            assert r[key] > 0, key
        # the amortization the engine does: one estimation per step, shared by the 4 tiny target layers
        assert abs(r["dustin_est_layer_us"] * 4 - r["dustin_est_step_us"]) < 1e-6 * r["dustin_est_step_us"]
        assert r["naive_est_step_us"] > 4 * r["naive_target_layer_us"] > 0
    assert plot_out.stat().st_size > 10_000
    out = capsys.readouterr().out
    assert "| tiny | 160 | 2 |" in out and "goals:" in out
    # the plot can be redrawn from the JSON alone (e.g. on a machine without the GPU)
    again = tmp_path / "again.png"
    assert bench.run(_args("--plot-from", str(json_out), "--plot-out", str(again))) == 0 and again.exists()
