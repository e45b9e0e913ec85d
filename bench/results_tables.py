#!/usr/bin/env python3
"""The generated tables of bench/RESULTS.md, from the CSVs in bench/ (Python 3 standard library only).

    python3 bench/results_tables.py            # rewrite every table in place
    python3 bench/results_tables.py --check    # exit 1, naming the table, where one differs from its CSVs
    python3 bench/results_tables.py --list     # each table and the CSVs it reads

RESULTS.md holds each table between `<!-- table:NAME -->` and `<!-- /table -->`; everything between the two
markers is this script's. A table here is one TABLES entry: its CSVs (`sources`, under bench/), its header,
a function that selects the rows (filters), computes each cell (medians, same-run ratios) and formats it,
and the caption under it (machine, date, the command that reproduces it; the CSV links are added). A
missing CSV, column, or selected row stops the script with a message naming the table and the file.
"""
import argparse
import csv
import re
import statistics
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent

# The machines, as the cells name them (RESULTS.md "Which machines" says what each is).
ZEN5 = "Zen 5"              # AMD EPYC family 26: AVX-512 with avx512_bf16, no AMX
ZEN5P = "Zen 5 (probably)"  # machine not recorded; the session's other runs were on Zen 5
AVX2 = "AVX2 EPYC"          # AMD EPYC, AVX2 only
AVX2P = "AVX2 EPYC (probably)"
XEON = "Xeon AMX"           # Intel Xeon: AVX-512 with avx512_bf16 and AMX
ZEN4 = "Zen 4"              # AMD EPYC family 25 model 17: AVX-512 with avx512_bf16, no AMX
METHODS = [("splitkv", "Split-KV"), ("ulysses", "Ulysses"), ("ring", "Ring"), ("ringx", "RingX"),
           ("lvxattn", "LV-XAttn")]


class TableError(Exception):
    pass


class Row(dict):
    """One CSV row; reading a column the file does not have names the file and its columns."""

    def __init__(self, data, source):
        super().__init__(data)
        self.source = source

    def __missing__(self, key):
        raise TableError(f"{self.source}: no column '{key}' (it has: {', '.join(self)})")

    def num(self, key):
        v = self[key]
        try:
            return float(v)
        except (TypeError, ValueError):
            raise TableError(f"{self.source}: column '{key}' is '{v}' in a selected row, not a number") from None


class Csv:
    """The rows of one CSV of bench/, or a selection of them."""

    def __init__(self, name, rows=None):
        self.name = name
        if rows is None:
            path = BENCH / name
            if not path.is_file():
                raise TableError(f"bench/{name}: no such file")
            with open(path, newline="") as f:
                rows = [Row(r, f"bench/{name}") for r in csv.DictReader(f)]
            if not rows:
                raise TableError(f"bench/{name}: no rows")
        self.rows = rows

    def where(self, **conds):
        """The rows whose columns match: a value (compared as text), a tuple of values, or a predicate."""
        def ok(r, k, v):
            if callable(v):
                return v(r[k])
            if isinstance(v, tuple):
                return r[k] in [str(x) for x in v]
            return r[k] == str(v)
        for r in self.rows[:1]:
            [r[k] for k in conds]  # a missing column fails here, with the file's name
        rows = [r for r in self.rows if all(ok(r, k, v) for k, v in conds.items())]
        if not rows:
            raise TableError(f"bench/{self.name}: no row with " + ", ".join(f"{k} = {v}" for k, v in conds.items()))
        return Csv(self.name, rows)

    def nums(self, col):
        return [r.num(col) for r in self.rows]

    def med(self, col):
        return statistics.median(self.nums(col))

    def first(self):
        return self.rows[0]

    def last(self):
        return self.rows[-1]

    def __len__(self):
        return len(self.rows)


# ---- formatting ----
def x(v, d=2):
    return f"{v:.{d}f}x"


def pct(v, d=1):
    return f"{100 * v:.{d}f} %"


def ms(v):
    return f"{v:,.0f}" if v >= 1000 else f"{v:.1f}"


def g3(v):
    return f"{v:.3g}"


def rng(vals, f, sep="–"):
    lo, hi = min(vals), max(vals)
    return f(lo) if f(lo) == f(hi) else f"{f(lo)}{sep}{f(hi)}"


def mb(v):
    return f"{v / 1e6:.1f}" if v < 1e8 else f"{v / 1e6:.0f}"


# ---- the tables ----
def t_peers(d):
    att, tdit = d["peers_torch_attention.csv"], d["peers_torch_dit.csv"]
    xe, z4 = d["dit_cpu_peers.csv"], d["dit_cpu_peers_epyc.csv"]
    spec, simp = d["speculative_speed.csv"], d["sim_papers.csv"]
    amx = d["amx_attention.csv"].where(d_h=64).last()

    def torch_cell(t, col):
        out = []
        for isa, name in (("avx2", "AVX2 forced"), ("native", "AVX-512")):
            s = t.where(isa=isa)
            runs = f"{len(s)} runs, {rng(s.nums(col), x)}" if len(s) > 1 else "1 run"
            out.append(f"{name} **{x(s.med(col))}** ({runs})")
        return "; ".join(out)

    def ov_cell(t):
        def last(shape, col):
            return x(t.where(shape=shape, isa="native").last().num(col))
        return (f"bf16: small **{last('small', 'speedup_bf16_vs_ov')}**, FLUX width **{last('flux', 'speedup_bf16_vs_ov')}**; "
                f"f32: {last('small', 'speedup_f32_vs_ov')}, {last('flux', 'speedup_f32_vs_ov')} (latest run)")

    fams = [("FLUX.1", "flux"), ("Qwen-Image", "qwen_image"), ("FLUX.2", "flux2"), ("SD3.5", "sd3")]
    dif = []
    for name, fam in fams:
        t = d[f"diffusers_{fam}_step.csv"]
        dif.append(f"{name} {x(t.where(impl='diffusers').med('step_ms') / t.where(impl='diffcp', P=1, mode='flat').med('step_ms'))}")
    g2, g8 = spec.where(mode="greedy", prompt_length=2048).first(), spec.where(mode="greedy", prompt_length=8192).first()
    lv = simp.where(profile="h100-ib", study="qs", point="1:32", model="35b-a3b")
    lvs = lv.where(method="lvxattn").first().num("step_ms") / lv.where(method="splitkv").first().num("step_ms")
    link = "[{0}]({0})".format
    return [
        ["PyTorch SDPA (dense boolean mask)", "DFlash block-sparse attention, forward + backward, f32, d_h 64",
         torch_cell(att, "speedup_vs_sdpa_fwd_bwd"), ZEN5, "2026-12-03", "`bench/bench_peers_torch.py attention`",
         link("peers_torch_attention.csv")],
        ["PyTorch FlexAttention (compiled, block mask)", "the same, forward", torch_cell(att, "speedup_vs_flex_fwd"),
         ZEN5, "2026-12-03", "`bench/bench_peers_torch.py attention`", link("peers_torch_attention.csv")],
        ["FlexAttention and SDPA, both in bf16", "the same in bf16 (diffcp on AMX tiles)",
         f"Flex forward **{x(amx.num('speedup_bf16_vs_flex_fwd'))}**; SDPA forward + backward "
         f"**{x(amx.num('speedup_bf16_vs_sdpa_fwd_bwd'))}** ({amx['rounds']} interleaved rounds)", XEON, "2026-12-06",
         "`bench/bench_peers_torch.py attention --amx-ab`", link("amx_attention.csv")],
        ["BFL's FLUX model in PyTorch", "one DiT step, default model, 256², f32, P = 1", torch_cell(tdit, "speedup_vs_flux"),
         ZEN5, "2026-12-03", "`bench/bench_peers_torch.py dit`", link("peers_torch_dit.csv")],
        ["OpenVINO 2026.4 (its bf16 default, and f32)", "one DiT step, small and FLUX width, P = 1", ov_cell(xe), XEON,
         "2026-12-05", "`bench/bench_dit_cpu.sh peers`", link("dit_cpu_peers.csv")],
        ["OpenVINO 2026.4", "the same", ov_cell(z4), ZEN4, "2026-12-05",
         "`CSV=bench/dit_cpu_peers_epyc.csv bench/bench_dit_cpu.sh peers`", link("dit_cpu_peers_epyc.csv")],
        ["diffusers' transformer models (torch 2.15)", "one step at real width, reduced depth, 1024², f32, P = 1",
         ", ".join(dif), ZEN5, "2026-12-03/04", "`bench/bench_diffusers_step.py --family F --rounds 2`",
         "[diffusers_flux_step.csv](diffusers_flux_step.csv) and 3 more (below)"],
        ["the target alone (transformers `generate`, KV cache)", "speculative decoding with the drafter, greedy, 64 new tokens",
         f"prompt 2048: **{x(g2.num('speedup'))}** (tau {g2.num('tau'):.2f}); prompt 8192: {x(g8.num('speedup'))} (tau {g8.num('tau'):.2f})",
         XEON, "2026-12-05", "`tools/long_context_study.py`", link("speculative_speed.csv")],
        ["the papers' tables (SPEC A.5, B.5)", "`diffcp sim` at the papers' scale (prediction, no machine)",
         f"e.g. LV-XAttn / Split-KV at Q:S 1:32: {x(lvs)} predicted (paper 1.98–3.48x); table below", "none", "2026-12-02",
         "`bench/bench_sim_papers.sh`", link("sim_papers.csv")],
    ]


def t_kernels(d):
    t = d["cpu_isa.csv"].where(build="new")
    out = []
    for isa, name in (("avx512", "AVX-512, f32"), ("avx2", "AVX2 forced, f32")):
        for dh in (64, 128):
            s = t.where(isa=isa, d_h=dh)
            out.append([ZEN5, name, f"#39's, d_h {dh}", str(len(s)), f"{s.med('fwd_ms'):.1f}", f"{s.med('bwd_ms'):.1f}",
                        f"{s.med('gemm_f32_gflops'):.0f}", f"**{pct(s.med('fwd_over_f32_gemm'))}**",
                        f"**{pct(s.med('bwd_over_f32_gemm'))}**"])
    a = d["amx_attention.csv"].where(d_h=64).last()
    out.append([XEON, "bf16 on AMX tiles (AMX off: oneDNN's tiles)", "#39's, d_h 64", a["rounds"],
                f"{a.num('bf16_fwd_ms'):.1f} (**{x(a.num('amx_gain_fwd'))}** AMX off)",
                f"{a.num('bf16_bwd_ms'):.1f} (**{x(a.num('amx_gain_bwd'))}** AMX off)",
                f"bf16 {a.num('gemm_bf16_gflops'):,.0f} ({a['gemm_bf16_gflops_spread']})",
                f"**{pct(a.num('bf16_fwd_over_bf16_gemm'))}**", f"**{pct(a.num('bf16_bwd_over_bf16_gemm'))}**"])
    for machine, name, src in ((ZEN4, "bf16 (avx512_bf16)", "dit_cpu_ab_fused_attention.csv"),):
        new = d[src].where(build="new")
        f32, bf = new.where(dtype="f32").rows, new.where(dtype="bf16").rows
        if len(f32) != len(bf):
            raise TableError(f"bench/{src}: {len(f32)} f32 rows of the new build but {len(bf)} bf16 rows")

        def cell(col):
            r = statistics.median(a.num(col) / b.num(col) for a, b in zip(f32, bf))
            return f"{statistics.median(b.num(col) for b in bf):,.0f} (**{x(r)}** faster than f32)"
        out.append([machine, name, "#2's at 8k, d_h 128", str(len(bf)), cell("fwd_ms"), cell("bwd_ms"), "—", "—", "—"])
    return out


def t_dense(d):
    out = []
    parts = [(XEON, "AMX", d["dit_cpu_amx_attention.csv"], "bf16", "amx"),
             (ZEN4, "AVX-512", d["dit_cpu_fused_attention.csv"], "f32", "avx512"),
             (ZEN4, "AVX-512", d["dit_cpu_fused_attention.csv"], "bf16", "avx512"),
             (ZEN4, "AVX2 forced", d["dit_cpu_fused_attention_avx2.csv"], "f32", "avx2")]
    for machine, isa, t, dtype, kernel in parts:
        cells = [machine, f"{isa}, {dtype}"]
        for shape in ("small", "flux"):
            s = t.where(shape=shape, dtype=dtype) if "dtype" in t.first() else t.where(shape=shape)
            tile, fused = s.where(kernel="tile").med("median_ms"), s.where(kernel=kernel)
            cells += [f"{tile:.1f} → {fused.med('median_ms'):.1f} ms (**{x(tile / fused.med('median_ms'))}**)",
                      f"{fused.med('gflops'):.0f}"]
        out.append(cells)
    return out


def t_openvino(d):
    out = []
    full = (("small", "native", "f32"), ("small", "native", "bf16"), ("flux", "native", "f32"), ("flux", "native", "bf16"),
            ("small", "avx2", "f32"))
    for machine, t, native, points in ((XEON, d["dit_cpu_peers.csv"], "AVX-512 + AMX", full),
                                       (ZEN4, d["dit_cpu_peers_epyc.csv"], "AVX-512", full),
                                       (AVX2, d["dit_cpu_peers_zen3.csv"], "AVX2", full[:2])):
        for shape, isa, dtype in points:
            s = t.where(shape=shape, isa=isa)
            r = s.last()
            earlier = ", ".join(x(e.num(f"speedup_{dtype}_vs_ov")) for e in s.rows[:-1])
            out.append([machine, "small" if shape == "small" else "FLUX width", native if isa == "native" else "AVX2 forced",
                        dtype, ms(r.num(f"diffcp_{dtype}_step_ms")), ms(r.num(f"ov_{dtype}_step_ms")),
                        f"**{x(r.num(f'speedup_{dtype}_vs_ov'), 3)}**", earlier or "—",
                        x(r.num("speedup_f32_vs_flux")) if dtype == "f32" else "—"])
    return out


def t_diffusers(d):
    out = []
    for name, fam in (("FLUX.1 (1 double + 1 single block)", "flux"), ("Qwen-Image (2 blocks)", "qwen_image"),
                      ("FLUX.2 (1 + 1)", "flux2"), ("SD3.5-large (2 blocks)", "sd3")):
        t = d[f"diffusers_{fam}_step.csv"]
        ref = t.where(impl="diffusers").med("step_ms")
        p1 = t.where(impl="diffcp", P=1, mode="flat").med("step_ms")
        p2 = t.where(impl="diffcp", P=2, mode="flat")
        exact = all(r["bytes_inter_group"] == r["predicted_bytes_inter_group"] for r in t.where(impl="diffcp").rows)
        out.append([name, ms(ref), ms(p1), f"**{x(ref / p1)}**", ms(p2.med("step_ms")), x(ref / p2.med("step_ms")),
                     f"{p2.med('bytes_inter_group') / 1e6:.1f} MB ({'= closed form' if exact else 'differs'})"])
    w = d["wan_step.csv"]  # Wan: its own bench (bench/bench_wan.sh), other columns
    ref, p1, p2 = w.where(mode="diffusers").med("step_ms"), w.where(P=1, mode="flat").med("step_ms"), w.where(P=2, mode="flat")
    exact = all(r["bytes_inter_group"] == r["predicted_bytes_inter_group"] for r in w.where(mode=lambda m: m != "diffusers").rows)
    out.append(["Wan 2.1 (1.3B's width, 1 block; 480p, 81 frames)", ms(ref), ms(p1), f"**{x(ref / p1)}**",
                ms(p2.med("step_ms")), x(ref / p2.med("step_ms")),
                f"{p2.med('bytes_inter_group') / 1e6:.1f} MB ({'= closed form' if exact else 'differs'})"])
    return out


def t_cp(d):
    out = []

    def closed_form(r):
        """Whether the row's bytes equal the closed form the CSV records (True where it records none)."""
        for got, want in (("bytes_per_layer", "predicted_bytes_per_layer"),
                          ("inter_bytes_per_layer", "predicted_inter_bytes_per_layer")):
            if want in r and r[want] != "":
                return r.num(got) == r.num(want)
        return True

    def row(setting, qs, pick):
        rows = [pick(m) for m, _ in METHODS]
        steps = [r.num("step_ms") for r in rows]
        byts = " / ".join(mb(r.num("bytes_per_layer")) + ("" if closed_form(r) else " (≠ closed form)") for r in rows)
        out.append([setting, qs, " / ".join(ms(v) for v in steps), f"**{x(min(steps[1:]) / steps[0])}**", byts])
    qs = d["cp_qs.csv"].where(P=2, timed=1)
    for p in ("4", "32"):
        row("one node, shared memory, P = 2", f"1:{p}", lambda m: qs.where(point=p, method=m).first())
    cl = d["cluster_cp.csv"].where(topology="2x1")
    for p in ("4", "32"):
        row("emulated 2 nodes × 1, h100-ib scaled", f"1:{p}", lambda m: cl.where(point=p, method=m).first())
    nd = d["splitkv_nodes.csv"].where(study="cluster")
    for q in ("1:16", "1:128"):
        row("emulated 2 nodes × 2 (oversubscribed)", q, lambda m: nd.where(qs=q, method=m).first())
    return out


def t_scaling(d):
    sk, st = d["splitkv_scaling.csv"], d["cp_strong.csv"]
    p1, p2 = sk.where(P=1).first(), sk.where(P=2).first()
    same = p2["attention_bytes_per_layer"] == p2["predicted_bytes_per_layer"]
    one, two = st.where(P=1, timed=1), st.where(P=2, timed=1)
    strong = ", ".join(f"{name} {x(one.where(method=m).first().num('step_ms') / two.where(method=m).first().num('step_ms'))}"
                       for m, name in METHODS)
    return [["one Split-KV layer, H 2048, n_q 32, n_kv 4, d_h 128, 2 samples × 32k context, 8k queries, f32",
             f"{ms(p1.num('step_ms'))} → {ms(p2.num('step_ms'))} ms: **{x(p1.num('step_ms') / p2.num('step_ms'))}**; "
             f"{p2.num('attention_bytes_per_layer'):,.0f} B per layer and rank ({'= closed form' if same else 'DIFFERS from the closed form'})",
             XEON, "2026-12-05", "`bench/bench_splitkv.sh`", "[splitkv_scaling.csv](splitkv_scaling.csv)"],
            ["every CP method, H 1024, 4 samples × 8k context, 512 queries each (strong scaling)", strong, ZEN5P,
             "2026-11-30", "`bench/bench_cp_studies.sh`", "[cp_strong.csv](cp_strong.csv)"]]


def t_balance(d):
    b, e2e = d["balance.csv"], d["balance_e2e.csv"]
    paper = {"none": ("55.26", "—"), "zigzag": ("8.01", "0.01–0.05"), "partition": ("0.80 (DCP)", "148–1165 (DCP)"),
             "lpt": ("0.21", "0.38–1.24")}
    none_e2e = e2e.where(balancer="none").first().num("step_ms")
    out = []
    for bal, name in (("none", "none"), ("zigzag", "zigzag"), ("partition", "partition (METIS)"), ("lpt", "**LPT**")):
        c = b.where(sweep="context", balancer=bal)
        p = b.where(sweep="P", balancer=bal)
        f2 = lambda v: f"{v:.2f}"  # noqa: E731
        cells = [name, rng(c.nums("imbalance_pct_mean"), f2), rng(p.nums("imbalance_pct_mean"), f2), paper[bal][0],
                 rng(p.nums("plan_ms_median"), g3), paper[bal][1]]
        if bal == "partition":
            cells.append("—")
        else:
            r = e2e.where(balancer=bal).first()
            cells.append(f"{r.num('imbalance_pct'):.2f} %: {ms(r.num('step_ms'))} ms, {x(none_e2e / r.num('step_ms'), 3)}")
        out.append(cells)
    return out


def t_train(d):
    t = d["train_throughput.csv"]
    out = []
    for cfg, dtype in (("tiny", "f32"), ("tiny", "bf16"), ("small", "f32"), ("small", "bf16")):
        s = t.where(config=cfg, dtype=dtype)
        p1, p2, pair = (s.where(P=p) for p in ("1", "2", "pair"))
        t1, t2, tp = p1.med("tokens_per_s"), p2.med("tokens_per_s"), pair.med("tokens_per_s")
        out.append([cfg, dtype, str(len(p1)), f"{t1:,.0f}", f"{t2:,.0f}", f"**{x(t2 / t1)}**", x(tp / t1), pct(t2 / tp, 0),
                    f"{ms(p1.med('median_step_ms'))} → {ms(p2.med('median_step_ms'))}"])
    return out


def t_memory(d):
    sm, wm = d["shard_memory.csv"], d["dit_weights_memory.csv"]
    out = []
    for P, ctx, shard, what in (("1", 8192, "none", "P = 1, 8k context, replicated"),
                                ("2", 8192, "none", "P = 2, 8k, replicated"), ("2", 32768, "full", "P = 2, **32k**, `--shard full`")):
        r = sm.where(P=P, context=ctx, shard=shard).first()
        peak = r["peak_rss_mib_per_rank"]
        cell = f"{float(peak):,.0f} MiB" if re.fullmatch(r"[0-9.]+", peak) else "out of memory (killed)"
        state = f"{r.num('state_mib_per_rank'):,.0f} MiB" if r["state_mib_per_rank"] else "—"
        out.append(["qwen3.5-35b-a3b drafter, a training step", what, cell, state, AVX2P, "2026-12-01",
                    "`bench/bench_shard.sh`", "[shard_memory.csv](shard_memory.csv)"])
    for P, dtype, shard, what in (("2", "bf16", "1", "P = 2, bf16, `--shard-weights`"),):
        r = wm.where(model="FLUX.1-dev", P=P, weights_dtype=dtype, shard_weights=shard).first()
        out.append(["FLUX.1-dev, 1024² + 512 text tokens", what,
                    f"{r.num('weights_bytes_per_rank') / 1e9:.2f} GB weights + {r.num('activation_bytes_per_rank') / 1e9:.2f} GB",
                    "—", "none (closed form)", "2026-12-04", "`bench/bench_dit_weights.sh`",
                    "[dit_weights_memory.csv](dit_weights_memory.csv)"])
    return out


def t_serving(d):
    q, cd, fp8 = d["dit_quality.csv"], d["cluster_dit.csv"], d["dit_fp8.csv"]
    cfg, cache, cs = d["dit_cfg_parallel.csv"], d["dit_step_cache.csv"], d["cluster_dit_serving.csv"]
    out = []
    lin = q.where(point="linear").first()
    out.append(["V-Major (`cocodiff`, linear schedule)", "default DiT, 256², 50 steps, P = 2, random weights",
                "— (runs under load)", f"{1 / lin.num('measured_inter_ratio_vs_tapa'):.2f} of TAPA's across groups",
                f"PSNR {lin.num('psnr'):.1f} dB vs flat", ZEN5P, "2026-11-30", "`bench/bench_dit_studies.sh modes quality`",
                "[dit_quality.csv](dit_quality.csv)"])
    flat = cd.where(mode="flat").first()
    modes = [cd.where(mode=m).first() for m in ("tapa", "vfirst", "cocodiff")]
    out.append(["TAPA / V-First / CoCoDiff (all three)", "default DiT, emulated 2 × 2 aurora-scaled (oversubscribed), 12 steps",
                " / ".join(x(flat.num("step_ms") / r.num("step_ms")) for r in modes),
                " / ".join(f"{r.num('bytes_inter_group') / flat.num('bytes_inter_group'):.2f}" for r in modes) + " across groups",
                "exact / exact / V-Major's", AVX2, "2026-11-30", "`bench/bench_cluster_studies.sh dit`",
                "[cluster_dit.csv](cluster_dit.csv)"])
    for cfgname, label in (("flux1_tiny", "FLUX.1 tiny"), ("flux1_realwidth", "FLUX.1 real width, 1 + 1 blocks"),
                           ("sd3_tiny", "SD3.5 tiny, CFG 7")):
        s = fp8.where(config=cfgname, steps=28, dtype="f32")
        ex, f = s.where(wire="auto").first(), s.where(wire="fp8").first()
        out.append(["fp8 wire (f32 compute)", f"{label}, 256², 28 steps, P = 2 flat", x(ex.num("step_ms") / f.num("step_ms")),
                    f"{f.num('bytes_per_step') / ex.num('bytes_per_step'):.3f} of f32's",
                    f"PSNR {f.num('psnr_vs_f32'):.1f} dB", XEON, "2026-12-04", "`bench/bench_dit_fp8.sh`",
                    "[dit_fp8.csv](dit_fp8.csv)"])
    s = cfg.where(P=2, mode="flat")
    seq, par = s.where(cfg_parallel="false"), s.where(cfg_parallel="true")
    passed = all(r["check_passed"] == "true" for r in s.rows)
    out.append(["CFG-parallel", "default DiT, true CFG 3.5, 28 steps, P = 2 flat",
                f"**{x(seq.med('step_ms') / par.med('step_ms'))}**",
                f"exchanges {par.med('bytes_inter_group') / 1e6:.0f} MB; velocities {par.med('cfg_pair_bytes') / 1024:.0f} KiB",
                "equal within f32 tolerance" if passed else "check FAILED", XEON, "2026-12-04",
                "`bench/bench_dit_serving.sh cfg`", "[dit_cfg_parallel.csv](dit_cfg_parallel.csv)"])
    s = cache.where(steps=50)
    for thr in ("0.68",):
        c = s.where(threshold=thr)
        out.append([f"step cache `fbcache:{thr}`", f"default DiT, 50 steps, P = 2 flat ({c.first()['steps_computed']} computed)",
                    f"**{x(s.where(threshold=0).med('total_ms') / c.med('total_ms'))}**", "—",
                    f"PSNR {c.med('psnr_db'):.1f} dB", XEON, "2026-12-04", "`bench/bench_dit_serving.sh cache`",
                    "[dit_step_cache.csv](dit_step_cache.csv)"])
    rates = ("1", "10")
    links = {g: cs.where(inter_gbit=g, mode="flat") for g in rates}
    ex = {g: links[g].where(variant="exact").first() for g in rates}

    def gain(v):
        return " / ".join(x(ex[g].num("total_ms") / links[g].where(variant=v).first().num("total_ms")) for g in rates)
    fb = links["1"].where(variant="fp8").first()
    out.append(["the three on links", "true CFG, 8 steps, emulated 2 × 2 (oversubscribed), flat, at 1 / 10 Gbit/s",
                ", ".join(f"{v.replace('_', '-')} {gain(v)}" for v in ("cfg_parallel", "fp8", "step_cache")),
                f"fp8 {fb.num('bytes_inter_group') / ex['1'].num('bytes_inter_group'):.2f}, CFG-parallel 0 across nodes",
                "—", XEON, "2026-12-04", "`bench/bench_dit_serving.sh cluster`",
                "[cluster_dit_serving.csv](cluster_dit_serving.csv)"])
    sv = d["serve.csv"]

    def rate(P, batching, clients):
        return sv.where(P=P, batching=batching, clients=clients).med("images_per_s")
    gains = {P: [rate(P, 1, c) / rate(P, 0, c) for c in (2, 4)] for P in (1, 2)}
    out.append(["image server, batching (`python -m diffcp.serve`)",
                "stand-in FLUX.1 pipeline, default DiT, 256², 8 steps, bf16 cocodiff, 2 / 4 clients",
                f"P = 2: **{x(gains[2][0])} / {x(gains[2][1])}** images/s; P = 1: {x(gains[1][0])} / {x(gains[1][1])}",
                "—", "one 8-bit level of one at a time", XEON, "2026-12-06", "`bench/bench_serve.py`",
                "[serve.csv](serve.csv), [plot](serve.png)"])
    srv = sv.where(P=1, batching=0, clients=1).med("latency_ms_median")
    inproc = sv.where(P=1, batching=-1, clients=1).med("latency_ms_median")
    out.append(["image server over the in-process call", "the same request, 1 client, P = 1, batching off",
                f"{x(inproc / srv)} ({srv:.0f} vs {inproc:.0f} ms)", "—", "equal within one 8-bit level", XEON,
                "2026-12-06", "`bench/bench_serve.py`", "[serve.csv](serve.csv)"])
    return out


def t_cluster_sim(d):
    fid, val, tr = d["cluster_fidelity.csv"], d["sim_validation.csv"], d["sim_train_validation.csv"]
    cs, dit = d["cluster_dit_serving.csv"], d["sim_papers_dit.csv"]
    rate = fid.where(study="rate")
    exact = rate.where(configured_gbit=lambda v: float(v) <= 5)
    r10, r20 = (rate.where(configured_gbit=g).first() for g in ("10", "20"))
    lat = rate.nums("latency_us")
    out = [["emulated links: measured / configured rate", f"{rng([r.num('gbit_s') / r.num('configured_gbit') for r in exact.rows], lambda v: f'{v:.2f}')} "
            f"at 0.05–5 Gbit/s, {r10.num('gbit_s') / 10:.2f} at 10, {r20.num('gbit_s') / 20:.2f} at 20; latency native, "
            f"{rng(lat, lambda v: f'{v:.0f}')} µs", AVX2, "2026-11-30", "`bench/bench_cluster_fidelity.sh`",
            "[cluster_fidelity.csv](cluster_fidelity.csv)"]]
    err = [abs(v) for v in val.nums("step_error_pct")]
    bytes_ok = all(r["measured_bytes"] == r["predicted_bytes"] for r in val.rows)
    groups = [("shm", "shared memory"), ("2x1_", "2 × 1"), ("2x2_", "2 × 2 oversubscribed"), ("dit_", "DiT 2 × 2")]
    per = "; ".join(f"{name} {rng([v for r, v in zip(val.rows, val.nums('step_error_pct')) if r['point'].startswith(p)], lambda e: f'{e:+.0f}', ' .. ')} %"
                    for p, name in groups)
    out.append([f"`diffcp sim` vs measured step, {len(val)} points (CP methods and DiT modes)",
                f"mean \\|error\\| **{statistics.mean(err):.1f} %**, worst {max(err):.1f} % ({per}); bytes "
                + ("equal at every point" if bytes_ok else "DIFFER"), ZEN5, "2026-12-02", "`bench/bench_sim_validate.sh`",
                "[sim_validation.csv](sim_validation.csv)"])
    out.append(["`diffcp sim train` vs the trainer (`small`, shards)", "; ".join(
        f"P = {r['P']}: {r.num('step_error_pct'):+.1f} %" for r in tr.rows), ZEN5P, "2026-12-02",
        "`ROUNDS=5 bench/bench_sim_train.sh`", "[sim_train_validation.csv](sim_train_validation.csv)"])
    e = cs.nums("error_pct")
    out.append(["`diffcp sim dit` vs the emulated cluster, DiT serving features", f"{rng(e, lambda v: f'{v:+.0f}', ' .. ')} % "
                "(one round each, oversubscribed)", XEON, "2026-12-04", "`bench/bench_dit_serving.sh cluster`",
                "[cluster_dit_serving.csv](cluster_dit_serving.csv)"])
    ok = dit.where(supported="true")
    ratios = [ok.where(P=r["P"], mode="flat").first().num("step_ms") / r.num("step_ms") for r in ok.where(mode="cocodiff").rows
              if r["P"] != "2"]
    out.append(["`diffcp sim dit`, CoCoDiff / flat, aurora profile, FLUX.1-dev 2304², P = 4–24",
                f"{rng(ratios, x)} predicted (paper: 3.6x average, 8.4x peak)", "none", "2026-12-02",
                "`bench/bench_sim_papers.sh`", "[sim_papers_dit.csv](sim_papers_dit.csv)"])
    return out


def t_sim_papers(d):
    t = d["sim_papers.csv"]
    cols = [(p, m) for p in ("h100-ib", "h100-ib-8nic") for m in ("35b-a3b", "27b")]

    def step(p, m, study, point, method):
        return t.where(profile=p, model=m, study=study, point=point, method=method).first().num("step_ms")

    def growth(method):
        return lambda p, m: x(step(p, m, "qs", "1:32", method) / step(p, m, "qs", "1:4", method))

    def lpt(p, m):
        v = [step(p, m, "balance", f"P{n}_none", "splitkv") / step(p, m, "balance", f"P{n}_lpt", "splitkv") for n in (8, 16, 32, 64)]
        return rng(v, x)
    rows = [
        ("Q:S 1:4 → 1:32, step growth, Split-KV", "1.11x / 1.44x", growth("splitkv")),
        ("the same, Ring", "5.63x / 6.32x", growth("ring")),
        ("the same, LV-XAttn", "1.17x / 1.22x", growth("lvxattn")),
        ("LV-XAttn / Split-KV at 1:32", "1.98–3.48x", lambda p, m: x(step(p, m, "qs", "1:32", "lvxattn") / step(p, m, "qs", "1:32", "splitkv"))),
        ("weak scaling P 8 → 64, Split-KV efficiency", "91 % / 85 %",
         lambda p, m: pct(step(p, m, "weak", "P8", "splitkv") / step(p, m, "weak", "P64", "splitkv"), 0)),
        ("strong scaling P 8 → 64, Split-KV speed-up", "4.44x / 3.43x",
         lambda p, m: x(step(p, m, "strong", "P8", "splitkv") / step(p, m, "strong", "P64", "splitkv"))),
        ("LPT end to end (none / LPT), P 8 → 64", "1.15–1.42x", lpt),
    ]
    return [[label, paper] + [f(p, m) for p, m in cols] for label, paper, f in rows]


def t_decoding(d):
    t = d["draft_cache.csv"]
    out = []
    for ctx in ("1024", "4096", "16384", "32768"):
        c = t.where(ctx=ctx)

        def v(drafter, P, mode):
            return c.where(drafter=drafter, P=P, mode=mode).first().num("ms")
        out.append([f"{int(ctx) // 1024}k", f"{v('full', 1, 'stateless'):.1f}", f"{v('full', 1, 'cache'):.1f}",
                    f"{v('full', 2, 'cache'):.1f}", f"{v('sliding', 1, 'cache'):.1f}",
                    f"**{x(v('full', 1, 'stateless') / v('full', 1, 'cache'), 1)}**"])
    return out


def t_dflash2(d):
    tau, speed = d["dflash2_tau.csv"], d["dflash2_speed.csv"]
    lengths = sorted({int(r["prompt_length"]) for r in tau.rows})
    out = []
    for C in sorted({int(r["train_context"]) for r in tau.rows}):
        for arch in ("dflash", "dflash2"):
            t = tau.where(train_context=str(C), arch=arch)
            cells = [f"{t.where(prompt_length=str(L)).first().num('tau'):.2f}" for L in lengths]
            recall = t.first()["train_candidate_recall"] if arch == "dflash2" else ""
            sp = [r for r in speed.rows if (r["train_context"], r["arch"], r["mode"]) == (str(C), arch, "greedy")]
            spd = " / ".join(f"{r.num('speedup'):.2f}x (tau {r.num('tau'):.2f})" for r in sp) if sp else "—"
            lossless = "yes" if all(r["lossless"] == "yes" for r in t.rows + sp) else "no"
            out.append([f"{C // 1024}k", "DFlash2" if arch == "dflash2" else "DFlash", " / ".join(cells),
                        f"{float(recall):.2f}" if recall else "—", spd, lossless])
    return out


def t_dflash2_step(d):
    t = d["dflash2_step.csv"]
    out = []
    for preset in dict.fromkeys(r["preset"] for r in t.rows):
        for P in ("1", "2"):
            a = t.where(preset=preset, P=P, arch="dflash").med("step_ms")
            b = t.where(preset=preset, P=P, arch="dflash2").med("step_ms")
            out.append([preset, P, f"{a:.1f}", f"{b:.1f}", f"**{b / a:.2f}**", str(len(t.where(preset=preset, P=P, arch="dflash")))])
    return out


def t_faults(d):
    w, f = d["watchdog.csv"], d["faults.csv"]
    coll = ", ".join(f"{r['what']} {r.num('ratio'):.2f}" for r in w.rows if r["unit"] == "us")
    st = w.where(what="train_step").first()
    kinds = {"kill": "SIGKILL of a rank", "link": "a node's uplink down", "stall": "SIGSTOP of a rank"}
    return [["the collective watchdog (600 s) on / off, P = 2, shared memory",
             f"64 B collectives: {coll}; `train` step (tiny): {st.num('off'):.1f} → {st.num('timeout_600'):.1f} ms "
             f"({st.num('ratio'):.2f})", XEON, "2026-12-05", "`bench/bench_watchdog.sh`", "[watchdog.csv](watchdog.csv)"],
            ["a fault mid-training to the end of the job, 2 emulated nodes, `--comm-timeout 5`",
             "; ".join(f"{kinds.get(r['fault'], r['fault'])} {r.num('fault_to_end_s'):.1f} s (limit {r.num('limit_s'):.0f} s)"
                       for r in f.rows) + "; resuming ends bitwise equal to an uninterrupted run",
             XEON, "2026-12-05", "`tests/cluster_faults.sh build/release/src/diffcp bench/faults.csv` (root)",
             "[faults.csv](faults.csv)"]]


class Table:
    """sources: the CSVs under bench/ it reads; header: its columns; rows(data) -> its cells, from
    {csv name: Csv}; caption: what is under it (machine, date, how to reproduce; the data links are added)."""

    def __init__(self, sources, header, rows, caption):
        self.sources, self.header, self.rows, self.caption = sources, header, rows, caption


TABLES = {
    "peers": Table(
        ["peers_torch_attention.csv", "amx_attention.csv", "peers_torch_dit.csv", "dit_cpu_peers.csv", "dit_cpu_peers_epyc.csv",
         "diffusers_flux_step.csv", "diffusers_qwen_image_step.csv", "diffusers_flux2_step.csv", "diffusers_sd3_step.csv",
         "speculative_speed.csv", "sim_papers.csv"],
        ["against", "what", "diffcp's speed-up (same run, medians)", "machine", "date", "reproduce", "data"], t_peers,
        "Two threads on two cores for both sides; P = 1 unless said. The sections below have each comparison's detail."),
    "kernels": Table(
        ["cpu_isa.csv", "amx_attention.csv", "dit_cpu_ab_fused_attention.csv"],
        ["machine", "kernels", "workload", "rounds", "fwd ms", "bwd ms", "oneDNN GEMM 2048³ GFLOP/s (f32 unless said)",
         "fwd / GEMM", "bwd / GEMM"], t_kernels,
        f"{ZEN5}, 2026-12-03: issue #39's workload, 2 samples × 4k context, 64 anchors, n_q 8, n_kv 2, B 16; \"AVX2 "
        "forced\" = the same CPU with the AVX2 kernels and oneDNN capped at AVX2; medians of 5 interleaved rounds, a "
        "ratio the median of each round's own; `bench/bench_cpu_isa.sh bench/cpu_isa.csv 5`. Xeon AMX, 2026-12-06 (issue "
        "#69): the same workload in bf16 against the same run's bf16 GEMM (its spread over the rounds in brackets), "
        "AMX off (`DIFFCP_CPU_AMX=0`) in the same round, medians of 3 interleaved rounds, `bench/bench_peers_torch.py "
        "attention --rounds 3 --amx-ab`. Zen 4 bf16 row, 2026-12-05: issue #2's workload at 2 samples × 8k context, "
        "128 anchors, n_q 32, n_kv 4, the f32 kernels in the same round, 3 rounds, the current code's side of an A/B "
        "(`bench/bench_dit_cpu.sh ab`). 2 threads throughout."),
    "dense_attention": Table(
        ["dit_cpu_amx_attention.csv", "dit_cpu_fused_attention.csv", "dit_cpu_fused_attention_avx2.csv"],
        ["machine", "fused kernel", "small (1088 tokens, d_h 32): tile path → fused", "fused GFLOP/s",
         "FLUX width (4608 tokens, d_h 128): the same", "fused GFLOP/s"], t_dense,
        "One attention call, 24 heads, forward, 2 threads; 2026-12-05; medians of 3 (AVX2: 5) interleaved rounds; the tile path is the same binary with the fused kernel "
        "off. Reproduce: `bench/bench_dit_cpu.sh fused` (AVX2: `ISA=avx2 REPEAT=5 "
        "OUT=bench/dit_cpu_fused_attention_avx2.csv`; the AMX row is this mode's first run, bf16 only, when it was `amx`)."),
    "openvino": Table(
        ["dit_cpu_peers.csv", "dit_cpu_peers_epyc.csv", "dit_cpu_peers_zen3.csv"],
        ["machine", "shape", "ISA", "dtype", "diffcp ms", "OpenVINO ms", "diffcp / OpenVINO (latest run)",
         "earlier runs (older diffcp)", "diffcp / BFL FLUX"], t_openvino,
        "2026-12-05 (AVX2 EPYC, a Zen 3: 2026-12-07, OpenVINO 2026.4 on AVX2, its bf16 runs f32 kernels there); one process, 2 threads, random weights, the same architecture and tokens in all three; medians "
        "over 2-3 interleaved rounds. small = hidden 768, 2 + 4 blocks, 512²; FLUX width = hidden 3072, 1 + 2 blocks, "
        "1024². Reproduce: `VENV=... FLUX_SRC=... bench/bench_dit_cpu.sh peers` (`CSV=bench/dit_cpu_peers_epyc.csv` "
        "on the Zen 4, `ROWS=small ROUNDS=2 CSV=bench/dit_cpu_peers_zen3.csv` on the AVX2 EPYC)."),
    "diffusers": Table(
        ["diffusers_flux_step.csv", "diffusers_qwen_image_step.csv", "diffusers_flux2_step.csv", "diffusers_sd3_step.csv",
         "wan_step.csv"],
        ["family (real width, reduced depth)", "diffusers ms", "diffcp P = 1 ms", "speed-up", "diffcp P = 2 (flat) ms",
         "speed-up", "bytes per rank per step, P = 2"], t_diffusers,
        f"{ZEN5}, 2026-12-03 (FLUX.1) and 2026-12-04; 1024² image + 512 text tokens, f32, random weights; P = 1 two "
        "threads, P = 2 one rank per core; medians of 2 interleaved rounds. Reproduce: "
        "`V/bin/python bench/bench_diffusers_step.py --family flux1|qwen_image|flux2|sd3 --rounds 2`. Wan: the AVX2 "
        "EPYC (Zen 3), 2026-12-07, 21 latent frames of 60 × 104 (21 × 30 × 52 = 32,760 tokens) + 512 text tokens, one "
        "run each (a step takes 1-2 minutes; diffusers: median of 2); `PYTHON=V/bin/python bench/bench_wan.sh step diffusers`."),
    "cp_methods": Table(
        ["cp_qs.csv", "cluster_cp.csv", "splitkv_nodes.csv"],
        ["setting", "Q:S", "step ms: Split-KV / Ulysses / Ring / RingX / LV-XAttn", "Split-KV vs the fastest other",
         "MB / layer / rank, same order"], t_cp,
        f"One layer's forward + backward, H 1024, n_q 16, n_kv 4, d_h 64, f32, slowest rank. Shared memory: "
        f"{ZEN5P}, 2026-11-30, Q = 4096, `bench/bench_cp_studies.sh`. Emulated: {AVX2}, 2026-11-30, Q = 512, links "
        "scaled to this CPU (a rank 205 Mbit/s, a node's uplink 34 Mbit/s), Split-KV with two-level collectives on "
        "2 × 2, `bench/bench_cluster_studies.sh cp` and `bench/bench_splitkv_nodes.sh cluster` (root). Bytes are the "
        "communicators' counts, equal to the closed forms wherever the CSV records them."),
    "scaling": Table(
        ["splitkv_scaling.csv", "cp_strong.csv"], ["P = 1 → P = 2, one rank per core", "step time, speed-up, bytes", "machine",
                                                   "date", "reproduce", "data"], t_scaling,
        "Forward + backward, slowest rank, median of 3 (strong scaling: 5) after a warm-up; both runs do the same "
        "total work on 1 and 2 cores."),
    "balance": Table(
        ["balance.csv", "balance_e2e.csv"],
        ["balancer", "imbalance %, context 16k → 256k, P = 8", "P 8 → 64, 256k", "paper, P sweep",
         "planning ms, P 8 → 64", "paper", "P = 2 layer step, skewed batch (vs none)"], t_balance,
        f"Sweeps: b = 4 samples, 8k queries each, J = 16, mean over 10 seeds, planning single-threaded in C++ "
        f"({ZEN5P}, 2026-11-30, `build/release/bench/bench_balance --seeds 10 --reps 11 --csv bench/balance.csv`; "
        f"the planner before issue #16's faster one). End to end: one drafter "
        f"layer, 4 samples of 2k-14k, P = 2 ({XEON}, 2026-12-05, `bench/bench_balance_e2e.sh`)."),
    "train": Table(
        ["train_throughput.csv"],
        ["preset", "dtype", "runs", "P = 1 tokens/s", "P = 2 tokens/s", "P = 2 / P = 1", "two-core ceiling / P = 1",
         "P = 2 / ceiling", "median step ms, P = 1 → 2"], t_train,
        f"{XEON}, 2026-12-05; one rank per core; medians of 5 runs; the ceiling is two independent P = 1 runs at once, "
        "one per core, in the same run. Reproduce: `REPEAT=5 bench/bench_train.sh`."),
    "memory": Table(
        ["shard_memory.csv", "dit_weights_memory.csv"],
        ["model", "run", "peak per rank", "trainable state per rank", "machine", "date", "reproduce", "data"], t_memory,
        "The drafter: the trainer's peak resident set per rank on a 24 GiB machine, `--anchors 64`; the DiT: "
        "the closed form of `dit/weights.hpp` that a run's allocation is tested against, for the published config."),
    "dit_serving": Table(
        ["dit_quality.csv", "cluster_dit.csv", "dit_fp8.csv", "dit_cfg_parallel.csv", "dit_step_cache.csv",
         "cluster_dit_serving.csv", "serve.csv"],
        ["feature", "job", "speed-up vs exact", "bytes vs exact", "quality vs exact", "machine", "date", "reproduce", "data"],
        t_serving, "Each figure against the exact run of the same job in the same run; random weights, so the quality "
        "columns show the mechanism, not what a trained model gets."),
    "cluster_sim": Table(
        ["cluster_fidelity.csv", "sim_validation.csv", "sim_train_validation.csv", "cluster_dit_serving.csv",
         "sim_papers_dit.csv"],
        ["what", "figure", "machine", "date", "reproduce", "data"], t_cluster_sim,
        "Error = (predicted - measured) / measured of the step time; measured = the median over 3 rounds "
        "(sim train: 5)."),
    "sim_papers": Table(
        ["sim_papers.csv"],
        ["study (per drafter attention layer)", "paper (35B-A3B / 27B)", "h100-ib 35B-A3B", "h100-ib 27B",
         "h100-ib-8nic 35B-A3B", "h100-ib-8nic 27B"], t_sim_papers,
        "Predictions from the shipped profiles (h100-ib: one 400 Gb/s uplink per node; -8nic: one per GPU), "
        "2026-12-02; the paper's figures are SPEC A.5's. Reproduce: `bench/bench_sim_papers.sh` (no MPI, seconds)."),
    "decoding": Table(
        ["draft_cache.csv"],
        ["context", "stateless, P = 1", "draft cache, P = 1", "draft cache, P = 2", "sliding (W 2048) cache, P = 1",
         "cache vs stateless, P = 1"], t_decoding,
        f"One DFlash draft block of the `small` drafter (H 512, 4 layers, B 16), ms, median of 5; {XEON}, 2026-12-05. "
        "Reproduce: `bench/bench_draft.sh`."),
    "dflash2": Table(
        ["dflash2_tau.csv", "dflash2_speed.csv"],
        ["trained at", "drafter", "tau at prompt 1k / 1.5k / 2k / 4k / 8k", "candidate recall (training)",
         "greedy speed-up vs the target alone at 2k / 4k", "lossless"], t_dflash2,
        f"`tools/long_context_study.py --archs dflash,dflash2` ({XEON}, 2026-12-06): its target and period-1024 "
        "corpus, tiny drafters trained at P = 2 (2k: 2000 steps, 8k: 1000), greedy, 4 prompts x 32 tokens (speed: 3 x "
        "64, draft cache, prefill included). Log: [dflash2_study.txt](dflash2_study.txt)."),
    "dflash2_step": Table(
        ["dflash2_step.csv"],
        ["preset", "P", "DFlash step ms", "DFlash2 step ms", "DFlash2 / DFlash", "rounds"], t_dflash2_step,
        f"The train step (context 2048, f32, 20 steps, one rank per core, `OMP_NUM_THREADS=1`), medians of 3 "
        f"interleaved rounds; {XEON}, 2026-12-06. Reproduce: `REPEAT=3 STEPS=20 bench/bench_dflash2.sh`."),
    "faults": Table(
        ["watchdog.csv", "faults.csv"], ["what", "figure", "machine", "date", "reproduce", "data"], t_faults,
        "The watchdog: medians over 5 alternating rounds; a fault: the time from the fault to the end of `mpirun`, "
        "no process left on any emulated host."),
}

BEGIN = re.compile(r"^<!-- table:([A-Za-z0-9_]+) -->$")
END = "<!-- /table -->"


def render(name):
    t = TABLES[name]
    try:
        rows = t.rows({s: Csv(s) for s in t.sources})
    except TableError as e:
        raise TableError(f"table '{name}': {e}") from None
    for r in rows:
        if len(r) != len(t.header):
            raise TableError(f"table '{name}': a row has {len(r)} cells for {len(t.header)} columns")
    cell = lambda c: str(c).replace("\n", " ")  # noqa: E731
    lines = ["| " + " | ".join(t.header) + " |", "|" + "---|" * len(t.header)]
    lines += ["| " + " | ".join(cell(c) for c in r) + " |" for r in rows]
    cells = " ".join(" ".join(map(str, r)) for r in rows)
    unlinked = [s for s in t.sources if f"]({s})" not in cells]  # a table with a data column links its CSVs there
    caption = t.caption
    if unlinked:
        caption += " Data: " + ", ".join(f"[{s}]({s})" for s in unlinked) + "."
    return lines + ["", f"*{caption}*"]


def blocks(lines, path):
    """(name, first line inside, end line) of every table block of the page."""
    out, i = [], 0
    while i < len(lines):
        m = BEGIN.match(lines[i])
        if m:
            j = i + 1
            while j < len(lines) and lines[j] != END:
                if BEGIN.match(lines[j]):
                    raise TableError(f"{path}:{j + 1}: table '{m.group(1)}' opened at line {i + 1} is not closed")
                j += 1
            if j == len(lines):
                raise TableError(f"{path}:{i + 1}: table '{m.group(1)}' has no '{END}'")
            if m.group(1) not in TABLES:
                raise TableError(f"{path}:{i + 1}: no table '{m.group(1)}' in bench/results_tables.py")
            out.append((m.group(1), i + 1, j))
            i = j
        i += 1
    return out


MAX_LINES = 300


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 where a table differs")
    ap.add_argument("--list", action="store_true", help="print each table and its CSVs")
    ap.add_argument("--file", default=str(BENCH / "RESULTS.md"), help="the page (default: bench/RESULTS.md)")
    a = ap.parse_args()
    if a.list:
        for n, t in TABLES.items():
            print(f"{n}: {', '.join('bench/' + s for s in t.sources)}")
        return 0
    path = Path(a.file)
    try:
        lines = path.read_text().split("\n")
        found = blocks(lines, path)
        names = [n for n, _, _ in found]
        missing = [n for n in TABLES if n not in names]
        twice = sorted({n for n in names if names.count(n) > 1})
        if missing or twice:
            raise TableError(f"{path}: " + "; ".join(
                ([f"no block for table(s) {', '.join(missing)}"] if missing else [])
                + ([f"table(s) {', '.join(twice)} more than once"] if twice else [])))
        new, differ, last = [], [], 0
        for name, a0, a1 in found:
            want = render(name)
            if lines[a0:a1] != want:
                differ.append(name)
                if a.check:
                    got = lines[a0:a1]
                    k = next((i for i in range(max(len(got), len(want)))
                              if i >= len(got) or i >= len(want) or got[i] != want[i]), 0)
                    print(f"{path}: table '{name}' differs from what its CSVs give ({', '.join('bench/' + s for s in TABLES[name].sources)}) "
                          f"(first at line {a0 + k + 1}):\n  page: {got[k] if k < len(got) else '(nothing)'}\n"
                          f"  CSVs: {want[k] if k < len(want) else '(nothing)'}", file=sys.stderr)
            new += lines[last:a0] + want
            last = a1
        new += lines[last:]
    except TableError as e:
        print(f"results_tables: {e}", file=sys.stderr)
        return 1
    if a.check:
        if differ:
            print(f"results_tables: {len(differ)} table(s) out of date: {', '.join(differ)}; "
                  "run python3 bench/results_tables.py", file=sys.stderr)
            return 1
        if len(lines) > MAX_LINES:  # one page: the detail goes to bench/history/
            print(f"results_tables: {path} has {len(lines)} lines; the page holds at most {MAX_LINES} "
                  "(move detail to bench/history/)", file=sys.stderr)
            return 1
        print(f"results_tables: {len(found)} tables match their CSVs; {len(lines)} lines")
        return 0
    if differ:
        path.write_text("\n".join(new))
        print(f"results_tables: rewrote {', '.join(differ)}")
    else:
        print(f"results_tables: {len(found)} tables already match their CSVs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
