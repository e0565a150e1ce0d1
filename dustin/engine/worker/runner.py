"""The runner: what the executor calls on the batch on the device. It holds no request queue and runs no loop
(`EngineCore.step` drives it); its parts each own one concern:

- `BatchState` (batch.py): every row's host and device state; the `StepState` the selection policies read;
- `Prefill` (prefill.py): prompts into the caches (chunks, a gang, prefix copies, prompt log-probabilities, the
  draft's catch-up);
- `DeviceStep` (step.py): the capturable draft -> plan -> verify -> accept and its CUDA graphs;
- `Staging` (staging.py): the steps in flight, read back to the host, with row epochs and log-probabilities;
- `ModelRunner` per model (engine/model_runner.py) over the caches of the batch's `KVManager`.

A step: `launch` queues its device work and the copy of its output to pinned memory, recording which rows (and
epochs) it runs for; `complete` waits for it and returns each row's tokens. The engine loop launches a step before
it reads the previous one back, so the host's work overlaps the device's next step.
"""
from __future__ import annotations

import torch

from dustin.engine.config import GenerationConfig
from dustin.engine.draft_step import EagerDraftStep
from dustin.engine.kv_manager import KVManager
from dustin.engine.model_runner import ModelRunner
from dustin.engine.request import Logprob, SamplingRule
from dustin.engine.sampling import GREEDY
from dustin.engine.timing import PhaseTimer
from dustin.engine.worker.batch import BatchState
from dustin.engine.worker.prefill import Prefill
from dustin.engine.worker.staging import RowTokens, Staging
from dustin.engine.worker.step import DeviceStep
from dustin.kernels.dispatch import is_fake
from dustin.models import draft_kernel
from dustin.models.transformer import Transformer
from dustin.selection.base import FullSelection, SelectionPolicy


class Runner:
    """`slots` rows of `capacity` KV positions (the `KVManager`'s) that sequences join (`admit`, then `prefill`
    chunks or one `prefill_gang`) and leave (`release`) between steps, and the step itself (`launch` /
    `complete`)."""

    def __init__(self, target: Transformer, draft: Transformer | None, cfg: GenerationConfig, vocab_limit: int,
                 policy: SelectionPolicy | None = None, *, kv: KVManager, max_new_tokens: int,
                 shared: SamplingRule = GREEDY) -> None:
        """cfg: the batch's decoding settings (Γ, graphs and overlap). kv: the batch's caches (a row per slot):
        "target", and "draft" when `draft` drafts. max_new_tokens: the most new tokens a row may ask; a row's
        prompt and new tokens must also fit its slot. shared: the sampling rule of rows that draw from the batch's
        generator, and of idle rows (`BatchState`)."""
        self.cfg, self.kv = cfg, kv
        self.policy = policy = policy or FullSelection()
        self.device = device = target.embed_tokens.weight.device
        speculative = cfg.spec.speculative
        # CUDA graphs for the fixed-shape step forwards (GPU + Triton backend; policies whose observers and plans
        # are graph-safe: fixed-address buffers, one index set for all layers)
        use_graphs = (device.type == "cuda" and cfg.options.cuda_graphs and target.backend.name == "triton"
                      and policy.graph_safe)
        for model in (target, draft):
            if model is not None:
                model.set_fused_ops(cfg.options.fused_ops)
        self.models = {"target": ModelRunner(target, kv.caches["target"], use_graphs)}
        # --gamma auto with a policy of shared sparse plans: rows at Γ = 0 are verified against the whole cache
        dense_plain = cfg.gamma_auto and policy.dense_rows and not policy.full_verify
        # the smallest Γ a row may take: 0 (plain steps) when its token does not depend on its drafts, or when a
        # plain row can be verified densely; else 1 (a sparse method's selection reads its drafts' lookahead)
        min_gamma = 0 if policy.full_verify or dense_plain else 1
        self.batch = BatchState(target, draft if speculative else None, cfg, vocab_limit, kv.caches,
                                max_new_tokens, min_gamma, shared)
        draft_step = None
        if speculative:
            self.models["draft"] = ModelRunner(draft, kv.caches["draft"], use_graphs)
            sinks, window = (cfg.draft_sinks, cfg.draft_recent) if cfg.draft_kv == "streaming" else (0, 0)
            # the persistent layer kernel (opt-in); never for the warm-up's fake twin, which leaves the models as
            # they were (dustin/engine/warmup.py), so a real runner's kernel stays attached
            if not is_fake(kv.caches["draft"].k):
                draft.layer_kernel = None
                if cfg.options.draft_kernel and device.type == "cuda" and window > 0:
                    # a step's draft forwards; greedy ones also choose their tokens in the launch
                    B = self.batch.B
                    draft_kernel.attach(draft, sinks, window, rows=(B, 2 * B), vocab=vocab_limit)
            draft_step = EagerDraftStep(self.models["draft"], self.batch.sampler, vocab_limit, self.batch.gamma,
                                        sinks, window)
        self.staging = Staging(self.batch)
        self.prefiller = Prefill(self.batch, self.staging, policy, self.models, kv)
        self.device_step = DeviceStep(self.batch, self.staging, policy, self.models, draft_step, use_graphs,
                                      dense_plain)

    @property
    def use_graphs(self) -> bool:
        """Whether the step's forwards (or the whole step) replay as CUDA graphs."""
        return self.device_step.use_graphs

    # ---------------------------------------------------------------- rows
    def admit(self, row: int, prompt: list[int], limit: int, params: SamplingRule | None = None,
              seed: int | None = None, *, logprobs: int | None = None, prompt_logprobs: int | None = None,
              prefix_from: int | None = None) -> None:
        """Give an idle row to a new sequence; its prompt is then prefilled by `prefill` calls (or a gang's).
        logprobs / prompt_logprobs: compute the log-probabilities of its generated / prompt tokens with that many
        most likely tokens each. prefix_from: a row admitted with the same prompt and still prefilling, whose
        prompt cache this row copies (n sequences of one prompt share one prefill). The request was checked at
        the edge (`EngineCore.check_request`)."""
        self.batch.admit(row, prompt, limit, params, seed)
        self.staging.new_owner(row, logprobs)
        self.prefiller.admit(row, prompt, prompt_logprobs, prefix_from)

    def release(self, row: int) -> None:
        """Free a row (finished, or aborted mid-prefill or mid-decode): it becomes idle for the next request."""
        self.batch.release(row)
        self.staging.new_owner(row)
        self.prefiller.release(row)

    def stop(self, row: int) -> None:
        """The row's sequence stopped: the row stops decoding (its cache length freezes) until it is released."""
        self.batch.stop(row)

    def set_gamma(self, row: int, gamma: int) -> None:
        """The row's own Γ from its next step on (`BatchState.set_gamma`)."""
        self.batch.set_gamma(row, gamma)

    def prefill(self, pieces: list[tuple[int, int]], pad_to: int = 0) -> None:
        """The next chunks of admitted rows, [(row, tokens)], in one packed forward per model (`Prefill.prefill`)."""
        self.prefiller.prefill(pieces, pad_to)

    def prefill_gang(self) -> None:
        """Every admitted row's whole prompt, computed (`Prefill.prefill_gang`)."""
        self.prefiller.prefill_gang()

    def prompt_logprobs(self, row: int) -> list[Logprob | None] | None:
        return self.prefiller.prompt_logprobs(row)

    # ---------------------------------------------------------------- steps
    @property
    def overlappable(self) -> bool:
        """Whether steps may be launched a step ahead of the host (the engine loop)."""
        return self.cfg.options.overlap and self.policy.graph_safe

    @property
    def catch_up_pending(self) -> bool:
        """Whether the next step first writes draft positions of rows' earlier plain steps: it then needs every
        launched step read back (`complete`) before `launch`."""
        return bool(self.batch.catch_up_rows())

    @torch.inference_mode()
    def launch(self, overlapped: bool = True) -> int:
        """Queue one step's device work and the copy of its output to pinned host memory; returns the staging slot
        to `complete` later. The rows the step runs for (and their epochs) are recorded now, so that its tokens are
        booked to the requests that held the rows at launch, whatever was released or admitted since.
        overlapped: the host may be a step behind the device (attention is then sized by the capacity)."""
        G = self.batch.step_gamma
        live = self.staging.live_rows()
        behind = self.batch.catch_up_rows()
        if behind:
            self.prefiller.catch_up_draft(behind)
        out = self.device_step.launch(overlapped, G, self.staging.computing_logprobs)
        slot = self.staging.stage(out, G, live)
        self.batch.lag_plain_rows([b for b, _, _ in live])
        return slot

    @torch.inference_mode()
    def complete(self, slot: int) -> list[RowTokens]:
        """Wait for the step staged in `slot` (the step's one host sync); the tokens it made for the rows it was
        launched for that still hold the same sequence and still decode."""
        return self.staging.read_back(slot)

    # ---------------------------------------------------------------- runs and one-time costs
    def begin_run(self, seed: int) -> None:
        """Start a new offline run on a kept batch (`Engine.generate` reuses one across calls, graphs and all): fresh
        timers, and the generators reseeded, so a call's result and numbers do not depend on earlier calls."""
        self.reset_timer()
        self.batch.generator.manual_seed(seed)
        self.batch.sampler.reseed(seed)
        self.device_step.reset_capture_time()

    @property
    def timer(self) -> PhaseTimer:
        """The phase timer of the steps (draft, verify, sparse_verify, estimate, select, step_graph)."""
        return self.batch.timer

    def reset_timer(self) -> None:
        """Time phases from now on only."""
        self.batch.timer = PhaseTimer(self.device)

    def capture_total(self) -> float:
        """One-time graph cost so far: captures plus their warm-up runs."""
        return self.device_step.capture_total()

    def add_one_time_s(self, seconds: float) -> None:
        """Count a one-time cost of the first decode step (the engine loop's wait for background kernel compiles)
        with the capture time, not the decode time."""
        self.device_step.warmup_s += seconds

    @property
    def warmup_s(self) -> float:
        """One-time seconds of the steps that ran eagerly before their graph was captured (and of waits counted
        with them, `add_one_time_s`)."""
        return self.device_step.warmup_s

    def graph_keys(self) -> list[tuple[str, int]]:
        """(sampling mode, G) of every step graph captured so far."""
        return self.device_step.graph_keys()

    def dry_step(self, gamma: int | None = None) -> None:
        """The device part of one step of G = gamma (default cfg.gamma), eagerly, at the captured graph's sizes;
        nothing is read back or booked. The warm-up runs it on a twin under FakeTensorMode to learn the step's
        kernel launches (dustin/engine/warmup.py)."""
        self.device_step.dry(self.batch.gamma if gamma is None else gamma)
