"""`dustin serve`: the OpenAI-compatible HTTP server on one `LLMEngine` (continuous batching).

    dustin serve --device cuda --method dustin --max-slots 16 --port 8000
"""
from __future__ import annotations

import argparse
import os
import socket

from dustin.cli.args import add_model_args, add_sparse_args, add_speculation_args
from dustin.errors import InputError


def add_arguments(p: argparse.ArgumentParser) -> None:
    from dustin.engine.config import METHODS

    add_model_args(p)
    g = p.add_argument_group("decoding")
    g.add_argument("--method", default="dustin", choices=list(METHODS),
                   help="decoding method of every request (default dustin; the offline-only baselines quest, "
                        "snapkv, specattn and oracle are refused)")
    add_speculation_args(p)
    add_sparse_args(p)
    s = p.add_argument_group("scheduling")
    s.add_argument("--max-slots", type=int, default=None,
                   help="KV-cache slots = requests decoded together (default 16 on a GPU, 8 on a CPU)")
    s.add_argument("--max-context", type=int, default=None,
                   help="positions per slot: prompt + max_tokens must fit (default the models' context; "
                        "at most 8192 on a CPU)")
    s.add_argument("--prefill-chunk", type=int, default=2048, help="prompt tokens prefilled per step at most")
    s.add_argument("--max-waiting", type=int, default=256,
                   help="requests that may wait for a slot; more are answered 429")
    h = p.add_argument_group("http")
    h.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    h.add_argument("--port", type=int, default=8000)
    h.add_argument("--served-model-name", default=None,
                   help="the model name clients send and /v1/models lists (default: the target folder's name)")


def _check_port(host: str, port: int) -> None:
    """Bind once before the (slow) model load, so a busy port or a bad address is one line at once."""
    if not 0 < port < 65536:
        raise InputError(f"--port must be in 1..65535, got {port}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise InputError(f"--host {host!r}: {e.strerror or e}") from None
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError as e:
            raise InputError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def _check_not_distributed() -> None:
    """Tensor parallelism: rank 0 would serve and every other rank would have to replay rank 0's engine steps
    (same admissions, same batch) in lockstep for the collectives to match. LLMEngine has no such follower mode
    yet, so a torchrun launch is refused before anything loads."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise InputError("dustin serve under torchrun is not supported yet (tensor parallelism needs every rank "
                         "to follow rank 0's engine steps); run it as a single process")


def build_engine(args):
    from dustin.engine.llm_engine import LLMEngine, ServeConfig

    cfg = ServeConfig(method=args.method, gamma=args.gamma, draft_window=args.draft_window, budget=args.budget,
                      sparse_config=args.config,
                      max_slots=args.max_slots, max_context=args.max_context, prefill_chunk=args.prefill_chunk,
                      max_waiting=args.max_waiting)
    cfg.generation(1)  # Γ and the budget are checked there: fail before the model load
    return LLMEngine.from_pretrained(args.target, args.draft, device=args.device, dtype=args.dtype,
                                     attention=args.attention, config=cfg)


def run(args) -> int:
    import uvicorn

    from dustin.serve.app import create_app
    from dustin.serve.async_engine import AsyncLLMEngine

    _check_not_distributed()
    _check_port(args.host, args.port)
    if args.config is not None and args.config != "builtin":
        from dustin.cli.args import check_sparse_config
        check_sparse_config(args.config, [args.budget] if args.budget is not None else [])
    engine = build_engine(args)
    name = args.served_model_name or engine.model_name
    async_engine = AsyncLLMEngine(engine)
    app = create_app(async_engine, name)
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"dustin serve: http://{host}:{args.port} (model {name}, method {args.method}, "
          f"{engine.max_context} context x {getattr(engine, 'max_slots', '?')} slots)", flush=True)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    try:
        server.run()
    except KeyboardInterrupt:  # Ctrl-C: uvicorn shut down gracefully, then re-raised the signal
        pass
    except SystemExit:  # uvicorn exits when it cannot bind (it logs why): one line of ours instead
        if server.started:
            raise
        raise InputError(f"could not start the HTTP server on {args.host}:{args.port}") from None
    finally:
        async_engine.shutdown()
    return 0
