"""The model pair: a target and its optional draft, loaded and checked once, and what every part of the engine asks
of them (tokenizer, EOS ids, the verification policy of a method, KV-memory fit, the context).

    pair = ModelPair.from_pretrained("default", "default", device="cuda")
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import torch

from dustin.attention.backend import AttentionBackend
from dustin.engine.config import GenerationConfig
from dustin.engine.kv_manager import MemoryFit, positions_needed
from dustin.errors import InputError, TokenizerMismatchError
from dustin.models.args import pair_context
from dustin.models.fetch import resolve_model_path
from dustin.models.loader import load_model, read_args
from dustin.models.transformer import Transformer
from dustin.parallel.tp import TensorParallel, current_parallel, init_distributed, is_main_process, rank_device
from dustin.runtime import auto_dtype, resolve_device
from dustin.selection.base import SelectionPolicy
from dustin.selection.config import BUILTIN, SparseConfig, default_config
from dustin.selection.registry import make_policy as build_policy
from dustin.selection.tuned import load_tuned, match_tuned, model_identity, note_identity_match


def parse_device(name: str) -> torch.device:
    """--device: auto (cuda when a CUDA GPU is available, else cpu), or cpu or cuda[:N] that exists here, else one
    InputError line (torch raises RuntimeError)."""
    try:
        dev = torch.device(resolve_device(name))
    except (RuntimeError, TypeError, ValueError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise InputError(f"--device must be auto, cpu or cuda[:N], got {name!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda was requested but no CUDA GPU is available")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise InputError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    return dev


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    if name in (None, "auto"):
        return auto_dtype(device)
    table = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32,
             "fp16": torch.float16, "float16": torch.float16}
    if name not in table:
        raise InputError(f"--dtype must be one of {', '.join(table)}, got {name!r}")
    return table[name]


def _load_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    if not any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    return AutoTokenizer.from_pretrained(str(folder))


class ModelPair:
    """A target model and its optional draft, checked to share one vocabulary: loading, the tokenizer, EOS ids, the
    verification policy of a method (`make_policy`), KV-memory fit and the context a sequence may take."""

    def __init__(self, target: Transformer, draft: Transformer | None = None, tokenizer=None,
                 draft_tokenizer=None, parallel: "TensorParallel | None" = None) -> None:
        """parallel: the TensorParallel that sharded `target` (under torchrun), else None."""
        self.target, self.draft, self.tokenizer = target, draft, tokenizer
        self.parallel = parallel
        # the target's unsharded shape: sparse configs and the tuned-config fingerprint name global heads
        self.target_args = parallel.full_args if parallel is not None and parallel.full_args else target.args
        self.device = target.embed_tokens.weight.device
        if draft is not None:
            _check_same_vocabulary(target, draft, tokenizer, draft_tokenizer)
        sizes = [target.args.vocab_size] + ([draft.args.vocab_size] if draft is not None else [])
        if tokenizer is not None:
            sizes.append(len(tokenizer))
        self.vocab_limit = min(sizes)  # rows past the tokenizer are padding: never sample them
        eos = set(target.args.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_ids = eos
        self._identities = None  # (target, draft) model identities, computed on first use

    @classmethod
    def from_pretrained(cls, target: str | Path, draft: str | Path | None = None, *, device: str = "cpu",
                        dtype: str | None = None, attention: str = "auto",
                        rope_scaling: str | None = None, tokenizer=None) -> "ModelPair":
        """rope_scaling: "yarn:F" extends both models' context F times (`models.args.with_rope_scaling`).
        tokenizer: the target's tokenizer when the caller already loaded it (`precheck_prompts`), else loaded here.
        On a GPU the draft and its tokenizer load on a second thread while the target loads (reading the files
        and copying them to the device release the GIL); on a CPU one after the other (host memory is the
        limit there, and both files' pages would be resident at once)."""
        dev = parse_device(device)
        init_distributed()  # under torchrun: join the process group (and pick LOCAL_RANK's GPU) before loading
        dev = rank_device(dev)
        dt = resolve_dtype(dtype, dev)
        backend = AttentionBackend.for_device(dev, attention)
        t_path = resolve_model_path(str(target), "target")
        d_path = resolve_model_path(str(draft), "draft") if draft is not None else None
        parallel = current_parallel()

        def load_target():  # under tensor parallelism each rank reads only its slices
            return load_model(t_path, dev, dt, backend, shard=parallel, rope_scaling=rope_scaling)

        def load_draft():
            if d_path is None:
                return None, None
            return load_model(d_path, dev, dt, backend, rope_scaling=rope_scaling), _load_tokenizer(d_path)

        if d_path is not None and dev.type == "cuda":
            with ThreadPoolExecutor(1, thread_name_prefix="dustin-draft-load") as pool:
                pending = pool.submit(load_draft)
                t_model = load_target()
                d_model, d_tok = pending.result()
        else:
            t_model = load_target()
            d_model, d_tok = load_draft()
        tok = tokenizer if tokenizer is not None else _load_tokenizer(t_path)
        return cls(t_model, d_model, tok, d_tok, parallel=parallel)

    @property
    def dtype_name(self) -> str:
        """The weights' dtype, e.g. "bfloat16" (what `--dtype auto` resolved to)."""
        return str(self.target.embed_tokens.weight.dtype).removeprefix("torch.")

    def max_context(self, speculative: bool = True) -> int:
        """Positions a sequence may take (prompt, new tokens and a step's lookahead): the target's context, and
        the draft's too when it drafts."""
        return pair_context(self.target.args, self.draft.args if speculative and self.draft is not None else None)

    # ------------------------------------------------------------------ API
    def encode(self, prompt: str | list[int], chat: bool = False) -> list[int]:
        return encode_prompt(self.tokenizer, prompt, chat)

    def identities(self) -> tuple[dict, dict | None]:
        """(target, draft) model identities: architecture, config and tokenizer, and a weight fingerprint
        (selection/tuned.py). The draft shares the target's tokenizer (checked when both have one)."""
        if self._identities is None:
            self._identities = (model_identity(self.target, self.target_args, self.tokenizer),
                                None if self.draft is None else model_identity(self.draft, tokenizer=self.tokenizer))
        return self._identities

    def default_sparse_config(self) -> SparseConfig:
        """The shipped tuned config of this pair: profiled on exactly these weights (by fingerprint), else on the
        same models (by identity: noted once on stderr); else the built-in fallback."""
        match = match_tuned(*self.identities())
        if match is not None:
            if is_main_process():
                note_identity_match(match)
            return load_tuned(match.path, match.exact)
        return default_config(self.target_args, self.draft.args if self.draft is not None else None)

    def make_policy(self, cfg: GenerationConfig) -> SelectionPolicy:
        """The verification policy of cfg.method with its sparse config: --config's file, else the tuned
        config shipped for this pair, else the built-in fallback. Configs name global heads (the target's
        unsharded shape); under tensor parallelism the `TensorParallel` object builds the policy's TP form."""
        build = build_policy if self.parallel is None else self.parallel.make_policy
        if cfg.spec.policy == "full":
            return build("full", None)
        d_args = self.draft.args if self.draft is not None else None
        if cfg.sparse_config == BUILTIN:
            sc = default_config(self.target_args, d_args)
        else:
            sc = SparseConfig.load(cfg.sparse_config) if cfg.sparse_config else self.default_sparse_config()
        rule = cfg.auto_budget
        if rule is not None:  # indices are padded to k_max; each row's k comes from its scores every step
            sc = sc.with_budget(rule.k_max)
        elif cfg.budget is not None:
            sc = sc.with_budget(cfg.budget)
        if cfg.tail_share is not None:
            sc = replace(sc, tail_share=cfg.tail_share)
        sc.validate_for(self.target_args, d_args)
        policy = build(cfg.spec.policy, sc)
        if rule is not None:
            policy.use_auto_budget(rule)
        return policy

    def decode(self, ids: list[int]) -> str | None:
        """Text of generated ids (special tokens dropped); None without a tokenizer."""
        return None if self.tokenizer is None else self.tokenizer.decode(ids, skip_special_tokens=True)

    def kv_fit(self, speculative: bool = True) -> MemoryFit:
        """The KV manager's memory rule for this pair's caches: the target's (this rank's KV heads under tensor
        parallelism) plus the draft's when speculating, in the weights' dtype, on the pair's device."""
        args = [self.target.args] + ([self.draft.args] if self.draft is not None and speculative else [])
        return MemoryFit(args, self.target.embed_tokens.weight.element_size(), self.device)


def encode_prompt(tokenizer, prompt: str | list[int], chat: bool = False) -> list[int]:
    """Token ids of a prompt (ids pass through), wrapped in the chat template with `chat`."""
    if not isinstance(prompt, str):
        return list(prompt)
    if tokenizer is None:
        raise InputError("this model folder has no tokenizer: pass token ids instead of text")
    if chat:
        return encode_chat(tokenizer, [{"role": "user", "content": prompt}])
    # verbose=False: a prompt longer than the model is `check_prompts`' one error line, not also transformers' warning
    return tokenizer.encode(prompt, add_special_tokens=False, verbose=False)


def encode_chat(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of `messages` in the chat template, the assistant's turn opened: the template's text, then its ids
    as apply_chat_template(tokenize=True) makes them, without transformers' length warning (above)."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False, verbose=False)


def check_prompts(prompts: list[list[int]], cfg: GenerationConfig, context: int, vocab_limit: int | None,
                  limits: list[int], limit_name: str = "max_tokens") -> None:
    """No prompts, an empty prompt, ids outside the vocabulary, or a prompt that leaves no room for
    its new tokens (`limits[i]`) and Γ within the model context: one InputError line naming the prompt.
    limit_name: what the caller calls the limit (a command line's flag: --max-new-tokens)."""
    if not prompts:
        raise InputError("no prompts given")
    for i, p in enumerate(prompts):
        if not p:
            raise InputError(f"prompt {i} is empty")
        if vocab_limit is not None and (max(p) >= vocab_limit or min(p) < 0):
            raise InputError(f"prompt {i} holds token ids outside the vocabulary (0..{vocab_limit - 1})")
        new = limits[i]
        need = positions_needed(len(p), new, cfg.gamma)
        if need > context:
            raise InputError(f"prompt {i} has {len(p)} tokens; with {limit_name} {new} and "
                             f"gamma {cfg.gamma} it needs {need} positions, more than the model context "
                             f"({context})")


def precheck_prompts(target: str | Path, draft: str | Path | None, prompts: list[str], cfg: GenerationConfig,
                     max_tokens: int, chat: bool = False, rope_scaling: str | None = None
                     ) -> tuple[object, list[list[int]] | None]:
    """`check_prompts` from the models' config.json and the target's tokenizer, before any weights load: an
    empty or over-long prompt fails in about a second instead of after both models loaded. Returns the tokenizer
    and the prompts' token ids (chat template applied with `chat`), which the caller passes on to
    `Engine.from_pretrained` and `Engine.generate` instead of loading and encoding again; (None, None) when the
    folder has no tokenizer."""
    t_path = resolve_model_path(str(target), "target")
    d_args = (read_args(resolve_model_path(str(draft), "draft"), rope_scaling)
              if draft is not None and cfg.spec.speculative else None)
    context = pair_context(read_args(t_path, rope_scaling), d_args)
    tokenizer = _load_tokenizer(t_path)
    if tokenizer is None:
        return None, None
    ids = [encode_prompt(tokenizer, p, chat) for p in prompts]
    check_prompts(ids, cfg, context, None, [max_tokens] * len(ids), "--max-new-tokens")
    return tokenizer, ids


def _check_same_vocabulary(target, draft, tok_t, tok_d) -> None:
    if tok_t is not None and tok_d is not None:
        if tok_t.get_vocab() != tok_d.get_vocab():
            raise TokenizerMismatchError("target and draft tokenizers differ: speculative decoding needs a draft "
                                         "that shares the target's tokenizer (same vocabulary and token ids)")
    elif target.args.vocab_size != draft.args.vocab_size:
        raise TokenizerMismatchError(f"target vocabulary ({target.args.vocab_size}) and draft vocabulary "
                                     f"({draft.args.vocab_size}) differ and no tokenizers were given to compare")
