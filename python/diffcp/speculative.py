"""Speculative decoding with a DFlash drafter, as z-lab's ``dflash_generate`` decodes, greedy or
sampled:

1. prefill: one target forward over the prompt gives the first new token and the context
   features (the target's hidden states of the drafter's layers) of the prompt;
2. per block, at position ``start`` (the last verified token): the drafter drafts ``b - 1``
   tokens from the features of every position before ``start`` and the target's embedding of
   ``[token at start, mask, ..., mask]`` (the drafter's final hidden states, the target's LM head
   on rows ``1 ..``); one target forward verifies the block; accepted drafts plus one token of the
   target's (the correction or the bonus) are produced; the target's cache is cropped to the
   accepted positions and their features join the context.

**Greedy** (``temperature = 0``): drafts are the draft logits' argmax, the longest prefix equal to
the target's argmax is accepted, plus the target's own next token. Lossless: the output equals the
target's own greedy generation token for token (up to ties in the target's argmax between a
batched and a one-token forward, which a float64 target does not have).

**Sampled** (``temperature > 0``): speculative sampling (Leviathan et al. 2023, Chen et al. 2023),
the acceptance rule DFlash's paper uses. Target and draft logits go through the same warping
(``/ temperature``, then ``top_k``, then ``top_p``) to distributions p and q. Draft token
x_i ~ q_i; it is accepted with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection the
token is drawn from the normalised residual max(0, p_i - q_i) and the block ends; when all are
accepted, the bonus is drawn from the target's next p. Lossless in distribution: the output is
distributed as the target's own sampling with the same warping (tests/test_speculative.py
compares the first tokens' distribution with the exact one). ``seed`` makes a generation
reproducible (one ``torch.Generator``).

**DFlash2** (``DFlash2DraftModel`` drafters): the candidate selector drafts
(:meth:`diffcp.Drafter.propose_logits`): greedy, the selector's path; sampled, each token drawn
from q = softmax(scores / temperature) over the row's candidates (no top-k / top-p on q, as the
reference), and verified as above with q zero outside the candidates: accept with
min(1, p / q), on rejection draw from max(0, p - q) renormalised (z-lab's rule). Lossless as
above: the target's greedy output, or its law.

**Draft KV cache**: with a :class:`diffcp.Drafter`, the context's K/V of every drafter layer are
kept (:meth:`diffcp.Drafter.new_cache`) and the accepted positions appended, so a block's cost does
not grow with the context; ``draft_cache=False`` drafts statelessly (the whole context each block).

``stats["acceptance_lengths"]`` holds each block's produced tokens (accepted drafts + 1), whose
mean is tau (SPEC A.1's acceptance length).

Works with a transformers causal LM (``model(input_ids, position_ids=..., past_key_values=...,
use_cache=True, output_hidden_states=True)`` with a ``DynamicCache``, cropped to the accepted
positions with ``crop(-removed)``; transformers 4.x and 5.x) or any module with that call signature that returns
``.logits`` and ``.hidden_states`` (then ``use_cache=False``: each forward recomputes the whole
sequence), ``get_input_embeddings()`` and ``get_output_embeddings()`` (or ``lm_head``).
"""
from __future__ import annotations

import time

import numpy as np

__all__ = ["generate", "warp", "verify_sampled"]


class _Target:
    """The target's forwards over new positions, with or without a KV cache."""

    def __init__(self, model, use_cache):
        import torch
        self.model = model
        self.torch = torch
        if use_cache is None:
            try:
                import transformers
                use_cache = isinstance(model, transformers.PreTrainedModel)
            except ImportError:
                use_cache = False
        self.cache = None
        if use_cache:
            from transformers import DynamicCache
            try:
                self.cache = DynamicCache(config=model.config)  # transformers 5.x
            except TypeError:
                self.cache = DynamicCache()  # 4.x
            if hasattr(self.cache, "activate_past_recording"):  # 5.x: sliding-window layers can then be cropped
                self.cache.activate_past_recording()
        self.seq = None  # without a cache: the tokens so far
        self.forwards = 0

    def __call__(self, ids, start: int, layer_ids):
        """ids: LongTensor [n] at positions start .. start+n-1 -> (logits [n, V], features [n, n_t*H])."""
        torch = self.torch
        n = ids.shape[0]
        self.forwards += 1
        if self.cache is not None:
            out = self.model(ids[None], position_ids=torch.arange(start, start + n)[None], past_key_values=self.cache,
                             use_cache=True, output_hidden_states=True)
            logits, hidden = out.logits[0], [h[0] for h in out.hidden_states]
        else:
            self.seq = ids if self.seq is None else torch.cat([self.seq[:start], ids])
            out = self.model(self.seq[None], position_ids=torch.arange(self.seq.shape[0])[None],
                             output_hidden_states=True)
            logits, hidden = out.logits[0, -n:], [h[0, -n:] for h in out.hidden_states]
        # transformers: hidden_states[0] is the embedding output, hidden_states[l + 1] layer l's
        feats = torch.cat([hidden[l + 1] for l in layer_ids], dim=-1)
        return logits, feats

    def crop(self, length: int):
        if self.cache is not None:
            # crop(-n) removes n positions in transformers 4.x and 5.x (5.x refuses crop(length))
            remove = self.cache.get_seq_length() - length
            if remove > 0:
                self.cache.crop(-remove)
        elif self.seq is not None:
            self.seq = self.seq[:length]


def warp(logits, temperature: float, top_k: int = 0, top_p: float = 1.0):
    """The sampling distribution of ``logits`` ``[..., V]`` (float64): ``softmax(logits /
    temperature)`` restricted to the ``top_k`` most likely tokens (0 = all), then to the smallest
    set of most likely tokens whose mass reaches ``top_p`` (1 = all; the token that crosses it is
    kept), renormalised. transformers' ``TopKLogitsWarper`` / ``TopPLogitsWarper`` order (ties at
    the k-th logit are all kept)."""
    import torch
    x = logits.double() / temperature
    if top_k and top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    p = torch.softmax(x, dim=-1)
    if top_p < 1.0:
        sp, idx = torch.sort(p, dim=-1, descending=True)
        before = torch.cumsum(sp, dim=-1) - sp  # mass of the tokens ranked above
        sp = sp.masked_fill(before >= top_p, 0.0)
        p = torch.zeros_like(p).scatter(-1, idx, sp)
        p = p / p.sum(dim=-1, keepdim=True)
    return p


def _draw(probs, gen):
    """One token id ~ probs [V] (float64)."""
    import torch
    return int(torch.multinomial(probs, 1, generator=gen))


def verify_sampled(drafts, q, p, gen):
    """Speculative sampling's verification of one block.

    Args:
        drafts: LongTensor ``[k]``, the draft tokens, ``drafts[i] ~ q[i]``.
        q: ``[k, V]`` the draft distributions. p: ``[k + 1, V]`` the target's distributions at the
            block's positions (row i: the token after the block's first i + 1 tokens).
        gen: the ``torch.Generator`` of the generation.

    Returns:
        ``(accepted, token)``: the number of drafts accepted, and the target's token that follows
        them (drawn from the residual at the first rejection, from ``p[k]`` when all are accepted).
    """
    import torch
    k = int(drafts.shape[0])
    for i in range(k):
        x = int(drafts[i])
        if float(torch.rand((), generator=gen, dtype=torch.float64)) * float(q[i, x]) < float(p[i, x]):
            continue  # accepted with probability min(1, p/q)
        residual = torch.clamp(p[i] - q[i], min=0.0)
        total = float(residual.sum())
        return i, _draw(residual / total if total > 0 else p[i], gen)
    return k, _draw(p[k], gen)


def generate(target, drafter, input_ids, max_new_tokens: int, block_size: int | None = None,
             stop_token_ids=None, use_cache: bool | None = None, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, seed: int = 0, draft_cache: bool | None = None):
    """Speculative decoding of ``max_new_tokens`` tokens after ``input_ids``, greedy or sampled.

    Args:
        target: the target model (see the module doc), in eval mode, on the CPU.
        drafter: a :class:`diffcp.Drafter` trained for this target (its ``target_layer_ids`` name
            the target's layers; its mask token is a token id of the target's vocabulary).
        input_ids: LongTensor ``[n]`` or ``[1, n]``, the prompt.
        max_new_tokens: tokens to generate (fewer if a stop token comes first).
        block_size: tokens per block (``1 .. drafter.block_size``; 1 drafts nothing: plain
            decoding); ``None`` = the drafter's.
        stop_token_ids: token ids that end the generation (included in the output).
        use_cache: the target's KV cache; ``None`` = for transformers models.
        temperature: 0 = greedy; > 0 samples (speculative sampling, lossless in distribution).
        top_k: sample among the k most likely tokens only (0 = all). top_p: nucleus mass (1 = all).
        seed: the seed of the sampling's ``torch.Generator``.
        draft_cache: draft from a :meth:`diffcp.Drafter.new_cache` KV cache (``None``: when the
            drafter has one); ``False``: the stateless draft of the whole context per block.

    Returns:
        ``(output_ids, stats)``: LongTensor ``[1, n + new]`` (the prompt and the new tokens) and a
        dict: ``acceptance_lengths`` (list, per block: accepted drafts + 1), ``tau`` (their mean),
        ``new_tokens``, ``target_forwards`` (prefill included), ``tokens_per_target_forward``
        (new tokens / target forwards, prefill included: plain decoding makes 1),
        ``draft_calls``, ``seconds``, ``target_seconds`` (the target's forwards, prefill
        included), ``draft_seconds`` (drafting: the drafter, its cache's appends and the LM head).
    """
    import torch
    dflash2 = getattr(drafter, "config", {}).get("architecture") == "DFlash2DraftModel"
    B = drafter.block_size if block_size is None else int(block_size)
    if not 1 <= B <= drafter.block_size:
        raise ValueError(f"block_size = {block_size}: expected 1 .. the drafter's block_size = {drafter.block_size}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens = {max_new_tokens}: expected >= 1")
    if not temperature >= 0:
        raise ValueError(f"temperature = {temperature}: expected >= 0 (0 = greedy)")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p = {top_p}: expected 0 < top_p <= 1")
    if top_k < 0:
        raise ValueError(f"top_k = {top_k}: expected >= 0 (0 = all tokens)")
    ids = torch.as_tensor(input_ids).reshape(-1).long().cpu()
    if ids.numel() < 1:
        raise ValueError("input_ids: the prompt is empty")
    if draft_cache is None:
        draft_cache = hasattr(drafter, "new_cache")
    elif draft_cache and not hasattr(drafter, "new_cache"):
        raise ValueError(f"draft_cache = True: {type(drafter).__name__} has no new_cache()")
    embed = target.get_input_embeddings()
    head = target.get_output_embeddings() if hasattr(target, "get_output_embeddings") else None
    head = head if head is not None else target.lm_head
    stops = torch.as_tensor(list(stop_token_ids or []), dtype=torch.long)
    layer_ids = drafter.target_layer_ids
    run = _Target(target, use_cache)
    sampled = temperature > 0
    gen = torch.Generator().manual_seed(int(seed))
    dist = (lambda logits: warp(logits, temperature, top_k, top_p)) if sampled else None
    t0 = time.perf_counter()
    t_target = t_draft = 0.0
    with torch.no_grad():
        n0 = ids.numel()
        max_length = n0 + max_new_tokens
        out = torch.full((max_length + 1,), drafter.mask_token_id, dtype=torch.long)
        out[:n0] = ids
        t1 = time.perf_counter()
        logits, feats = run(ids, 0, layer_ids)
        t_target += time.perf_counter() - t1
        out[n0] = _draw(dist(logits[-1]), gen) if sampled else int(torch.argmax(logits[-1]))
        t1 = time.perf_counter()
        cache = drafter.new_cache() if draft_cache else None
        context = [feats]  # without the cache: features of positions 0 .. start-1
        if cache is not None:
            cache.append(feats.float().numpy())
        t_draft += time.perf_counter() - t1
        run.crop(n0)
        start, acceptance, drafts = n0, [], 0
        stopped = bool(torch.isin(out[start:start + 1], stops).any()) if stops.numel() else False
        while start + 1 < max_length and not stopped:
            v = min(B, max_length - start)
            block = out[start:start + v].clone()
            q = None
            if v > 1:
                t1 = time.perf_counter()
                noise = embed(block).float().numpy()
                drafted = cache.draft(noise) if cache is not None else drafter.draft(torch.cat(context).float().numpy(), noise)
                draft_logits = head(torch.from_numpy(drafted[1:]).to(head.weight.dtype))
                if dflash2:  # the candidate selector drafts; q is zero outside each row's candidates
                    draw_seed = int(torch.randint(0, 2 ** 62, (1,), generator=gen)) if sampled else 0
                    path, cand, qc = drafter.propose_logits(drafted[1:], draft_logits.float().numpy(), int(block[0]),
                                                            temperature, draw_seed)
                    block[1:] = torch.from_numpy(path)
                    if sampled:
                        q = torch.zeros(v - 1, draft_logits.shape[-1], dtype=torch.float64)
                        q.scatter_(1, torch.from_numpy(cand), torch.from_numpy(qc).double())
                elif sampled:
                    q = dist(draft_logits)
                    block[1:] = torch.multinomial(q, 1, generator=gen)[:, 0]
                else:
                    block[1:] = torch.argmax(draft_logits, dim=-1)
                drafts += 1
                t_draft += time.perf_counter() - t1
            t1 = time.perf_counter()
            logits, feats = run(block, start, layer_ids)
            t_target += time.perf_counter() - t1
            if sampled:
                p = dist(logits)
                accepted, token = verify_sampled(block[1:], q, p, gen) if v > 1 else (0, _draw(p[0], gen))
            else:
                posterior = torch.argmax(logits, dim=-1)
                accepted = int((block[1:] == posterior[:-1]).int().cumprod(0).sum())
                token = int(posterior[accepted])
            out[start:start + accepted + 1] = block[:accepted + 1]
            out[start + accepted + 1] = token
            produced = min(accepted + 1, max_length - start - 1)
            if stops.numel():
                hit = torch.isin(out[start + 1:start + produced + 1], stops).nonzero()
                if hit.numel():
                    produced = int(hit[0, 0]) + 1
                    stopped = True
            t1 = time.perf_counter()
            if cache is not None:
                cache.append(feats[:produced].float().numpy())
            else:
                context.append(feats[:produced])
            t_draft += time.perf_counter() - t1
            start += produced
            run.crop(start)
            acceptance.append(produced)
    out = out[:min(start + 1, max_length)]
    new = out.numel() - n0
    stats = {
        "acceptance_lengths": acceptance,
        "tau": float(np.mean(acceptance)) if acceptance else 0.0,
        "new_tokens": new,
        "target_forwards": run.forwards,
        "tokens_per_target_forward": new / run.forwards,
        "draft_calls": drafts,
        "seconds": time.perf_counter() - t0,
        "target_seconds": t_target,
        "draft_seconds": t_draft,
    }
    return out[None], stats
