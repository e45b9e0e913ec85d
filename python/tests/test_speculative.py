"""diffcp.Drafter and diffcp.speculative.generate (issues #36, #53) with Debian's torch, no transformers:
a tiny float64 causal LM stands in for the target (the call signature of a transformers model, no
KV cache), drafters are written here as DFlash folders (random weights, full and sliding layers).

* Greedy speculative decoding is lossless: the output equals the target's own greedy loop, token
  for token, with a real (random) drafter, full or sliding, and any block size.
* The acceptance logic is exact: an oracle drafter (it knows the greedy continuation) is accepted
  whole (tau = B), one wrong at slot k gets exactly k accepted per block; the stats add up.
* The draft KV cache (issue #53) drafts what the stateless draft does (within f32 rounding), with
  the context appended in pieces; greedy decoding stays lossless with it and without it.
* Speculative sampling is lossless in distribution: one verification step gives tokens distributed
  as p (chi-square, many draws), and the first 3 tokens of whole generations (a 6-token vocabulary,
  a real drafter, many seeds) are distributed as the target's own sampling, computed exactly by
  enumeration; with the acceptance rule broken on purpose (accept every draft; or draw the
  correction from p instead of the residual) the same tests reject.
* Bad input is a ValueError naming it.
"""
import math
import json
import struct
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import diffcp  # noqa: E402

V = H = 32  # the fake target's LM head is the identity: a one-hot hidden row picks its token


class TinyLM(torch.nn.Module):
    """A float64 causal LM with transformers' call signature (recomputes the whole sequence)."""

    def __init__(self, layers=4, seed=0, vocab=V):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = torch.nn.Embedding(vocab, H).double()
        self.emb.weight.data = torch.randn(vocab, H, generator=g, dtype=torch.float64)
        self.qkv = [torch.randn(H, 3 * H, generator=g, dtype=torch.float64) / H ** 0.5 for _ in range(layers)]
        self.mlp = [torch.randn(H, H, generator=g, dtype=torch.float64) / H ** 0.5 for _ in range(layers)]
        self.head = torch.nn.Linear(H, vocab, bias=False).double()
        self.head.weight.data = (torch.eye(V, H, dtype=torch.float64) * 3.0 if vocab == V else
                                 torch.randn(vocab, H, generator=g, dtype=torch.float64) / H ** 0.5)

    def get_input_embeddings(self):
        return self.emb

    def get_output_embeddings(self):
        return self.head

    def forward(self, input_ids, position_ids=None, output_hidden_states=True, **_):
        x = self.emb(input_ids[0])
        n = x.shape[0]
        pos = torch.arange(n, dtype=torch.float64)[:, None]
        x = x + torch.sin(pos / (1 + torch.arange(H, dtype=torch.float64)))  # positions matter
        hidden = [x[None]]
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        for wqkv, wm in zip(self.qkv, self.mlp):
            q, k, v = (x @ wqkv).split(H, dim=-1)
            s = (q @ k.T / H ** 0.5).masked_fill(~causal, float("-inf"))
            x = x + torch.softmax(s, -1) @ v
            x = x + torch.tanh(x @ wm)
            hidden.append(x[None])
        return types.SimpleNamespace(logits=self.head(x)[None], hidden_states=tuple(hidden))


def greedy(target, prompt, n):
    seq = prompt.clone()
    with torch.no_grad():
        for _ in range(n):
            nxt = torch.argmax(target(seq[None]).logits[0, -1])
            seq = torch.cat([seq, nxt[None]])
    return seq


def write_drafter(path, layer_types=None, window=None, block=4, layers=2, seed=1, vocab=V, dflash2=False):
    """A DFlash folder (config.json + model.safetensors) with random weights for the fake target;
    dflash2: z-lab's DFlash2DraftModel layout (convolutions: 2 taps, groups of 8; a selector of rank 4)."""
    path.mkdir(parents=True, exist_ok=True)
    n_t, nq, nkv, d, F = 2, 4, 2, 8, 48
    rng = np.random.default_rng(seed)
    t = {"fc.weight": rng.standard_normal((H, n_t * H)) / np.sqrt(n_t * H), "hidden_norm.weight": 1 + 0.1 * rng.standard_normal(H),
         "norm.weight": 1 + 0.1 * rng.standard_normal(H)}
    for i in range(layers):
        p = f"layers.{i}."
        for name, shape in [("input_layernorm.weight", (H,)), ("post_attention_layernorm.weight", (H,)),
                            ("self_attn.q_norm.weight", (d,)), ("self_attn.k_norm.weight", (d,))]:
            t[p + name] = 1 + 0.1 * rng.standard_normal(shape)
        for name, shape in [("self_attn.q_proj.weight", (nq * d, H)), ("self_attn.k_proj.weight", (nkv * d, H)),
                            ("self_attn.v_proj.weight", (nkv * d, H)), ("self_attn.o_proj.weight", (H, nq * d)),
                            ("mlp.gate_proj.weight", (F, H)), ("mlp.up_proj.weight", (F, H)), ("mlp.down_proj.weight", (H, F))]:
            t[p + name] = rng.standard_normal(shape) / np.sqrt(shape[1])
        if dflash2:
            for conv in ("attention_conv", "mlp_conv"):
                t[p + conv + ".base_kernel"] = np.stack([np.eye(2, 1).repeat(H, axis=1)] * 2) + 0.1 * rng.standard_normal((2, 2, H))
                t[p + conv + ".kernel_projection.weight"] = 0.1 * rng.standard_normal((2 * 2 * (H // 8), H))
    if dflash2:
        t["candidate_selector.hidden_projection.weight"] = rng.standard_normal((4, H)) / np.sqrt(H)
        t["candidate_selector.predecessor_codebook"] = 0.02 * rng.standard_normal((vocab, 4))
        t["candidate_selector.successor_codebook"] = 0.02 * rng.standard_normal((vocab, 4))
    head, blobs, off = {}, [], 0
    for name, a in t.items():
        b = np.ascontiguousarray(a, dtype="<f4").tobytes()
        head[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(head).encode()
    h += b" " * (-len(h) % 8)
    (path / "model.safetensors").write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": H, "num_hidden_layers": layers,
           "num_attention_heads": nq, "num_key_value_heads": nkv, "head_dim": d, "intermediate_size": F,
           "vocab_size": vocab, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "block_size": block, "num_target_layers": 4,
           "dflash_config": {"target_layer_ids": [1, 2], "mask_token_id": vocab - 1}}
    if layer_types:
        cfg.update(layer_types=layer_types, use_sliding_window=window is not None, sliding_window=window)
    if dflash2:
        cfg["architectures"] = ["DFlash2DraftModel"]
        cfg["dflash_config"].update(conv_kernel_size=2, conv_group_size=8, selector_rank=4, selector_top_k=3,
                                    output_multiplier=0.7, final_logit_softcapping=5.0)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def read_tensors(path):
    """name -> float64 array of a safetensors file (F32 only: what write_drafter writes)."""
    raw = (path / "model.safetensors").read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    head, data = json.loads(raw[8:8 + n]), raw[8 + n:]
    return {k: np.frombuffer(data[t["data_offsets"][0]:t["data_offsets"][1]], dtype="<f4").astype(np.float64).reshape(t["shape"])
            for k, t in head.items()}


def numpy_select(folder, hidden, logits, anchor, path=None, temperature=0.0):
    """z-lab's CandidateSelector.select in numpy: (path, candidates, q). Given ``path`` (a sampled
    one), each row's q is computed with that row's predecessor taken from it."""
    t, dc = read_tensors(folder), json.loads((folder / "config.json").read_text())["dflash_config"]
    u = logits.astype(np.float64) * dc.get("output_multiplier", 1.0)
    cap = dc.get("final_logit_softcapping")
    if cap:
        u = cap * np.tanh(u / cap)
    K = dc["selector_top_k"]
    A, Bc = t["candidate_selector.predecessor_codebook"], t["candidate_selector.successor_codebook"]
    P = t["candidate_selector.hidden_projection.weight"]  # [r, H]
    prev, out_path, cands, qs = anchor, [], [], []
    for i in range(hidden.shape[0]):
        order = np.lexsort((np.arange(u.shape[1]), -u[i]))[:K]  # descending, ties: lower id
        s = u[i, order] + (A[prev] * (P @ hidden[i].astype(np.float64))) @ Bc[order].T
        if temperature > 0:
            q = np.exp((s - s.max()) / temperature)
            qs.append(q / q.sum())
        prev = int(path[i]) if path is not None else int(order[np.argmax(s)])
        out_path.append(prev)
        cands.append(order)
    return np.array(out_path), np.array(cands), (np.array(qs) if qs else None)


def test_dflash2_drafts_through_its_candidate_selector(tmp_path, target):
    """Issue #67: a DFlash2 folder loads (its architecture and keys in config) and drafts (its
    convolutions change the block); propose() equals z-lab's selector written in numpy, greedy
    (the path) and sampled (each row's q, its draw among the candidates); greedy speculative
    decoding with it is lossless."""
    v1 = diffcp.Drafter.load(write_drafter(tmp_path / "v1"))
    folder = write_drafter(tmp_path / "v2", dflash2=True)
    v2 = diffcp.Drafter.load(folder)
    assert v2.config["architecture"] == "DFlash2DraftModel" and v2.config["selector_top_k"] == 3
    assert v1.config["architecture"] == "DFlashDraftModel"
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((7, 2 * H)).astype(np.float32)
    noise = rng.standard_normal((4, H)).astype(np.float32)
    a, b = v1.draft(hidden, noise), v2.draft(hidden, noise)
    assert a.shape == b.shape == (4, H) and np.isfinite(b).all()
    assert np.abs(a - b).max() > 1e-3  # the same backbone weights, convolved
    lm_head = 2.0 * rng.standard_normal((V, H)).astype(np.float32)
    rows = b[1:]
    logits = rows @ lm_head.T
    path, cand, q = v2.propose(rows, 5, lm_head)
    ref_path, ref_cand, _ = numpy_select(folder, rows, logits, 5)
    assert q is None and path.tolist() == ref_path.tolist() and cand.tolist() == ref_cand.tolist()
    path, cand, q = v2.propose(rows, 5, lm_head, temperature=0.8, seed=4)
    _, ref_cand, ref_q = numpy_select(folder, rows, logits, 5, path=path, temperature=0.8)
    assert cand.tolist() == ref_cand.tolist() and np.abs(q - ref_q).max() < 1e-5
    prompt = torch.tensor([1, 7, 3, 9, 2])
    out, stats = diffcp.speculative.generate(target, v2, prompt, 12)
    assert out[0].tolist() == greedy(target, prompt, 12).tolist() and stats["new_tokens"] == 12
    with pytest.raises(Exception, match="anchor token 99"):
        v2.propose(rows, 99, lm_head)


@pytest.fixture(scope="module")
def target():
    return TinyLM().eval()


@pytest.mark.parametrize("kind", ["full", "sliding"])
@pytest.mark.parametrize("block_size", [None, 1, 2, 3])
def test_greedy_speculative_decoding_is_lossless(tmp_path, target, kind, block_size):
    layer_types = ["sliding_attention", "full_attention"] if kind == "sliding" else None
    drafter = diffcp.Drafter.load(write_drafter(tmp_path / kind, layer_types, window=3 if layer_types else None))
    assert drafter.block_size == 4 and drafter.target_layer_ids == [1, 2]
    assert drafter.config["layer_types"][0] == ("sliding_attention" if layer_types else "full_attention")
    for seed in range(3):
        prompt = torch.randint(0, V - 1, (5 + 3 * seed,), generator=torch.Generator().manual_seed(seed))
        out, stats = diffcp.speculative.generate(target, drafter, prompt, 17, block_size=block_size)
        ref = greedy(target, prompt, 17)
        assert torch.equal(out[0], ref), f"seed {seed}: speculative {out[0].tolist()} != greedy {ref.tolist()}"
        B = block_size or 4
        assert all(1 <= a <= B for a in stats["acceptance_lengths"])
        assert sum(stats["acceptance_lengths"]) == stats["new_tokens"] - 1 == 16  # the prefill gives the first
        assert stats["target_forwards"] == 1 + len(stats["acceptance_lengths"])
        assert stats["tau"] == pytest.approx(np.mean(stats["acceptance_lengths"]))
        assert stats["draft_calls"] == (0 if block_size == 1 else len(stats["acceptance_lengths"]))


class OracleDrafter:
    """Drafts the target's greedy continuation (one-hot rows through the identity LM head), except
    at block slot `wrong` where it drafts another token."""

    def __init__(self, continuation, wrong=None, block=4):
        self.continuation, self.wrong = continuation, wrong
        self.block_size, self.mask_token_id, self.target_layer_ids = block, V - 1, [1, 2]

    def draft(self, target_hidden, noise_embedding):
        start, b = target_hidden.shape[0], noise_embedding.shape[0]
        rows = np.zeros((b, H), np.float32)
        for r in range(1, b):
            tok = int(self.continuation[start + r])
            if r == self.wrong:
                tok = (tok + 1) % (V - 1)
            rows[r, tok] = 10.0
        return rows


@pytest.mark.parametrize("wrong", [None, 1, 2, 3])
def test_acceptance_counts_the_agreeing_prefix(target, wrong):
    prompt = torch.arange(6) % (V - 1)
    ref = greedy(target, prompt, 24)
    out, stats = diffcp.speculative.generate(target, OracleDrafter(ref, wrong), prompt, 20)
    assert torch.equal(out[0], ref[:26])
    lengths = stats["acceptance_lengths"]
    expect = 4 if wrong is None else wrong  # all drafts, or those before the wrong slot, + the bonus
    assert all(a == expect for a in lengths[:-1]), lengths
    assert stats["tau"] > 1.5 if expect > 1 else stats["tau"] == 1.0
    assert stats["tokens_per_target_forward"] == pytest.approx(20 / (1 + len(lengths)))


def test_stop_tokens_and_bad_input(tmp_path, target):
    drafter = diffcp.Drafter.load(write_drafter(tmp_path / "d"))
    prompt = torch.arange(5)
    ref = greedy(target, prompt, 12)
    stop = int(ref[8])
    out, _ = diffcp.speculative.generate(target, drafter, prompt, 12, stop_token_ids=[stop])
    first = next(i for i in range(5, 17) if int(ref[i]) == stop)
    assert torch.equal(out[0], ref[:first + 1])  # up to and including the first stop token
    with pytest.raises(ValueError, match="block_size = 5"):
        diffcp.speculative.generate(target, drafter, prompt, 4, block_size=5)
    with pytest.raises(ValueError, match="max_new_tokens = 0"):
        diffcp.speculative.generate(target, drafter, prompt, 0)
    with pytest.raises(ValueError, match="noise_embedding must be"):
        drafter.draft(np.zeros((3, 2 * H), np.float32), np.zeros((5, H), np.float32))
    with pytest.raises(ValueError, match="target_hidden must be"):
        drafter.draft(np.zeros((3, H), np.float32), np.zeros((4, H), np.float32))
    with pytest.raises(ValueError, match="config.json"):
        diffcp.Drafter.load(tmp_path / "missing")


@pytest.mark.parametrize("kind", ["full", "sliding"])
def test_draft_cache_drafts_what_the_stateless_draft_does(tmp_path, kind):
    layer_types = ["sliding_attention", "full_attention"] if kind == "sliding" else None
    drafter = diffcp.Drafter.load(write_drafter(tmp_path / kind, layer_types, window=3 if layer_types else None))
    rng = np.random.default_rng(3)
    hidden = rng.standard_normal((300, 2 * H)).astype(np.float32)
    cache = drafter.new_cache()
    with pytest.raises(ValueError, match="no context yet"):
        cache.draft(np.zeros((4, H), np.float32))
    ctx = 0
    for piece in [1, 4, 1, 250, 44]:
        cache.append(hidden[ctx:ctx + piece])
        ctx += piece
        assert len(cache) == ctx
        for b in (4, 2):
            noise = rng.standard_normal((b, H)).astype(np.float32)
            got, ref = cache.draft(noise), drafter.draft(hidden[:ctx], noise)
            np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5 * np.abs(ref).max())
    assert cache.bytes > 0
    with pytest.raises(ValueError, match="target_hidden must be"):
        cache.append(np.zeros((2, H), np.float32))
    with pytest.raises(ValueError, match="noise_embedding must be"):
        cache.draft(np.zeros((5, H), np.float32))


def test_greedy_is_lossless_with_and_without_the_draft_cache(tmp_path, target):
    drafter = diffcp.Drafter.load(write_drafter(tmp_path / "d"))
    prompt = torch.randint(0, V - 1, (9,), generator=torch.Generator().manual_seed(4))
    ref = greedy(target, prompt, 15)
    for draft_cache in (True, False):
        out, stats = diffcp.speculative.generate(target, drafter, prompt, 15, draft_cache=draft_cache)
        assert torch.equal(out[0], ref), draft_cache
        assert stats["draft_seconds"] > 0 and stats["target_seconds"] > 0
    with pytest.raises(ValueError, match="has no new_cache"):
        diffcp.speculative.generate(target, OracleDrafter(ref), prompt, 4, draft_cache=True)
    with pytest.raises(ValueError, match="temperature = -1"):
        diffcp.speculative.generate(target, drafter, prompt, 4, temperature=-1)
    with pytest.raises(ValueError, match="top_p = 0"):
        diffcp.speculative.generate(target, drafter, prompt, 4, temperature=1, top_p=0)
    with pytest.raises(ValueError, match="top_k = -2"):
        diffcp.speculative.generate(target, drafter, prompt, 4, temperature=1, top_k=-2)


def test_sampled_generation_is_reproducible_and_greedy_at_temperature_zero(tmp_path, target):
    drafter = diffcp.Drafter.load(write_drafter(tmp_path / "d"))
    prompt = torch.arange(7) % (V - 1)
    a, _ = diffcp.speculative.generate(target, drafter, prompt, 12, temperature=0.8, top_k=8, top_p=0.9, seed=5)
    b, _ = diffcp.speculative.generate(target, drafter, prompt, 12, temperature=0.8, top_k=8, top_p=0.9, seed=5)
    assert torch.equal(a, b)
    greedy_out, _ = diffcp.speculative.generate(target, drafter, prompt, 12, temperature=0.0, seed=5)
    assert torch.equal(greedy_out[0], greedy(target, prompt, 12))


def test_warp_matches_top_k_then_top_p():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    p = diffcp.speculative.warp(logits, 1.0)
    assert torch.allclose(p, torch.softmax(logits.double(), -1))
    p = diffcp.speculative.warp(logits, 0.5, top_k=3)
    assert (p[0, 3:] == 0).all() and torch.allclose(p[0, :3], torch.softmax(logits[0, :3].double() / 0.5, -1))
    full = torch.softmax(logits.double(), -1)[0]
    p = diffcp.speculative.warp(logits, 1.0, top_p=float(full[0] + 1e-3))  # the crossing token is kept
    assert (p[0, 2:] == 0).all() and torch.allclose(p[0, :2], full[:2] / full[:2].sum())


def chi_square_p(observed, expected):
    """Pearson's chi-square p-value (cells with expected < 5 pooled; the Wilson-Hilferty normal
    approximation of the chi-square tail)."""
    obs, exp = np.asarray(observed, float), np.asarray(expected, float)
    small = exp < 5
    if small.any():
        obs = np.append(obs[~small], obs[small].sum())
        exp = np.append(exp[~small], exp[small].sum())
    x2, k = float(((obs - exp) ** 2 / exp).sum()), len(exp) - 1
    assert k >= 1, "one cell after pooling: nothing to test"
    z = ((x2 / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


def accept_everything(drafts, q, p, gen):
    """A broken rule: every draft is accepted (the output then follows the drafter)."""
    k = int(drafts.shape[0])
    return k, diffcp.speculative._draw(p[k], gen)


def correction_from_p(drafts, q, p, gen):
    """A broken rule: the right acceptance, but the correction drawn from p, not the residual."""
    for i in range(int(drafts.shape[0])):
        x = int(drafts[i])
        if float(torch.rand((), generator=gen, dtype=torch.float64)) * float(q[i, x]) >= float(p[i, x]):
            return i, diffcp.speculative._draw(p[i], gen)
    return int(drafts.shape[0]), diffcp.speculative._draw(p[-1], gen)


@pytest.mark.parametrize("rule", ["exact", "accept_everything", "correction_from_p"])
def test_one_verification_draws_from_p(rule):
    """One block position: output token = the draft if accepted, else the correction; ~ p exactly."""
    verify = {"exact": diffcp.speculative.verify_sampled, "accept_everything": accept_everything,
              "correction_from_p": correction_from_p}[rule]
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]], dtype=torch.float64)
    q = torch.tensor([[0.1, 0.6, 0.1, 0.2]], dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    n, counts = 20000, np.zeros(4)
    for _ in range(n):
        x = torch.multinomial(q[0], 1, generator=gen)
        accepted, token = verify(x, q, p, gen)
        counts[int(x) if accepted else token] += 1
    pv = chi_square_p(counts, n * p[0].numpy())
    assert (pv > 1e-4) if rule == "exact" else (pv < 1e-6), (rule, counts / n, pv)


def exact_first_tokens(target, prompt, k, warp_args):
    """{(t1..tk): probability} of the target's own sampling, by enumeration."""
    probs = {(): 1.0}
    with torch.no_grad():
        for _ in range(k):
            nxt = {}
            for seq, pr in probs.items():
                ids = torch.cat([prompt, torch.tensor(seq, dtype=torch.long)])
                p = diffcp.speculative.warp(target(ids[None]).logits[0, -1], **warp_args)
                for t in range(p.shape[0]):
                    if p[t] > 0:
                        nxt[seq + (t,)] = pr * float(p[t])
            probs = nxt
    return probs


@pytest.mark.parametrize("rule,dflash2", [("exact", False), ("accept_everything", False), ("correction_from_p", False),
                                          ("exact", True), ("correction_from_p", True)])
def test_sampling_is_lossless_in_distribution(tmp_path, monkeypatch, rule, dflash2):
    """The first 3 tokens of speculative sampling (B = 4: one draft block of 2 drafts after the
    prefill's token), over many seeds, against the target's exact joint distribution; with a DFlash
    drafter and a DFlash2 one (its q over 3 candidates of the 6 tokens)."""
    vocab = 6
    target = TinyLM(vocab=vocab, seed=2).eval()
    drafter = diffcp.Drafter.load(write_drafter(tmp_path / "d", vocab=vocab, seed=3, dflash2=dflash2))
    prompt = torch.tensor([0, 3, 1, 4, 2])
    warp_args = dict(temperature=1.3, top_k=5, top_p=0.97)
    exact = exact_first_tokens(target, prompt, 3, warp_args)
    if rule != "exact":
        monkeypatch.setattr(diffcp.speculative, "verify_sampled",
                            accept_everything if rule == "accept_everything" else correction_from_p)
    n, counts, accepted = 3000, {}, 0
    for seed in range(n):
        out, stats = diffcp.speculative.generate(target, drafter, prompt, 3, seed=seed, **warp_args)
        seq = tuple(out[0, len(prompt):].tolist())
        counts[seq] = counts.get(seq, 0) + 1
        accepted += stats["acceptance_lengths"][0] - 1
    outside = sum(c for seq, c in counts.items() if seq not in exact)  # sequences the target cannot sample
    cells = sorted(exact)
    pv = chi_square_p([counts.get(c, 0) for c in cells], [n * exact[c] for c in cells])
    if rule == "exact":
        assert accepted / n > 0.2, f"too few drafts accepted ({accepted / n:.2f} per block) to test the rule"
        assert outside == 0 and pv > 1e-4, (outside, pv)
    else:
        assert outside > 0 or pv < 1e-6, (rule, pv)
