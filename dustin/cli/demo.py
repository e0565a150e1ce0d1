"""`dustin demo`: the project's main job on the default pair, on any machine.

A long real input: the beginning of a Python standard-library source file (present on every machine), cut
just after a method signature, as a code-completion prompt of a few thousand tokens. Each method decodes it
greedily; the table shows τ, speed and whether the output equals vanilla's token for token.
"""
from __future__ import annotations

from dustin.engine.config import GenerationConfig
from dustin.engine.engine import Engine
from dustin.engine.offline.prefill import PrefillCache
from dustin.engine.request import SamplingParams
from dustin.errors import InputError
from dustin.eval.inputs import common_prefix, long_code_prompt
from dustin.flags import budget_settings
from dustin.parallel.tp import is_main_process

DEMO_METHODS = ("vanilla", "classic", "magicdec", "dustin")


def run_demo(args) -> int:
    from rich.console import Console
    from rich.table import Table

    engine = Engine.from_pretrained(args.target, args.draft, device=args.device, dtype=args.dtype,
                                    attention=args.attention,
                                    rope_scaling=args.rope_scaling)
    console = Console(quiet=not is_main_process())  # under torchrun only rank 0 reports
    if engine.pair.tokenizer is None:
        raise InputError("the demo needs a target folder with a tokenizer")
    prompt, name = long_code_prompt(engine.pair.tokenizer, args.context_tokens, args.source)
    ids = engine.pair.encode(prompt)
    console.print(f"[bold]Prompt[/bold]: the first {len(ids)} tokens of {name}, ending with:")
    console.print(prompt[-300:], style="dim", markup=False, highlight=False)
    results = {}
    shared = PrefillCache()
    # classic first: its prefill (target + draft) is then reused by the other methods, so the long prompt is
    # prefilled once; each method's decode is timed on its own.
    params = SamplingParams.from_flags(args, temperature=0)  # greedy: the methods compare token for token
    for method in ("classic", "vanilla", "magicdec", "dustin"):
        cfg = GenerationConfig(method=method, gamma=args.gamma, draft_window=args.draft_window,
                               **budget_settings(args, method == "dustin"),
                               sparse_config=args.config if method == "dustin" else None)
        with console.status(f"decoding with {method}..."):
            results[method] = engine.generate([ids], cfg, params, prefill_cache=shared)
    results = {m: results[m] for m in DEMO_METHODS}
    reference = results["vanilla"].sequences[0].token_ids
    console.print("\n[bold]Continuation[/bold] (vanilla greedy):")
    console.print(results["vanilla"].sequences[0].text, markup=False, highlight=False)
    table = Table(title=f"{len(ids)}-token prompt, {args.max_new_tokens} new tokens, Γ={args.gamma}, "
                        f"{args.device}, {str(engine.pair.target.embed_tokens.weight.dtype).replace('torch.', '')}")
    console.print(f"prefill (target + draft, once): {results['classic'].prefill_s:.1f}s")
    for col in ("method", "steps", "τ", "tokens/s", "decode s", "same as vanilla"):  # dustin: sparse verify, k
        table.add_column(col, justify="right")
    for method, r in results.items():
        out = r.sequences[0].token_ids
        same = "yes" if out == reference else f"no: the first {common_prefix(out, reference)} of {len(reference)} agree"
        name = method if r.sparse_config is None else f"{method} (k = {r.sparse_config['budget']})"
        table.add_row(name, str(r.steps), f"{r.tau:.2f}", f"{r.tokens_per_s:.2f}", f"{r.decode_s:.1f}", same)
    console.print(table)
    sc = results["dustin"].sparse_config
    console.print(
        "steps: target forwards; τ: tokens produced per target forward (1 for vanilla; speculative methods verify "
        "Γ draft tokens per step); same as vanilla: greedy tokens identical to plain decoding (classic and "
        "magicdec verify with the full cache, so they must match; dustin verifies with k cached positions and "
        f"may differ). dustin's score heads: {sc['source']} (m = {sc['draft_topm']} of k from the draft).",
        style="dim", highlight=False)
    return 0
