"""diffcp.Drafter and diffcp.speculative.generate (issue #36) with Debian's torch, no transformers:
a tiny float64 causal LM stands in for the target (the call signature of a transformers model, no
KV cache), drafters are written here as DFlash folders (random weights, full and sliding layers).

* Greedy speculative decoding is lossless: the output equals the target's own greedy loop, token
  for token, with a real (random) drafter, full or sliding, and any block size.
* The acceptance logic is exact: an oracle drafter (it knows the greedy continuation) is accepted
  whole (tau = B), one wrong at slot k gets exactly k accepted per block; the stats add up.
* Bad input is a ValueError naming it.
"""
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

    def __init__(self, layers=4, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = torch.nn.Embedding(V, H).double()
        self.emb.weight.data = torch.randn(V, H, generator=g, dtype=torch.float64)
        self.qkv = [torch.randn(H, 3 * H, generator=g, dtype=torch.float64) / H ** 0.5 for _ in range(layers)]
        self.mlp = [torch.randn(H, H, generator=g, dtype=torch.float64) / H ** 0.5 for _ in range(layers)]
        self.head = torch.nn.Linear(H, V, bias=False).double()
        self.head.weight.data = torch.eye(V, H, dtype=torch.float64) * 3.0

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


def write_drafter(path, layer_types=None, window=None, block=4, layers=2, seed=1):
    """A DFlash folder (config.json + model.safetensors) with random weights for the fake target."""
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
           "vocab_size": V, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "block_size": block, "num_target_layers": 4,
           "dflash_config": {"target_layer_ids": [1, 2], "mask_token_id": V - 1}}
    if layer_types:
        cfg.update(layer_types=layer_types, use_sliding_window=window is not None, sliding_window=window)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


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
