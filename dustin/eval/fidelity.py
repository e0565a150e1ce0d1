"""`dustin eval fidelity`: how much sparse verification changes decoding, on real long inputs.

For each budget k: τ of every sparse method against full verification with the same draft cache, how often the
greedy output equals classic's token for token, and the ARR of each policy's sets (and the oracle's) along the
full-verification trajectory. Long inputs: Python standard-library modules (present on every machine), cut to
`context` tokens, as code-completion prompts. The prompts are prefilled once and reused by every run.
"""
from __future__ import annotations

import json
import statistics
import time

from dustin.engine.config import DUSTIN_METHODS, GenerationConfig
from dustin.errors import InputError
from dustin.eval.inputs import common_prefix, long_code_prompt
from dustin.flags import add_model_args, add_sparse_args, add_speculation_args, int_list

DEFAULT_SOURCES = ("argparse.py", "inspect.py", "tarfile.py", "typing.py", "pydoc.py")
SPARSE_METHODS = (*DUSTIN_METHODS, "streaming")  # the default --methods


def add_arguments(p) -> None:
    add_model_args(p)
    p.add_argument("--sources", default=",".join(DEFAULT_SOURCES), help="stdlib modules (or file paths)")
    p.add_argument("--context", type=int, default=4096, help="prompt tokens per input")
    p.add_argument("--methods", default=",".join(SPARSE_METHODS))
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--draft-kv", choices=["full", "streaming"], default="streaming")
    add_speculation_args(p)
    add_sparse_args(p, sweep="512,256,128", auto=False)
    p.add_argument("--no-arr", action="store_true", help="skip the ARR measurement")
    p.add_argument("--with-vanilla", action="store_true",
                   help="also decode with vanilla and check classic / magicdec against it token for token")
    p.add_argument("--json-out", default=None)


def run(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from dustin.engine.engine import Engine

    budgets = int_list("--budgets", args.budgets, 21)  # one error line before the models load
    engine = Engine.from_pretrained(args.target, args.draft, device=args.device, dtype=args.dtype,
                                    attention=args.attention,
                                    rope_scaling=args.rope_scaling)
    from dustin.parallel.tp import is_main_process, tp_rank_world
    main = is_main_process()  # under torchrun only rank 0 reports
    if tp_rank_world()[1] > 1 and not args.no_arr:
        raise InputError("the ARR measurement reads every target head, which a tensor-parallel rank does not hold: "
                         "add --no-arr under torchrun")
    console = Console(stderr=True, quiet=not main)
    pair = engine.pair
    prompts = [pair.encode(long_code_prompt(pair.tokenizer, args.context, s)[0]) for s in args.sources.split(",")]
    base = dict(gamma=args.gamma, max_new_tokens=args.max_new_tokens, draft_kv=args.draft_kv,
                draft_window=args.draft_window, sparse_config=args.config)
    results: dict = {"prompt_tokens": [len(p) for p in prompts], "settings": vars(args).copy(), "runs": {}}
    results["settings"].pop("func", None)

    from dustin.engine.offline.prefill import PrefillCache

    shared = PrefillCache()  # every run below is over the same prompts: one prefill

    def generate(method: str, **kw):
        t0 = time.perf_counter()
        with console.status(f"{method} {kw or ''}..."):
            r = engine.generate(prompts, GenerationConfig(method=method, **{**base, **kw}),
                                prefill_cache=shared)
        console.print(f"{method} {kw or ''}: tau {r.tau:.3f}, {time.perf_counter() - t0:.0f}s")
        return r

    classic = generate("classic", draft_kv="full")
    ref = [s.token_ids for s in classic.sequences]
    full_same_draft = generate("classic") if args.draft_kv != "full" else classic
    results["runs"]["classic"] = {"tau": classic.tau}
    results["runs"][f"full-verify ({args.draft_kv} draft)"] = {"tau": full_same_draft.tau}
    van = None
    if args.with_vanilla:  # the lossless methods must reproduce the target's own greedy output
        van = [s.token_ids for s in generate("vanilla").sequences]
        for name, r in (("classic", classic), (f"full-verify ({args.draft_kv} draft)", full_same_draft)):
            outs = [s.token_ids for s in r.sequences]
            pairs = list(zip(outs, van, strict=True))
            results["runs"][name].update({
                "same_as_vanilla": sum(o == v for o, v in pairs) / len(van),
                "first_divergence_from_vanilla": [None if o == v else common_prefix(o, v) for o, v in pairs]})
    for k in budgets:
        for method in args.methods.split(","):
            r = generate(method, budget=k)
            outs = [s.token_ids for s in r.sequences]
            results["runs"][f"{method}@{k}"] = {
                "method": method, "budget": k, "tau": r.tau,
                "tau_vs_full_verify": r.tau / full_same_draft.tau,
                "same_as_classic": sum(o == c for o, c in zip(outs, ref, strict=False)) / len(ref),
                "mean_common_prefix": sum(common_prefix(o, c) for o, c in zip(outs, ref, strict=False)) / len(ref)}
            if van is not None:  # where the greedy text first leaves the target's (its length if never)
                first = [common_prefix(o, v) for o, v in zip(outs, van, strict=True)]
                results["runs"][f"{method}@{k}"].update({"first_divergence_from_vanilla": first,
                                                         "median_first_divergence": statistics.median(first)})
        if not args.no_arr:
            cfg = GenerationConfig(method="classic", **{**base, "budget": k})
            policies = {m: engine.pair.make_policy(GenerationConfig(method=m, **{**base, "budget": k}))
                        for m in args.methods.split(",")}
            from dustin.eval.arr import ARRProbe

            probe = ARRProbe(policies, k)
            with console.status(f"ARR at k={k}..."):
                engine.generate(prompts, cfg, policy=probe, prefill_cache=shared)
            results.setdefault("arr", {})[str(k)] = probe.mean_arr()
    _print(results, Table, Console(quiet=not main))
    if args.json_out and main:
        with open(args.json_out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


def _print(results, Table, console) -> None:
    t = Table(title=f"Fidelity: {len(results['prompt_tokens'])} inputs of {min(results['prompt_tokens'])}-"
                    f"{max(results['prompt_tokens'])} tokens")
    for col in ("run", "τ", "τ / full verify", "same output as classic", "mean common prefix",
                "median first divergence from vanilla"):
        t.add_column(col, justify="right")
    for name, r in results["runs"].items():
        t.add_row(name, f"{r['tau']:.3f}", f"{r.get('tau_vs_full_verify', 1.0):.3f}",
                  f"{100 * r['same_as_classic']:.0f}%" if "same_as_classic" in r else "-",
                  f"{r['mean_common_prefix']:.1f}" if "mean_common_prefix" in r else "-",
                  f"{r['median_first_divergence']:g}" if "median_first_divergence" in r else "-")
    console.print(t)
    if "arr" in results:
        a = Table(title="Attention recovery rate (w = 4, all target heads and layers)")
        names = list(next(iter(results["arr"].values())))
        a.add_column("k")
        for n in names:
            a.add_column(n, justify="right")
        for k, row in results["arr"].items():
            a.add_row(k, *["per-layer" if row[n] is None else f"{row[n]:.4f}" for n in names])
        console.print(a)
