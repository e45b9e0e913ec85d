"""Speculative decoding with a DFlash drafter, as z-lab's ``dflash_generate`` decodes (greedy):

1. prefill: one target forward over the prompt gives the first new token and the context
   features (the target's hidden states of the drafter's layers) of the prompt;
2. per block, at position ``start`` (the last verified token): the drafter drafts ``b - 1``
   tokens from the features of every position before ``start`` and the target's embedding of
   ``[token at start, mask, ..., mask]`` (one :meth:`diffcp.Drafter.draft`, the target's LM head
   on its rows ``1 ..``); one target forward verifies the block; the longest prefix of drafts
   equal to the target's argmax is accepted, plus the target's own next token (the bonus); the
   target's cache is cropped to the accepted positions and their features join the context.

Greedy decoding is lossless: the output equals the target's own greedy generation token for
token (up to ties in the target's argmax between a batched and a one-token forward, which a
float64 target does not have). ``stats["acceptance_lengths"]`` holds each block's produced tokens
(accepted drafts + 1), whose mean is tau (SPEC A.1's acceptance length).

Works with a transformers causal LM (``model(input_ids, position_ids=..., past_key_values=...,
use_cache=True, output_hidden_states=True)`` with a ``DynamicCache``, cropped to the accepted
positions with ``crop(-removed)``; transformers 4.x and 5.x) or any module with that call signature that returns
``.logits`` and ``.hidden_states`` (then ``use_cache=False``: each forward recomputes the whole
sequence), ``get_input_embeddings()`` and ``get_output_embeddings()`` (or ``lm_head``).
"""
from __future__ import annotations

import time

import numpy as np

__all__ = ["generate"]


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


def generate(target, drafter, input_ids, max_new_tokens: int, block_size: int | None = None,
             stop_token_ids=None, use_cache: bool | None = None):
    """Greedy speculative decoding of ``max_new_tokens`` tokens after ``input_ids``.

    Args:
        target: the target model (see the module doc), in eval mode, on the CPU.
        drafter: a :class:`diffcp.Drafter` trained for this target (its ``target_layer_ids`` name
            the target's layers; its mask token is a token id of the target's vocabulary).
        input_ids: LongTensor ``[n]`` or ``[1, n]``, the prompt.
        max_new_tokens: tokens to generate (fewer if a stop token comes first).
        block_size: tokens per block (``1 .. drafter.block_size``; 1 drafts nothing: plain greedy
            decoding); ``None`` = the drafter's.
        stop_token_ids: token ids that end the generation (included in the output).
        use_cache: the target's KV cache; ``None`` = for transformers models.

    Returns:
        ``(output_ids, stats)``: LongTensor ``[1, n + new]`` (the prompt and the new tokens) and a
        dict: ``acceptance_lengths`` (list, per block: accepted drafts + 1), ``tau`` (their mean),
        ``new_tokens``, ``target_forwards`` (prefill included), ``tokens_per_target_forward``
        (new tokens / target forwards, prefill included: plain greedy decoding makes 1),
        ``draft_calls``, ``seconds``.
    """
    import torch
    B = drafter.block_size if block_size is None else int(block_size)
    if not 1 <= B <= drafter.block_size:
        raise ValueError(f"block_size = {block_size}: expected 1 .. the drafter's block_size = {drafter.block_size}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens = {max_new_tokens}: expected >= 1")
    ids = torch.as_tensor(input_ids).reshape(-1).long().cpu()
    if ids.numel() < 1:
        raise ValueError("input_ids: the prompt is empty")
    embed = target.get_input_embeddings()
    head = target.get_output_embeddings() if hasattr(target, "get_output_embeddings") else None
    head = head if head is not None else target.lm_head
    stops = torch.as_tensor(list(stop_token_ids or []), dtype=torch.long)
    layer_ids = drafter.target_layer_ids
    run = _Target(target, use_cache)
    t0 = time.perf_counter()
    with torch.no_grad():
        n0 = ids.numel()
        max_length = n0 + max_new_tokens
        out = torch.full((max_length + 1,), drafter.mask_token_id, dtype=torch.long)
        out[:n0] = ids
        logits, feats = run(ids, 0, layer_ids)
        out[n0] = int(torch.argmax(logits[-1]))
        context = [feats]  # features of positions 0 .. start-1
        run.crop(n0)
        start, acceptance, drafts = n0, [], 0
        stopped = bool(torch.isin(out[start:start + 1], stops).any()) if stops.numel() else False
        while start + 1 < max_length and not stopped:
            v = min(B, max_length - start)
            block = out[start:start + v].clone()
            if v > 1:
                ctx = torch.cat(context).float().numpy()
                noise = embed(block).float().numpy()
                hidden = torch.from_numpy(drafter.draft(ctx, noise)[1:]).to(head.weight.dtype)
                block[1:] = torch.argmax(head(hidden), dim=-1)
                drafts += 1
            logits, feats = run(block, start, layer_ids)
            posterior = torch.argmax(logits, dim=-1)
            accepted = int((block[1:] == posterior[:-1]).int().cumprod(0).sum())
            out[start:start + accepted + 1] = block[:accepted + 1]
            out[start + accepted + 1] = posterior[accepted]
            produced = min(accepted + 1, max_length - start - 1)
            if stops.numel():
                hit = torch.isin(out[start + 1:start + produced + 1], stops).nonzero()
                if hit.numel():
                    produced = int(hit[0, 0]) + 1
                    stopped = True
            context.append(feats[:produced])
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
    }
    return out[None], stats
