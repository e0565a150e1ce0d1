"""Token choice: greedy, temperature / top-k / top-p sampling, and the speculative acceptance rules.

Everything here is batched and runs on the device without host syncs (on a GPU the whole decode step is captured
as one CUDA graph); the one exception is the CPU's top-p search below, where a sync costs nothing. A sampled step
adds a few passes over the vocabulary per distribution to a greedy one, and no sort of it on the CPU:
  * top-k and top-p are cuts by value. Top-k keeps the tokens whose logit is at least the k-th largest; top-p
    keeps the tokens whose logit is at least that of the last token the nucleus needs (the most likely tokens in
    descending order, up to the first whose preceding mass reaches top_p). Tokens tied at a cut are all kept, so
    the result does not depend on how a sort orders ties. The cut values come from the row's largest logits in
    descending order: on a GPU a sort of the row; on the CPU `torch.topk` of the 256 largest (4 times more while
    the nucleus may reach past them, up to the whole row), which gives the same cuts;
  * a token is drawn by inverse CDF (one uniform number per row; block sums, then one block's cumulative sum), not
    by `torch.multinomial`, which draws an exponential number per vocabulary entry;
  * acceptance reads the draft's distribution at the first rejected slot by index, without copying it;
  * an argmax over bf16 logits on the CPU runs on their fp32 cast (4x faster there, the same index).
"""
from __future__ import annotations

import torch

from dustin.engine.request import SamplingRule
from dustin.rng import counter_uniform, i64

_FIRST_K = 256  # the CPU looks for the top-p cut among this many largest logits first (x4 while it may be past)
_BLOCK = 1024  # entries per block of `inverse_cdf`'s two-level search


GREEDY = SamplingRule()  # the rule of idle rows, and the server's shared rule (`BatchState`)


def _largest(x: torch.Tensor, size: int) -> torch.Tensor:
    """The `size` largest values of each row of x, in descending order."""
    return torch.sort(x, dim=-1, descending=True).values if size >= x.shape[-1] else torch.topk(x, size, dim=-1).values


def _cut(x: torch.Tensor, top_k, top_p, k_need: int) -> torch.Tensor:
    """Logits x [..., V] (fp32, after temperature) with the tokens that top-k and then top-p drop set to -inf.
    top_k: an int or a long tensor broadcasting to x[..., :1] (0: off); top_p: a float or such a float tensor
    (>= 1: off); k_need: the largest top_k in use (0: none). The cuts are values (see the module's docstring)."""
    V = x.shape[-1]
    k_need = min(k_need, V)
    per_row = isinstance(top_p, torch.Tensor)
    p_on = per_row or top_p < 1.0
    # a GPU sorts the whole row (fast there, and one shape for its graph); the CPU looks among the largest only
    size = V if x.device.type != "cpu" else min(V, max(k_need, _FIRST_K)) if p_on else k_need
    top = _largest(x, size)
    if k_need:
        if isinstance(top_k, torch.Tensor):
            kth = top.gather(-1, (top_k.clamp(1, k_need) - 1).expand(*top.shape[:-1], 1))
            kth = torch.where(top_k > 0, kth, float("-inf"))
        else:
            kth = top[..., top_k - 1:top_k]
        x = torch.where(x < kth, float("-inf"), x)
        top = torch.where(top < kth, float("-inf"), top)
    if not p_on:
        return x
    # the probabilities of the largest logits in the whole (top-k cut) row, and the mass before each
    peak = top[..., :1]
    log_total = (x - peak).exp_().sum(-1, keepdim=True).log_()
    while True:
        probs = (top - peak - log_total).exp()
        before = probs.cumsum(-1) - probs
        needed = (before < top_p).sum(-1, keepdim=True)  # >= 1: the most likely token is always kept
        short = (needed == size) & (top[..., -1:] > float("-inf")) & (top_p < 1.0)
        if size >= V or not bool(short.any()):
            break
        size = min(V, 4 * size)  # the nucleus may reach past the values looked at (CPU only: no graph there)
        top = _largest(x, size)
    cut = top.gather(-1, needed - 1)
    if per_row:
        cut = torch.where(top_p < 1.0, cut, float("-inf"))
    return torch.where(x < cut, float("-inf"), x)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(-1); on the CPU over an fp32 cast (the same index: the cast is exact and both take the first
    maximum), since there an argmax over bf16 takes 4x as long as the cast and an fp32 argmax together."""
    return (logits.float() if logits.device.type == "cpu" else logits).argmax(-1)


def probabilities(logits: torch.Tensor, p: SamplingRule) -> torch.Tensor:
    """fp32 probabilities after temperature, top-k and top-p (nucleus) filtering; logits [..., V]."""
    x = logits.float()
    if p.temperature != 1.0:
        x = x / max(p.temperature, 1e-6)
    top_k = p.top_k if 0 < p.top_k < x.shape[-1] else 0
    if top_k or p.top_p < 1.0:
        x = _cut(x, top_k, p.top_p, top_k)
    return x.softmax(-1)


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One index per row of weights [..., V] (non-negative, not necessarily normalized) for uniforms u [...] in
    [0, 1): the first index whose cumulative weight exceeds u times the row's total, so never an index of zero
    weight (u < 1 keeps u times the total below the total: rounding to nearest cannot reach it). A long row is
    searched in two levels, blocks of `_BLOCK` by their sums and then one block's entries, since a cumulative sum
    along a whole row of a large vocabulary is slow (one pass in order on the CPU, few parallel rows on a GPU)."""
    V = weights.shape[-1]
    if V <= 2 * _BLOCK:
        cdf = weights.cumsum(-1)
        t = u[..., None] * cdf[..., -1:]
        return torch.searchsorted(cdf, t, right=True).squeeze(-1).clamp_max(V - 1)
    n = V // _BLOCK  # whole blocks, then the rest (possibly empty) as one more
    sums = torch.cat([weights[..., :n * _BLOCK].unflatten(-1, (n, _BLOCK)).sum(-1),
                      weights[..., n * _BLOCK:].sum(-1, keepdim=True)], dim=-1)
    cdf = sums.cumsum(-1)
    t = u[..., None] * cdf[..., -1:]
    block = torch.searchsorted(cdf, t, right=True).clamp_max(n)  # [..., 1]: its sum is > 0
    t = t - torch.where(block > 0, cdf.gather(-1, (block - 1).clamp_min(0)), 0.0)  # the mass to go inside it
    at = block * _BLOCK + torch.arange(_BLOCK, device=weights.device)
    inner = weights.gather(-1, at.clamp_max(V - 1)) * (at < V)
    cdf = inner.cumsum(-1)
    t = torch.minimum(t.clamp_min(0.0), torch.nextafter(cdf[..., -1:], torch.zeros_like(t)))  # rounding: stay inside
    return (block * _BLOCK + torch.searchsorted(cdf, t, right=True).clamp_max(_BLOCK - 1)).squeeze(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of probs [..., V] (weights: need not sum to 1), by inverse CDF."""
    u = torch.rand(probs.shape[:-1], device=probs.device, generator=generator)
    return inverse_cdf(probs, u)


def choose(logits: torch.Tensor, p: SamplingRule, generator: torch.Generator | None):
    """Return (tokens, probs or None): argmax when greedy, else a sample and the distribution it came from."""
    if p.greedy:
        return argmax(logits), None
    probs = probabilities(logits, p)
    return sample(probs, generator), probs


def _within(limit: torch.Tensor | None, G: int, device) -> torch.Tensor | bool:
    """[B, G] whether draft slot i is within each row's Γ (`limit` [B], None: every slot)."""
    return True if limit is None else torch.arange(G, device=device)[None, :] < limit[:, None]


def accept_greedy(draft: torch.Tensor, target_logits: torch.Tensor, limit: torch.Tensor | None = None):
    """draft [B, G], target_logits [B, G+1, V] -> (n_accepted [B], next token [B]).

    A draft token is accepted while it equals the target's argmax; the next token is the target's own
    choice at the first mismatch (or the bonus token after the last draft token). limit [B]: each row's own Γ
    (<= G): its drafts past it are not looked at, so its result is that of a step of Γ = limit[b]."""
    target_choice = argmax(target_logits)  # [B, G+1]
    match = ((draft == target_choice[:, :-1]) & _within(limit, draft.shape[1], draft.device)).int()
    n_acc = match.cumprod(dim=1).sum(dim=1)
    next_tok = target_choice.gather(1, n_acc[:, None]).squeeze(1)
    return n_acc, next_tok


def _verify(draft: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor, u: torch.Tensor,
            limit: torch.Tensor | None = None):
    """The acceptance test of speculative sampling with uniforms u [B, G]: (n_accepted [B], the weights [B, V] to
    draw the next token from: the residual max(0, p - q) at the first rejected slot, p itself after the row's last
    draft token (its `limit`, default G) or where the residual has no mass)."""
    B, G = draft.shape
    p_x = target_probs[:, :G].gather(2, draft[..., None]).squeeze(2)
    q_x = draft_probs.gather(2, draft[..., None]).squeeze(2)
    # u < p/q without dividing by a possibly tiny q
    n_acc = ((u * q_x <= p_x) & _within(limit, G, draft.device)).int().cumprod(dim=1).sum(dim=1)
    rows = torch.arange(B, device=draft.device)
    p_at = target_probs[rows, n_acc]  # [B, V]: target distribution at the first rejected slot (or bonus)
    last = G if limit is None else limit
    q_at = draft_probs[rows, n_acc.clamp_max(G - 1)] * (n_acc < last)[:, None]  # none after the last draft token
    residual = (p_at - q_at).clamp_min(0)
    return n_acc, torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_at)


def accept_speculative(draft: torch.Tensor, draft_probs: torch.Tensor, target_logits: torch.Tensor,
                       p: SamplingRule, generator: torch.Generator | None, limit: torch.Tensor | None = None):
    """Lossless speculative sampling (Leviathan et al. / Chen et al.).

    Accept draft token x_i with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection sample from
    the residual norm(max(0, p_i - q_i)); if all are accepted sample the bonus token from p_{G+1}. The output
    then follows the target's (processed) distribution exactly."""
    B, G = draft.shape
    target_probs = probabilities(target_logits, p)  # [B, G+1, V]
    u = torch.rand(B, G, device=draft.device, generator=generator)
    n_acc, weights = _verify(draft, draft_probs, target_probs, u, limit)
    return n_acc, sample(weights, generator)


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
                      generator: torch.Generator | None, limit: torch.Tensor | None = None):
    """Acceptance-controlled verification, for benchmarks with random weights only: draft token i is accepted
    with probability `accept_prob`, independently, until the first rejection (so E[tokens per step] =
    (1 - p^(Γ+1)) / (1 - p)). The next token is the target's argmax at the first rejected slot, as in greedy
    verification: every computation of the real method still runs, only the accept decision is replaced."""
    B, G = draft.shape
    u = torch.rand(B, G, device=draft.device, generator=generator)
    n_acc = ((u < accept_prob) & _within(limit, G, draft.device)).int().cumprod(dim=1).sum(dim=1)
    next_tok = argmax(target_logits).gather(1, n_acc[:, None]).squeeze(1)
    return n_acc, next_tok


class RowSampling:
    """Per-sequence sampling parameters of a batch whose requests differ (the serving engine's slots).

    Rows sharing one `SamplingRule` and the batch's generator (`uniform`) take the batched functions above
    unchanged. Otherwise every row is processed with its own temperature / top-k / top-p read from device tensors
    (greedy rows by argmax), and draws its random numbers from `counter_uniform` with its own seed: a request's
    `seed` when it has one (its tokens then do not depend on what else is in the batch), else a seed drawn at
    admission from a host generator seeded with the batch's seed. Nothing in that path loops over rows on the host
    or depends on the rows' values, so a step over a mixed batch is captured as one CUDA graph like a uniform one
    (the runner's device step keeps one graph per mode). Whether any sampled row uses top-k or top-p is known on
    the host: a batch without them skips the cuts (mode "mixed"), one with them takes them (mode "mixed-cut")."""

    def __init__(self, batch: int, default: SamplingRule, generator: torch.Generator | None,
                 seed: int = 0) -> None:
        self.params = [default] * batch
        self.seeded = [False] * batch
        self.default, self.generator = default, generator
        dev = generator.device if generator is not None else torch.device("cpu")
        self._temp = torch.full((batch,), max(default.temperature, 1e-6), dtype=torch.float32, device=dev)
        self._top_k = torch.full((batch,), default.top_k if default.filters else 0, dtype=torch.long, device=dev)
        self._top_p = torch.full((batch,), default.top_p if default.filters else 1.0, dtype=torch.float32,
                                 device=dev)
        self._greedy = torch.full((batch,), default.greedy, dtype=torch.bool, device=dev)
        self._seeds = torch.zeros(batch, dtype=torch.long, device=dev)
        self._offsets = torch.zeros(batch, dtype=torch.long, device=dev)
        self._host_seeds = torch.Generator().manual_seed(seed)  # seeds of unseeded rows, in admission order

    def reseed(self, seed: int) -> None:
        """Restart the seeds of unseeded rows (a new offline run: its draws do not depend on earlier runs)."""
        self._host_seeds.manual_seed(seed)

    def set_row(self, row: int, params: SamplingRule, seed: int | None, device=None) -> None:
        """A row's new rule and seed (in place: a captured graph reads the same tensors)."""
        self.params[row] = params
        self.seeded[row] = seed is not None
        if seed is None:
            seed = int(torch.randint(0, 1 << 62, (1,), generator=self._host_seeds))
        self._temp[row] = max(params.temperature, 1e-6)
        self._top_k[row] = params.top_k if params.filters else 0
        self._top_p[row] = params.top_p if params.filters else 1.0
        self._greedy[row] = params.greedy
        self._seeds[row] = i64(seed * 0x2545F4914F6CDD1D + 1)  # spread small seeds over 64 bits
        self._offsets[row] = 0

    @property
    def uniform(self) -> bool:
        return all(p == self.default for p in self.params) and not any(self.seeded)

    @property
    def greedy(self) -> bool:
        return all(p.greedy for p in self.params)

    def row_keys(self, greedy_key: int) -> torch.Tensor:
        """[B] int64: one key per row for the random choices made for a row outside its token choice (the sampled
        tail of sparse verification: dustin/selection/tail.py). A sampled row's is its own seed (its request's, or
        the one drawn at admission), so that its tail is as reproducible as its tokens; a greedy row's is
        `greedy_key`, the same for every greedy row, so that greedy output depends on nothing but the row itself:
        the same run to run, alone or in any batch, in any slot."""
        return torch.where(self._greedy, i64(greedy_key), self._seeds)

    @property
    def mode(self) -> str:
        """Which code path a step takes: "uniform" (the batch's rule and generator), "greedy" (per-row settings,
        every row greedy: argmax), "mixed" (per-row rules and counter noise) or "mixed-cut" (the same with top-k /
        top-p cuts). A captured step graph is one mode's."""
        if self.uniform:
            return "uniform"
        if self.greedy:
            return "greedy"
        return "mixed-cut" if any(p.filters for p in self.params) else "mixed"

    def _noise(self, n: int) -> torch.Tensor:
        """[B, n] per-row uniforms; each row's counter advances by n."""
        u = counter_uniform(self._seeds, self._offsets, n)
        self._offsets.add_(n)
        return u

    def skip(self, n: int) -> None:
        """Advance every row's counter by n draws (in place): a step takes the same number of draws per row
        whatever its Γ (engine/worker/step.py), so a seeded row's numbers do not depend on the Γ of the rows beside
        it."""
        if n:
            self._offsets.add_(n)

    def _distributions(self, x: torch.Tensor) -> torch.Tensor:
        """Per-row probabilities of fp32 logits x [B, ..., V] after each row's temperature, top-k and top-p (the
        rules of `probabilities`); a greedy row's are those of a near-zero temperature (its token is the argmax)."""
        shape = (x.shape[0],) + (1,) * (x.dim() - 1)
        x = x / self._temp.view(shape)
        if not any(p.filters for p in self.params):
            return x.softmax(-1)
        if x.device.type == "cpu":  # no graph here: the rules on the host choose the work
            top_p = self._top_p.view(shape) if any(p.filters and p.top_p < 1.0 for p in self.params) else 1.0
            k_need = max((p.top_k for p in self.params if p.filters), default=0)
        else:  # the same work for every batch of this mode (mode "mixed-cut": one graph)
            top_p, k_need = self._top_p.view(shape), x.shape[-1]
        return _cut(x, self._top_k.view(shape), top_p, k_need).softmax(-1)

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """`_distributions` of logits in any dtype, with a greedy row's argmax as a one-hot (the distribution its
        token comes from)."""
        x = logits.float()  # cast once, for the argmax and the distributions
        probs = self._distributions(x)
        one_hot = torch.zeros_like(probs).scatter_(-1, argmax(x)[..., None], 1.0)
        return torch.where(self._greedy.view((-1,) + (1,) * (probs.dim() - 1)), one_hot, probs)

    def sample(self, weights: torch.Tensor) -> torch.Tensor:
        """Inverse-CDF sampling of weights [B, ..., V] with per-row counter noise."""
        u = self._noise(weights[0, ..., 0].numel()).view(weights.shape[:-1])
        return inverse_cdf(weights, u)

    def choose(self, logits: torch.Tensor):
        """logits [B, V] -> (tokens [B], probs [B, V] or None when every row is greedy)."""
        if self.uniform:
            return choose(logits, self.default, self.generator)
        if self.greedy:
            return argmax(logits), None
        probs = self.probabilities(logits)
        return self.sample(probs), probs  # a greedy row's one-hot draws its argmax

    def accept(self, drafts: torch.Tensor, draft_probs: torch.Tensor | None, target_logits: torch.Tensor,
               limit: torch.Tensor | None = None, stride: int = 0):
        """Greedy rows: the greedy rule; sampled rows: lossless speculative sampling with their own params.
        limit [B]: each row's own Γ (None: all G drafts); stride: draws each row's acceptance test takes whatever
        G is (at least G; the next token's draw follows them)."""
        if self.uniform:
            if self.default.greedy:
                return accept_greedy(drafts, target_logits, limit)
            return accept_speculative(drafts, draft_probs, target_logits, self.default, self.generator, limit)
        if self.greedy:
            return accept_greedy(drafts, target_logits, limit)
        x = target_logits.float()  # cast once, for the argmax and the distributions
        G = drafts.shape[1]
        n_g, next_g = accept_greedy(drafts, x, limit)
        u = self._noise(G)
        self.skip(max(stride - G, 0))
        n_s, weights = _verify(drafts, draft_probs, self._distributions(x), u, limit)
        next_s = self.sample(weights)
        return torch.where(self._greedy, n_g, n_s), torch.where(self._greedy, next_g, next_s)

    def choose_row(self, row: int, logits: torch.Tensor) -> torch.Tensor:
        """The first token of one sequence (after its prefill): logits [1, V] -> [1]. A uniform batch draws from
        the batch's generator (as a whole-batch prefill does); otherwise from the row's own counter."""
        p = self.params[row]
        if p.greedy:
            return argmax(logits)
        if self.uniform:
            return sample(probabilities(logits, p), self.generator)
        u = counter_uniform(self._seeds[row:row + 1], self._offsets[row:row + 1], 1)
        self._offsets[row:row + 1].add_(1)
        return inverse_cdf(probabilities(logits, p), u.view(1))
