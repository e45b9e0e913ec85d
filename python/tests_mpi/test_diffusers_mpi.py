"""diffcp.diffusers at P ranks (mpirun -np P python -m pytest python/tests_mpi), without diffusers
installed (CI has Debian's torch, not PyPI's diffusers): a stand-in FluxTransformer2DModel (a torch
module with the class name, the config and the weights folder of a diffusers transformer written by
tools/flux_reference.py) is parallelized, and its forward, called as FluxPipeline calls it
(hidden_states, encoder_hidden_states, pooled_projections, timestep = sigma, img_ids, txt_ids,
guidance, return_dict=False), equals the independent float64 NumPy reference's velocity
(tools/flux_reference.py FluxReference) in every mode, for token counts P does not divide, with
bf16 / sharded weights within bf16's tolerance, two prompts in one batch run as two groups, and the
torch weights freed. tools/diffusers_pipeline_check.py runs the real FluxPipeline (PyPI)."""
import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from mpi4py import MPI

torch = pytest.importorskip("torch")

import diffcp.diffusers  # noqa: E402
from standin_pipeline import (Flux2Transformer2DModel, FluxTransformer2DModel,  # noqa: E402
                              QwenImageTransformer2DModel, SD3Transformer2DModel, WanImageToVideoPipeline,
                              WanPipeline, WanTransformer3DModel)

COMM = MPI.COMM_WORLD
P, RANK = COMM.Get_size(), COMM.Get_rank()
ROOT = Path(__file__).resolve().parents[2]


def _reference_module(name: str):
    sys.path.insert(0, str(ROOT / "tools"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


REF = _reference_module("flux_reference")
SD3 = _reference_module("sd3_reference")


@pytest.fixture(scope="module")
def folder():
    """A tiny FLUX.1-dev-like diffusers pipeline folder (4 heads, guidance embedding), one per rank."""
    d = tempfile.TemporaryDirectory()
    subprocess.run([sys.executable, str(ROOT / "tools" / "flux_reference.py"), "make", "--out", d.name, "--format",
                    "diffusers", "--heads", "4", "--hidden", "64", "--depth", "1", "--depth-single", "2"],
                   check=True, stdout=subprocess.DEVNULL)
    yield Path(d.name)
    d.cleanup()


@pytest.fixture(scope="module")
def sd3_folder():
    """A tiny SD3.5-like diffusers pipeline folder (2 blocks, the last context-pre-only), one per rank."""
    d = tempfile.TemporaryDirectory()
    subprocess.run([sys.executable, str(ROOT / "tools" / "sd3_reference.py"), "make", "--out", d.name],
                   check=True, stdout=subprocess.DEVNULL)
    yield Path(d.name)
    d.cleanup()


def inputs(batch: int, width: int, height: int, text_tokens: int, seed: int):
    rng = np.random.default_rng(seed)
    gh, gw = height // 16, width // 16
    x = rng.standard_normal((batch, gh * gw, 16)).astype(np.float32)
    txt = np.repeat(rng.standard_normal((1, text_tokens, 32)).astype(np.float32), batch, 0)
    pooled = np.repeat(rng.standard_normal((1, 24)).astype(np.float32), batch, 0)
    img_ids, txt_ids = REF.make_ids(1, text_tokens, height, width)
    return x, txt, pooled, img_ids[0], txt_ids[0]


def reference(folder: Path, x, txt, pooled, img_ids, txt_ids, t: float, g: float) -> np.ndarray:
    p, w = REF.load_diffusers_folder(folder)
    B = x.shape[0]
    m = REF.FluxReference(p, w)
    return m.forward(x.astype(np.float64), np.repeat(img_ids[None], B, 0), txt.astype(np.float64),
                     np.repeat(txt_ids[None], B, 0), np.full(B, t), pooled.astype(np.float64), np.full(B, g))


def call(transformer, x, txt, pooled, img_ids, txt_ids, t, g):
    out = transformer(hidden_states=torch.from_numpy(x), encoder_hidden_states=torch.from_numpy(txt),
                      pooled_projections=torch.from_numpy(pooled), timestep=torch.full((x.shape[0],), t),
                      img_ids=torch.from_numpy(img_ids), txt_ids=torch.from_numpy(txt_ids),
                      guidance=torch.full((x.shape[0],), g), joint_attention_kwargs=None, return_dict=False)
    assert isinstance(out, tuple) and out[0].dtype == torch.float32
    return out[0].numpy()


def close(got, want, tol, what):
    err = float(np.abs(got - want).max())
    scale = max(1.0, float(np.abs(want).max()))
    assert err <= tol * scale, f"rank {RANK}: {what}: max abs error {err} (scale {scale})"


@pytest.mark.parametrize("mode", ["flat", "tapa", "vfirst", "cocodiff"])
def test_forward_equals_numpy_reference(folder, mode):
    # 80 x 48 pixels: 15 image tokens and 7 text tokens (P = 2, 4, 8 divide neither: padded shards).
    x, txt, pooled, img_ids, txt_ids = inputs(2, 80, 48, 7, seed=3)
    pipe = SimpleNamespace(transformer=FluxTransformer2DModel(folder))
    par = diffcp.diffusers.parallelize(pipe, mode=mode, dtype="f32", weights_dtype="f32", cache_ratio=0.0)
    assert pipe.transformer.w.numel() == 0  # torch's copy freed; the dtype stays
    assert pipe.transformer.w.dtype == torch.bfloat16
    par._state.reset(2)
    want = reference(folder, x, txt, pooled, img_ids, txt_ids, 0.7, 3.5)
    close(call(pipe.transformer, x, txt, pooled, img_ids, txt_ids, 0.7, 3.5), want, 1e-4, mode)


def test_fp8_wire_stays_close_to_f32(folder):
    # wire="fp8": q, k, v, o travel as e4m3 with one float32 scale per (token, head) (2^-4 relative
    # per element); one forward stays within 2^-4 of the f32 run's scale (measured: 2^-6.6 at P = 2), and is
    # not the f32 run itself.
    x, txt, pooled, img_ids, txt_ids = inputs(1, 80, 48, 7, seed=4)
    outs = {}
    for wire in ("auto", "fp8"):
        pipe = SimpleNamespace(transformer=FluxTransformer2DModel(folder))
        par = diffcp.diffusers.parallelize(pipe, mode="tapa", dtype="f32", weights_dtype="f32", wire=wire)
        par._state.reset(1)
        outs[wire] = call(pipe.transformer, x, txt, pooled, img_ids, txt_ids, 0.6, 3.5)
    assert np.abs(outs["fp8"] - outs["auto"]).max() > 0
    close(outs["fp8"], outs["auto"], 2 ** -4, "fp8 wire vs f32")
    pipe = SimpleNamespace(transformer=FluxTransformer2DModel(folder))
    with pytest.raises(Exception, match="`wire` 'e5m2': unknown wire format"):
        diffcp.diffusers.parallelize(pipe, mode="flat", dtype="f32", weights_dtype="f32", wire="e5m2")


def test_bf16_sharded_weights_and_two_prompts(folder):
    x, txt, pooled, img_ids, txt_ids = inputs(2, 64, 48, 5, seed=5)
    txt[1] += 0.5  # a second prompt: the batch runs as two groups
    pipe = SimpleNamespace(transformer=FluxTransformer2DModel(folder))
    par = diffcp.diffusers.parallelize(pipe, mode="flat", dtype="f32", weights_dtype="bf16", shard_weights=True)
    assert par.core.config()["weights_dtype"] == "bf16"
    assert par.core.config()["shard_weights"] == (P > 1)
    got = call(pipe.transformer, x, txt, pooled, img_ids, txt_ids, 0.4, 2.0)
    for i in range(2):  # each image against its own prompt's reference; bf16 weights: bf16's tolerance
        want = reference(folder, x[i:i + 1], txt[i:i + 1], pooled[i:i + 1], img_ids, txt_ids, 0.4, 2.0)
        close(got[i:i + 1], want, 2 ** -5, f"image {i}")


@pytest.mark.parametrize("mode", ["flat", "cocodiff"])
def test_batch_prompts_runs_two_prompts_as_one_batch(folder, mode):
    # batch_prompts: two prompts of one call are one transformer call with per-image text and
    # pooled vectors, each image equal to its own prompt's reference.
    x, txt, pooled, img_ids, txt_ids = inputs(3, 64, 48, 5, seed=7)
    txt[1] += 0.5
    pooled[2] -= 0.25
    pipe = SimpleNamespace(transformer=FluxTransformer2DModel(folder))
    par = diffcp.diffusers.parallelize(pipe, mode=mode, dtype="f32", weights_dtype="f32", cache_ratio=0.0,
                                       batch_prompts=True)
    calls, fwd = [], pipe.transformer.forward  # the images of each core call
    fwd.core = SimpleNamespace(velocity=lambda *a: calls.append(a[0].shape[0]) or par.core.velocity(*a))
    got = call(pipe.transformer, x, txt, pooled, img_ids, txt_ids, 0.4, 2.0)
    assert calls == [3], calls
    for i in range(3):
        want = reference(folder, x[i:i + 1], txt[i:i + 1], pooled[i:i + 1], img_ids, txt_ids, 0.4, 2.0)
        close(got[i:i + 1], want, 1e-4, f"image {i}")


def test_bad_input_is_refused(folder):
    pipe = SimpleNamespace(transformer=torch.nn.Linear(2, 2))
    with pytest.raises(NotImplementedError, match="transformer Linear is not supported"):
        diffcp.diffusers.parallelize(pipe)
    pipe = SimpleNamespace(transformer=FluxTransformer2DModel(folder))
    with pytest.raises(ValueError, match="`ulysses_degree` U = 3 x `ring_degree` R = 5 = 15, expected U x R = P"):
        diffcp.diffusers.parallelize(pipe, ulysses_degree=3, ring_degree=5)
    par = diffcp.diffusers.parallelize(pipe, mode="flat", dtype="f32", weights_dtype="f32")
    x, txt, pooled, img_ids, txt_ids = inputs(1, 64, 32, 4, seed=1)
    with pytest.raises(NotImplementedError, match="img_ids other than"):
        call(pipe.transformer, x, txt, pooled, img_ids[::-1].copy(), txt_ids, 0.5, 1.0)
    with pytest.raises(ValueError, match="rows for 7 image tokens"):
        call(pipe.transformer, x[:, :-1].copy(), txt, pooled, img_ids, txt_ids, 0.5, 1.0)
    assert par.output_on == "rank0"
    with pytest.raises(NotImplementedError, match="a LoRA scale"):
        pipe.transformer(hidden_states=torch.from_numpy(x), encoder_hidden_states=torch.from_numpy(txt),
                         pooled_projections=torch.from_numpy(pooled), timestep=torch.full((1,), 0.5),
                         img_ids=torch.from_numpy(img_ids), txt_ids=torch.from_numpy(txt_ids),
                         joint_attention_kwargs={"scale": 0.5}, return_dict=False)
    lora = SimpleNamespace(transformer=FluxTransformer2DModel(folder))
    lora.transformer.lora_A = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(NotImplementedError, match="LoRA weights"):
        diffcp.diffusers.parallelize(lora)


def test_steps_follow_the_pipeline_call():
    class Pipe:
        def __call__(self, prompt=None, num_inference_steps: int = 50, sigmas=None):
            return None
    steps = diffcp.diffusers._steps
    assert steps(Pipe(), (), {}) == 50  # the pipeline's own default (Qwen-Image's, FLUX.2's)
    assert steps(Pipe(), ("a", 12), {}) == 12  # positional
    assert steps(Pipe(), (), {"sigmas": [1.0, 0.5, 0.25]}) == 3


def check_sd3_cfg_batch(sd3_folder, pipe, what: str):
    """SD3's pipeline batches [negative; prompt]: two prompts of one batch, run as two passes. A
    80 x 48 image: a 3 x 5 grid, 15 tokens (P = 2, 4 divide it not). Both against the reference."""
    rng = np.random.default_rng(9)
    lat = rng.standard_normal((2, 4, 6, 10)).astype(np.float32)
    txt = rng.standard_normal((2, 7, 32)).astype(np.float32)
    pooled = rng.standard_normal((2, 24)).astype(np.float32)
    out = pipe.transformer(hidden_states=torch.from_numpy(lat), encoder_hidden_states=torch.from_numpy(txt),
                           pooled_projections=torch.from_numpy(pooled), timestep=torch.full((2,), 640.0),
                           joint_attention_kwargs=None, return_dict=False)[0].numpy()
    a, w, _ = SD3.load_folder(sd3_folder)
    ref = SD3.SD3Reference(a, w)
    for i in range(2):
        want = ref.forward(lat[i:i + 1].astype(np.float64), txt[i].astype(np.float64), pooled[i].astype(np.float64), 0.64)
        close(out[i:i + 1], want, 1e-4, f"{what} image {i}")


@pytest.mark.parametrize("mode", ["flat", "vfirst"])
def test_sd3_forward_with_cfg_batch_equals_numpy_reference(sd3_folder, mode):
    pipe = SimpleNamespace(transformer=SD3Transformer2DModel(sd3_folder))
    diffcp.diffusers.parallelize(pipe, mode=mode, dtype="f32", weights_dtype="f32")
    check_sd3_cfg_batch(sd3_folder, pipe, mode)


QWEN = _reference_module("qwenimage_reference")
FLUX2 = _reference_module("flux2_reference")


def _tool_folder(tool: str) -> tempfile.TemporaryDirectory:
    """A diffusers folder made by tools/<tool> (a temporary directory: call .cleanup())."""
    d = tempfile.TemporaryDirectory()
    subprocess.run([sys.executable, str(ROOT / "tools" / tool), "make", "--out", d.name], check=True,
                   stdout=subprocess.DEVNULL)
    return d


def _parallel(tool: str, module, cls, reference: str, mode: str):
    """A folder made by tools/<tool>, its stand-in transformer parallelized, the NumPy reference."""
    d = _tool_folder(tool)
    pipe = SimpleNamespace(transformer=cls(Path(d.name)))
    diffcp.diffusers.parallelize(pipe, mode=mode, dtype="f32", weights_dtype="f32")
    a, w, _ = module.load_folder(Path(d.name))
    return d, pipe, a, getattr(module, reference)(a, w)


def test_qwen_image_two_calls_with_masks_equal_numpy_reference():
    # QwenImagePipeline's true CFG: a call for the prompt, then one for the negative prompt (another
    # pass), each text padded to a longer length with encoder_hidden_states_mask's trailing zeros.
    d, pipe, a, ref = _parallel("qwenimage_reference.py", QWEN, QwenImageTransformer2DModel, "QwenImageReference", "vfirst")
    rng = np.random.default_rng(11)
    gh, gw = 3, 5
    x = rng.standard_normal((2, gh * gw, a["in_channels"])).astype(np.float32)
    for n_real in (7, 4):
        enc = rng.standard_normal((2, 9, a["joint_attention_dim"])).astype(np.float32)
        enc[1] = enc[0]
        mask = np.zeros((2, 9), np.int64)
        mask[:, :n_real] = 1
        out = pipe.transformer(hidden_states=torch.from_numpy(x), encoder_hidden_states=torch.from_numpy(enc),
                               encoder_hidden_states_mask=torch.from_numpy(mask), timestep=torch.full((2,), 0.55),
                               img_shapes=[[(1, gh, gw)]] * 2, guidance=None, attention_kwargs=None,
                               return_dict=False)[0].numpy()
        want = ref.forward(x.astype(np.float64), enc[0, :n_real].astype(np.float64), 0.55, gh, gw)
        close(out, want, 1e-4, f"{n_real} real text tokens")
    d.cleanup()


def test_flux2_forward_equals_numpy_reference():
    d, pipe, a, ref = _parallel("flux2_reference.py", FLUX2, Flux2Transformer2DModel, "Flux2Reference", "tapa")
    rng = np.random.default_rng(13)
    gh, gw, T = 3, 5, 7
    x = rng.standard_normal((2, gh * gw, a["in_channels"])).astype(np.float32)
    enc = np.repeat(rng.standard_normal((1, T, a["joint_attention_dim"])).astype(np.float32), 2, 0)
    img_ids = torch.cartesian_prod(torch.arange(1), torch.arange(gh), torch.arange(gw), torch.arange(1))
    txt_ids = torch.cartesian_prod(torch.arange(1), torch.arange(1), torch.arange(1), torch.arange(T))
    out = pipe.transformer(hidden_states=torch.from_numpy(x), encoder_hidden_states=torch.from_numpy(enc),
                           timestep=torch.full((2,), 0.3), img_ids=img_ids[None].repeat(2, 1, 1),
                           txt_ids=txt_ids[None].repeat(2, 1, 1), guidance=torch.full((2,), 4.0),
                           joint_attention_kwargs=None, return_dict=False)[0].numpy()
    want = ref.forward(x.astype(np.float64), enc[0].astype(np.float64), 0.3, 4.0, gh, gw)
    close(out, want, 1e-4, "flux2")
    with pytest.raises(NotImplementedError, match="txt_ids other than"):
        pipe.transformer(hidden_states=torch.from_numpy(x), encoder_hidden_states=torch.from_numpy(enc),
                         timestep=torch.full((2,), 0.3), img_ids=img_ids, txt_ids=torch.zeros(T, 4),
                         guidance=torch.full((2,), 4.0), return_dict=False)
    d.cleanup()


# ---- issue #52: CFG-parallel and step caching ----

def test_sd3_cfg_parallel_runs_the_batch_halves_at_once(sd3_folder):
    # SD3's [negative; prompt] batch with cfg_parallel: each half of the ranks runs one prompt; both
    # equal the float64 reference (P odd: refused by name).
    pipe = SimpleNamespace(transformer=SD3Transformer2DModel(sd3_folder))
    if P % 2:
        with pytest.raises(ValueError, match=f"P = {P} is odd"):
            diffcp.diffusers.parallelize(pipe, cfg_parallel=True)
        return
    par = diffcp.diffusers.parallelize(pipe, mode="tapa", dtype="f32", weights_dtype="f32", cfg_parallel=True)
    assert par.core.config()["cfg_parallel"]
    check_sd3_cfg_batch(sd3_folder, pipe, "cfg_parallel")


def test_qwen_image_cfg_parallel_pairs_the_two_calls():
    # QwenImagePipeline's true CFG with cfg_parallel: the prompt's call returns its tensor at once and
    # the negative prompt's call fills it (both passes run then, one per half); each equals the reference.
    if P % 2:
        pytest.skip("cfg_parallel needs an even P")
    d = _tool_folder("qwenimage_reference.py")
    pipe = SimpleNamespace(transformer=QwenImageTransformer2DModel(Path(d.name)))
    par = diffcp.diffusers.parallelize(pipe, mode="vfirst", dtype="f32", weights_dtype="f32", cfg_parallel=True)
    a, w, _ = QWEN.load_folder(Path(d.name))
    ref = QWEN.QwenImageReference(a, w)
    rng = np.random.default_rng(17)
    gh, gw = 3, 5
    x = rng.standard_normal((1, gh * gw, a["in_channels"])).astype(np.float32)
    encs = [rng.standard_normal((1, n, a["joint_attention_dim"])).astype(np.float32) for n in (7, 4)]
    for step in range(2):
        par._state.reset(2, two_calls=True) if step == 0 else None
        t = 0.8 - 0.3 * step
        outs = [pipe.transformer(hidden_states=torch.from_numpy(x), encoder_hidden_states=torch.from_numpy(e),
                                 encoder_hidden_states_mask=None, timestep=torch.full((1,), t),
                                 img_shapes=[[(1, gh, gw)]], guidance=None, attention_kwargs=None,
                                 return_dict=False)[0] for e in encs]
        for e, o, what in zip(encs, outs, ("prompt", "negative")):
            close(o.numpy(), ref.forward(x.astype(np.float64), e[0].astype(np.float64), t, gh, gw), 1e-4,
                  f"step {step} {what}")
    assert par._state.pending is None
    d.cleanup()


def test_step_cache_threshold_zero_is_exact_and_a_huge_one_skips(folder):
    x, txt, pooled, img_ids, txt_ids = inputs(1, 80, 48, 7, seed=21)
    runs = {}
    for spec in ("none", "fbcache:0", "fbcache:1e9"):
        pipe = SimpleNamespace(transformer=FluxTransformer2DModel(folder))
        par = diffcp.diffusers.parallelize(pipe, mode="flat", dtype="f32", weights_dtype="f32", step_cache=spec)
        par._state.reset(3)
        runs[spec] = [call(pipe.transformer, x, txt, pooled, img_ids, txt_ids, t, 3.5) for t in (0.9, 0.6, 0.3)]
        stats = par.core.step_cache_stats()
        if spec == "fbcache:1e9":
            assert stats["0"]["computed"] == 1 and stats["0"]["cached"] == 2, stats
        elif spec == "fbcache:0":
            assert stats["0"]["computed"] == 3 and stats["0"]["cached"] == 0, stats
    for a_, b_ in zip(runs["none"], runs["fbcache:0"]):
        assert np.array_equal(a_, b_)
    assert np.array_equal(runs["none"][0], runs["fbcache:1e9"][0])  # the first step is always full
    assert not np.array_equal(runs["none"][2], runs["fbcache:1e9"][2])  # later steps reuse the residual


def test_cfg_parallel_keeps_each_pair_of_a_step_apart():
    # Two prompts per call, two true-CFG calls a step (FluxPipeline / QwenImagePipeline with a list of
    # prompts and of negative prompts): each call is its own pair with its own caches. With a step cache
    # that reuses every step after the first, cfg_parallel equals the sequential passes (each prompt its
    # own pass), step for step; pairs sharing caches would apply one prompt's residual to another's.
    if P % 2:
        pytest.skip("cfg_parallel needs an even P")
    d = _tool_folder("qwenimage_reference.py")
    a = QWEN.load_folder(Path(d.name))[0]
    rng = np.random.default_rng(23)
    gh, gw = 3, 5
    x = rng.standard_normal((2, gh * gw, a["in_channels"])).astype(np.float32)
    calls = [rng.standard_normal((2, 6, a["joint_attention_dim"])).astype(np.float32) for _ in range(2)]
    outs = {}
    for par in (False, True):
        pipe = SimpleNamespace(transformer=QwenImageTransformer2DModel(Path(d.name)))
        p = diffcp.diffusers.parallelize(pipe, mode="flat", dtype="f32", weights_dtype="f32", cfg_parallel=par,
                                         step_cache="fbcache:1e9")
        p._state.reset(3, two_calls=True)
        got = []
        for t in (0.9, 0.6, 0.3):
            res = [pipe.transformer(hidden_states=torch.from_numpy(x), encoder_hidden_states=torch.from_numpy(e),
                                    encoder_hidden_states_mask=None, timestep=torch.full((2,), t),
                                    img_shapes=[[(1, gh, gw)]] * 2, guidance=None, attention_kwargs=None,
                                    return_dict=False)[0] for e in calls]
            got.append([r.numpy().copy() for r in res])
        outs[par] = got
        if par:
            stats = p.core.step_cache_stats()
            half = 0 if RANK < P // 2 else 1
            assert {k: v["cached"] for k, v in stats.items()} == {f"pair0.{half}": 2, f"pair1.{half}": 2}, stats
    for k, (seq, par) in enumerate(zip(outs[False], outs[True])):
        for c in range(2):
            close(par[c], seq[c], 1e-4, f"step {k} call {c}")
    d.cleanup()


WAN = _reference_module("wan_reference")


def _wan_folder(seed: int, *extra: str) -> tempfile.TemporaryDirectory:
    """tools/wan_reference.py make: 2 blocks, 4 heads x 12, 4 latent channels (a temporary directory);
    `extra`: its other options (image-to-video: --condition-channels, --image-dim, ...)."""
    d = tempfile.TemporaryDirectory()
    subprocess.run([sys.executable, str(ROOT / "tools" / "wan_reference.py"), "make", "--out", d.name, "--seed", str(seed),
                    *extra], check=True, stdout=subprocess.DEVNULL)
    return d


# Wan 2.1 I2V's shape, reduced: 8 condition channels after the latent's 4, a 20-feature image context
# of 6 tokens (FLF2V: with its position table); Wan 2.2 I2V A14B's: the condition alone.
WAN_I2V = ("--condition-channels", "8", "--image-dim", "20", "--image-tokens", "6")
WAN_I2V_A14B = ("--condition-channels", "8")


class _WanReference(torch.nn.Module):
    """A transformer whose forward is tools/wan_reference.py's float64 NumPy model (WanPipeline's call)."""

    def __init__(self, path: Path):
        super().__init__()
        a, w, _ = WAN.load_folder(path)
        self.m = WAN.WanRef(a, w)
        self.config = SimpleNamespace(**{k: v for k, v in a.items()})

    def forward(self, hidden_states, timestep, encoder_hidden_states, encoder_hidden_states_image=None,
                attention_kwargs=None, return_dict=True):
        image = None if encoder_hidden_states_image is None else encoder_hidden_states_image.double().numpy()
        if image is not None and self.config.pos_embed_seq_len is not None:  # FLF2V's pairs of frames
            image = image.reshape(-1, 2 * image.shape[1], image.shape[2])
        ts = timestep.double()
        sigma = ts[0].numpy() / 1000.0 if ts.dim() == 2 else float(ts[0]) / 1000.0  # per token (TI2V) or one
        v = self.m.forward(hidden_states.double().numpy(), encoder_hidden_states.double().numpy(), sigma, image)
        return (torch.from_numpy(v.astype(np.float32)),)


@pytest.mark.parametrize("mode", ["flat", "tapa", "vfirst", "cocodiff"])
def test_wan_forward_equals_numpy_reference(mode):
    # WanPipeline's call: the latent video [B, C, F, H/8, W/8] (2 frames of 6 x 10: 30 tokens, which P = 4
    # divides not), timestep = 1000 sigma, the text cross-attended on every rank; two videos of a prompt.
    d = _wan_folder(3)
    rng = np.random.default_rng(31)
    lat = rng.standard_normal((2, 4, 2, 6, 10)).astype(np.float32)
    enc = np.repeat(rng.standard_normal((1, 7, 32)).astype(np.float32), 2, 0)
    pipe = SimpleNamespace(transformer=WanTransformer3DModel(Path(d.name)))
    par = diffcp.diffusers.parallelize(pipe, mode=mode, dtype="f32", weights_dtype="f32", cache_ratio=0.0)
    assert pipe.transformer.w.numel() == 0
    par._state.reset(2)
    got = pipe.transformer(hidden_states=torch.from_numpy(lat), timestep=torch.full((2,), 700.0),
                           encoder_hidden_states=torch.from_numpy(enc), attention_kwargs=None, return_dict=False)[0]
    assert tuple(got.shape) == lat.shape
    want = _WanReference(Path(d.name))(torch.from_numpy(lat), torch.full((2,), 700.0), torch.from_numpy(enc))[0]
    close(got.numpy(), want.numpy(), 1e-4, mode)
    with pytest.raises(ValueError, match="without an image embedder"):
        pipe.transformer(hidden_states=torch.from_numpy(lat), timestep=torch.full((2,), 700.0),
                         encoder_hidden_states=torch.from_numpy(enc), encoder_hidden_states_image=torch.zeros(2, 3, 8),
                         return_dict=False)
    with pytest.raises(ValueError, match="expected even sides"):
        pipe.transformer(hidden_states=torch.from_numpy(lat[..., :5]), timestep=torch.full((2,), 700.0),
                         encoder_hidden_states=torch.from_numpy(enc), return_dict=False)
    d.cleanup()


@pytest.mark.parametrize("cfg_parallel", [False, True])
def test_wan_pipeline_with_two_experts_equals_numpy_reference(cfg_parallel):
    # WanPipeline as Wan 2.2 A14B runs it: the high-noise expert above t = 500, the low-noise expert
    # (transformer_2) below, classifier-free guidance as two calls a step (cfg_parallel: the pair at
    # once on two halves of the ranks, an even P). Both experts parallel, each against its reference.
    if cfg_parallel and P % 2:
        pytest.skip("cfg_parallel needs an even P")
    hi, lo = _wan_folder(4), _wan_folder(5)
    pipe = WanPipeline(WanTransformer3DModel(Path(hi.name)), WanTransformer3DModel(Path(lo.name)), boundary_ratio=0.5)
    par = diffcp.diffusers.parallelize(pipe, mode="tapa", dtype="f32", weights_dtype="f32", cfg_parallel=cfg_parallel)
    assert len(par.cores) == 2 and pipe.transformer_2.w.numel() == 0
    kw = dict(prompt="a boat", height=48, width=80, num_frames=5, num_inference_steps=4, guidance_scale=4.0)
    got = par(generator=torch.Generator().manual_seed(2), **kw).frames
    ref = WanPipeline(_WanReference(Path(hi.name)), _WanReference(Path(lo.name)), boundary_ratio=0.5)
    want = ref(generator=torch.Generator().manual_seed(2), **kw).frames
    assert tuple(got.shape) == (1, 4, 2, 6, 10)
    close(got.numpy(), want.numpy(), 1e-4, f"A14B pipeline, cfg_parallel {cfg_parallel}")
    one = WanPipeline(_WanReference(Path(hi.name)))  # the low-noise expert mattered
    assert np.abs(one(generator=torch.Generator().manual_seed(2), **kw).frames.numpy() - want.numpy()).max() > 1e-2
    hi.cleanup()
    lo.cleanup()


def test_wan_second_expert_starts_its_caches_afresh():
    # A14B's low-noise expert is first called at the boundary (step 6 of 10 here, after V-Major's 5
    # warm-up steps): that call is its own step 0 (full exchanges, the step cache restarted), so a
    # second generation equals the first instead of reusing the first one's last caches.
    hi, lo = _wan_folder(6), _wan_folder(7)
    pipe = WanPipeline(WanTransformer3DModel(Path(hi.name)), WanTransformer3DModel(Path(lo.name)), boundary_ratio=0.5)
    par = diffcp.diffusers.parallelize(pipe, mode="cocodiff", dtype="f32", weights_dtype="f32", cache_ratio=0.5,
                                       step_cache="fbcache:1e-3")
    kw = dict(prompt="a boat", height=48, width=80, num_frames=5, num_inference_steps=10, guidance_scale=4.0)
    first = par(generator=torch.Generator().manual_seed(3), **kw).frames.numpy()
    second = par(generator=torch.Generator().manual_seed(3), **kw).frames.numpy()
    assert np.array_equal(first, second)
    assert set(par.cores[1].step_cache_stats()) == {"0", "1"}  # the prompt's and the negative prompt's passes
    hi.cleanup()
    lo.cleanup()


@pytest.mark.parametrize("mode", ["flat", "cocodiff"])
def test_wan_per_token_timesteps(mode):
    # The pipelines' expand_timesteps (Wan 2.2 TI2V) pass one timestep per token [B, N]: all equal in
    # text-to-video (the run as with [B]); in image-to-video the first frame's tokens are at 0 (the
    # modulation then per token: each rank's rows run per timestep), equal to the reference; rows that
    # differ between the videos of a batch are refused.
    d = _wan_folder(8)
    rng = np.random.default_rng(5)
    lat = torch.from_numpy(rng.standard_normal((2, 4, 3, 4, 6)).astype(np.float32))  # 18 tokens: P = 4 pads
    enc = torch.from_numpy(np.repeat(rng.standard_normal((1, 7, 32)).astype(np.float32), 2, 0))
    pipe = SimpleNamespace(transformer=WanTransformer3DModel(Path(d.name)))
    par = diffcp.diffusers.parallelize(pipe, mode=mode, dtype="f32", weights_dtype="f32", cache_ratio=0.0)
    par._state.reset(1)
    one = pipe.transformer(hidden_states=lat, timestep=torch.full((2,), 600.0), encoder_hidden_states=enc,
                           return_dict=False)[0]
    per_token = pipe.transformer(hidden_states=lat, timestep=torch.full((2, 18), 600.0), encoder_hidden_states=enc,
                                 return_dict=False)[0]
    assert torch.equal(one, per_token)
    mixed = torch.full((2, 18), 600.0)
    mixed[:, :6] = 0.0  # the first latent frame: TI2V's conditioning image
    par._state.reset(1)
    got = pipe.transformer(hidden_states=lat, timestep=mixed, encoder_hidden_states=enc, return_dict=False)[0]
    want = _WanReference(Path(d.name))(lat, mixed, enc)[0]
    close(got.numpy(), want.numpy(), 1e-4, f"per-token timesteps, {mode}")
    assert np.abs(got.numpy() - one.numpy()).max() > 1e-2  # the first frame's timestep mattered
    uneven = mixed.clone()
    uneven[1, 7] = 100.0
    with pytest.raises(NotImplementedError, match="differ between the videos of the batch"):
        pipe.transformer(hidden_states=lat, timestep=uneven, encoder_hidden_states=enc, return_dict=False)
    d.cleanup()


@pytest.mark.parametrize("mode,variant", [("flat", "i2v"), ("tapa", "flf2v"), ("vfirst", "i2v"), ("cocodiff", "flf2v")])
def test_wan_i2v_forward_equals_numpy_reference(mode, variant):
    # WanImageToVideoPipeline's call: 12 input channels (the latent's 4, then the condition's 8) and 4 out,
    # the text (512 tokens, what diffusers' attention assumes beside an image) and the image context
    # cross-attended on every rank. Two videos of one prompt with different images: two passes.
    # FLF2V: the context arrives as the first and last frames' [2B, 3, 20], paired for its position table.
    d = _wan_folder(11, *WAN_I2V, *(("--pos-embed",) if variant == "flf2v" else ()))
    rng = np.random.default_rng(41)
    lat = rng.standard_normal((2, 12, 2, 6, 10)).astype(np.float32)
    enc = torch.from_numpy(np.repeat(rng.standard_normal((1, 512, 32)).astype(np.float32), 2, 0))
    image = torch.from_numpy(rng.standard_normal((2, 6, 20)).astype(np.float32))
    given = image.reshape(4, 3, 20) if variant == "flf2v" else image
    pipe = SimpleNamespace(transformer=WanTransformer3DModel(Path(d.name)))
    diffcp.diffusers.parallelize(pipe, mode=mode, dtype="f32", weights_dtype="f32", cache_ratio=0.0)._state.reset(2)
    call = dict(timestep=torch.full((2,), 700.0), encoder_hidden_states=enc, return_dict=False)
    got = pipe.transformer(hidden_states=torch.from_numpy(lat), encoder_hidden_states_image=given, **call)[0]
    assert tuple(got.shape) == (2, 4, 2, 6, 10)
    want = _WanReference(Path(d.name))(torch.from_numpy(lat), torch.full((2,), 700.0), enc, given)[0]
    close(got.numpy(), want.numpy(), 1e-4, f"{mode} {variant}")
    # the image context matters at this tolerance: the other video's image gives another velocity
    other = _WanReference(Path(d.name))(torch.from_numpy(lat), torch.full((2,), 700.0), enc, given.flip(0))[0]
    assert np.abs(other.numpy() - want.numpy()).max() > 1e-2
    with pytest.raises(ValueError, match="needs encoder_hidden_states_image"):
        pipe.transformer(hidden_states=torch.from_numpy(lat), **call)
    with pytest.raises(NotImplementedError, match="max_sequence_length=512"):
        pipe.transformer(hidden_states=torch.from_numpy(lat), encoder_hidden_states_image=given,
                         **{**call, "encoder_hidden_states": enc[:, :226]})
    # The image context's shape, checked on every rank before any collective: one shared [I, 20] beside
    # per-image text must be [b, I, 20]; FLF2V's position table takes 6 tokens, not 4.
    core, x = pipe.transformer.forward.core, np.zeros((2, 30, 48), np.float32)
    per_image_txt = np.zeros((2, 512, 32), np.float32)
    with pytest.raises(ValueError, match=r"the image context is \[6, 20\], expected \[b, I_ctx, 20\]"):
        core.velocity(x, 96, 160, per_image_txt, image[0].numpy(), 0.7, 0.0, 7, 0, 1, 2)
    if variant == "flf2v":
        with pytest.raises(ValueError, match="position table .* has 6"):
            core.velocity(x, 96, 160, per_image_txt[0], image[0, :4].numpy(), 0.7, 0.0, 7, 0, 1, 2)
    d.cleanup()


@pytest.mark.parametrize("variant,cfg_parallel", [("i2v", False), ("i2v_a14b", True)])
def test_wan_i2v_pipeline_equals_numpy_reference(variant, cfg_parallel):
    # WanImageToVideoPipeline as Wan 2.1 I2V (one expert, the image context) and Wan 2.2 I2V A14B (two
    # experts switched at the boundary, no image context; cfg_parallel at an even P) run it.
    if cfg_parallel and P % 2:
        pytest.skip("cfg_parallel needs an even P")
    extra = WAN_I2V if variant == "i2v" else WAN_I2V_A14B
    folders = [_wan_folder(12, *extra)] + ([_wan_folder(13, *extra)] if variant == "i2v_a14b" else [])
    experts = dict(boundary_ratio=0.5) if len(folders) == 2 else {}
    pipe = WanImageToVideoPipeline(*[WanTransformer3DModel(Path(f.name)) for f in folders], **experts)
    par = diffcp.diffusers.parallelize(pipe, mode="tapa", dtype="f32", weights_dtype="f32", cfg_parallel=cfg_parallel)
    kw = dict(prompt="a boat", height=48, width=80, num_frames=5, num_inference_steps=3, guidance_scale=4.0)
    got = par(generator=torch.Generator().manual_seed(2), **kw).frames
    ref = WanImageToVideoPipeline(*[_WanReference(Path(f.name)) for f in folders], **experts)
    want = ref(generator=torch.Generator().manual_seed(2), **kw).frames
    assert tuple(got.shape) == (1, 4, 2, 6, 10)
    close(got.numpy(), want.numpy(), 1e-4, f"{variant} pipeline, cfg_parallel {cfg_parallel}")
    for f in folders:
        f.cleanup()
