"""Lossless speculative decoding with an EAGLE-3 drafter: chain, EAGLE-2 dynamic tree, and that tree with
prompt-lookup branches grafted on (hybrid).

Each round the drafter proposes tokens, the target verifies all of them in one forward pass, and the
longest acceptable prefix plus one target token (the bonus) is kept. At temperature 0 acceptance is
"equals the target's argmax"; above 0 it is rejection sampling, so the output distribution is exactly
the target's. Both KV caches are rolled back to the accepted tokens after every round.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from draftsmith.core.errors import UsageError
from draftsmith.model.drafter import Eagle3Drafter, KVCache
from draftsmith.model.kinds import get_kind
from draftsmith.model.target import Target, context_budget
from draftsmith.stages.block_decode import BlockSpec, new_block_cache, propose_block, resolve_block_spec, scatter_q

#: The longest draft (chain K, tree depth, prompt-lookup K). Acceptance decays geometrically with the draft
#: position (EAGLE-3 chains use K 3-8, its trees depth 5-8), so past a few dozen positions nothing is ever
#: accepted, while every drafted token costs a drafter step and a verified position per round.
MAX_DRAFT_LENGTH = 64
#: The most tokens one tree verify pass checks (root incl.; EAGLE-2 uses 60). Beyond ~1k a verify pass costs
#: as much as a prefill and its attention mask grows with the square.
MAX_TREE_TOKENS = 1024
#: The most candidate nodes one tree drafting round scores (``TreeSpec.candidates``: each level expands top_k
#: nodes by top_k children). Drafting cost grows with it, i.e. with top_k squared: at depth 3 a CPU decoded
#: 52.5 / 11.0 / 2.8 / 0.28 tok/s for top_k 8 / 64 / 128 / 256, and 64,256,1024 asked for 38.8 GB.
MAX_TREE_CANDIDATES = 16384


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self):
        if not 0 <= self.temperature < float("inf"):  # NaN fails too
            raise UsageError(f"temperature must be >= 0 and finite, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise UsageError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise UsageError(f"top_k must be >= 0 (0: off), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class ChainSpec:
    """Draft k tokens one after another."""

    k: int

    def __post_init__(self):
        _check_length("chain length", self.k)

    @property
    def max_draft_tokens(self) -> int:
        return self.k

    @property
    def max_accepted(self) -> int:
        """The most drafted tokens one verify pass can accept."""
        return self.k


@dataclass(frozen=True)
class TreeSpec:
    """EAGLE-2 dynamic tree: ``depth`` levels, ``top_k`` per expansion, ``total_tokens`` verified (root incl.)."""

    depth: int
    top_k: int
    total_tokens: int

    def __post_init__(self):
        if self.depth < 1 or self.top_k < 1 or self.total_tokens < 2:
            raise UsageError(f"tree needs depth >= 1, top_k >= 1, total_tokens >= 2; got {self}")
        _check_length("tree depth", self.depth)
        if self.total_tokens > MAX_TREE_TOKENS:
            raise UsageError(f"tree total_tokens must be at most {MAX_TREE_TOKENS} (a verify pass that long costs "
                             f"a prefill), got {self.total_tokens}")
        if self.candidates > MAX_TREE_CANDIDATES:
            raise UsageError(f"tree {self.depth},{self.top_k},{self.total_tokens} scores {self.candidates} candidate "
                             f"nodes per round (TOPK + (DEPTH-1) x TOPK^2); at most {MAX_TREE_CANDIDATES}: drafting "
                             "cost grows with TOPK squared (EAGLE-2 uses TOPK 10)")

    @property
    def candidates(self) -> int:
        """Nodes one drafting round creates and scores: top_k at depth 1, then top_k x top_k per further level."""
        return self.top_k + (self.depth - 1) * self.top_k * self.top_k

    @property
    def max_draft_tokens(self) -> int:
        return self.total_tokens - 1

    @property
    def max_accepted(self) -> int:
        """One root-to-leaf path is accepted: at most ``depth`` tokens."""
        return self.depth

    @classmethod
    def parse(cls, text: str) -> TreeSpec:
        try:
            depth, top_k, total = (int(x) for x in text.split(","))
        except ValueError as e:
            raise UsageError(f"--tree wants DEPTH,TOPK,TOTAL (e.g. 5,8,48), got {text!r}") from e
        return cls(depth, top_k, total)


@dataclass(frozen=True)
class NgramSpec:
    """Prompt lookup (n-gram) drafting: the free baseline EAGLE-3 has to beat. No drafter model at all."""

    k: int = 3
    max_ngram: int = 3
    min_ngram: int = 1

    def __post_init__(self):
        _check_length("prompt lookup length", self.k)
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise UsageError(f"prompt lookup needs 1 <= min_ngram <= max_ngram, got {self.min_ngram}, "
                             f"{self.max_ngram}")

    @property
    def max_draft_tokens(self) -> int:
        return self.k

    @property
    def max_accepted(self) -> int:
        return self.k

    @property
    def ngram_label(self) -> str:
        """'' for the default n-gram sizes (1-3), else e.g. ' (n>=2)': what names of methods append."""
        if (self.min_ngram, self.max_ngram) == (1, 3):
            return ""
        return f" (n>={self.min_ngram})" if self.max_ngram == 3 else f" (n {self.min_ngram}-{self.max_ngram})"


@dataclass(frozen=True)
class HybridSpec:
    """The EAGLE-2 tree plus the prompt-lookup continuation grafted under its root, verified in one pass.

    Lookup wins on text that repeats its context (summaries, RAG, code edits), the drafter elsewhere;
    each round keeps whichever path the target accepts furthest. ``lookup.min_ngram`` 2 grafts only where
    two or more tokens recur: a lone recurring token's continuation is seldom right in prose, and in rounds
    without a graft the verify pass is the tree's alone.
    """

    tree: TreeSpec
    lookup: NgramSpec = field(default_factory=NgramSpec)

    @property
    def max_draft_tokens(self) -> int:
        return self.tree.max_draft_tokens + self.lookup.k

    @property
    def max_accepted(self) -> int:
        return max(self.tree.max_accepted, self.lookup.k)

    @classmethod
    def parse(cls, tree: str | None, k: int, min_ngram: int = 1) -> HybridSpec:
        if not tree:
            raise UsageError("--hybrid grafts prompt lookup onto a draft tree: give --tree DEPTH,TOPK,TOTAL too")
        return cls(TreeSpec.parse(tree), NgramSpec(k, max(3, min_ngram), min_ngram))


def _check_length(what: str, k: int) -> None:
    if k < 1:
        raise UsageError(f"{what} must be >= 1, got {k}")
    if k > MAX_DRAFT_LENGTH:
        raise UsageError(f"{what} must be at most {MAX_DRAFT_LENGTH} (acceptance dies out long before), got {k}")


def ngram_match(context: list[int], spec: NgramSpec) -> tuple[int, list[int]]:
    """(n, the k tokens that followed the latest earlier occurrence of the context's last n-gram), longest n
    first; (0, []) when no n-gram of ``spec``'s sizes recurs. The match length is how far to trust it."""
    for n in range(spec.max_ngram, spec.min_ngram - 1, -1):
        if len(context) <= n:
            continue
        tail = context[-n:]
        for start in range(len(context) - n - 1, -1, -1):
            if context[start: start + n] == tail:
                return n, context[start + n: start + n + spec.k]
    return 0, []


def ngram_propose(context: list[int], spec: NgramSpec) -> list[int]:
    """Prompt lookup's proposal: what followed the context's last n-gram before (see ``ngram_match``)."""
    return ngram_match(context, spec)[1]


@dataclass
class DecodeResult:
    """Per-request report. ``acceptance_length`` counts tokens per verification pass, as vLLM does."""

    token_ids: list[int]
    prompt_length: int
    target_forward_passes: int = 0
    accepted_per_step: list[int] = field(default_factory=list)  # drafted tokens accepted per verify pass
    drafted_per_step: list[int] = field(default_factory=list)
    lookup_accepted_per_step: list[int] = field(default_factory=list)  # hybrid: of those, proposed by lookup only
    prefill_time: float = 0.0
    draft_time: float = 0.0
    verify_time: float = 0.0
    total_time: float = 0.0

    @property
    def acceptance_length(self) -> float:
        if not self.accepted_per_step:
            return 1.0
        return 1.0 + sum(self.accepted_per_step) / len(self.accepted_per_step)

    @property
    def tokens_per_second(self) -> float:
        return len(self.token_ids) / self.total_time if self.total_time > 0 else 0.0

    def accepted_per_position(self, max_len: int) -> list[int]:
        """How many verify passes accepted at least i+1 drafted tokens, for i < max_len."""
        return [sum(1 for a in self.accepted_per_step if a > i) for i in range(max_len)]

    def to_dict(self) -> dict:
        return {
            "token_ids": self.token_ids,
            "num_tokens": len(self.token_ids),
            "prompt_length": self.prompt_length,
            "acceptance_length": self.acceptance_length,
            "target_forward_passes": self.target_forward_passes,
            "accepted_per_step": self.accepted_per_step,
            "lookup_accepted_per_step": self.lookup_accepted_per_step,
            "tokens_per_second": self.tokens_per_second,
            "prefill_time": self.prefill_time,
            "draft_time": self.draft_time,
            "verify_time": self.verify_time,
            "total_time": self.total_time,
        }


# --- sampling ------------------------------------------------------------------------------------------
def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The target's sampling distribution after temperature, top-k and top-p (float32)."""
    logits = logits.float() / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs >= params.top_p  # keep the smallest prefix reaching top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits.softmax(-1)


def _sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def _uniform(generator: torch.Generator | None, device) -> float:
    return float(torch.rand((), generator=generator, device=device))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- the decoder -----------------------------------------------------------------------------------------
class SpeculativeDecoder:
    """Batch-1 decoding of one request, plain (no drafter) or speculative (chain or tree)."""

    def __init__(self, target: Target, drafter: Eagle3Drafter | None = None,
                 spec: ChainSpec | TreeSpec | NgramSpec | HybridSpec | BlockSpec | None = None):
        """``drafter`` of any kind (model/kinds.py): a block drafter drafts ``BlockSpec`` blocks."""
        blocks = drafter is not None and get_kind(drafter.kind).drafts_blocks
        if drafter is not None and spec is None:
            spec = BlockSpec() if blocks else ChainSpec(3)
        if drafter is None and spec is not None and not isinstance(spec, NgramSpec):
            raise UsageError(f"{type(spec).__name__} drafting needs a drafter")
        if drafter is not None and blocks != isinstance(spec, BlockSpec):
            raise UsageError(f"a {drafter.kind} drafter cannot draft {type(spec).__name__}")
        self.target, self.drafter, self.spec = target, drafter, spec
        if blocks:
            self.spec = resolve_block_spec(drafter, target, spec)
        elif drafter is not None:
            from draftsmith.model.drafter import check_fits

            check_fits(drafter.config, target)
            vocab = drafter.config.draft_vocab_size
            tree_spec = spec.tree if isinstance(spec, HybridSpec) else spec
            if isinstance(tree_spec, TreeSpec) and tree_spec.top_k > vocab:
                raise UsageError(f"tree top_k {tree_spec.top_k} exceeds the drafter's draft vocabulary of {vocab} "
                                 "tokens")
        self._stop_ids: set[int] = set()

    @torch.no_grad()
    def generate(self, prompt_ids: Iterable[int] | torch.Tensor, max_new_tokens: int = 128,
                 sampling: SamplingParams = SamplingParams(), eos_token_ids: Iterable[int] = (),
                 generator: torch.Generator | None = None) -> DecodeResult:
        device = self.target.device
        ids = torch.as_tensor(list(prompt_ids) if not torch.is_tensor(prompt_ids) else prompt_ids,
                              dtype=torch.long, device=device).reshape(1, -1)
        if ids.shape[1] == 0:
            raise UsageError("prompt must contain at least one token")
        if max_new_tokens < 1:
            raise UsageError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        max_new_tokens = context_budget(self.target, ids.shape[1], max_new_tokens)
        self._stop_ids = set(int(x) for x in eos_token_ids)
        result = DecodeResult(token_ids=[], prompt_length=ids.shape[1])
        t0 = time.perf_counter()
        if self.spec is None:
            self._plain(ids, max_new_tokens, sampling, generator, result)
        else:
            self._speculative(ids, max_new_tokens, sampling, generator, result)
        _sync(device)
        result.total_time = time.perf_counter() - t0
        return result

    def _emit(self, result: DecodeResult, tokens: list[int], max_new_tokens: int) -> bool:
        """Append tokens up to a stop token or the budget; True when decoding is finished."""
        for tok in tokens:
            result.token_ids.append(tok)
            if tok in self._stop_ids or len(result.token_ids) >= max_new_tokens:
                return True
        return False

    def _pick(self, logits: torch.Tensor, sampling: SamplingParams, generator) -> int:
        if sampling.greedy:
            return int(logits.argmax())
        return _sample(logits_to_probs(logits, sampling), generator)

    # --- plain -------------------------------------------------------------------------------------------
    def _plain(self, ids, max_new_tokens, sampling, generator, result: DecodeResult) -> None:
        cache = self.target.new_cache()
        t = time.perf_counter()
        out = self.target(ids, cache=cache, logits_to_keep=1)
        result.target_forward_passes += 1
        tok = self._pick(out.logits[0, -1], sampling, generator)
        result.prefill_time = time.perf_counter() - t
        while not self._emit(result, [tok], max_new_tokens):
            t = time.perf_counter()
            out = self.target(torch.tensor([[tok]], device=ids.device), cache=cache, logits_to_keep=1)
            result.target_forward_passes += 1
            tok = self._pick(out.logits[0, -1], sampling, generator)
            result.verify_time += time.perf_counter() - t

    # --- speculative -------------------------------------------------------------------------------------
    def _speculative(self, ids, max_new_tokens, sampling, generator, result: DecodeResult) -> None:
        target, drafter, device = self.target, self.drafter, ids.device
        blocks = isinstance(self.spec, BlockSpec)
        cache, dcache = target.new_cache(), new_block_cache(drafter) if blocks else KVCache()
        t = time.perf_counter()
        out = target(ids, cache=cache, logits_to_keep=1)
        result.target_forward_passes += 1
        pending = self._pick(out.logits[0, -1], sampling, generator)
        _sync(device)
        result.prefill_time = time.perf_counter() - t
        if self._emit(result, [pending], max_new_tokens):
            return
        # Features for real positions 0..L-1 and, for each, the token that follows it.
        feats = out.aux_hidden_states
        next_ids = torch.cat([ids[:, 1:], torch.tensor([[pending]], device=device)], dim=1)
        length = ids.shape[1]
        prompt = ids[0].tolist()
        while True:
            t = time.perf_counter()
            pos = torch.arange(length - next_ids.shape[1], length, device=device)[None]  # fed since last round
            if drafter is None:  # prompt lookup
                tree = _chain(ngram_propose(prompt + result.token_ids, self.spec))
            elif blocks:
                tree = _chain(*propose_block(drafter, dcache, feats, pos, pending, self.spec.k, sampling, generator))
            else:
                h = drafter(drafter.fuse(feats), next_ids, pos, dcache)[:, -1:]
                if isinstance(self.spec, TreeSpec):
                    tree = self._draft_tree(h, length, dcache, self.spec)
                elif isinstance(self.spec, HybridSpec):
                    tree = self._draft_tree(h, length, dcache, self.spec.tree)
                    tree = _graft(tree, ngram_propose(prompt + result.token_ids, self.spec.lookup))
                else:
                    tree = self._draft_chain(h, length, dcache, sampling, generator)
                # Drafted keys never survive a round: the accepted tokens (drafted, looked up or the bonus) are
                # re-fed next round with the target's features, so lookup nodes need no drafter pass.
                dcache.crop(length)
            _sync(device)
            result.draft_time += time.perf_counter() - t

            t = time.perf_counter()
            out = self._verify(tree, pending, length, cache)
            result.target_forward_passes += 1
            path, bonus = self._accept(tree, out.logits[0], sampling, generator)
            # Keep the prefix, then the root (the pending token) and the accepted nodes.
            cache.keep(length, [0, *path])
            _sync(device)
            result.verify_time += time.perf_counter() - t

            accepted = [tree.tokens[i - 1] for i in path]
            result.accepted_per_step.append(len(accepted))
            result.drafted_per_step.append(len(tree.tokens))
            if isinstance(self.spec, HybridSpec):
                result.lookup_accepted_per_step.append(sum(1 for i in path if i in tree.lookup_only))
            if self._emit(result, [*accepted, bonus], max_new_tokens):
                return
            rows = torch.tensor([0, *path], device=device)
            feats = tuple(a[:, rows] for a in out.aux_hidden_states)
            next_ids = torch.tensor([[*accepted, bonus]], device=device)
            length += len(path) + 1
            pending = bonus

    def _draft_chain(self, h, length, dcache, sampling, generator) -> _Tree:
        """k greedy (or sampled, at temperature > 0) drafter steps; each feeds its own output back."""
        drafter, k = self.drafter, self.spec.k
        tokens, q_probs = [], []
        for j in range(k):
            logits = drafter.logits(h)[0, -1]
            if sampling.greedy:
                draft = int(logits.argmax())
            else:
                q = logits_to_probs(logits, SamplingParams(temperature=sampling.temperature))
                draft = _sample(q, generator)
                q_probs.append(scatter_q(drafter, q))
            tok = int(drafter.d2t[draft]) + draft
            tokens.append(tok)
            if j + 1 < k:
                pos = torch.tensor([[length + j]], device=h.device)
                h = drafter(h, torch.tensor([[tok]], device=h.device), pos, dcache)
        return _chain(tokens, q_probs)

    def _draft_tree(self, h, length, dcache, spec: TreeSpec) -> _Tree:
        """EAGLE-2: expand the top_k best frontier nodes by their top_k children, keep the best overall."""
        drafter, device = self.drafter, h.device
        logp = drafter.logits(h)[0, -1].float().log_softmax(-1)
        score, draft = logp.topk(spec.top_k)
        tokens = drafter.to_target_ids(draft)  # nodes are numbered from 1; 0 is the root
        parents = torch.zeros(spec.top_k, dtype=torch.long, device=device)
        depths = torch.ones(spec.top_k, dtype=torch.long, device=device)
        scores = score
        frontier = torch.arange(1, spec.top_k + 1, device=device)  # node ids to feed next
        frontier_h = h.expand(1, spec.top_k, -1)  # each node is fed with its parent's output
        fed: list[torch.Tensor] = []  # node ids whose keys sit in the drafter cache after the prefix
        for d in range(1, spec.depth):
            fed_ids = torch.cat([*fed, frontier])
            # Node i sees the prefix, then the fed nodes that are its ancestors or itself.
            anc = _ancestors(parents, fed_ids, frontier)
            mask = torch.cat([torch.ones(len(frontier), length, dtype=torch.bool, device=device), anc], dim=1)
            pos = torch.full((1, len(frontier)), length - 1 + d, device=device)
            out = drafter(frontier_h, tokens[frontier - 1][None], pos, dcache, mask[None, None])
            fed.append(frontier)
            logp = drafter.logits(out)[0].float().log_softmax(-1)  # [F, Vd]
            child_score, child_draft = logp.topk(spec.top_k, dim=-1)
            child_score = child_score + scores[frontier - 1][:, None]
            n0 = tokens.numel()
            tokens = torch.cat([tokens, drafter.to_target_ids(child_draft.flatten())])
            parents = torch.cat([parents, frontier.repeat_interleave(spec.top_k)])
            depths = torch.cat([depths, torch.full((child_draft.numel(),), d + 1, device=device)])
            scores = torch.cat([scores, child_score.flatten()])
            best = child_score.flatten().topk(min(spec.top_k, child_score.numel())).indices
            frontier = n0 + 1 + best
            frontier_h = out[0, best // spec.top_k][None]
        keep = min(spec.total_tokens - 1, tokens.numel())
        # Stable sort: on equal scores a parent (lower id) ranks before its child, so the kept set is a tree.
        order = torch.sort(-scores, stable=True).indices[:keep]
        chosen = torch.sort(order).values  # creation order: parents before children
        remap = torch.zeros(tokens.numel() + 1, dtype=torch.long, device=device)
        remap[chosen + 1] = torch.arange(1, keep + 1, device=device)
        return _Tree(tokens=tokens[chosen].tolist(), parents=remap[parents[chosen]].tolist(),
                     depths=depths[chosen].tolist(), scores=scores[chosen].tolist(), is_tree=True)

    def _verify(self, tree: _Tree, pending: int, length: int, cache):
        device = self.target.device
        ids = torch.tensor([[pending, *tree.tokens]], device=device)
        # The block: the pending token from the prefix, each drafted node from its parent (block index = node id).
        cache.begin_block([-1, *tree.parents])
        if not tree.is_tree:
            return self.target(ids, cache=cache)
        n = ids.shape[1]
        parents = torch.tensor([0, *tree.parents], device=device)
        anc = _ancestors(parents[1:], torch.arange(n, device=device), torch.arange(n, device=device), root=True)
        allowed = torch.cat([torch.ones(n, length, dtype=torch.bool, device=device), anc], dim=1)
        dtype = self.target.dtype
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)
        pos = length + torch.tensor([[0, *tree.depths]], device=device)
        return self.target(ids, cache=cache, attention_mask=mask[None, None], position_ids=pos)

    def _accept(self, tree: _Tree, logits: torch.Tensor, sampling: SamplingParams, generator):
        """Walk from the root; return (accepted node ids, bonus token)."""
        children: dict[int, list[int]] = {}
        for i, p in enumerate(tree.parents, start=1):
            children.setdefault(p, []).append(i)
        if tree.is_tree:  # try children in order of draft score
            for kids in children.values():
                kids.sort(key=lambda i: -tree.scores[i - 1])
        path, node = [], 0
        while True:
            kids = children.get(node, [])
            if sampling.greedy:
                best = int(logits[node].argmax())
                nxt = next((c for c in kids if tree.tokens[c - 1] == best), None)
                if nxt is None:
                    return path, best
            else:
                p = logits_to_probs(logits[node], sampling)
                nxt = None
                if tree.q_probs and kids:  # a sampled chain draft: accept with min(1, p/q)
                    c = kids[0]
                    x, q = tree.tokens[c - 1], tree.q_probs[c - 1]
                    if _uniform(generator, p.device) * float(q[x]) < float(p[x]):
                        nxt = c
                    else:
                        residual = (p - q).clamp_min(0)
                        total = residual.sum()
                        return path, _sample(residual / total if total > 0 else p, generator)
                else:  # one-hot drafts (tree children): accept x with prob p(x), else zero it and renormalise
                    for c in kids:
                        x = tree.tokens[c - 1]
                        if _uniform(generator, p.device) < float(p[x]):
                            nxt = c
                            break
                        p[x] = 0.0
                        total = p.sum()
                        if total <= 0:
                            break
                        p = p / total
                    if nxt is None:
                        return path, _sample(p, generator)
            path.append(nxt)
            node = nxt


@dataclass
class _Tree:
    """Drafted tokens as a tree: node i (1-based) has token tokens[i-1] and parent parents[i-1] (0 = root)."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    is_tree: bool
    scores: list[float] = field(default_factory=list)
    q_probs: list[torch.Tensor] = field(default_factory=list)  # sampled chain drafts: q over target vocab
    lookup_only: frozenset[int] = frozenset()  # hybrid: grafted nodes the drafter did not propose


def _chain(tokens: list[int], q_probs: list[torch.Tensor] = ()) -> _Tree:
    """Drafts as a chain: node i's parent is node i-1 (``q_probs``: the sampled drafts' proposal distributions)."""
    return _Tree(tokens=tokens, parents=list(range(len(tokens))), depths=list(range(1, len(tokens) + 1)),
                 q_probs=list(q_probs), is_tree=False)


def _graft(tree: _Tree, chain: list[int]) -> _Tree:
    """Hang a prompt-lookup chain under the root, walking existing nodes while its tokens match theirs.

    Merging keeps siblings distinct, so a token shared with the drafter is one node whose subtree holds both
    continuations; a duplicate would shadow the second copy (greedy follows the first match, sampling zeroes
    a rejected token) and waste its verify slots. New nodes come after their parents, as ``_ancestors`` needs,
    and are one-hot candidates like the drafter's children; they sort last (score -inf) among siblings.
    """
    child = {(p, t): i for i, (p, t) in enumerate(zip(tree.parents, tree.tokens, strict=True), start=1)}
    tokens, parents, depths = list(tree.tokens), list(tree.parents), list(tree.depths)
    scores, new = list(tree.scores), set()
    node = 0
    for depth, tok in enumerate(chain, start=1):
        nxt = child.get((node, tok))
        if nxt is None:
            tokens.append(tok)
            parents.append(node)
            depths.append(depth)
            scores.append(float("-inf"))
            nxt = len(tokens)
            child[(node, tok)] = nxt
            new.add(nxt)
        node = nxt
    return _Tree(tokens=tokens, parents=parents, depths=depths, is_tree=True, scores=scores,
                 lookup_only=frozenset(new))


def _ancestors(parents: torch.Tensor, keys: torch.Tensor, queries: torch.Tensor, root: bool = False):
    """Bool [len(queries), len(keys)]: key is the query itself or one of its ancestors.

    ``parents[i-1]`` is the parent of node i (0 = root). With ``root`` the root (node 0) is an ancestor
    of every node.
    """
    n = parents.numel() + 1
    parent = torch.cat([torch.zeros(1, dtype=torch.long, device=parents.device), parents])
    anc = torch.eye(n, dtype=torch.bool, device=parents.device)
    # Nodes are numbered parents-first, so one pass in order fills every ancestor row.
    for i in range(1, n):
        anc[i] |= anc[int(parent[i])]
    if not root:
        anc[:, 0] = False
    return anc[queries][:, keys]
