"""Token choice: greedy, temperature / top-k / top-p sampling, and the speculative acceptance rules.

Everything here is batched and runs on the device without host syncs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingRule:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def probabilities(logits: torch.Tensor, p: SamplingRule) -> torch.Tensor:
    """fp32 probabilities after temperature, top-k and top-p (nucleus) filtering; logits [..., V]."""
    logits = logits.float() / max(p.temperature, 1e-6)
    if p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # drop a token when the mass of the tokens strictly before it already reaches top_p
        drop = (sorted_probs.cumsum(-1) - sorted_probs) >= p.top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of probs [..., V]."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


def choose(logits: torch.Tensor, p: SamplingRule, generator: torch.Generator | None):
    """Return (tokens, probs or None): argmax when greedy, else a sample and the distribution it came from."""
    if p.greedy:
        return logits.argmax(-1), None
    probs = probabilities(logits, p)
    return sample(probs, generator), probs


def accept_greedy(draft: torch.Tensor, target_logits: torch.Tensor):
    """draft [B, G], target_logits [B, G+1, V] -> (n_accepted [B], next token [B]).

    A draft token is accepted while it equals the target's argmax; the next token is the target's own
    choice at the first mismatch (or the bonus token after the last draft token)."""
    target_choice = target_logits.argmax(-1)  # [B, G+1]
    match = (draft == target_choice[:, :-1]).int()
    n_acc = match.cumprod(dim=1).sum(dim=1)
    next_tok = target_choice.gather(1, n_acc[:, None]).squeeze(1)
    return n_acc, next_tok


def accept_speculative(draft: torch.Tensor, draft_probs: torch.Tensor, target_logits: torch.Tensor,
                       p: SamplingRule, generator: torch.Generator | None):
    """Lossless speculative sampling (Leviathan et al. / Chen et al.).

    Accept draft token x_i with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection sample from
    the residual norm(max(0, p_i - q_i)); if all are accepted sample the bonus token from p_{G+1}. The output
    then follows the target's (processed) distribution exactly."""
    B, G = draft.shape
    target_probs = probabilities(target_logits, p)  # [B, G+1, V]
    p_x = target_probs[:, :G].gather(2, draft[..., None]).squeeze(2)
    q_x = draft_probs.gather(2, draft[..., None]).squeeze(2)
    u = torch.rand(B, G, device=draft.device, generator=generator)
    ok = (u * q_x <= p_x).int()  # u < p/q without dividing by a possibly tiny q
    n_acc = ok.cumprod(dim=1).sum(dim=1)
    rows = torch.arange(B, device=draft.device)
    p_at = target_probs[rows, n_acc]  # [B, V]: target distribution at the first rejected slot (or bonus)
    q_at = torch.cat([draft_probs, torch.zeros_like(draft_probs[:, :1])], dim=1)[rows, n_acc]
    residual = (p_at - q_at).clamp_min(0)
    mass = residual.sum(-1, keepdim=True)
    # all accepted (q_at = 0 -> residual = p) or a degenerate residual: fall back to p itself
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_at)
    return n_acc, sample(residual, generator)


def accept_prob_for_tau(tau: float, gamma: int) -> float:
    """The per-token acceptance probability p whose expected tokens per step, (1 - p^(Γ+1)) / (1 - p), is tau
    (bisection: that sum is increasing in p). tau must lie in [1, Γ + 1)."""
    if not 1.0 <= tau < gamma + 1:
        raise ValueError(f"tau must be in [1, {gamma + 1}) for gamma {gamma}, got {tau}")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid ** i for i in range(gamma + 1)) < tau:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def accept_controlled(draft: torch.Tensor, target_logits: torch.Tensor, accept_prob: float,
                      generator: torch.Generator | None):
    """Acceptance-controlled verification, for benchmarks with random weights only: draft token i is accepted
    with probability `accept_prob`, independently, until the first rejection (so E[tokens per step] =
    (1 - p^(Γ+1)) / (1 - p)). The next token is the target's argmax at the first rejected slot, as in greedy
    verification: every computation of the real method still runs, only the accept decision is replaced."""
    B, G = draft.shape
    u = torch.rand(B, G, device=draft.device, generator=generator)
    n_acc = (u < accept_prob).int().cumprod(dim=1).sum(dim=1)
    next_tok = target_logits.argmax(-1).gather(1, n_acc[:, None]).squeeze(1)
    return n_acc, next_tok


_MASK64 = (1 << 64) - 1


def _i64(x: int) -> int:
    """A 64-bit constant as the signed value torch's int64 arithmetic wraps around to."""
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN, _MIX1, _MIX2 = _i64(0x9E3779B97F4A7C15), _i64(0xBF58476D1CE4E5B9), _i64(0x94D049BB133111EB)


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def counter_uniform(seeds: torch.Tensor, offsets: torch.Tensor, n: int) -> torch.Tensor:
    """U[0, 1) noise [B, n] from a counter-based generator: draw j of row b is splitmix64(seed[b] + golden *
    (offset[b] + j)), its top 24 bits as a float. A row's numbers depend only on its own seed and how many it drew
    before, never on the batch or on other rows' draws, and the state is two device tensors: a CUDA graph replays
    it by reading them (callers advance `offsets` in place)."""
    j = offsets[:, None] + torch.arange(n, device=seeds.device)[None, :]
    z = seeds[:, None] + j * _GOLDEN
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    z = z ^ _shr(z, 31)
    return _shr(z, 40).float() * (1.0 / (1 << 24))


class RowSampling:
    """Per-sequence sampling parameters of a batch whose requests differ (the serving engine's slots).

    Rows sharing one `SamplingRule` and the batch's generator (`uniform`) take the batched functions above
    unchanged. Otherwise every row is processed with its own temperature / top-k / top-p read from device tensors
    (greedy rows by argmax), and draws its random numbers from `counter_uniform` with its own seed: a request's
    `seed` when it has one (its tokens then do not depend on what else is in the batch), else a seed drawn at
    admission from a host generator seeded with the batch's seed. Nothing in that path loops over rows on the host
    or depends on the rows' values, so a step over a mixed batch is captured as one CUDA graph like a uniform one
    (`Session` keeps one graph per mode)."""

    def __init__(self, batch: int, default: SamplingRule, generator: torch.Generator | None,
                 seed: int = 0) -> None:
        self.params = [default] * batch
        self.seeded = [False] * batch
        self.default, self.generator = default, generator
        dev = generator.device if generator is not None else torch.device("cpu")
        self._temp = torch.full((batch,), max(default.temperature, 1e-6), dtype=torch.float32, device=dev)
        self._top_k = torch.full((batch,), default.top_k, dtype=torch.long, device=dev)
        self._top_p = torch.full((batch,), default.top_p, dtype=torch.float32, device=dev)
        self._greedy = torch.full((batch,), default.greedy, dtype=torch.bool, device=dev)
        self._seeds = torch.zeros(batch, dtype=torch.long, device=dev)
        self._offsets = torch.zeros(batch, dtype=torch.long, device=dev)
        self._host_seeds = torch.Generator().manual_seed(seed)  # seeds of unseeded rows, in admission order

    def set_row(self, row: int, params: SamplingRule, seed: int | None, device=None) -> None:
        """A row's new rule and seed (in place: a captured graph reads the same tensors)."""
        self.params[row] = params
        self.seeded[row] = seed is not None
        if seed is None:
            seed = int(torch.randint(0, 1 << 62, (1,), generator=self._host_seeds))
        self._temp[row] = max(params.temperature, 1e-6)
        self._top_k[row] = params.top_k
        self._top_p[row] = params.top_p
        self._greedy[row] = params.greedy
        self._seeds[row] = _i64(seed * 0x2545F4914F6CDD1D + 1)  # spread small seeds over 64 bits
        self._offsets[row] = 0

    @property
    def uniform(self) -> bool:
        return all(p == self.default for p in self.params) and not any(self.seeded)

    @property
    def greedy(self) -> bool:
        return all(p.greedy for p in self.params)

    @property
    def mode(self) -> str:
        """Which code path a step takes: "uniform" (the batch's rule and generator), "greedy" (per-row settings,
        every row greedy: argmax), "mixed" (per-row rules and counter noise). A captured step graph is one mode's."""
        return "uniform" if self.uniform else "greedy" if self.greedy else "mixed"

    def _noise(self, n: int) -> torch.Tensor:
        """[B, n] per-row uniforms; each row's counter advances by n."""
        u = counter_uniform(self._seeds, self._offsets, n)
        self._offsets.add_(n)
        return u

    def _probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """Per-row probabilities of logits [B, ..., V] after each row's temperature, top-k and top-p (the rules of
        `probabilities`, applied in sorted order); a greedy row gets its argmax as a one-hot."""
        B, V = logits.shape[0], logits.shape[-1]
        shape = (B,) + (1,) * (logits.dim() - 1)
        x = logits.float() / self._temp.view(shape)
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        rank = torch.arange(V, device=logits.device)
        k = torch.where(self._top_k > 0, self._top_k, V).view(shape)
        sorted_x = sorted_x.masked_fill(rank >= k, float("-inf"))
        p_sorted = sorted_x.softmax(-1)
        drop = (p_sorted.cumsum(-1) - p_sorted) >= self._top_p.view(shape)
        p_sorted = p_sorted.masked_fill(drop, 0.0)
        p_sorted = p_sorted / p_sorted.sum(-1, keepdim=True)
        probs = torch.zeros_like(p_sorted).scatter_(-1, order, p_sorted)
        one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        return torch.where(self._greedy.view(shape), one_hot, probs)

    def _sample(self, probs: torch.Tensor) -> torch.Tensor:
        """Inverse-CDF sampling of probs [B, ..., V] with per-row counter noise."""
        B = probs.shape[0]
        u = self._noise(probs[0, ..., 0].numel()).view(probs.shape[:-1])
        cdf = probs.cumsum(-1)
        idx = torch.searchsorted(cdf, (u * cdf[..., -1])[..., None]).squeeze(-1)
        return idx.clamp_max(probs.shape[-1] - 1).view(B, *probs.shape[1:-1])

    def choose(self, logits: torch.Tensor):
        """logits [B, V] -> (tokens [B], probs [B, V] or None when every row is greedy)."""
        if self.uniform:
            return choose(logits, self.default, self.generator)
        if self.greedy:
            return logits.argmax(-1), None
        probs = self._probabilities(logits)
        return self._sample(probs), probs

    def accept(self, drafts: torch.Tensor, draft_probs: torch.Tensor | None, target_logits: torch.Tensor):
        """Greedy rows: the greedy rule; sampled rows: lossless speculative sampling with their own params."""
        if self.uniform:
            if self.default.greedy:
                return accept_greedy(drafts, target_logits)
            return accept_speculative(drafts, draft_probs, target_logits, self.default, self.generator)
        if self.greedy:
            return accept_greedy(drafts, target_logits)
        B, G = drafts.shape
        n_g, next_g = accept_greedy(drafts, target_logits)
        target_probs = self._probabilities(target_logits)  # [B, G+1, V]
        p_x = target_probs[:, :G].gather(2, drafts[..., None]).squeeze(2)
        q_x = draft_probs.gather(2, drafts[..., None]).squeeze(2)
        u = self._noise(G)
        n_s = (u * q_x <= p_x).int().cumprod(dim=1).sum(dim=1)
        rows = torch.arange(B, device=drafts.device)
        p_at = target_probs[rows, n_s]
        q_at = torch.cat([draft_probs, torch.zeros_like(draft_probs[:, :1])], dim=1)[rows, n_s]
        residual = (p_at - q_at).clamp_min(0)
        mass = residual.sum(-1, keepdim=True)
        residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_at)
        next_s = self._sample(residual)
        return torch.where(self._greedy, n_g, n_s), torch.where(self._greedy, next_g, next_s)

    def choose_row(self, row: int, logits: torch.Tensor) -> torch.Tensor:
        """The first token of one sequence (after its prefill): logits [1, V] -> [1]. A uniform batch draws from
        the batch's generator (as a whole-batch prefill does); otherwise from the row's own counter."""
        p = self.params[row]
        if p.greedy:
            return logits.argmax(-1)
        if self.uniform:
            return sample(probabilities(logits, p), self.generator)
        probs = probabilities(logits, p)
        u = counter_uniform(self._seeds[row:row + 1], self._offsets[row:row + 1], 1)
        self._offsets[row:row + 1].add_(1)
        cdf = probs.cumsum(-1)
        idx = torch.searchsorted(cdf, (u * cdf[..., -1:]))
        return idx.clamp_max(probs.shape[-1] - 1).view(1)
