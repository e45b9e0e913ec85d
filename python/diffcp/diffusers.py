"""A diffusers pipeline whose transformer runs sequence-parallel on diffcp (CoCoDiff, issue #35).

The pipeline stays the one you know: its text encoders, scheduler and VAE run as diffusers runs
them, on every rank (replicated: every rank then holds the same latents, so nothing but the
transformer's attention ever crosses ranks; the cost is each rank's memory for the encoders and
the VAE). The transformer's forward becomes diffcp's distributed DiT (``_core.Dit``): each rank
takes its tokens (any count: padded shards), Ulysses / TAPA / V-First / CoCoDiff (V-Major) moves
q, k, v, o between the ranks, and the velocity is gathered on every rank. The weights are read
from the transformer's own safetensors files (its ``from_pretrained`` folder, or a folder the
transformer writes with ``save_pretrained`` when it has none) and the torch copies are freed, so
no second copy stays on the Python side.

Run the script on every rank (``mpirun -np P python script.py``); every rank calls the pipeline
with the same arguments::

    pipe = FluxPipeline.from_pretrained("black-forest-labs/FLUX.1-dev", torch_dtype=torch.bfloat16)
    pipe = diffcp.diffusers.parallelize(pipe)            # comm: MPI.COMM_WORLD
    image = pipe(prompt="a lighthouse", num_inference_steps=28).images   # rank 0 (output_on="all": every rank)

Supported: FluxPipeline (FluxTransformer2DModel, FLUX.1 dev / schnell), StableDiffusion3Pipeline
(SD3Transformer2DModel, SD3.5 large / large turbo: no dual attention), QwenImagePipeline
(QwenImageTransformer2DModel), Flux2Pipeline (Flux2Transformer2DModel) and WanPipeline
(WanTransformer3DModel, Wan 2.1 / 2.2 text-to-video; A14B's two experts both parallel; vae="patch"
decodes the video patch-parallel, diffcp.vae), with the pipeline's own
arguments (``prompt`` or ``prompt_embeds`` + ``pooled_prompt_embeds``, ``negative_prompt``,
``height``, ``width``, ``num_inference_steps``, ``guidance_scale``, ``generator``, ``output_type``,
...). Images of a batch that share a prompt run as one batch; different prompts (SD3's
classifier-free guidance batches the negative prompt with the prompt) run one after another, or,
with ``batch_prompts=True``, as one batch with per-image text.
"""
from __future__ import annotations

import os
import tempfile
from typing import Any

import numpy as np

from . import _core

__all__ = ["parallelize", "ParallelPipeline", "SUPPORTED_TRANSFORMERS"]

SUPPORTED_TRANSFORMERS = ("FluxTransformer2DModel", "SD3Transformer2DModel", "QwenImageTransformer2DModel",
                          "Flux2Transformer2DModel", "WanTransformer3DModel")


def _world(comm):
    """(mpi4py communicator, transport): see diffcp._comm_kind; None is MPI.COMM_WORLD."""
    from mpi4py import MPI
    from . import _comm_kind
    return _comm_kind(comm, MPI.COMM_WORLD)


def _weights_folder(transformer) -> tuple[str, tempfile.TemporaryDirectory | None]:
    """The transformer's diffusers folder (config.json + safetensors); written here when it has none."""
    src = getattr(transformer.config, "_name_or_path", None)
    if src and os.path.isfile(os.path.join(src, "config.json")) and any(
            f.endswith(".safetensors") or f.endswith(".safetensors.index.json") for f in os.listdir(src)):
        return src, None
    tmp = tempfile.TemporaryDirectory(prefix="diffcp_transformer_")
    transformer.save_pretrained(tmp.name, safe_serialization=True)
    return tmp.name, tmp


def _f32(x) -> np.ndarray:
    return np.ascontiguousarray(x.detach().to("cpu").float().numpy())


def _guidance(guidance) -> float:
    """The distilled guidance scale of a batch (one value; 0 without one)."""
    if guidance is None:
        return 0.0
    g = guidance.detach().to("cpu").double().reshape(-1)
    if not bool((g == g[0]).all()):
        raise NotImplementedError("diffcp.diffusers: every image of a batch must share the guidance")
    return float(g[0])



class _Forward:
    """A transformer's forward on diffcp: the family's arguments in, its output out (subclasses)."""

    def __init__(self, core, state):
        self.core = core
        self.state = state
        self.config = core.config()
        self.out_channels = 4 * int(self.config["latent_channels"])  # C_in: 2 x 2 patches of the latent

    def velocity(self, x: np.ndarray, gh: int, gw: int, txt, pooled, t: float, g: float, frames: int = 1,
                 token_t: list[float] | None = None) -> np.ndarray:
        """x [B, N, C_in] packed tokens of `frames` gh x gw grids (frame-major; 1 for an image); txt: per image its [T_i, D] rows, pooled
        [B, P] or None (torch) -> the velocity [B, N, C_in]. Images sharing the prompt run as one
        batch (the model shares the text rows across images); each other prompt (classifier-free
        guidance's negative half of SD3's batch, or Qwen-Image's second call of a step) is another
        pass, with its own V-Major caches. token_t: Wan's per-token timesteps in [0, 1] (TI2V's image
        conditioning), shared by the images; t is then the step's (their largest)."""
        import torch
        token_t = list(token_t or [])
        # The step within this transformer's run: Wan 2.2 A14B's low-noise expert starts at the boundary,
        # and its V-Major caches and step cache must start afresh there (its own step 0).
        step, steps = self.state.local(id(self), self.state.step_of(t))
        out = np.empty(x.shape[:2] + (self.out_channels,), np.float32)  # Wan I2V: the input has the condition too
        groups: list[list[int]] = []
        for i in range(x.shape[0]):
            for grp in groups:
                j = grp[0]
                if torch.equal(txt[i], txt[j]) and (pooled is None or torch.equal(pooled[i], pooled[j])):
                    grp.append(i)
                    break
            else:
                groups.append([i])
        passes = [(np.ascontiguousarray(x[grp]), _f32(txt[grp[0]]),
                   _f32(pooled[grp[0]]) if pooled is not None else np.zeros(0, np.float32)) for grp in groups]
        state = self.state
        if state.pending is not None and (len(groups) != 1 or state.pending["step"] != step):
            raise RuntimeError("diffcp.diffusers: cfg_parallel held back a call whose negative-prompt call never came")
        if state.cfg_parallel and len(groups) == 2 and len(groups[0]) == len(groups[1]):
            # SD3's [negative; prompt] batch (or any two prompts of one call): both passes at once, one
            # per half of the ranks; each pair of a step keeps its own caches (pair index).
            pair = state.next_pass() // 2
            state.next_pass()
            v = self.core.velocity_pair(*passes[0], *passes[1], 16 * gh, 16 * gw, t, g, step, steps, pair, frames,
                                        token_t)
            out[groups[0]], out[groups[1]] = v[0], v[1]
            return out
        if state.cfg_parallel and state.two_calls and len(groups) == 1 and (state.passes == 0 or state.pending):
            # Qwen-Image's / FLUX.1's true CFG: the prompt's call, then the negative prompt's. The step's
            # first call hands its output back now (NaN until filled) and the second call, which runs
            # both passes at once, fills it (the pipelines read neither before the second call returns).
            if state.pending is None:
                state.next_pass()
                out[...] = np.nan
                state.pending = {"inputs": passes[0], "out": out, "step": step, "sample": None, "unpack": None,
                                 "token_t": token_t}
                return out
            first = state.pending
            state.pending = None
            if first["token_t"] != token_t:
                raise NotImplementedError("diffcp.diffusers: cfg_parallel pairs two calls of a step with different "
                                          "per-token timesteps")
            pair = state.next_pass() // 2
            v = self.core.velocity_pair(*first["inputs"], *passes[0], 16 * gh, 16 * gw, t, g, step, steps, pair,
                                        frames, token_t)
            first["out"][...] = v[0]
            if first["sample"] is not None:
                first["sample"].copy_(torch.from_numpy(first["unpack"](v[0]) if first["unpack"] else v[0]))
            out[...] = v[1]
            return out
        if state.batch_prompts and len(groups) > 1:
            # Images of different prompts with the same text length as one transformer batch, each
            # with its own text rows and pooled vector.
            by_len: dict[int, list[int]] = {}
            for i in range(x.shape[0]):
                by_len.setdefault(int(txt[i].shape[0]), []).append(i)
            for idx in by_len.values():
                txt_b = np.ascontiguousarray(np.stack([_f32(txt[i]) for i in idx]))
                pooled_b = (np.ascontiguousarray(np.stack([_f32(pooled[i]) for i in idx])) if pooled is not None
                            else np.zeros(0, np.float32))
                out[idx] = self.core.velocity(np.ascontiguousarray(x[idx]), 16 * gh, 16 * gw, txt_b, pooled_b, t, g,
                                              state.next_pass(), step, steps, frames, token_t)
            return out
        for grp, pas in zip(groups, passes):
            out[grp] = self.core.velocity(pas[0], 16 * gh, 16 * gw, pas[1], pas[2], t, g, state.next_pass(), step,
                                          steps, frames, token_t)
        return out

    @staticmethod
    def check_grid(ids, gh: int, gw: int, axes: int, row: int, what: str) -> None:
        """ids [N, axes] must be the pipeline's grid: (.., row, column, ..) at columns row, row + 1, 0 elsewhere."""
        import torch
        want = torch.zeros(gh, gw, axes, dtype=torch.float64)
        want[..., row] = torch.arange(gh, dtype=torch.float64)[:, None]
        want[..., row + 1] = torch.arange(gw, dtype=torch.float64)[None, :]
        if ids.shape != (gh * gw, axes) or not torch.equal(ids, want.reshape(-1, axes)):
            raise NotImplementedError(f"diffcp.diffusers: {what} other than the pipeline's (row, column) grid "
                                      "are not supported (e.g. a reference image's tokens)")

    def grid_of(self, img_ids, axes: int, N: int) -> tuple[int, int]:
        """The (g_h, g_w) of the pipeline's img_ids ([N, axes] or [B, N, axes]: row, column at columns 1, 2)."""
        ids = self.ids2d(img_ids, axes)
        if ids.shape[0] != N:
            raise ValueError(f"img_ids: {ids.shape[0]} rows for {N} image tokens")
        gh, gw = int(ids[:, 1].max()) + 1, int(ids[:, 2].max()) + 1
        self.check_grid(ids, gh, gw, axes, 1, "img_ids")
        return gh, gw

    @staticmethod
    def ids2d(ids, axes: int):
        """[N, axes] or [B, N, axes] (every image the same) -> [N, axes] float64 on the host."""
        import torch
        ids = ids.detach().to("cpu").double()
        if ids.dim() == 3:
            if not all(torch.equal(ids[0], i) for i in ids):
                raise NotImplementedError("diffcp.diffusers: ids that differ between the images of a batch")
            ids = ids[0]
        if ids.dim() != 2 or ids.shape[1] != axes:
            raise ValueError(f"ids of shape {tuple(ids.shape)}, expected [N, {axes}]")
        return ids

    @staticmethod
    def timestep(timestep) -> float:
        t = timestep.detach().to("cpu").double().reshape(-1)
        if not bool((t == t[0]).all()):
            raise NotImplementedError("diffcp.diffusers: every image of a batch must share the timestep")
        return float(t[0])

    def output(self, out: np.ndarray, like, return_dict: bool, unpack=None):
        """out (velocity's tokens), made the family's layout by unpack (None: as it is) -> the forward's result."""
        import torch
        sample = torch.from_numpy(np.ascontiguousarray(unpack(out)) if unpack else out).to(device=like.device,
                                                                                            dtype=like.dtype)
        if self.state.pending is not None and self.state.pending["out"] is out:  # cfg_parallel: filled later
            self.state.pending["sample"], self.state.pending["unpack"] = sample, unpack
        if not return_dict:
            return (sample,)
        from diffusers.models.modeling_outputs import Transformer2DModelOutput
        return Transformer2DModelOutput(sample=sample)

    @staticmethod
    def refuse(attention_kwargs, unused) -> None:
        """Attention processors / LoRA (attention kwargs other than scale) and unknown arguments."""
        if attention_kwargs and any(k != "scale" or v != 1.0 for k, v in attention_kwargs.items()):
            raise NotImplementedError(f"diffcp.diffusers: attention kwargs {attention_kwargs} (attention "
                                      "processors, a LoRA scale) are not supported")
        if unused:
            raise TypeError(f"diffcp.diffusers: unexpected arguments {sorted(unused)}")


class _FluxForward(_Forward):
    """FluxTransformer2DModel.forward: hidden_states [B, N, C_in] packed 2x2, timestep = sigma."""

    def __call__(self, hidden_states, encoder_hidden_states=None, pooled_projections=None, timestep=None,
                 img_ids=None, txt_ids=None, guidance=None, joint_attention_kwargs=None,
                 controlnet_block_samples=None, controlnet_single_block_samples=None, return_dict=True,
                 controlnet_blocks_repeat=False, **unused):
        if controlnet_block_samples is not None or controlnet_single_block_samples is not None:
            raise NotImplementedError("diffcp.diffusers: ControlNet residuals are not supported")
        self.refuse(joint_attention_kwargs, unused)
        gh, gw = self.grid_of(img_ids, 3, hidden_states.shape[1])
        if txt_ids is not None and bool(txt_ids.detach().abs().sum() != 0):
            raise NotImplementedError("diffcp.diffusers: non-zero txt_ids are not supported (FLUX.1 text sits at the origin)")
        pooled = pooled_projections.detach() if pooled_projections is not None else None
        out = self.velocity(_f32(hidden_states), gh, gw, list(encoder_hidden_states.detach()), pooled,
                            self.timestep(timestep), _guidance(guidance))
        return self.output(out, hidden_states, return_dict)


class _SD3Forward(_Forward):
    """SD3Transformer2DModel.forward: hidden_states the latent [B, C, H/8, W/8], timestep = 1000 sigma;
    classifier-free guidance's batch [negative; prompt] runs as two passes."""

    def __call__(self, hidden_states, encoder_hidden_states=None, pooled_projections=None, timestep=None,
                 block_controlnet_hidden_states=None, joint_attention_kwargs=None, return_dict=True, skip_layers=None,
                 **unused):
        if block_controlnet_hidden_states is not None:
            raise NotImplementedError("diffcp.diffusers: ControlNet residuals are not supported")
        if skip_layers is not None:
            raise NotImplementedError("diffcp.diffusers: skip_layers (skip-layer guidance) is not supported")
        self.refuse(joint_attention_kwargs, unused)
        B, C, H, W = hidden_states.shape
        if H % 2 or W % 2:
            raise ValueError(f"hidden_states: a {H} x {W} latent, expected even sides (2x2 patches)")
        gh, gw = H // 2, W // 2
        # [B, C, 2gh, 2gw] -> tokens [B, gh gw, 4C], channels (c, ph, pw) (dit/sampler.hpp pack_latent)
        x = _f32(hidden_states).reshape(B, C, gh, 2, gw, 2).transpose(0, 2, 4, 1, 3, 5).reshape(B, gh * gw, 4 * C)
        v = self.velocity(np.ascontiguousarray(x), gh, gw, list(encoder_hidden_states.detach()),
                          pooled_projections.detach(), self.timestep(timestep) / 1000.0, 0.0)
        out = np.ascontiguousarray(v.reshape(B, gh, gw, C, 2, 2).transpose(0, 3, 1, 4, 2, 5).reshape(B, C, H, W))
        return self.output(out, hidden_states, return_dict)


class _QwenImageForward(_Forward):
    """QwenImageTransformer2DModel.forward: hidden_states [B, N, C_in] packed 2x2, timestep = sigma,
    img_shapes [(1, gh, gw)] per image; the text's padding (encoder_hidden_states_mask's trailing
    zeros) is dropped, which is what the mask does; the pipeline's second call of a step (the
    negative prompt) is another pass."""

    def __call__(self, hidden_states, encoder_hidden_states=None, encoder_hidden_states_mask=None, timestep=None,
                 img_shapes=None, guidance=None, attention_kwargs=None, controlnet_block_samples=None,
                 additional_t_cond=None, return_dict=True, txt_seq_lens=None, **unused):
        if controlnet_block_samples is not None or additional_t_cond is not None:
            raise NotImplementedError("diffcp.diffusers: ControlNet residuals and additional_t_cond are not supported")
        self.refuse(attention_kwargs, unused)
        B, N, _ = hidden_states.shape
        shapes = {tuple(tuple(int(v) for v in s) for s in ([sh] if isinstance(sh[0], int) else sh)) for sh in img_shapes}
        if len(shapes) != 1 or len(next(iter(shapes))) != 1 or next(iter(shapes))[0][0] != 1:
            raise NotImplementedError(f"diffcp.diffusers: img_shapes {img_shapes}: one frame of one image per batch "
                                      "entry, the same for all, is supported (not edit models' reference images)")
        _, gh, gw = next(iter(shapes))[0]
        if gh * gw != N:
            raise ValueError(f"img_shapes: a {gh} x {gw} grid for {N} image tokens")
        txt = []
        for i in range(B):
            rows = encoder_hidden_states[i].detach()
            if encoder_hidden_states_mask is not None:
                m = encoder_hidden_states_mask[i].detach().to("cpu").bool()
                n = int(m.sum())
                if not bool(m[:n].all()):
                    raise NotImplementedError("diffcp.diffusers: a text mask with holes (padding before real tokens)")
                rows = rows[:n]
            txt.append(rows)
        out = self.velocity(_f32(hidden_states), gh, gw, txt, None, self.timestep(timestep), 0.0)
        return self.output(out, hidden_states, return_dict)


class _Flux2Forward(_Forward):
    """Flux2Transformer2DModel.forward: hidden_states [B, N, C_in], timestep = sigma, img_ids
    (0, row, column, 0) and txt_ids (0, 0, 0, i); no reference images or KV cache."""

    def __call__(self, hidden_states, encoder_hidden_states=None, timestep=None, img_ids=None, txt_ids=None,
                 guidance=None, joint_attention_kwargs=None, return_dict=True, kv_cache=None, kv_cache_mode=None,
                 num_ref_tokens=0, ref_fixed_timestep=0.0, **unused):
        import torch
        if kv_cache is not None or kv_cache_mode is not None or num_ref_tokens:
            raise NotImplementedError("diffcp.diffusers: reference-image tokens and the KV cache are not supported")
        self.refuse(joint_attention_kwargs, unused)
        gh, gw = self.grid_of(img_ids, 4, hidden_states.shape[1])
        T = encoder_hidden_states.shape[1]
        t_ids = self.ids2d(txt_ids, 4)
        want = torch.zeros(T, 4, dtype=torch.float64)
        want[:, 3] = torch.arange(T, dtype=torch.float64)
        if not torch.equal(t_ids, want):
            raise NotImplementedError("diffcp.diffusers: txt_ids other than Flux2Pipeline's (0, 0, 0, i)")
        out = self.velocity(_f32(hidden_states), gh, gw, list(encoder_hidden_states.detach()), None,
                            self.timestep(timestep), _guidance(guidance))
        return self.output(out, hidden_states, return_dict)


class _WanForward(_Forward):
    """WanTransformer3DModel.forward: hidden_states the latent video [B, C, F, H/8, W/8] (patches 1 x 2 x 2,
    tokens frame-major; image-to-video: the latent's channels, then the mask's and the encoded image's),
    timestep = 1000 sigma ([B], or the pipelines' expand_timesteps [B, N]: Wan 2.2 TI2V's image-to-video
    gives the first frame's tokens 0, the modulation then per token),
    encoder_hidden_states [B, T, D] (cross-attended: every rank holds it whole), and Wan 2.1 I2V's
    encoder_hidden_states_image [B, I, 1280] (CLIP's; FLF2V: [2B, 257, 1280], the first and last frames',
    paired as the model's position table wants), cross-attended whole on every rank too;
    the pipelines' classifier-free guidance is two calls a step (the prompt's, then the negative
    prompt's)."""

    # diffusers' WanAttnProcessor takes all but the last 512 context tokens as the image's
    TEXT_TOKENS_WITH_IMAGE = 512

    def __call__(self, hidden_states, timestep=None, encoder_hidden_states=None, encoder_hidden_states_image=None,
                 return_dict=True, attention_kwargs=None, **unused):
        self.refuse(attention_kwargs, unused)
        image = None
        if int(self.config["image_dim"]) > 0:
            if encoder_hidden_states_image is None:
                raise ValueError("diffcp.diffusers: this Wan image-to-video transformer needs "
                                 "encoder_hidden_states_image (its CLIP image context)")
            T = int(encoder_hidden_states.shape[1])
            if T != self.TEXT_TOKENS_WITH_IMAGE:
                raise NotImplementedError(
                    f"diffcp.diffusers: a text of {T} tokens beside the image context; diffusers' WanAttnProcessor "
                    f"takes all but the last {self.TEXT_TOKENS_WITH_IMAGE} context tokens as the image's, so only "
                    f"max_sequence_length={self.TEXT_TOKENS_WITH_IMAGE} (the pipeline's default) gives its result")
            image = encoder_hidden_states_image.detach()
            if int(self.config["image_pos_tokens"]) > 0:  # FLF2V: WanImageEmbedding's view(-1, 2 S, D)
                S, D = image.shape[1], image.shape[2]
                image = image.reshape(-1, 2 * S, D)
            if image.dim() != 3 or image.shape[0] != hidden_states.shape[0] or image.shape[2] != int(self.config["image_dim"]):
                raise ValueError(f"encoder_hidden_states_image of shape {tuple(encoder_hidden_states_image.shape)}, "
                                 f"expected [{hidden_states.shape[0]}, I, {self.config['image_dim']}]")
        elif encoder_hidden_states_image is not None:
            raise ValueError("diffcp.diffusers: encoder_hidden_states_image for a Wan transformer without an image "
                             "embedder (image_dim None: text-to-video, or Wan 2.2 I2V A14B)")
        if hidden_states.dim() != 5:
            raise ValueError(f"hidden_states of shape {tuple(hidden_states.shape)}, expected the latent video "
                             "[B, C, F, H/8, W/8]")
        B, C, F, H, W = hidden_states.shape
        if H % 2 or W % 2:
            raise ValueError(f"hidden_states: a {H} x {W} latent, expected even sides (1 x 2 x 2 patches)")
        gh, gw = H // 2, W // 2
        # [B, C, F, 2gh, 2gw] -> tokens [B, F gh gw, 4C], channels (c, ph, pw) (dit/sampler.hpp pack_latent)
        x = _f32(hidden_states).reshape(B, C, F, gh, 2, gw, 2).transpose(0, 2, 3, 5, 1, 4, 6).reshape(B, F * gh * gw,
                                                                                                      4 * C)
        token_t = None
        if timestep is not None and timestep.dim() == 2 and not bool((timestep == timestep.reshape(-1)[0]).all()):
            # Wan 2.2 TI2V's image conditioning (expand_timesteps): one timestep per token, the first frame's 0
            ts = timestep.detach().to("cpu").double()
            if tuple(ts.shape) != (B, F * gh * gw) or not bool((ts == ts[:1]).all()):
                raise NotImplementedError(f"diffcp.diffusers: per-token timesteps of shape {tuple(ts.shape)} that differ "
                                          f"between the videos of the batch (expected [{B}, {F * gh * gw}], the same row)")
            token_t = (ts[0] / 1000.0).tolist()
            t = float(ts.max()) / 1000.0
        else:
            t = self.timestep(timestep) / 1000.0
        v = self.velocity(np.ascontiguousarray(x), gh, gw, list(encoder_hidden_states.detach()), image, t, 0.0,
                          frames=F, token_t=token_t)
        Co = self.out_channels // 4  # image-to-video: fewer channels out than in
        def unpack(tokens):  # [B, F gh gw, 4 Co] -> [B, Co, F, H, W]
            return tokens.reshape(B, F, gh, gw, Co, 2, 2).transpose(0, 4, 1, 2, 5, 3, 6).reshape(B, Co, F, H, W)
        return self.output(v, hidden_states, return_dict, unpack)


_FORWARDS = {"FluxTransformer2DModel": _FluxForward, "SD3Transformer2DModel": _SD3Forward,
             "QwenImageTransformer2DModel": _QwenImageForward, "Flux2Transformer2DModel": _Flux2Forward,
             "WanTransformer3DModel": _WanForward}


class _StepState:
    """The denoising step of each forward (V-Major's schedule reads it): a new timestep, a new step."""

    def __init__(self, cfg_parallel: bool = False, batch_prompts: bool = False):
        self.cfg_parallel, self.batch_prompts = cfg_parallel, batch_prompts
        self.reset(1)

    def reset(self, steps: int, two_calls: bool = False):
        """A pipeline call of `steps` steps; two_calls: classifier-free guidance as two transformer
        calls a step (the prompt's, then the negative prompt's: Qwen-Image, FLUX.1's true CFG)."""
        self.steps, self.step, self.t, self.passes = max(int(steps), 1), -1, None, 0
        self.two_calls, self.pending, self.first = two_calls, None, {}

    def step_of(self, t: float) -> int:
        if t != self.t:
            self.t, self.passes = t, 0
            self.step += 1
        return min(self.step, self.steps - 1)

    def local(self, who, step: int) -> tuple[int, int]:
        """(step, steps) of the transformer `who` counted from its first call of this pipeline call."""
        first = self.first.setdefault(who, step)
        return step - first, self.steps - first

    def next_pass(self) -> int:
        """The index of this model run within the step (0, 1, ...: its V-Major caches)."""
        self.passes += 1
        return self.passes - 1


def _two_calls(pipe, args, kwargs) -> bool:
    """Whether the call runs classifier-free guidance as two transformer calls a step: QwenImagePipeline's
    and FluxPipeline's rule, true_cfg_scale > 1 with a negative prompt (or its embeddings); WanPipeline's,
    guidance_scale > 1 (its negative prompt defaults to "")."""
    import inspect
    sig = inspect.signature(pipe.__call__)
    given = sig.bind_partial(*args, **kwargs).arguments
    if type(getattr(pipe, "transformer", None)).__name__ == "WanTransformer3DModel" and "guidance_scale" in sig.parameters:
        g = given.get("guidance_scale", sig.parameters["guidance_scale"].default)
        return g is not None and float(g) > 1
    if "true_cfg_scale" not in sig.parameters:
        return False
    scale = given.get("true_cfg_scale", sig.parameters["true_cfg_scale"].default)
    negative = given.get("negative_prompt") is not None or given.get("negative_prompt_embeds") is not None
    return scale is not None and float(scale) > 1 and negative


def _steps(pipe, args, kwargs) -> int:
    """The denoising steps a pipeline call will take: len(sigmas / timesteps) when given, else its
    num_inference_steps (passed, or the pipeline's own default)."""
    import inspect
    sig = inspect.signature(pipe.__call__)
    given = sig.bind_partial(*args, **kwargs).arguments
    for key in ("sigmas", "timesteps"):
        if given.get(key) is not None:
            return len(given[key])
    if given.get("num_inference_steps") is not None:
        return int(given["num_inference_steps"])
    p = sig.parameters.get("num_inference_steps")
    if p is None or not isinstance(p.default, int):
        raise ValueError(f"diffcp.diffusers: {type(pipe).__name__}: cannot tell the number of steps; pass num_inference_steps")
    return p.default


class ParallelPipeline:
    """The pipeline, parallelized: call it as the pipeline (every rank, the same arguments); every
    other attribute is the pipeline's. ``output_on="rank0"``: ranks other than 0 skip the VAE
    decode and return the latents (``output_type="latent"``); with ``vae="patch"`` every rank takes
    part in the decode and returns the output. ``cores``: one diffcp session per parallel transformer
    (``core`` is the first: Wan 2.2 A14B's high-noise expert, ``cores[1]`` its low-noise one)."""

    def __init__(self, pipe, cores, state, comm, output_on: str, vae_decoder=None, comms=()):
        self.__dict__.update(pipe=pipe, core=cores[0], cores=cores, _state=state, comm=comm, output_on=output_on,
                             vae_decoder=vae_decoder, _comms=list(comms))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["pipe"], name)

    def __call__(self, *args, **kwargs):
        self._state.reset(_steps(self.pipe, args, kwargs), _two_calls(self.pipe, args, kwargs))
        if self.output_on == "rank0" and self.comm.Get_rank() != 0 and self.vae_decoder is None:
            kwargs["output_type"] = "latent"
        out = self.pipe(*args, **kwargs)
        if self._state.pending is not None:
            raise RuntimeError("diffcp.diffusers: cfg_parallel held back a call whose negative-prompt call never came")
        return out


def parallelize(pipe, comm=None, mode: str = "cocodiff", ulysses_degree: int | None = None,
                ring_degree: int | None = None, dtype: str = "bf16", weights_dtype: str = "auto",
                shard_weights: bool = False, group_size: int = 0, cache_ratio: float = 1.0,
                output_on: str = "rank0", cfg_parallel: bool = False, step_cache: str = "none",
                wire: str = "auto", backend: str = "cpu", batch_prompts: bool = False,
                vae: str = "replicated") -> ParallelPipeline:
    """Runs ``pipe``'s transformer across the ranks of ``comm`` with diffcp.

    Args:
        pipe: a diffusers pipeline whose ``transformer`` is one of :data:`SUPPORTED_TRANSFORMERS`.
        comm: an mpi4py communicator (default ``MPI.COMM_WORLD``); collective over it. Or
            ``"rendezvous"``: ``MPI.COMM_WORLD`` on NCCL's semantics made strict (docs/gpu.md).
        mode: ``flat`` | ``tapa`` | ``vfirst`` | ``cocodiff`` (docs/dit.md).
        ulysses_degree, ring_degree: USP's degrees (default: Ulysses over the largest divisor of P
            that divides the heads, a Ring over the rest).
        dtype: ``bf16`` | ``f32``: GEMMs, attention and the exchanges' payloads.
        weights_dtype: ``bf16`` | ``f32`` | ``auto`` (the transformer's parameter dtype: bf16 stays bf16).
        shard_weights: each rank holds 1/P of every block's weights (gathered per block).
        group_size: TAPA's link group L (0: the ranks of a node).
        cache_ratio: CoCoDiff's V-Major ratio at the last step (linear schedule after 5 warm-up steps).
        output_on: ``rank0`` | ``all``: where the decoded images are made.
        cfg_parallel: classifier-free guidance's two passes at once on two halves of the ranks (an even
            P; each half runs ``mode`` over P/2 ranks and holds the weights, sharded within it with
            ``shard_weights``): SD3.5's [negative; prompt] batch, Qwen-Image's and FLUX.1's (true_cfg_scale)
            two calls a step.
        step_cache: ``none`` | ``fbcache:THRESHOLD``: First-Block Cache per pass (docs/dit.md); the
            decisions are in ``core.step_cache_stats()``.
        wire: ``auto`` | ``fp8``: the exchanges' payload: ``dtype`` itself, or e4m3 with one float32
            scale per (token, head) (half of bf16's bytes; decoded into ``dtype`` before attention).
        backend: the compute backend (:func:`diffcp.backends`; ``"cpu"``).
        batch_prompts: images of different prompts in one call (a list of prompts, a server's
            batch) run as one transformer batch, each with its own text rows and pooled vector
            (prompts of one text length together); off: each prompt is a pass of its own. Equal
            within float32 rounding (the GEMMs see more rows); V-Major's and the step cache's
            decisions then cover the whole batch.
        vae: ``replicated`` (every rank holds the pipeline's VAE; with ``output_on="rank0"`` only rank 0
            decodes) | ``patch``: Wan's video VAE (AutoencoderKLWan) decodes patch-parallel, the latent's
            rows split over the ranks with the convolutions' halos exchanged (:mod:`diffcp.vae`); every
            rank takes part and gets the decoded video.
    """
    _core.check_backend(str(backend))
    comm, comm_kind = _world(comm)
    if output_on not in ("rank0", "all"):
        raise ValueError(f"output_on '{output_on}': expected rank0 or all")
    if vae not in ("replicated", "patch"):
        raise ValueError(f"vae '{vae}': expected replicated or patch")
    transformers = [getattr(pipe, "transformer", None)]
    if getattr(pipe, "transformer_2", None) is not None:  # Wan 2.2 A14B: the low-noise expert
        transformers.append(pipe.transformer_2)
    for t in transformers:  # every refusal before the first collective, and before any weight is freed
        _check_transformer(t)
    vae_decoder = None
    if vae == "patch":  # checked before any collective: every rank fails alike
        from .vae import PatchParallelDecoder
        vae_decoder = PatchParallelDecoder(getattr(pipe, "vae", None), comm)
    runs = [_parallelize_transformer(t, comm, comm_kind, mode, ulysses_degree, ring_degree, dtype, weights_dtype,
                                      shard_weights, group_size, cache_ratio, cfg_parallel, step_cache, wire)
            for t in transformers]
    import torch
    with torch.no_grad():  # the weights live in diffcp now: drop torch's copies (dtype and device stay)
        for t in transformers:
            for p in t.parameters():
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    cores = [core for core, _ in runs]
    state = _StepState(bool(cfg_parallel), bool(batch_prompts))
    for t, core in zip(transformers, cores):
        t.forward = _FORWARDS[type(t).__name__](core, state)  # nn.Module.__call__ calls self.forward
    if vae_decoder is not None:
        # WanPipeline calls self.vae.decode(latents, return_dict=False): from now on every rank must call
        # the pipeline's VAE decode together (it is collective).
        pipe.vae.decode = vae_decoder.decode
    return ParallelPipeline(pipe, cores, state, runs[0][1], output_on, vae_decoder, [dup for _, dup in runs])


def _check_transformer(transformer) -> None:
    """A transformer diffcp can take (its class, no LoRA); local."""
    name = type(transformer).__name__
    if name not in SUPPORTED_TRANSFORMERS:
        raise NotImplementedError(f"diffcp.diffusers: transformer {name} is not supported "
                                  f"(supported: {', '.join(SUPPORTED_TRANSFORMERS)})")
    if getattr(transformer, "peft_config", None) or any("lora" in n for n, _ in transformer.named_parameters()):
        raise NotImplementedError("diffcp.diffusers: a transformer with LoRA weights is not supported (diffcp reads "
                                  "the weights from the transformer's folder): fuse them and save the model first")


def _parallelize_transformer(transformer, comm, comm_kind, mode, ulysses_degree, ring_degree, dtype, weights_dtype,
                             shard_weights, group_size, cache_ratio, cfg_parallel, step_cache, wire):
    """A diffcp session for one of the pipeline's transformers (collective over comm) and the communicator
    it runs on (the caller keeps it alive; and frees torch's weights once every session is made)."""
    import torch
    params = list(transformer.parameters())
    if weights_dtype == "auto":
        weights_dtype = "bf16" if params and params[0].dtype == torch.bfloat16 else "f32"
    try:
        folder, tmp, err = *_weights_folder(transformer), None
    except Exception as e:  # every rank agrees before the collectives below
        folder, tmp, err = None, None, e
    if comm.allreduce(int(err is not None)):
        raise err or RuntimeError("diffcp.diffusers: another rank could not write the transformer's weights")
    dup = comm.Dup()  # diffcp's traffic never matches the caller's
    try:
        # The session checks every option (errors name these keywords) before any collective.
        core = _core.Dit(folder, dup.py2f(), mode, ulysses_degree, ring_degree, group_size, weights_dtype,
                         bool(shard_weights), dtype, float(cache_ratio), bool(cfg_parallel), str(step_cache), wire,
                         comm_kind)
    finally:
        if tmp is not None:
            tmp.cleanup()
    return core, dup
