"""`--budget auto` (dustin/selection/adaptive.py): k per row from the estimated attention mass, the ragged
selection against the reference selection at each row's own k and m, and the histogram of the k used."""
from __future__ import annotations

import pytest
import torch

from dustin.errors import InputError
from dustin.kernels.selection import rows_contain, select_dustin_reference
from dustin.selection.adaptive import BudgetHistogram, adaptive_budgets, select_ragged
from dustin.selection.config import AutoBudget
from tests.offline import offline


def test_k_follows_the_mass_by_hand():
    """Row 0: all of S_target's mass on 3 positions (0.5, 0.3, 0.2) -> n = 3 -> k = 4 + 16 + 3 = 23 (k_min 22);
    row 1: mass spread evenly over 200 pickable positions -> n = ceil(0.9 * 200) = 180 -> k = 200;
    row 2: nothing estimated (zeros) -> k_max."""
    S = 300
    st = torch.zeros(3, S)
    st[0, [50, 60, 70]] = torch.tensor([5.0, 3.0, 2.0])
    st[1, 4:204] = 1.0
    rule = AutoBudget(p=0.9, k_min=22, k_max=256)
    k, m, _ = adaptive_budgets(st, None, torch.tensor([250, 220, 250]), rule, sinks=4, window=16, m_share=0.25)
    assert k.tolist() == [23, 200, 256]
    assert m.tolist() == [round(3 * 0.25), round(180 * 0.25), round(236 * 0.25)]
    # 0.5 of row 0's mass sits on position 50 alone: n = 1
    k, _, _ = adaptive_budgets(st, None, torch.tensor([250, 220, 250]), AutoBudget(0.5, 21, 256), sinks=4, window=16,
                            m_share=0.0)
    assert k[0] == 21


def test_hybrid_mass_averages_the_two_sources():
    S = 200
    st, sd = torch.zeros(1, S), torch.zeros(1, S)
    st[0, 30] = 1.0  # target: one position
    sd[0, 40:120] = 1.0  # draft: 80 positions
    rule = AutoBudget(p=0.9, k_min=21, k_max=180)
    k, _, _ = adaptive_budgets(st, sd, torch.tensor([190]), rule, sinks=4, window=16, m_share=0.5)
    # combined mass: 0.5 on position 30, 0.5/80 each on 40..119; 0.9 needs 1 + ceil(0.4 / (0.5 / 80)) = 65
    assert k.item() == 4 + 16 + 65


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ragged_selection_equals_the_reference_per_row(seed):
    g = torch.Generator().manual_seed(seed)
    B, S = 5, 400
    st, sd = torch.rand(B, S, generator=g), torch.rand(B, S, generator=g)
    lengths = torch.tensor([400, 37, 250, 120, 399])
    k = torch.tensor([60, 60, 130, 21, 200])
    m = torch.tensor([10, 5, 0, 1, 80])
    idx, counts = select_ragged(st, sd, lengths, k, m, k_max=256, m_max=100, sinks=4, window=16)
    assert idx.shape == (B, 256)
    for b in range(B):
        want_i, want_c = select_dustin_reference(st[b:b + 1], sd[b:b + 1], lengths[b:b + 1], k=int(k[b]),
                                                 m=int(m[b]), sinks=4, window=16)
        assert counts[b] == want_c[0]
        assert idx[b, :counts[b]].tolist() == want_i[0, :want_c[0]].tolist()
        assert torch.all(idx[b, counts[b]:] == 0)


def test_rows_contain_is_membership():
    """The scatter/gather membership test against comparing every query with every member: repeated members,
    members dropped by `keep`, positions 0 and size - 1, rows with nothing kept."""
    g = torch.Generator().manual_seed(3)
    B, size = 4, 53
    members = torch.randint(0, size, (B, 31), generator=g)
    members[0, :3] = torch.tensor([0, size - 1, 0])
    keep = torch.rand(B, 31, generator=g) < 0.6
    keep[2] = False
    queries = torch.randint(0, size, (B, 70), generator=g)
    queries[0, :2] = torch.tensor([0, size - 1])
    taken = torch.where(keep, members, torch.full_like(members, -1))
    want = (queries[:, :, None] == taken[:, None, :]).any(-1)
    assert torch.equal(rows_contain(members, queries, size, keep=keep), want)
    assert torch.equal(rows_contain(members, queries, size), (queries[:, :, None] == members[:, None, :]).any(-1))
    assert not rows_contain(members, queries, size, keep=keep)[2].any()


def test_uncapped_auto_selection_equals_the_reference():
    """`--budget auto` without a cap: k_max at the context, m_max in the thousands, rows of every kind (k near the
    length, k far below it, a row shorter than k_max)."""
    g = torch.Generator().manual_seed(5)
    B, S = 4, 3001
    st, sd = torch.rand(B, S, generator=g), torch.rand(B, S, generator=g)
    lengths = torch.tensor([3001, 2900, 1700, 3000])
    k = torch.tensor([2200, 300, 1699, 2990])
    m = torch.tensor([1500, 100, 1100, 2050])
    idx, counts = select_ragged(st, sd, lengths, k, m, k_max=S, m_max=2100, sinks=4, window=16)
    for b in range(B):
        want_i, want_c = select_dustin_reference(st[b:b + 1], sd[b:b + 1], lengths[b:b + 1], k=int(k[b]),
                                                 m=int(m[b]), sinks=4, window=16)
        assert counts[b] == want_c[0] and idx[b, :counts[b]].tolist() == want_i[0, :want_c[0]].tolist()


def test_histogram_summary():
    h = BudgetHistogram(100, "cpu")
    h.add(torch.tensor([10, 20, 30, 40]), torch.tensor([True, True, True, False]))
    h.add(torch.tensor([10, 10, 90, 40]), torch.tensor([True, True, True, True]))
    s = h.summary()  # k used: 10, 20, 30, 10, 10, 90, 40 (the inactive row of step 1 not counted)
    assert s["samples"] == 7 and s["mean"] == round(210 / 7, 1) and s["p50"] == 20 and s["p99"] == 90
    assert BudgetHistogram(8, "cpu").summary() is None


def test_bad_rules():
    with pytest.raises(InputError, match="budget-p"):
        AutoBudget(p=0.0)
    with pytest.raises(InputError, match="budget-min"):
        AutoBudget(k_min=600, k_max=512)


@pytest.fixture(scope="module")
def engine(tiny_pair):
    from dustin.engine.engine import Engine

    return Engine.from_pretrained(str(tiny_pair[0]), str(tiny_pair[1]), dtype="fp32")


def _prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 96, (n,), generator=g).tolist() for n in (150, 90, 233)]


def test_auto_with_room_for_everything_is_full_verification(engine):
    """k_min above every context: each row keeps all its positions, so greedy tokens equal classic's; the k
    reported are the rows' own lengths."""

    auto, auto_params = offline(method="dustin", gamma=3, max_new_tokens=12, stop_at_eos=False, draft_window=32,
                            budget="auto", budget_min=1024, budget_max=1024)
    full, full_params = offline(method="classic", gamma=3, max_new_tokens=12, stop_at_eos=False, draft_window=32)
    got, want = engine.generate(_prompts(), auto, auto_params), engine.generate(_prompts(), full, full_params)
    assert [s.token_ids for s in got.sequences] == [s.token_ids for s in want.sequences]
    k = got.budget_k
    assert k["samples"] >= 3 * 3  # every row, at least 3 steps each
    assert 90 <= k["p50"] <= 233 + 12 and k["p99"] <= 233 + 12  # short rows: their own length


def test_auto_k_grows_with_the_mass_to_cover(engine):

    means = []
    for p in (0.3, 0.99):
        cfg, params = offline(method="dustin", gamma=3, max_new_tokens=10, stop_at_eos=False, draft_window=32,
                               budget="auto", budget_p=p, budget_min=21, budget_max=64)
        r = engine.generate(_prompts(), cfg, params)
        assert 21 <= r.budget_k["p50"] <= 64 and r.budget_k["samples"] > 0
        means.append(r.budget_k["mean"])
    assert means[0] < means[1]


def test_auto_needs_a_dustin_method_and_valid_flags(tiny_pair, capsys):
    from dustin.cli.main import main
    from dustin.engine.config import GenerationConfig

    with pytest.raises(InputError, match="budget auto"):
        GenerationConfig(method="quest", budget="auto")
    with pytest.raises(InputError, match="budget"):
        GenerationConfig(method="dustin", budget="many")
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--target", str(tiny_pair[0]), "--draft", str(tiny_pair[1]), "--budget", "lots",
              "--prompt", "x"])
    assert exit_.value.code == 2 and "--budget" in capsys.readouterr().err


def test_generate_json_and_server_metrics_report_the_k_used(tiny_pair, capsys, tmp_path):
    import json

    import httpx

    from dustin.cli.main import main
    from dustin.engine.config import GenerationConfig
    from dustin.engine.core import EngineCore
    from dustin.engine.request import SamplingParams
    from dustin.serve.local import LocalServer

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in _prompts()))
    code = main(["generate", "--target", str(tiny_pair[0]), "--draft", str(tiny_pair[1]), "--method", "dustin",
                 "--budget", "auto", "--budget-min", "21", "--budget-max", "64", "--draft-window", "32",
                 "--prompts-jsonl", str(prompts), "--max-new-tokens", "6", "--json"])
    assert code == 0
    k = json.loads(capsys.readouterr().out)["budget_k"]
    assert set(k) == {"mean", "p50", "p90", "p99", "samples", "dense"} and 21 <= k["p50"] <= 64
    assert k["dense"] == 0.0  # without --budget-dense
    cfg = GenerationConfig(method="dustin", gamma=3, budget="auto", budget_min=21, budget_max=64, draft_window=32,
                           max_slots=2, max_context=512)
    llm = EngineCore.from_pretrained(str(tiny_pair[0]), str(tiny_pair[1]), dtype="fp32", config=cfg)
    llm.BUDGET_REFRESH_S = 0.0
    llm.generate(_prompts(), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert 21 <= llm.stats()["budget_k"]["p50"] <= 64
    with LocalServer(llm, "tiny") as srv:
        text = httpx.get(srv.url + "/metrics").text
    assert "dustin_budget_k_mean " in text and "dustin_budget_k_p99 " in text
    assert "dustin_budget_dense_share 0.0" in text


def test_rows_too_spread_for_k_max_verify_densely():
    """--budget-dense: a row whose k_max best positions hold less than p of its estimated mass is marked dense (row
    1: 200 equal positions, k_max 120 holds 100 / 200); a concentrated row and an unestimated one are not; without
    the option there are no dense rows."""
    S = 300
    st = torch.zeros(3, S)
    st[0, [50, 60, 70]] = torch.tensor([5.0, 3.0, 2.0])
    st[1, 4:204] = 1.0
    L = torch.tensor([250, 220, 250])
    _, _, dense = adaptive_budgets(st, None, L, AutoBudget(0.9, 22, 120, dense=True), sinks=4, window=16,
                                   m_share=0.0)
    assert dense.tolist() == [False, True, False]
    assert adaptive_budgets(st, None, L, AutoBudget(0.9, 22, 120), sinks=4, window=16, m_share=0.0)[2] is None


def test_histogram_counts_dense_steps_apart():
    h = BudgetHistogram(64, "cpu")
    h.add(torch.tensor([30, 40, 50]), torch.tensor([True, True, False]), torch.tensor([False, True, True]))
    s = h.summary()
    assert s["samples"] == 1 and s["mean"] == 30 and s["dense"] == 0.5


def test_dense_rows_give_full_verification_tokens(tiny_pair):
    """--budget auto --budget-dense with p = 1: every row whose k_max best positions miss any estimated mass verifies
    against the whole cache, so with prompts past k_max the greedy tokens are full verification's (classic), which
    plain auto at that k_max does not give; --budget-dense without --budget auto is one error."""
    from dustin.engine.config import GenerationConfig
    from dustin.engine.engine import Engine

    engine = Engine.from_pretrained(str(tiny_pair[0]), str(tiny_pair[1]))
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, 90, (n,), generator=g).tolist() for n in (150, 220, 180)]
    kw = dict(max_new_tokens=16, stop_at_eos=False, draft_window=32)
    full = [s.token_ids for s in engine.generate(prompts, *offline(method="classic", **kw)).sequences]
    auto = dict(method="dustin", budget="auto", budget_p=1.0, budget_min=21, budget_max=40, **kw)
    dense = engine.generate(prompts, *offline(budget_dense=True, **auto))
    assert [s.token_ids for s in dense.sequences] == full
    assert dense.budget_k["dense"] == 1.0
    sparse = engine.generate(prompts, *offline(**auto))
    assert [s.token_ids for s in sparse.sequences] != full
    with pytest.raises(InputError, match="--budget-dense goes with --budget auto"):
        GenerationConfig(method="dustin", budget=64, budget_dense=True)
