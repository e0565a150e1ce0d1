"""The generated parts of the documentation: docs/cli.md from the command line's parsers, and README.md's results
table (between `<!-- results-table:start -->` and `<!-- results-table:end -->`) with its plot
(docs/results/readme_results.png) from the result files under docs/results/.

    python3 -m dustin.cli.docs            # rewrite docs/cli.md, README's table and the plot
    python3 -m dustin.cli.docs --check    # exit 1, naming the file, when either text is not what this writes

tests/cli/test_docs.py runs the check on both texts. Each results row names the JSON it is read from; a figure
measured again is a new JSON, one path changed here and the command rerun.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"
CLI_MD = ROOT / "docs" / "cli.md"
README = ROOT / "README.md"
PLOT = RESULTS / "readme_results.png"
START, END = "<!-- results-table:start -->", "<!-- results-table:end -->"


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
    from dustin.cli.main import build_parser

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


def _paired_delta(rel_a: str, rel_b: str, row_a: tuple, row_b: tuple) -> tuple[float, tuple[float, float]]:
    """Paired difference (a - b) of two rows' average over tasks, on the same prompts, with its 95% interval
    (dustin.eval.stats, seed 0, as `dustin eval tasks` computes it)."""
    from dustin.eval.stats import paired_difference_interval

    def scores(rel: str, method: str, budget) -> dict[str, dict[int, float]]:
        out: dict[str, dict[int, float]] = {}
        for r in _load(rel)["rows"]:
            if r["method"] == method and r["budget"] == budget:
                out.setdefault(r["task"], {})[r["index"]] = float(r["score"])
        return out

    a, b = scores(rel_a, *row_a), scores(rel_b, *row_b)
    pairs = []
    for task in sorted(a):
        idx = sorted(a[task])
        pairs.append(([a[task][i] for i in idx], [b[task][i] for i in idx]))
    delta = sum(sum(x - y for x, y in zip(pa, pb, strict=True)) / len(pa) for pa, pb in pairs) / len(pairs)
    return delta, paired_difference_interval(pairs)


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
    dec = "bench_decode.json"
    r = next(x for x in _load(dec)["results"] if x["model"] == "llama-3.1-8b" and x["batch"] == 16
             and x["context"] == 32768)
    rows.append(dict(
        what="vanilla decode step, Llama-3.1-8B shape, 16 × 32k",
        result=f"{r['decode_ms']:.2f} ms: {r['decode_TBps']:.2f} TB/s read, "
               f"**{r['decode_fraction_of_limit'] * 100:.0f}%** of the {_load(dec)['copy_bandwidth_Bps'] / 1e12:.2f} "
               "TB/s copy bandwidth",
        when="2026-11-30", where=H200, source=dec, cmd=6))
    lad = "ladder/ruler_16k_ladder.summary.json"  # 50 samples a task, one run with both rows
    v, d = _avg(lad, "vanilla", None), _avg(lad, "dustin", 512)
    acc = [("16k", v["score"], d["score"], d["delta"], d["delta_ci95"], [lad])]
    for ctx in ("32k",):
        van, five = f"accuracy/h200_ruler20_{ctx}.json", f"accuracy/h200_ruler20_{ctx}_5layer.json"
        v = _avg(f"accuracy/h200_ruler20_{ctx}.summary.json", "vanilla", None)
        d = _avg(f"accuracy/h200_ruler20_{ctx}_5layer.summary.json", "dustin", 512)
        delta, ci = _paired_delta(five, van, ("dustin", 512), ("vanilla", None))
        acc.append((ctx, v["score"], d["score"], delta, ci, [van, five]))
    r64 = "accuracy/h200_ruler20_64k.summary.json"
    v, d = _avg(r64, "vanilla", None), _avg(r64, "dustin", 512)
    acc.append(("64k (YaRN ×4)", v["score"], d["score"], d["delta"], d["delta_ci95"], [r64]))
    rows.append(dict(
        what="RULER, 13 tasks, 50 samples a task at 16k and 20 a task at 32k and 64k, the real pair, dustin k = 512; "
             "Δ: paired difference to vanilla, 95% interval",
        result="; ".join(f"{c}: vanilla {vs * 100:.1f}, dustin {ds * 100:.1f} (Δ {_pts(dl)} {_ci(ci)})"
                         for c, vs, ds, dl, ci, _ in acc),
        when="2026-12-01 to 04", where=H200, source=[f for *_, fs in acc for f in fs], cmd=7,
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
        source=[f"accuracy/h200_ruler20_{c}_uncapped.summary.json" for c in ("16k", "32k")], cmd=8))
    arr = "accuracy/arr_kl_cpu_2k.json"
    rows.append(dict(
        what="ARR against output KL (paper appendix B), the real target, 2k tokens, k = 256, 24 subsets",
        result=f"Pearson **{_load(arr)['pearson']:.3f}** (paper: −0.81 for Qwen2.5-7B)".replace("*-", "*−"),
        when="2026-11-30", where="2-core CPU, fp32", source=arr, cmd=9))
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
# 6
dustin bench decode --models llama-3.1-8b,qwen2.5-7b
# 7 (vanilla and dustin@512 in one run per context: 16k as here (the 16k figures come from this run with the
#    oracle rows of docs/accuracy.md beside them); 32k: --samples 20 --contexts 32768 --batch-size 33, vanilla from
#    h200_ruler20_32k.json and dustin from h200_ruler20_32k_5layer.json, paired by prompt; 64k: --samples 20
#    --rope-scaling yarn:4 --contexts 65536 --batch-size 20)
dustin eval tasks --device cuda --gamma 4 --seed 0 --tasks ruler --samples 50 --contexts 16384 --batch-size 65 \\
    --rows vanilla,dustin@512 --json-out ruler_16k.json
# 8 (and --contexts 32768 --batch-size 33 --budget-max 32768)
dustin eval tasks --device cuda --tasks ruler --samples 20 --contexts 16384 --batch-size 65 \\
    --rows vanilla,dustin@auto:0.99 --budget-max 16384 --json-out ruler_16k_uncapped.json
# 9
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
    ax2.set_ylabel("RULER average (13 tasks × 20 samples)")
    ax2.set_xlabel("context (real pair)")
    ax2.set_ylim(0, 100)
    ax2.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


def readme_with_table(text: str, table: str) -> str:
    if START not in text or END not in text:
        raise SystemExit(f"README.md lacks the {START} / {END} markers")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{table}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m dustin.cli.docs", description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 when docs/cli.md or README's table differ")
    args = p.parse_args(argv)
    cli = cli_markdown()
    readme = readme_with_table(README.read_text(encoding="utf-8"), results_table())
    if args.check:
        stale = [str(f.relative_to(ROOT)) for f, text in ((CLI_MD, cli), (README, readme))
                 if not f.is_file() or f.read_text(encoding="utf-8") != text]
        for name in stale:
            print(f"{name} is not what `python3 -m dustin.cli.docs` writes: run it", file=sys.stderr)
        return 1 if stale else 0
    CLI_MD.write_text(cli, encoding="utf-8")
    README.write_text(readme, encoding="utf-8")
    write_plot()
    return 0


if __name__ == "__main__":
    sys.exit(main())
