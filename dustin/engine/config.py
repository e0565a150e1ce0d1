"""The engine's one config (`GenerationConfig`), validated once, and the table of decoding methods."""
from __future__ import annotations

from dataclasses import dataclass, field

from dustin.defaults import (
    AUTO_MAX,
    AUTO_MIN,
    AUTO_P,
    DEFAULT_METHOD,
    DRAFT_KERNEL,
    DRAFT_WINDOW,
    GAMMA,
    GAMMA_AUTO_MAX,
)
from dustin.errors import InputError
from dustin.selection.config import (
    DUSTIN_POLICIES,
    DUSTIN_TAIL_ROWS,
    ORACLE_RUNGS,
    ORACLE_TAIL_ROWS,
    AutoBudget,
    SparseConfig,
)


@dataclass(frozen=True)
class MethodSpec:
    speculative: bool
    draft_kv: str | None  # "full" | "streaming" | None (no draft)
    policy: str = "full"  # verification-time KV selection policy


METHODS: dict[str, MethodSpec] = {
    "vanilla": MethodSpec(speculative=False, draft_kv=None),
    "classic": MethodSpec(speculative=True, draft_kv="full"),
    "magicdec": MethodSpec(speculative=True, draft_kv="streaming"),
    # sparse verification (paper Sec. 4): the draft defaults to the streaming cache, the fastest mode, since its
    # score heads read the full draft cache anyway (docs/sparse_verification.md)
    "dustin": MethodSpec(speculative=True, draft_kv="streaming", policy="dustin"),
    "dustin-t": MethodSpec(speculative=True, draft_kv="streaming", policy="dustin-t"),
    "dustin-d": MethodSpec(speculative=True, draft_kv="streaming", policy="dustin-d"),
    "streaming": MethodSpec(speculative=True, draft_kv="streaming", policy="streaming"),
    "quest": MethodSpec(speculative=True, draft_kv="streaming", policy="quest"),
    "specattn": MethodSpec(speculative=True, draft_kv="streaming", policy="specattn"),
    "snapkv": MethodSpec(speculative=True, draft_kv="streaming", policy="snapkv"),
    "oracle": MethodSpec(speculative=True, draft_kv="full", policy="oracle"),
    # the oracle ladder (analysis, docs/accuracy.md): per-layer oracle sets per layer / KV head / query head
    **{name: MethodSpec(speculative=True, draft_kv="full", policy=name) for name in ORACLE_RUNGS},
    # the sampled-tail rows (analysis, docs/accuracy.md): an exact set plus a uniform, reweighted sample of the rest;
    # the exact set of rung (b) with the ladder's full draft, or dustin's own with dustin's streaming one
    **{name: MethodSpec(speculative=True, draft_kv="full" if row.source == "layer" else "streaming", policy=name)
       for name, row in ORACLE_TAIL_ROWS.items()},
    # the engine's own tail at a fixed share (sweep rows: dustin-tail is dustin with --tail-share 0.5)
    **{name: MethodSpec(speculative=True, draft_kv="streaming", policy=name) for name in DUSTIN_TAIL_ROWS},
}
DRAFT_KV_MODES = ("full", "streaming")
# the methods that verify against the whole cache (lossless: greedy output is vanilla's whatever the budget)
FULL_METHODS = tuple(m for m, s in METHODS.items() if s.policy == "full")
# the lossy ones: sparse verification, whose output is the sparse-verified target's and can differ from the target's
LOSSY_METHODS = tuple(m for m in METHODS if m not in FULL_METHODS)


def method_output(method: str) -> str:
    """What a method's output is, in the words a user chooses by (the server's start line, /v1/models)."""
    if method in FULL_METHODS:
        return "lossless: the target's own output"
    return "lossy: sparse verification, the output can differ from the target's"


def methods_help(default: str) -> str:
    """The `--method` help of every command: the default, and which methods are lossy."""
    return (f"decoding method (default {default}). Lossless, the target's own output (greedy: token for token; "
            f"sampled: its distribution): {', '.join(FULL_METHODS)}. Lossy, sparse verification (the output is the "
            f"sparse-verified target's and can differ from the target's own; measured loss: docs/accuracy.md): "
            f"{', '.join(LOSSY_METHODS)}")
# the methods of Dustin's hybrid selection, the ones that can size k themselves (--budget auto)
DUSTIN_METHODS = tuple(m for m, s in METHODS.items() if s.policy in DUSTIN_POLICIES)


@dataclass(frozen=True)
class ExecutionOptions:
    """How a batch executes: switches for benchmarks and debugging, on the fast path by default (the persistent draft
    kernel, opt-in, aside). `accept_prob` replaces verification (benchmarks with random weights); `fused_ops` and
    `draft_kernel` round in another order, so they may change a token at a near-tie; the others change no token."""

    cuda_graphs: bool = True  # replay step forwards as CUDA graphs on the GPU
    # with cuda_graphs: capture the whole speculative step (Γ draft forwards, token choice, estimation, selection,
    # verify, acceptance, cache bookkeeping) as ONE graph; False: one graph per forward, Python in between
    step_graph: bool = True
    # decode with the device one step ahead of the host (`EngineCore.step`): the host's stopping and output work
    # overlaps the next step; a sequence that stops runs one extra step whose tokens are dropped
    overlap: bool = True
    # benchmarks with random weights only: accept each draft token with this probability instead of checking it
    # against the target ("acceptance-controlled"; see sampling.accept_controlled). None: real verification.
    accept_prob: float | None = None
    # our fused Triton kernels on the GPU (decode layers in three kernels each, RMSNorm / RoPE / SiLU-mul in one launch
    # each: `Transformer.set_fused_ops`); False: plain PyTorch ops (A/B, debugging; the same tokens within rounding)
    fused_ops: bool = True
    # a streaming draft's decoder layers (and, for an all-greedy batch where the build has K whole, its LM head and
    # argmax) as one persistent kernel per forward where it runs (sm_90, bf16, the draft shapes it is built for, <= 64
    # token rows a forward: dustin/kernels/draft_decoder.py; its GPU checks: tests/kernels/test_draft_decoder.py).
    # Elsewhere, and for larger forwards, a few kernels a layer. Its rounding order differs from theirs, so a draft
    # token may differ at a near-tie: the speed and, under sparse verification, the selection. The default: defaults.py
    draft_kernel: bool = DRAFT_KERNEL

    def __post_init__(self) -> None:
        if self.accept_prob is not None and not 0.0 <= self.accept_prob <= 1.0:
            raise InputError(f"--accept-prob must be in [0, 1], got {self.accept_prob}")


@dataclass(frozen=True)
class GenerationConfig:
    """The engine's one config, validated once: what an engine core fixes when it starts. `EngineCore` (the
    server, `dustin serve`) and `Engine.generate` (offline: eval, bench, profiling, `dustin generate`) both take it.

    Engine-fixed (an engine core is built for them): method, gamma / gamma_auto, draft_kv, draft_sinks,
    draft_window, budget and budget_p / budget_min / budget_max / budget_dense, sparse_config, seed (the engine's
    sampling stream), the serving sizes max_slots, max_context, prefill_chunk, prefill_tokens and max_waiting, and
    `options` (benchmark and debugging switches). What may differ per request (max_tokens, temperature, top_p,
    top_k, seed, ignore_eos, log-probabilities) is `SamplingParams`' (engine/request.py), its defaults and checks
    there only: a setting kept in both places would have two defaults that drift apart."""

    method: str = DEFAULT_METHOD
    # draft tokens per step (Γ), or "auto": each sequence picks its own Γ in [0 or 1, GAMMA_AUTO_MAX] per step from
    # measured step costs and its own acceptance (dustin/engine/gamma.py); gamma then holds that largest Γ and
    # gamma_auto is True
    gamma: int | str = GAMMA
    gamma_auto: bool = False
    seed: int = 0
    draft_kv: str | None = None  # None: the method's default
    draft_sinks: int = 4  # streaming draft (MagicDec): 4 sinks + (draft_window - 4) recent positions
    draft_window: int = DRAFT_WINDOW  # positions the streaming draft attends (sinks + recent); `budget` is the verify k
    # sparse verification: k positions per sequence (None: the config's, 512), or "auto": per sequence and step,
    # the fewest positions holding budget_p of the estimated attention mass, in [budget_min, budget_max]
    # (dustin/selection/adaptive.py)
    budget: int | str | None = None
    budget_p: float = AUTO_P
    budget_min: int = AUTO_MIN
    budget_max: int = AUTO_MAX
    # --budget auto only: a row whose budget_max best positions hold less than budget_p of its estimated mass
    # verifies against the whole cache that step
    budget_dense: bool = False
    # dustin, dustin-t, dustin-d: the share of the budget drawn per layer and KV head as a sampled, reweighted tail
    # (selection/stratified.py); None: the sparse config's `tail_share` (0 unless the config sets it)
    tail_share: float | None = None
    sparse_config: str | None = None  # JSON file of score heads / m (None: built-in default for the pair)
    # serving sizes: max_slots None: 16 on a GPU, 8 on a CPU; max_context None: the models' context (capped at
    # 8192 on a CPU, where the slots' caches live in host memory). An offline batch (`Engine.generate`) takes one
    # slot per prompt and the context its prompts need instead.
    max_slots: int | None = None
    max_context: int | None = None
    # prefill: prompts are cut at multiples of `prefill_chunk` tokens from their start (request-local), and one
    # step prefills up to `prefill_tokens` tokens of such chunks, of any requests, in ONE forward padded to that
    # size (None: 8192 on a GPU, 512 on a CPU; see docs/serving.md for the measurement behind the GPU default).
    # Small chunks cost nothing in the forward (several chunks of a row share it); they only bound the budget
    # left unused when the next chunk in line does not fit
    prefill_chunk: int = 512
    prefill_tokens: int | None = None
    max_waiting: int = 256  # requests waiting for a slot (an offline batch: at least its prompts)
    options: ExecutionOptions = field(default_factory=ExecutionOptions)  # benchmark and debugging switches

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise InputError(f"unknown method {self.method!r}; choose from {', '.join(METHODS)}")
        for name, low in (("max_slots", 1), ("max_context", 16), ("prefill_chunk", 1), ("prefill_tokens", 1),
                          ("max_waiting", 1)):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < low):
                raise InputError(f"--{name.replace('_', '-')} must be an integer >= {low}, got {v!r}")
        if self.prefill_tokens is not None and self.prefill_tokens < self.prefill_chunk:
            raise InputError(f"--prefill-tokens ({self.prefill_tokens}) must be >= --prefill-chunk "
                             f"({self.prefill_chunk}): a step prefills whole chunks")
        if self.gamma == "auto":  # frozen: the normalized values are set once, here
            object.__setattr__(self, "gamma", GAMMA_AUTO_MAX)
            object.__setattr__(self, "gamma_auto", True)
        if not isinstance(self.gamma, int):
            raise InputError(f"--gamma must be an integer or auto, got {self.gamma!r}")
        if self.gamma < 1:
            raise InputError(f"--gamma must be >= 1 (draft tokens per step), got {self.gamma}")
        if self.gamma > 15:
            raise InputError(f"--gamma must be <= 15 (the verify kernels take at most 16 queries), got {self.gamma}")
        if self.draft_kv is None:
            object.__setattr__(self, "draft_kv", METHODS[self.method].draft_kv)
        elif self.draft_kv not in DRAFT_KV_MODES:
            raise InputError(f"--draft-kv must be one of {DRAFT_KV_MODES}, got {self.draft_kv!r}")
        if self.budget == "auto":
            _ = self.auto_budget  # validates p and the range
            if self.spec.policy not in DUSTIN_POLICIES:
                raise InputError(f"--budget auto sizes Dustin's selection: use dustin, dustin-t or dustin-d, not "
                                 f"{self.method!r}")
        elif self.budget_dense:
            raise InputError("--budget-dense goes with --budget auto (it widens rows that auto's k cannot serve)")
        elif self.budget is not None and (not isinstance(self.budget, int) or self.budget < 21):
            raise InputError(f"--budget must be >= 21 (4 sinks + 16 recent + 1), or auto; got {self.budget!r}")
        elif self.budget is not None and self.spec.policy in ORACLE_TAIL_ROWS:
            ORACLE_TAIL_ROWS[self.spec.policy].split(self.budget, 21)  # the exact part >= 4 sinks + 16 recent + 1
        if self.tail_share is not None:
            if self.spec.policy not in DUSTIN_POLICIES:
                raise InputError(f"--tail-share goes with dustin, dustin-t or dustin-d, not {self.method!r}")
            if self.budget == "auto" and self.tail_share:
                raise InputError("--budget auto sizes an exact set; it takes no sampled tail (--tail-share 0)")
        share = DUSTIN_TAIL_ROWS.get(self.spec.policy, self.tail_share)
        if share and isinstance(self.budget, int):  # the split at this k, by the sparse config's own rule
            SparseConfig(budget=self.budget, draft_topm=0, tail_share=share)
        elif share is not None and not 0.0 <= share < 1.0:
            raise InputError(f"--tail-share must be in [0, 1), got {share}")
        if self.options.accept_prob is not None and not self.spec.speculative:
            raise InputError(f"acceptance control needs a speculative method, not {self.method!r}")
        if self.draft_kv == "streaming" and not 0 <= self.draft_sinks < self.draft_window:
            raise InputError(f"streaming draft needs 0 <= sinks ({self.draft_sinks}) < --draft-window "
                             f"({self.draft_window})")

    @property
    def auto_budget(self) -> AutoBudget | None:
        """The `--budget auto` rule's settings, or None for a fixed k."""
        if self.budget != "auto":
            return None
        return AutoBudget(self.budget_p, self.budget_min, self.budget_max, self.budget_dense)

    @property
    def spec(self) -> MethodSpec:
        return METHODS[self.method]

    @property
    def draft_recent(self) -> int:
        """Recent positions of the streaming draft's window (after its sinks); 0 for a full draft cache."""
        return self.draft_window - self.draft_sinks if self.draft_kv == "streaming" else 0
