"""`dustin serve`: the OpenAI-compatible HTTP server on one `EngineCore` (continuous batching).

    dustin serve --device cuda --method dustin --max-slots 16 --port 8000
    torchrun --nproc-per-node 2 -m dustin serve --device cuda --method dustin --port 8000   # tensor parallel

Under torchrun, rank 0 checks the port, loads its shard and serves HTTP; every other rank loads its shard and
follows rank 0's engine steps (`EngineCore.follow`) until rank 0's server stops and sends the stop plan; then all
ranks leave the process group together (dustin/cli/main.py) and exit 0.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import threading

from dustin.defaults import DEFAULT_METHOD
from dustin.engine.config import METHODS, ExecutionOptions, GenerationConfig, method_output, methods_help
from dustin.errors import DustinError, InputError
from dustin.flags import (
    add_draft_kernel_arg,
    add_model_args,
    add_sparse_args,
    add_speculation_args,
    budget_settings,
    check_sparse_config,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    g = p.add_argument_group("decoding")
    g.add_argument("--method", default=DEFAULT_METHOD, choices=list(METHODS),
                   help=methods_help(DEFAULT_METHOD) + ". Every request is decoded with it; quest, snapkv, specattn, "
                        "oracle and the oracle-* ladder keep whole-batch state: their requests are admitted in gangs "
                        "that nothing joins until all finish")
    add_draft_kernel_arg(add_speculation_args(p, auto=True))
    add_sparse_args(p)
    s = p.add_argument_group("scheduling")
    s.add_argument("--max-slots", type=int, default=None,
                   help="KV-cache slots = requests decoded together (default 16 on a GPU, 8 on a CPU)")
    s.add_argument("--max-context", type=int, default=None,
                   help="positions per slot: prompt + max_tokens must fit (default the models' context; "
                        "at most 8192 on a CPU)")
    s.add_argument("--prefill-chunk", type=int, default=512,
                   help="prompts are prefilled in chunks of this many tokens, cut at the same offsets whatever "
                        "else runs")
    s.add_argument("--prefill-tokens", type=int, default=None,
                   help="prompt tokens per prefill step (one forward of that size; default 8192 on a GPU, "
                        "512 on a CPU)")
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


def _launch(method: str) -> tuple[int, int]:
    """(rank, world) of this launch, from torchrun's environment before anything loads ((0, 1) without torchrun).
    Under torchrun rank 0 serves HTTP and every other rank follows its engine steps (tensor parallelism); a method
    without a tensor-parallel form, or a half-set environment, is one InputError line before any load."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1
    missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        verb = "is" if len(missing) == 1 else "are"
        raise InputError(f"WORLD_SIZE is {world} but {', '.join(missing)} {verb} not set: launch tensor-parallel "
                         f"serving with torchrun --nproc-per-node N -m dustin serve ...")
    from dustin.parallel.tp_selection import TP_POLICIES

    if METHODS[method].policy not in TP_POLICIES:
        tp = [m for m in METHODS if METHODS[m].policy in TP_POLICIES]
        raise InputError(f"--method {method} has no tensor-parallel form; under torchrun serve one of {', '.join(tp)}")
    return int(os.environ["RANK"]), world


def build_engine(args):
    from dustin.engine.core import EngineCore

    # every setting is checked here, before the model load
    cfg = GenerationConfig(method=args.method, gamma=args.gamma, draft_window=args.draft_window,
                           **budget_settings(args), sparse_config=args.config, max_slots=args.max_slots,
                           max_context=args.max_context, prefill_chunk=args.prefill_chunk,
                           prefill_tokens=args.prefill_tokens, max_waiting=args.max_waiting,
                           options=ExecutionOptions(draft_kernel=args.draft_kernel))
    return EngineCore.from_pretrained(args.target, args.draft, device=args.device, dtype=args.dtype,
                                     attention=args.attention, config=cfg,
                                     rope_scaling=args.rope_scaling)


def run(args) -> int:
    rank, world = _launch(args.method)
    if rank == 0:
        _check_port(args.host, args.port)
    if args.config is not None and args.config != "builtin":
        check_sparse_config(args.config, [args.budget_max if args.budget == "auto" else args.budget]
                            if args.budget is not None else [])
    engine = build_engine(args)  # under torchrun: joins the process group and loads this rank's shard
    if rank > 0:
        return _follow(engine)
    return _serve(args, engine, world)


def _follow(engine) -> int:
    """A rank > 0: execute rank 0's step plans until its stop plan. Ctrl-C and SIGTERM are ignored meanwhile:
    torchrun passes a signal it gets to every rank, and rank 0 alone decides when the ranks stop (it sends the stop
    plan once its server shut down); a follower that ended at once would leave rank 0's last broadcasts and the
    final barrier without a peer. (torchrun kills a rank that ignores its signal for 30 s, e.g. after rank 0
    died.)"""
    with _signals({signal.SIGINT: signal.SIG_IGN, signal.SIGTERM: signal.SIG_IGN}):
        engine.executor.follow()
    return 0


def _serve(args, engine, world: int) -> int:
    import uvicorn

    from dustin.serve.app import create_app
    from dustin.serve.async_engine import AsyncEngineCore

    name = args.served_model_name or engine.model_name
    async_engine = AsyncEngineCore(engine)
    app = create_app(async_engine, name)
    print(start_line(args.host, args.port, name, args.method, engine.max_context, getattr(engine, "max_slots", "?"),
                     world), flush=True)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    try:
        # SIGTERM (also what torchrun sends every rank when it is stopped) shuts down like Ctrl-C: uvicorn handles
        # both gracefully and then raises the signal again, which this handler turns into KeyboardInterrupt
        with _signals({signal.SIGTERM: _interrupt}):
            server.run()
    except KeyboardInterrupt:  # Ctrl-C: uvicorn shut down gracefully, then re-raised the signal
        pass
    except SystemExit:  # uvicorn exits when it cannot bind (it logs why): one line of ours instead
        if server.started:
            raise
        raise InputError(f"could not start the HTTP server on {args.host}:{args.port}") from None
    finally:
        # under tensor parallelism the engine thread stops the followers as it ends: wait for that (one step at most)
        async_engine.shutdown(timeout=None if world > 1 else 30.0)
    if not engine.executor.stop_followers():  # idempotent: True once the engine thread stopped them
        raise DustinError("the tensor-parallel ranks could not be stopped cleanly (an engine step failed after its "
                          "plan was sent); they end at the process group's timeout")
    return 0


def start_line(host: str, port: int, name: str, method: str, context: int, slots, world: int = 1) -> str:
    """The one line `dustin serve` prints once it serves: where, what, and whether its output is the target's."""
    host = f"[{host}]" if ":" in host else host
    tp = f", tensor parallel over {world} ranks" if world > 1 else ""
    return (f"dustin serve: http://{host}:{port} (model {name}, method {method}, {context} context x {slots} slots"
            f"{tp}); {method_output(method)}")


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def _signals(handlers: dict):
    """Install signal handlers for the block (main thread only: elsewhere Python cannot), then restore."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {sig: signal.signal(sig, h) for sig, h in handlers.items()}
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)
