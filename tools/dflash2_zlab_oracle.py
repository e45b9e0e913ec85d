#!/usr/bin/env python3
"""diffcp's DFlash2 drafter against z-lab's own ``DFlash2DraftModel`` (PyTorch + transformers),
run side by side: an oracle check, not part of CI (it needs torch >= 2.6, transformers 5.x and
z-lab's modeling file, none of which the project ships; nothing of z-lab's is copied here).

A tiny random DFlash2 drafter (a sliding two-sided layer whose window is below the block and the
context, a full layer, the grouped dynamic convolutions with perturbed taps, the candidate
selector with a logit multiplier and a softcap) is built as z-lab's class, saved with
``save_pretrained`` in the released layout (the codebooks without ``.weight``), reloaded by
z-lab's ``from_pretrained`` and by diffcp, then:

  layout    z-lab's class reloads the released folder to the same forward, bit for bit;
  forward   one block over a context longer than the window: z-lab's forward (positions
            0 .. ctx+B-1) vs ``mpirun -np P diffcp draft`` at P = 1, 2, 3 and from the draft cache;
  propose   z-lab's greedy ``propose`` vs ``diffcp.Drafter.propose`` (path equal, candidates
            equal as sets), and the sampled q rows along the same path;
  generate  z-lab's ``dflash_generate`` vs ``diffcp.speculative.generate`` (greedy, with and
            without the draft KV cache) on a tiny random transformers Qwen3 target: same tokens,
            same acceptance lengths (and the target's own greedy output).
  export    the other way: ``diffcp train --arch dflash2`` + ``diffcp export`` (f32, bf16) in z-lab's
            from_pretrained; its forward vs ``diffcp draft`` (P = 1, 2), greedy path vs ``propose``.

Each check prints ``PASS|FAIL name: figures``; the exit status is 1 on any FAIL.

  python3 tools/dflash2_zlab_oracle.py --zlab DIR   # DIR/dflash/model.py is z-lab's file
"""
import argparse
import datetime
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import warnings

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAILS = []
MPI_ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
# The keys z-lab's model.py reads with _draft_value (dflash_config, else the top level); its defaults.
ZLAB_KEYS = {"target_layer_ids": None, "block_size": 16, "mask_token_id": None, "conv_kernel_size": None,
             "conv_group_size": None, "selector_rank": None, "selector_top_k": None, "output_multiplier": 1.0,
             "final_logit_softcapping": None, "input_embedding_scale": 1.0}


def report(name, ok, figures):
    print(f"{'PASS' if ok else 'FAIL'} {name}: {figures}", flush=True)
    if not ok:
        FAILS.append(name)


def rel_err(got, ref):
    """max |got - ref| / max |ref| (one figure for the whole block)."""
    return float(np.abs(np.asarray(got, np.float64) - ref).max() / np.abs(ref).max())


def drafter_config(a):
    from transformers import Qwen3Config
    return Qwen3Config(
        architectures=["DFlash2DraftModel"], hidden_size=a.hidden, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=2 * a.hidden, vocab_size=a.vocab, rms_norm_eps=1e-6,
        layer_types=["sliding_attention", "full_attention"], use_sliding_window=True, sliding_window=a.window,
        max_window_layers=2, is_causal=False, tie_word_embeddings=False, num_target_layers=a.target_layers,
        dflash_config={"target_layer_ids": [1, a.target_layers - 2], "mask_token_id": a.vocab - 1,
                       "block_size": a.block, "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8,
                       "selector_top_k": 6, "output_multiplier": 0.5, "final_logit_softcapping": 10.0})


def randomize(model, seed):
    """Seeded, non-identity weights: norms near 1, conv taps away from the identity, codebooks O(1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * r)
            elif name.endswith("base_kernel"):  # [2, K, H]: tap 0 near 1, the older tap +-0.3
                p.copy_(0.3 * r)
                p[:, 0] += 1
            elif "codebook" in name:
                p.copy_(0.7 * r)
            else:  # projections, incl. kernel_projection and hidden_projection
                p.copy_(r / p.shape[-1] ** 0.5)


def save_released(model, d):
    """save_pretrained, then the codebooks renamed as released (z-lab's key_mapping undoes it)."""
    from safetensors.torch import load_file, save_file
    model.save_pretrained(d, safe_serialization=True)
    f = os.path.join(d, "model.safetensors")
    t = load_file(f)
    t = {k.removesuffix(".weight") if "_codebook" in k else k: v.contiguous() for k, v in t.items()}
    save_file(t, f, metadata={"format": "pt"})
    return sorted(t)


def run_cli(a, args, P=None, cwd=None):
    """diffcp's CLI (under ``mpirun -np P`` when P is given): its stdout, None on failure."""
    cmd = (["mpirun", "-np", str(P), "--oversubscribe"] if P else []) + [a.diffcp, *args]
    r = subprocess.run(cmd, cwd=cwd, env=MPI_ENV, capture_output=True, text=True)
    if r.returncode != 0:
        print(f"$ {' '.join(cmd)}\n{r.stdout}{r.stderr}", file=sys.stderr)
    return None if r.returncode else r.stdout


def run_diffcp_draft(a, d, H, E, P, extra=()):
    with tempfile.TemporaryDirectory() as t:
        np.save(f"{t}/h.npy", H)
        np.save(f"{t}/e.npy", E)
        out = run_cli(a, ["draft", "--model", d, "--target-hidden", f"{t}/h.npy", "--noise-embedding", f"{t}/e.npy",
                          "--out", f"{t}/o.npy", *extra], P)
        return None if out is None else np.load(f"{t}/o.npy")


def zlab_forward(m, H, E):
    """z-lab's forward of one block: context positions 0 .. ctx-1, block ctx .. ctx+B-1, no cache."""
    with torch.no_grad():
        return m(position_ids=torch.arange(len(H) + len(E))[None], noise_embedding=torch.from_numpy(E)[None],
                 target_hidden=torch.from_numpy(H)[None])[0].double().numpy()


def check_forward(a, zl, model, d):
    rng = np.random.default_rng(a.seed)
    n_t = len(model.target_layer_ids)
    E = rng.standard_normal((a.block, a.hidden)).astype(np.float32)
    rows = None
    for ctx, runs in [(a.ctx, [(1, ()), (2, ()), (3, ()), (2, ("--draft-cache",)), (3, ("--balancer", "zigzag"))]),
                      (a.long_ctx, [(3, ()), (3, ("--draft-cache",))])]:
        H = rng.standard_normal((ctx, n_t * a.hidden)).astype(np.float32)
        ref = zlab_forward(model, H, E)
        if rows is None:
            rows = ref
            re = zl.DFlash2DraftModel.from_pretrained(d, dtype=torch.float32).eval()
            same = np.array_equal(zlab_forward(re, H, E), ref)
            report("layout", same, f"z-lab from_pretrained of the released folder ({len(a.keys)} tensors, codebooks "
                   f"without .weight) gives its forward {'bitwise' if same else 'DIFFERENTLY'}")
            # What the check would see if a feature were dropped (so that a PASS means something).
            attn0 = model.layers[0].self_attn
            attn0.sliding_window, w = None, attn0.sliding_window
            no_window = rel_err(zlab_forward(model, H, E), ref)
            attn0.sliding_window = w
            convs = [(l, l.attention_conv, l.mlp_conv) for l in model.layers]
            for l, _, _ in convs:
                l.attention_conv = l.mlp_conv = None
            no_conv = rel_err(zlab_forward(model, H, E), ref)
            for l, ac, mc in convs:
                l.attention_conv, l.mlp_conv = ac, mc
            print(f"     forward sensitivity: without the window {no_window:.3g}, without the convolutions {no_conv:.3g}")
        for P, extra in runs:
            got = run_diffcp_draft(a, d, H, E, P, extra)
            err = float("inf") if got is None else rel_err(got, ref)
            report(f"forward ctx={ctx} P={P}{' ' + ' '.join(extra) if extra else ''}", err <= a.rtol,
                   f"B {a.block}, window {a.window}: max|diff|/max|ref| = {err:.2e} (goal <= {a.rtol:g})")
    return rows


def check_propose(a, zl, model, ours, block_rows):
    rng = np.random.default_rng(a.seed + 1)
    head = torch.nn.Linear(a.hidden, a.vocab, bias=False)
    with torch.no_grad():  # logits ~ N(0, 64): the multiplier and the cap both matter
        head.weight.copy_(torch.from_numpy(rng.standard_normal((a.vocab, a.hidden)) * 8 / a.hidden ** 0.5))
    W = head.weight.detach().numpy()
    K = model.candidate_selector.top_k
    trials = [block_rows[1:]] + [rng.standard_normal((a.block - 1, a.hidden)) for _ in range(a.trials - 1)]
    bad_path = bad_cand = off_argmax = rows = 0
    q_err = 0.0
    for i, h in enumerate(trials):
        h = h.astype(np.float32)
        anchor = int(rng.integers(a.vocab))
        ht = torch.from_numpy(h)[None]
        with torch.no_grad():
            zpath, zcand, _ = model.propose(ht, torch.tensor([anchor]), head, 0.0)
        path, cand, q = ours.propose(h, anchor, W, temperature=0.0, seed=0)
        bad_path += int(not np.array_equal(zpath[0].numpy(), path))
        bad_cand += int(not np.array_equal(np.sort(zcand[0].numpy(), 1), np.sort(cand, 1)))
        off_argmax += int((path != (h @ W.T).argmax(1)).sum())
        rows += len(path)
        # Sampled: diffcp draws its path; z-lab's select is made to take the same candidates
        # (its _sample_probs replaced by a lookup), and the q rows it computes are compared.
        T = 0.7 + 0.2 * i / len(trials)
        spath, scand, sq = ours.propose(h, anchor, W, temperature=T, seed=i)
        with torch.no_grad():
            zc = torch.topk(model.compute_logits(ht, head), K, dim=-1, sorted=False).indices[0]
        picks = iter([int(np.flatnonzero(zc[r].numpy() == spath[r])[0]) for r in range(len(spath))])
        orig = zl._sample_probs
        zl._sample_probs = lambda probs: torch.tensor([next(picks)])
        try:
            with torch.no_grad():
                zp2, _, zq = model.propose(ht, torch.tensor([anchor]), head, T)
        finally:
            zl._sample_probs = orig
        zq = zq[0].double().numpy()
        order = [[int(np.flatnonzero(zc[r].numpy() == c)[0]) for c in scand[r]] for r in range(len(spath))]
        zq = np.take_along_axis(zq, np.array(order), 1)
        ok_path = np.array_equal(zp2[0].numpy(), spath)
        q_err = max(q_err, float(np.abs(zq - sq).max()) if ok_path else float("inf"))
    report("propose greedy", bad_path == 0 and bad_cand == 0,
           f"{a.trials} blocks x {a.block - 1} rows (first: the drafter's block rows), top_k {K}: paths differ in "
           f"{bad_path}, candidate sets in {bad_cand}; the selector leaves the logits' argmax in {off_argmax}/{rows} rows")
    report("propose sampled q", q_err <= 1e-5, f"T 0.7-0.9, q rows along diffcp's drawn path: max|diff| = {q_err:.2e}")


def tiny_target(a):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(a.seed + 2)
    cfg = Qwen3Config(hidden_size=a.hidden, num_hidden_layers=a.target_layers, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, intermediate_size=2 * a.hidden, vocab_size=a.vocab,
                      tie_word_embeddings=False, max_position_embeddings=512)
    t = Qwen3ForCausalLM(cfg).float().eval()
    with torch.no_grad():  # few dominant tokens (head rows c_v u), so that drafts are accepted at times
        for p in t.parameters():
            if p.dim() == 2:
                p.normal_(0, 1 / p.shape[-1] ** 0.5)
        u = torch.randn(a.hidden)
        c = torch.zeros(a.vocab)
        c[torch.randperm(a.vocab - 1)[:3]] = torch.tensor([3.0, -3.0, 1.5])
        t.lm_head.weight.mul_(0.3).add_(c[:, None] * u[None] / a.hidden ** 0.5)
    return t


def check_generate(a, zl, model, ours):
    import diffcp.speculative as spec
    target = tiny_target(a)
    g = torch.Generator().manual_seed(a.seed + 3)
    zl._cuda_time = time.perf_counter  # the only patch: z-lab's timer syncs CUDA; we run on the CPU
    # Both sides' drafter calls are recorded (hidden rows 1 .. b-1, drafted path) by wrapping the
    # instances' propose methods: every block's draft is compared, not only the accepted prefix.
    zrec, drec = [], []
    zprop, dprop = model.propose, ours.propose_logits
    model.propose = lambda h, *r: zrec.append((h[0].double().numpy(), out := zprop(h, *r))) or out
    ours.propose_logits = lambda h, *r: drec.append((np.asarray(h, np.float64), out := dprop(h, *r))) or out
    for n in range(a.prompts):
        prompt = torch.randint(0, a.vocab - 1, (a.prompt_len + 3 * n,), generator=g)
        zrec.clear()
        z = zl.dflash_generate(model, target, prompt[None], a.new_tokens, None, temperature=0.0, return_stats=True)
        zt, zacc, zblocks = z.output_ids[0].tolist(), list(z.acceptance_lengths), list(zrec)
        with torch.no_grad():
            plain = target.generate(prompt[None], max_new_tokens=a.new_tokens, do_sample=False,
                                    attention_mask=torch.ones(1, prompt.numel(), dtype=torch.long))[0].tolist()
        for cache in (True, False):
            drec.clear()
            out, st = spec.generate(target, ours, prompt, a.new_tokens, temperature=0.0, draft_cache=cache)
            same_blocks = len(drec) == len(zblocks)
            err = max((rel_err(dh, zh) for (zh, _), (dh, _) in zip(zblocks, drec)), default=0.0)
            bad = sum(not np.array_equal(zp[0][0].numpy(), dp[0]) for (_, zp), (_, dp) in zip(zblocks, drec))
            ok = out[0].tolist() == zt and st["acceptance_lengths"] == zacc and same_blocks and bad == 0
            report(f"generate prompt {n} draft_cache={cache}", ok and err <= a.rtol,
                   f"prompt {prompt.numel()}, {a.new_tokens} new tokens {'equal' if out[0].tolist() == zt else 'DIFFER'}"
                   f" (= the target's own greedy: {zt == plain}); {len(drec)}/{len(zblocks)} drafts, paths differ in "
                   f"{bad}, draft rows max|diff|/max|ref| {err:.1e}; acceptance lengths equal: "
                   f"{st['acceptance_lengths'] == zacc} {zacc}")
    model.propose, ours.propose_logits = zprop, dprop


def zlab_load(zl, d):
    """z-lab's from_pretrained of an exported folder: the tensors it found, the config keys it read."""
    try:
        m, info = zl.DFlash2DraftModel.from_pretrained(d, dtype=torch.float32, output_loading_info=True)
    except Exception as e:  # a required key missing, a shape it cannot build
        return None, f"z-lab's from_pretrained raised {type(e).__name__}: {e}", False
    cfg = json.load(open(os.path.join(d, "config.json")))
    dc = cfg.get("dflash_config", {})
    defaulted = ", ".join(f"{k}={v}" for k, v in ZLAB_KEYS.items() if k not in dc and k not in cfg) or "none"
    split = [k for k in ZLAB_KEYS if k in dc and k in cfg and dc[k] != cfg[k]]  # z-lab takes dflash_config's
    bad = {k: sorted(v) for k, v in info.items() if v}
    read = ", ".join(f"{k}={zl._draft_value(m.config, k)}" for k in ZLAB_KEYS if k in dc or k in cfg)
    attn = sorted({(l.self_attn.is_causal, l.self_attn.sliding_window) for l in m.layers}, key=str)
    amax = {k: float(v.abs().max()) for k, v in m.state_dict().items()}  # trained from 0: how far they moved
    moved = [max(v for k, v in amax.items() if key in k) for key in ("successor_codebook", "kernel_projection")]
    return m.eval().requires_grad_(False), (
        f"tensors missing/unexpected/mismatched: {bad or 'none'}; read {read}; z-lab's defaults {defaulted}; "
        f"top level vs dflash_config differ in {split or 'none'}; (is_causal, window) {attn}; trained from 0: "
        f"max|successor codebook| {moved[0]:.3g}, max|kernel_projection| {moved[1]:.3g}"), not bad and not split


def check_export(a, zl, diffcp):
    from safetensors.torch import load_file
    with tempfile.TemporaryDirectory() as t:
        train = run_cli(a, ["train", "--arch", "dflash2", "--steps", str(a.export_steps), "--out", "T", "--no-progress"],
                        P=2, cwd=t)
        ok = train is not None and all(run_cli(a, ["export", "--checkpoint", "T/checkpoint.bin", "--out", dt,
                                                   "--dtype", dt], cwd=t) is not None for dt in ("f32", "bf16"))
        loss = next((l.split(": ", 1)[1] for l in (train or "").splitlines() if "final loss" in l), "?")
        report("export train+export", ok, f"diffcp train --arch dflash2 --steps {a.export_steps} (tiny preset, "
               f"2 ranks): {loss}; diffcp export --dtype f32 and bf16")
        if not ok:
            return
        f32, bf16 = (load_file(f"{t}/{dt}/model.safetensors") for dt in ("f32", "bf16"))
        same = sorted(f32) == sorted(bf16) and all(torch.equal(f32[k].bfloat16(), bf16[k]) for k in f32)
        report("export bf16 tensors", same, f"{len(bf16)} tensors = the f32 export's rounded to nearest even: {same}")
        for dt in ("f32", "bf16"):  # bf16: z-lab loads it as float32, diffcp as it computes
            m, figures, ok = zlab_load(zl, d := f"{t}/{dt}")
            report(f"export {dt} z-lab load", ok, figures)
            if m is None:
                continue
            rng = np.random.default_rng(a.seed + 4)
            Hd, V, B = m.config.hidden_size, m.config.vocab_size, m.block_size
            inputs = lambda: (rng.standard_normal((a.ctx, m.fc.in_features)).astype(np.float32),  # noqa: E731
                              rng.standard_normal((B, Hd)).astype(np.float32))
            H, E = inputs()
            ref = zlab_forward(m, H, E)
            for P in (1, 2):
                err = float("inf") if (got := run_diffcp_draft(a, d, H, E, P)) is None else rel_err(got, ref)
                report(f"export {dt} forward ctx={a.ctx} P={P}", err <= a.rtol,
                       f"B {B}: max|diff|/max|ref| = {err:.2e} (goal <= {a.rtol:g})")
            # A random head, logits ~ N(0, 1/4), so that the selector's pair scores (small) matter at times.
            head = torch.nn.Linear(Hd, V, bias=False).requires_grad_(False)
            head.weight.copy_(torch.from_numpy(rng.standard_normal((V, Hd)) * 0.5 / Hd ** 0.5))
            W, ours, bad, off = head.weight.numpy(), diffcp.Drafter.load(d), 0, 0
            for i in range(a.export_trials):  # the drafter's rows 1 .. B-1 (first: the block above)
                h = (ref if i == 0 else zlab_forward(m, *inputs()))[1:].astype(np.float32)
                anchor = int(rng.integers(V))
                zpath = m.propose(torch.from_numpy(h)[None], torch.tensor([anchor]), head, 0.0)[0][0].numpy()
                bad += int(not np.array_equal(zpath, ours.propose(h, anchor, W)[0]))
                off += int((zpath != (h @ W.T).argmax(1)).sum())
            report(f"export {dt} propose greedy", bad == 0 and off > 0, f"{a.export_trials} blocks x {B - 1} rows: paths "
                   f"differ in {bad}; the selector leaves the argmax in {off}/{a.export_trials * (B - 1)} rows (goal > 0)")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--zlab", required=True, help="directory holding z-lab's dflash/model.py")
    p.add_argument("--zlab-commit", default="unknown", help="the z-lab commit the file came from (for the header)")
    p.add_argument("--diffcp", default=os.path.join(ROOT, "build/release/src/diffcp"))
    p.add_argument("--python", default=os.path.join(ROOT, "build/release/python"), help="diffcp's Python package dir")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--vocab", type=int, default=97)
    p.add_argument("--block", type=int, default=8)
    p.add_argument("--window", type=int, default=6, help="layer 0's sliding window (below --block and --ctx)")
    p.add_argument("--ctx", type=int, default=37)
    p.add_argument("--long-ctx", type=int, default=600, help="a second context (over the draft cache's 256-row chunks)")
    p.add_argument("--target-layers", type=int, default=4)
    p.add_argument("--trials", type=int, default=16)
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=12)
    p.add_argument("--new-tokens", type=int, default=40)
    p.add_argument("--rtol", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-generate", action="store_true")
    p.add_argument("--export-steps", type=int, default=20, help="diffcp train steps of the export check (0: skip it)")
    p.add_argument("--export-trials", type=int, default=64, help="propose blocks of the export check")
    a = p.parse_args()
    sys.path[:0] = [a.zlab, a.python]
    import transformers
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated")  # 5.x: both sides pass it
    import diffcp
    from dflash import model as zl
    sha = hashlib.sha256(open(os.path.join(a.zlab, "dflash", "model.py"), "rb").read()).hexdigest()[:16]
    rev = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    print(f"# {datetime.datetime.now().isoformat(timespec='seconds')} z-lab dflash/model.py @ {a.zlab_commit} "
          f"(sha256 {sha}); torch {torch.__version__}, transformers {transformers.__version__}, "
          f"python {platform.python_version()}; diffcp HEAD {rev}; CPU {cpu}", flush=True)
    torch.manual_seed(a.seed)
    model = zl.DFlash2DraftModel(drafter_config(a)).float().eval()
    randomize(model, a.seed)
    with tempfile.TemporaryDirectory() as d:
        a.keys = save_released(model, d)
        ours = diffcp.Drafter.load(d)
        ok = ours.config.get("architecture") == "DFlash2DraftModel"
        report("load", ok, f"diffcp.Drafter.load: architecture {ours.config.get('architecture')}, block "
               f"{ours.block_size}, target layers {ours.target_layer_ids}")
        check_propose(a, zl, model, ours, check_forward(a, zl, model, d))  # its first block's rows
        if not a.skip_generate:
            check_generate(a, zl, model, ours)
    if a.export_steps:
        check_export(a, zl, diffcp)
    print(f"{'FAILED' if FAILS else 'ALL PASSED'}" + (f": {', '.join(FAILS)}" if FAILS else ""))
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(main())
