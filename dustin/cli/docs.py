"""The generated parts of the documentation, each between `<!-- NAME:start -->` and `<!-- NAME:end -->` markers of
its page (BLOCKS), and docs/cli.md whole:
- docs/cli.md and docs/serving.md's flag table (`serve-flags`), from the command line's parsers;
- README.md's results table (`results-table`) with its plot (docs/results/readme_results.png), from the result
  files under docs/results/;
- docs/choosing.md's table of methods (`methods`), from the engine's table of methods;
- docs/coming_from_vllm.md's memory table (`memory`), from the models' shapes and the engine's KV-cache sizes;
- docs/accuracy.md's table of the RULER runs behind README's RULER headline (`ruler-runs`), from their result files.

    python3 -m dustin.cli.docs            # rewrite them all and the plot
    python3 -m dustin.cli.docs --check    # exit 1, naming the file, when a text is not what this writes

tests/cli/test_docs.py runs the check on each. Each results row names the JSON it is read from; a figure measured
again is a new JSON, one path changed here and the command rerun.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dustin.cli.main import build_parser
from dustin.defaults import GAMMA
from dustin.engine.config import FULL_METHODS, METHODS
from dustin.engine.kv_manager import cache_capacity
from dustin.eval.stats import paired_difference_interval
from dustin.models.args import named_config
from dustin.parallel.tp_selection import TP_POLICIES
from dustin.selection.config import DUSTIN_POLICIES, DUSTIN_TAIL_ROWS
from dustin.selection.registry import policy_class

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"
CLI_MD = ROOT / "docs" / "cli.md"
README = ROOT / "README.md"
SERVING_MD = ROOT / "docs" / "serving.md"
CHOOSING_MD = ROOT / "docs" / "choosing.md"
VLLM_MD = ROOT / "docs" / "coming_from_vllm.md"
ACCURACY_MD = ROOT / "docs" / "accuracy.md"
PLOT = RESULTS / "readme_results.png"
START, END = "<!-- results-table:start -->", "<!-- results-table:end -->"  # README's results table


# ---------------------------------------------------------------------------------------------------- CLI reference
def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The parser's subcommands by name ({} for a command without any): how this page and the tests walk the
    command line (argparse keeps them in a private list)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The parser's own flags (not its subcommands'), each option string (`-h` and `--help` both) to its action:
    what the tests check the flags and their defaults on (argparse keeps them in a private list)."""
    return {name: action for action in parser._actions for name in action.option_strings}


def _help_lines(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Each subcommand's one-line help, as `dustin <group> --help` lists it."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return {a.dest: a.help or "" for a in action._choices_actions}
    return {}


def _flag(action: argparse.Action) -> str:
    if not action.option_strings:
        choices = f" {{{','.join(str(c) for c in action.choices)}}}" if action.choices is not None else ""
        return f"`{action.metavar or action.dest}`{choices}"
    names = ", ".join(f"`{s}`" for s in action.option_strings)
    if action.nargs == 0:
        return names
    if action.choices is not None:
        return f"{names} {{{','.join(str(c) for c in action.choices)}}}"
    metavar = action.metavar or action.dest.upper()
    return f"{names} {metavar}"


def _default(action: argparse.Action) -> str:
    if action.nargs == 0 or action.required or not action.option_strings:
        return "required" if action.required or not action.option_strings else ""
    if action.default is None or action.default == argparse.SUPPRESS:
        return ""
    return f"`{action.default}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _command_section(path: list[str], parser: argparse.ArgumentParser, help_line: str) -> list[str]:
    out = [f"## `{' '.join(path)}`", ""]
    if help_line:
        out += [_cell(help_line[0].upper() + help_line[1:]) + ".", ""]
    groups = [g for g in parser._action_groups if any(a.help != argparse.SUPPRESS and
                                                      not isinstance(a, (argparse._HelpAction,
                                                                         argparse._SubParsersAction))
                                                      for a in g._group_actions)]
    for group in groups:
        title = {"options": "options", "positional arguments": "arguments"}.get(group.title, group.title)
        out += [f"*{title}*", "", "| flag | default | what it does |", "|---|---|---|"]
        for a in group._group_actions:
            if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)) or a.help == argparse.SUPPRESS:
                continue
            out.append(f"| {_flag(a)} | {_default(a)} | {_cell(a.help or '')} |")
        out.append("")
    return out


def cli_markdown() -> str:
    """docs/cli.md: every command and subcommand with its flags, defaults and help, read from the parsers."""
    root = build_parser()  # without argv: every subcommand gets its flags
    lines = ["# Command-line reference", "",
             "Generated from the command line's own parsers by `python3 -m dustin.cli.docs` (tests/cli/test_docs.py "
             "fails when this page differs from what it writes). `dustin <command> --help` prints the same flags. "
             "Errors caused by input print one line, `dustin: error: ...`, and exit non-zero.", ""]
    index: list[str] = []
    body: list[str] = []

    def walk(path: list[str], parser: argparse.ArgumentParser, help_line: str) -> None:
        subs = subparsers(parser)
        if subs:
            helps = _help_lines(parser)
            for name, sub in subs.items():
                walk(path + [name], sub, helps.get(name, ""))
            return
        anchor = "-".join(path).replace(" ", "-")
        index.append(f"- [`{' '.join(path)}`](#{anchor}): {_cell(help_line)}")
        body.extend(_command_section(path, parser, help_line))

    walk(["dustin"], root, "")
    return "\n".join(lines + index + [""] + body).rstrip() + "\n"


def serve_flags_markdown() -> str:
    """docs/serving.md's flag table: `dustin serve`'s flags by group, as docs/cli.md lists them."""
    serve = subparsers(build_parser())["serve"]
    return "\n".join(_command_section(["dustin", "serve"], serve, "")[2:]).rstrip()


# ------------------------------------------------------------------------------------------------ the methods
# what each method verifies against and what it is for; a method of the engine's table without a line here fails
# tests/cli/test_docs.py, so a new method is documented where users choose
METHOD_NOTES = {
    "vanilla": ("the whole cache, one token per target forward (no draft)", "the reference"),
    "classic": ("the whole cache; the draft attends its whole cache", "the target's output, faster"),
    "magicdec": ("the whole cache; the draft attends 4 sinks + its most recent positions (MagicDec)",
                 "the target's output, faster at long context"),
    "dustin": ("k positions per sequence: 4 sinks, 16 recent, the rest by the draft's lookahead and the target's "
               "recent attention on a few profiled heads", "the default: the most tokens/s at 16k-128k"),
    "dustin-t": ("k positions by the target's recent attention only", "an ablation of dustin"),
    "dustin-d": ("k positions by the draft's lookahead only", "an ablation of dustin"),
    "streaming": ("4 sinks + the most recent k - 4 positions (StreamingLLM)", "a baseline"),
    "quest": ("k positions per KV head by page statistics (Quest)", "a baseline"),
    "specattn": ("k positions from the draft's attention (SpecAttn)", "a baseline"),
    "snapkv": ("per layer and KV head, chosen once at prefill (SnapKV)", "a baseline"),
    "oracle": ("the top of the true attention of the verify window (a dense forward each step)", "analysis only"),
}


def method_note(method: str) -> tuple[str, str]:
    if method in METHOD_NOTES:
        return METHOD_NOTES[method]
    if method in DUSTIN_TAIL_ROWS:  # dustin's own tail at a fixed share (selection/stratified.py)
        return (f"dustin's set plus a stratified sample of the rest per layer and KV head, reweighted: "
                f"{DUSTIN_TAIL_ROWS[method]:.0%} of k sampled", f"a sweep row: `--method dustin --tail-share "
                f"{DUSTIN_TAIL_ROWS[method]:g}`")
    if "-tail" in method:  # the sampled-tail rows beside the ladder (selection/tail.py)
        src = "the oracle ladder's per-layer set" if method.startswith("oracle-layer-") else "dustin's set"
        weight = "not reweighted (w = 1, a control)" if method.endswith("-w1") else "reweighted"
        return (f"{src} plus a uniform sample of the rest of the context, {weight} (a sampled tail)", "analysis only")
    if method.startswith("oracle-"):  # the oracle ladder's rungs
        return ("the oracle's set per layer, per KV head or per query head (the oracle ladder)", "analysis only")
    raise KeyError(f"{method}: no line in dustin/cli/docs.py METHOD_NOTES")


def methods_markdown() -> str:
    """docs/choosing.md's table: every method, lossless or lossy, what it verifies against, what it is for, whether
    `dustin serve` mixes its requests into a running batch and whether it runs under tensor parallelism."""
    out = ["| `--method` | output | verifies against | for | `dustin serve` | tensor parallel |",
           "|---|---|---|---|---|---|"]
    for m, spec in METHODS.items():
        where, use = method_note(m)
        output = "**lossless**: the target's own" if m in FULL_METHODS else "**lossy**: the sparse-verified target's"
        # a policy whose state spans the batch is served in gangs (admitted together once every slot is free)
        batch = "continuous batching" if policy_class(spec.policy).row_local else "gangs"
        tp = "yes" if spec.policy in TP_POLICIES else "no"
        budget = ", `--budget auto`" if spec.policy in DUSTIN_POLICIES else ""
        out.append(f"| `{m}` | {output} | {where} | {use}{budget} | {batch} | {tp} |")
    return "\n".join(out)


# ------------------------------------------------------------------------------------------------- memory
# (label, target shape, draft shape, tensor-parallel ranks) of docs/coming_from_vllm.md's memory table
MEMORY_PAIRS = [("the default pair (Qwen2.5-Coder-1.5B + 0.5B)", "qwen2.5-1.5b", "qwen2.5-0.5b", 1),
                ("Llama-3.1-8B + Llama-3.2-1B", "llama-3.1-8b", "llama-3.2-1b", 1),
                ("Qwen2.5-7B + Qwen2.5-0.5B", "qwen2.5-7b", "qwen2.5-0.5b", 1),
                ("Llama-3.3-70B + Llama-3.2-1B", "llama-3.3-70b", "llama-3.2-1b", 2),
                ("Llama-3.3-70B + Llama-3.2-1B", "llama-3.3-70b", "llama-3.2-1b", 4),
                ("Qwen2.5-72B + Qwen2.5-0.5B", "qwen2.5-72b", "qwen2.5-0.5b", 2),
                ("Qwen2.5-72B + Qwen2.5-0.5B", "qwen2.5-72b", "qwen2.5-0.5b", 4)]
MEMORY_CONTEXTS = (8192, 32768, 131072)
MEMORY_CARDS = (("80 GB", 80e9), ("141 GB", 141e9))
MEMORY_SHARE = 0.9  # weights + KV caches within this share of a card; the rest for activations and graph pools


def memory_rows() -> list[dict]:
    """Per pair and GPU count: bf16 weights per GPU (under tensor parallelism the target's embeddings, LM head and
    norms are replicated and the rest sharded, the draft replicated: docs/tensor_parallel.md), KV bytes per position
    per GPU (the target's KV heads split over the ranks, the draft's whole) and, per card and context, the slots whose
    caches (context + 3Γ + 4 positions each, as `dustin serve` allocates them) fit beside the weights in MEMORY_SHARE
    of the card; `yarn`: the context is past the pair's own (Qwen2.5: 128k with --rope-scaling yarn:4)."""
    rows = []
    for label, t, d, tp in MEMORY_PAIRS:
        ta, da = named_config(t), named_config(d)
        replicated = ta.vocab_size * ta.dim * (1 if ta.tie_word_embeddings else 2) + (2 * ta.n_layers + 1) * ta.dim
        weights = 2 * ((ta.num_params() - replicated) / tp + replicated + da.num_params())
        per_pos = ta.kv_bytes_per_token(2) // tp + da.kv_bytes_per_token(2)
        native = min(ta.max_position_embeddings, da.max_position_embeddings)
        fits = {}
        for card, size in MEMORY_CARDS:
            for ctx in MEMORY_CONTEXTS:
                per_slot = per_pos * cache_capacity([0], [ctx], GAMMA)
                fits[card, ctx] = (max(0, int((MEMORY_SHARE * size - weights) // per_slot)), ctx > native)
        rows.append({"pair": label, "target": t, "draft": d, "gpus": tp, "weights": weights, "per_position": per_pos,
                     "fits": fits})
    return rows


def memory_markdown() -> str:
    head = "| pair | GPUs | bf16 weights per GPU | KV cache per position per GPU | " + " | ".join(
        f"slots at {c // 1024}k, {card}" for card, _ in MEMORY_CARDS for c in MEMORY_CONTEXTS) + " |"
    out = [head, "|---" * (4 + len(MEMORY_CARDS) * len(MEMORY_CONTEXTS)) + "|"]
    for r in memory_rows():
        cells = []
        for card, _ in MEMORY_CARDS:
            for c in MEMORY_CONTEXTS:
                n, yarn = r["fits"][card, c]
                cells.append(f"{n}{' (YaRN)' if yarn else ''}")
        out.append(f"| {r['pair']} | {r['gpus']} | {r['weights'] / 1e9:.1f} GB | {r['per_position'] / 1024:,.0f} KiB | "
                   + " | ".join(cells) + " |")
    return "\n".join(out)


# ------------------------------------------------------------------------------------------------- results table
def _load(rel: str) -> dict | list:
    return json.loads((RESULTS / rel).read_text(encoding="utf-8"))


def _e2e(rel: str, **match) -> dict[str, dict]:
    """method -> row of a `dustin bench e2e` result file, for the rows matching `match`."""
    rows = [r for r in _load(rel)["results"] if all(r.get(k) == v for k, v in match.items())]
    return {r["method"]: r for r in rows}


def _avg(rel: str, method: str, budget) -> dict:
    """The average-over-tasks row of a `dustin eval tasks` summary."""
    for r in _load(rel):
        if r["task"] == "avg" and r["method"] == method and r["budget"] == budget:
            return r
    raise KeyError(f"{rel}: no avg row for {method}@{budget}")


def _scores(rel: str, method: str, budget) -> dict[str, dict[int, float]]:
    """task -> sample index -> score of one row of a `dustin eval tasks` result file."""
    out: dict[str, dict[int, float]] = {}
    for r in _load(rel)["rows"]:
        if r["method"] == method and r["budget"] == budget:
            out.setdefault(r["task"], {})[r["index"]] = float(r["score"])
    return out


def _paired_delta(rel_a: str, rel_b: str, row_a: tuple, row_b: tuple,
                  samples: set | None = None) -> tuple[float, tuple[float, float]]:
    """Paired difference (a - b) of two rows' average over tasks, on the same prompts (those of `samples`, (task,
    index) pairs, when given), with its 95% interval (dustin.eval.stats, seed 0, as `dustin eval tasks` computes
    it)."""
    a, b = _scores(rel_a, *row_a), _scores(rel_b, *row_b)
    pairs = []
    for task in sorted(a):
        idx = sorted(i for i in a[task] if samples is None or (task, i) in samples)
        pairs.append(([a[task][i] for i in idx], [b[task][i] for i in idx]))
    delta = sum(sum(x - y for x, y in zip(pa, pb, strict=True)) / len(pa) for pa, pb in pairs) / len(pairs)
    return delta, paired_difference_interval(pairs)


# Every RULER run of the shipped config at k = 512 on the real pair (one H200, bf16, seed 0, Γ = 4), per context:
# (date, what the run was for, dustin's result file, the file of the vanilla row it is paired with). The first of a
# context is its headline (the largest run with both rows in it); the others give the run-to-run spread, each
# run's Δ taken on the prompts every run of the context answered (RULER's generators with seed 0 give the same
# first 20 samples a task whatever --samples is).
RULER_RUNS = {
    "16k": [("2026-12-04", "the oracle ladder", "ladder/ruler_16k_ladder.json", "ladder/ruler_16k_ladder.json"),
            ("2026-12-02", "the 5-layer config's check; vanilla from the 2026-12-01 run",
             "accuracy/h200_ruler20_16k_5layer.json", "accuracy/h200_ruler20_16k.json"),
            ("2026-12-05", "the anchor-layer selection's run (not kept)", "anchor_h200/h200_ruler_16k_anchor.json",
             "anchor_h200/h200_ruler_16k_anchor.json")],
    "32k": [("2026-12-04", "the oracle ladder", "ladder/ruler_32k_ladder.json", "ladder/ruler_32k_ladder.json"),
            ("2026-12-02", "the 5-layer config's check; vanilla from the 2026-12-01 run",
             "accuracy/h200_ruler20_32k_5layer.json", "accuracy/h200_ruler20_32k.json")],
    "64k (YaRN ×4)": [("2026-12-03", "the 64k run", "accuracy/h200_ruler20_64k.json",
                       "accuracy/h200_ruler20_64k.json")],
}


def ruler_runs(context: str) -> list[dict]:
    """Each run of RULER_RUNS[context]: its date and purpose, files, its own prompts and Δ (dustin − vanilla) with
    the interval, and Δ on the prompts all runs of the context share (and how many those are)."""
    runs = RULER_RUNS[context]
    shared = None
    for *_, d, v in runs:
        keys = {(t, i) for t, xs in _scores(d, "dustin", 512).items() for i in xs}
        keys &= {(t, i) for t, xs in _scores(v, "vanilla", None).items() for i in xs}
        shared = keys if shared is None else shared & keys
    out = []
    for date, what, d, v in runs:
        if d == v:  # both rows in one run: its own summary's Δ and interval, as `dustin eval tasks` wrote them
            row = _avg(d.replace(".json", ".summary.json"), "dustin", 512)
            own, ci = row["delta"], tuple(row["delta_ci95"])
        else:
            own, ci = _paired_delta(d, v, ("dustin", 512), ("vanilla", None))
        out.append({"date": date, "what": what, "files": sorted({d, v}), "prompts": len(shared),
                    "own_prompts": sum(map(len, _scores(d, "dustin", 512).values())), "own_delta": own,
                    "own_ci": ci, "delta": _paired_delta(d, v, ("dustin", 512), ("vanilla", None), shared)[0]})
    return out


def ruler_runs_markdown() -> str:
    """docs/accuracy.md's table of every RULER run of the shipped config at k = 512."""
    out = ["| context | run | result files (docs/results/) | its prompts: Δ [95% CI] | Δ on the prompts all runs of "
           "the context share |", "|---|---|---|---|---|"]
    for ctx in RULER_RUNS:
        for i, r in enumerate(ruler_runs(ctx)):
            head = " (the headline)" if i == 0 else ""
            files = ", ".join(f"`{f}`" for f in r["files"])
            out.append(f"| {ctx} | {r['date']}, {r['what']}{head} | {files} | {r['own_prompts']}: "
                       f"{_pts(r['own_delta'])} {_ci(r['own_ci'])} | {r['prompts']}: {_pts(r['delta'])} |")
    return "\n".join(out)


def _pts(x: float) -> str:
    return f"{x * 100:+.1f}".replace("-", "−")


def _ci(lo_hi) -> str:
    lo, hi = lo_hi
    return f"[{_pts(lo)}, {_pts(hi)}]"


def _n(x: float, digits: int = 0) -> str:
    return f"{x:,.{digits}f}"


H200 = "1 H200, bf16"


def results() -> list[dict]:
    """The current figure of each kind: what, result, when and where, the command, the result file. The shipped
    tuned config (S_draft on 5 draft layers) unless a row says otherwise."""
    rows = []
    real = "headline_h200/h200_bench_e2e_real_16k_32k.json"
    for ctx in (32768, 16384):
        m = _e2e(real, context=ctx, batch=16)
        v, d = m["vanilla"], m["dustin"]
        rows.append(dict(
            what=f"decoding throughput, the real pair, 16 × {ctx // 1024}k code prompts, greedy",
            result=f"dustin k = 512: **{_n(d['tokens_per_s'])} tokens/s, {d['speedup_vs_vanilla']:.2f}×** vanilla "
                   f"(τ {d['tau']:.2f}, {d['ms_per_step']:.2f} ms/step); vanilla {_n(v['tokens_per_s'])} tokens/s "
                   f"at {v['pct_of_byte_roofline']:.1f}% of its byte roofline",
            when=_load(real)["date"], where=H200, source=real, cmd=1,
            plot=("real pair 16 × " + f"{ctx // 1024}k", d["speedup_vs_vanilla"])))
    long = "headline_h200/h200_bench_e2e_real_64k.json"
    m = _e2e(long, context=65536, batch=8)
    v, d = m["vanilla"], m["dustin"]
    rows.append(dict(
        what="decoding throughput, the real pair, 8 × 64k code prompts, YaRN ×4",
        result=f"dustin k = 512: **{_n(d['tokens_per_s'])} tokens/s, {d['speedup_vs_vanilla']:.2f}×** vanilla "
               f"(τ {d['tau']:.2f}); vanilla at {v['pct_of_byte_roofline']:.1f}% of its byte roofline",
        when=_load(long)["date"], where=H200, source=long, cmd=2, plot=("real pair 8 × 64k", d["speedup_vs_vanilla"])))
    llama = "headline_h200/h200_bench_e2e_llama8b.json"
    m = _e2e(llama, context=32768, batch=16)
    v, d = m["vanilla"], m["dustin"]
    rows.append(dict(
        what="decoding throughput, Llama-3.1-8B + Llama-3.2-1B shapes (random weights), 16 × 32k, "
             f"acceptance-controlled τ {d['tau']:.2f}",
        result=f"dustin **{d['speedup_vs_vanilla']:.2f}×** vanilla ({_n(d['tokens_per_s'])} against "
               f"{_n(v['tokens_per_s'])} tokens/s; vanilla at {v['pct_of_byte_roofline']:.0f}% of its byte roofline)",
        when=_load(llama)["date"], where=H200, source=llama, cmd=3,
        plot=("Llama-8B shapes 16 × 32k", d["speedup_vs_vanilla"])))
    tp = "bench_e2e.json"
    parts, plot = [], []
    for target, name in (("qwen2.5-72b", "Qwen2.5-72B"), ("llama-3.3-70b", "Llama-3.3-70B")):
        m = _e2e(tp, target=target, context=32768, batch=8)
        parts.append(f"{name} **{m['dustin']['speedup_vs_vanilla']:.2f}×** (MagicDec "
                     f"{m['magicdec']['speedup_vs_vanilla']:.2f}×)")
        plot.append((f"{name} shapes, 2 GPUs, 8 × 32k",
                     m["dustin"]["speedup_vs_vanilla"]))
    rows.append(dict(
        what="decoding throughput, 70B-class shapes (random weights), tensor parallel over 2 GPUs, 8 × 32k, "
             "acceptance-controlled τ ≈ 2.2",
        result="dustin over vanilla: " + "; ".join(parts),
        when=_load(tp)["date"], where="2 H200, bf16", source=tp, cmd=4, plot=plot))
    att = "headline_h200/h200_bench_attention_32b.json"
    a = _load(att)["rows"][0]
    rows.append(dict(
        what="verify self-attention, Qwen2.5-32B layer shape, 16 × 32k, k = 512",
        result=f"dustin **{a['speedup_dustin']:.1f}×** full attention with estimation "
               f"({a['speedup_dustin_sparse_only']:.1f}× sparse attention alone); estimation "
               f"{a['dustin_est_layer_pct_of_full']:.2f}% of full",
        when="2026-12-03", where=H200, source=att, cmd=5))
    acc, spreads, files = [], [], []
    for ctx, runs in RULER_RUNS.items():  # each context's headline run: both rows in one run, its own summary
        summary = runs[0][2].replace(".json", ".summary.json")
        v, d = _avg(summary, "vanilla", None), _avg(summary, "dustin", 512)
        acc.append((ctx, v["score"], d["score"], d["delta"], d["delta_ci95"]))
        spread = ruler_runs(ctx)
        files += [summary] + [f for r in spread for f in r["files"] if f not in files]
        deltas = [r["delta"] for r in spread]
        spreads.append(f"{ctx}: " + (f"{len(deltas)} runs, Δ {_pts(min(deltas))} to {_pts(max(deltas))} on the "
                                     f"{spread[0]['prompts']} prompts they share" if len(deltas) > 1
                                     else "one run, its spread not measured"))
    rows.append(dict(
        what="RULER, 13 tasks, the real pair, dustin k = 512 (lossy) against vanilla: 50 samples a task at 16k, 20 at "
             "32k and 64k; Δ: paired difference to vanilla with its 95% interval; run-to-run spread: the other runs "
             "of the shipped config ([accuracy](docs/accuracy.md#run-to-run-spread-of-the-ruler-headline))",
        result="; ".join(f"{c}: vanilla {vs * 100:.1f}, dustin {ds * 100:.1f} (**Δ {_pts(dl)}** {_ci(ci)})"
                         for c, vs, ds, dl, ci in acc) + ". Spread: " + "; ".join(spreads),
        when="2026-12-03 to 04", where=H200, source=files, cmd=6,
        plot_acc=[(c.split(" ")[0], vs, ds) for c, vs, ds, *_ in acc]))
    parts = []
    for ctx in ("16k", "32k"):
        rel = f"accuracy/h200_ruler20_{ctx}_uncapped.summary.json"
        d = _avg(rel, "dustin", "auto:0.99")
        parts.append(f"{ctx}: Δ {_pts(d['delta'])} {_ci(d['delta_ci95'])}, mean k {_n(d['mean_k'])}")
    rows.append(dict(
        what="RULER as above, `--budget auto --budget-p 0.99` without a cap on k (the 11-layer config of "
             "2026-12-01)",
        result="; ".join(parts), when="2026-12-01", where=H200,
        source=[f"accuracy/h200_ruler20_{c}_uncapped.summary.json" for c in ("16k", "32k")], cmd=7))
    arr = "accuracy/arr_kl_cpu_2k.json"
    rows.append(dict(
        what="ARR against output KL (paper appendix B), the real target, 2k tokens, k = 256, 24 subsets",
        result=f"Pearson **{_load(arr)['pearson']:.3f}** (paper: −0.81 for Qwen2.5-7B)".replace("*-", "*−"),
        when="2026-11-30", where="2-core CPU, fp32", source=arr, cmd=8))
    return rows


COMMANDS = """\
```bash
# 1
dustin bench e2e --real --prompts code --contexts 32768,16384 --batches 16 --methods vanilla,dustin \\
    --warmup 4 --steps 40
# 2
dustin bench e2e --real --rope-scaling yarn:4 --prompts code --contexts 65536 --batches 8 --methods vanilla,dustin \\
    --warmup 4 --steps 40
# 3
dustin bench e2e --pairs llama-3.1-8b:llama-3.2-1b --contexts 32768 --batches 16 --methods vanilla,dustin
# 4 (and --pairs llama-3.3-70b:llama-3.2-1b)
NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 -m dustin bench e2e --pairs qwen2.5-72b:qwen2.5-0.5b \\
    --contexts 8192,16384,32768 --batches 8,16 --steps 8 --warmup 2
# 5
dustin bench attention --models qwen2.5-32b --contexts 32768 --batches 16
# 6 (vanilla and dustin@512 in one run per context; 16k as here, with the oracle rows of docs/accuracy.md beside
#    them in the same run; 32k: --samples 20 --contexts 32768 --batch-size 33; 64k: --samples 20
#    --rope-scaling yarn:4 --contexts 65536 --batch-size 20)
dustin eval tasks --device cuda --gamma 4 --seed 0 --tasks ruler --samples 50 --contexts 16384 --batch-size 65 \\
    --rows vanilla,dustin@512 --json-out ruler_16k.json
# 7 (and --contexts 32768 --batch-size 33 --budget-max 32768)
dustin eval tasks --device cuda --tasks ruler --samples 20 --contexts 16384 --batch-size 65 \\
    --rows vanilla,dustin@auto:0.99 --budget-max 16384 --json-out ruler_16k_uncapped.json
# 8
dustin eval arr-kl --context 2048 --budget 256 --subsets 24 --new-tokens 8 --dtype fp32
```"""


def results_table() -> str:
    """README's block between the markers: the table, where each figure comes from, and the commands."""
    rows = results()
    out = ["| what | result | measured | command |", "|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['what']} | {r['result']} | {r['when']}, {r['where']} | {r['cmd']} |")
    sources = {r["cmd"]: r["source"] if isinstance(r["source"], list) else [r["source"]] for r in rows}
    out += ["", "The result files, under `docs/results/`, by command: "
            + "; ".join(f"{c}: " + ", ".join(f"`{f}`" for f in fs) for c, fs in sources.items()) + ".", "",
            COMMANDS]
    return "\n".join(out)


def write_plot(path: Path = PLOT) -> None:
    """Two panels: dustin's decoding throughput over vanilla per setting, and RULER scores of vanilla and dustin."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results()
    speed: list[tuple[str, float]] = []
    acc: list[tuple[str, float, float]] = []
    for r in rows:
        p = r.get("plot")
        if p:
            speed.extend(p if isinstance(p, list) else [p])
        acc.extend(r.get("plot_acc", []))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [1.6, 1]})
    labels = [s[0] for s in speed]
    ax1.barh(range(len(speed)), [s[1] for s in speed], color="#3a6ea5")
    ax1.set_yticks(range(len(speed)), labels, fontsize=8)
    ax1.invert_yaxis()
    ax1.axvline(1.0, color="grey", lw=0.8, ls="--")
    for i, (_, x) in enumerate(speed):
        ax1.text(x + 0.03, i, f"{x:.2f}×", va="center", fontsize=8)
    ax1.set_xlabel("dustin tokens/s over vanilla (H200, bf16)")
    ax1.set_xlim(0, max(s[1] for s in speed) * 1.18)
    x = range(len(acc))
    ax2.bar([i - 0.2 for i in x], [a[1] * 100 for a in acc], 0.4, label="vanilla", color="#999999")
    ax2.bar([i + 0.2 for i in x], [a[2] * 100 for a in acc], 0.4, label="dustin k = 512", color="#3a6ea5")
    ax2.set_xticks(list(x), [a[0] for a in acc])
    ax2.set_ylabel("RULER average, 13 tasks")
    ax2.set_xlabel("context (real pair)")
    ax2.set_ylim(0, 100)
    ax2.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


def with_block(text: str, name: str, block: str, where: str = "the page") -> str:
    """`text` with what stands between its `<!-- NAME:start -->` and `<!-- NAME:end -->` markers replaced."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    if text.count(start) != 1 or text.count(end) != 1:
        raise SystemExit(f"{where} needs one {start} and one {end} marker")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n{block}\n{end}{tail}"


def readme_with_table(text: str, table: str) -> str:
    return with_block(text, "results-table", table, "README.md")


# (page, block name, what writes the block)
BLOCKS = [(README, "results-table", results_table), (SERVING_MD, "serve-flags", serve_flags_markdown),
          (CHOOSING_MD, "methods", methods_markdown), (VLLM_MD, "memory", memory_markdown),
          (ACCURACY_MD, "ruler-runs", ruler_runs_markdown)]


def generated() -> dict[Path, str]:
    """Every page with a generated part, as this module writes it."""
    pages = {CLI_MD: cli_markdown()}
    for path, name, make in BLOCKS:
        text = pages.get(path, path.read_text(encoding="utf-8"))
        pages[path] = with_block(text, name, make(), str(path.relative_to(ROOT)))
    return pages


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m dustin.cli.docs", description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 when a generated text differs from what is written")
    args = p.parse_args(argv)
    pages = generated()
    if args.check:
        stale = [str(f.relative_to(ROOT)) for f, text in pages.items()
                 if not f.is_file() or f.read_text(encoding="utf-8") != text]
        for name in stale:
            print(f"{name} is not what `python3 -m dustin.cli.docs` writes: run it", file=sys.stderr)
        return 1 if stale else 0
    for path, text in pages.items():
        path.write_text(text, encoding="utf-8")
    write_plot()
    return 0


if __name__ == "__main__":
    sys.exit(main())
