"""Stand-ins for diffusers' DiT pipelines where diffusers is not installed (CI has Debian's torch,
not PyPI's diffusers): a transformer under each family's class name (the config with the folder it
came from, and parameters: what diffcp.diffusers.parallelize reads) and a pipeline per family that
calls it as diffusers' does:
  FluxPipeline                packed latents, img_ids / txt_ids (3 axes), timestep = sigma, the distilled guidance
  Flux2Pipeline               the same with 4-axis ids (0, row, col, 0) and (0, 0, 0, i), no pooled vector
  StableDiffusion3Pipeline    the latent image [B, C, H/8, W/8], timestep = 1000 sigma, classifier-free guidance
                              as one [negative; prompt] batch (guidance_scale > 1, negative prompt "" by default)
  WanPipeline                 the latent video [B, C, F, H/8, W/8], two CFG calls a step, A14B's two experts;
  WanImageToVideoPipeline     the same with the condition's channels after the latent's, and (Wan 2.1 I2V)
                              the image context beside 512 text tokens
  QwenImagePipeline           true CFG as two calls a step (true_cfg_scale > 1 with a negative prompt), text
                              padded to the batch's longest with encoder_hidden_states_mask, img_shapes
A list of prompts and one generator per image; callback_on_step_end and the interrupt flag;
output_type "np" or "latent". The text encoder is a seeded hash of the prompt (Qwen-Image: 4-8
tokens by prompt) and the "VAE" a fixed map of the latent to RGB: enough to serve and compare
images, not a real model. The prompt "__fail_on_rank_1__" raises on rank 1 and
"__stall_on_rank_1__" stalls it (the server test's failed ranks).

    make(args): the pipeline of the folder args.pipeline (tools/<family>_reference.py make, FLUX.1's
    with --format diffusers), its family from the transformer's _class_name; what
    `python -m diffcp.serve --pipeline-factory standin_pipeline:make` calls.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch


class FluxTransformer2DModel(torch.nn.Module):
    """Stands in for diffusers' class: its name, config (with the folder it came from) and parameters."""

    def __init__(self, path: Path):
        super().__init__()
        c = json.loads((Path(path) / "transformer" / "config.json").read_text())
        self.config = SimpleNamespace(_name_or_path=str(Path(path) / "transformer"), **c)
        self.w = torch.nn.Parameter(torch.ones(16, dtype=torch.bfloat16))


class SD3Transformer2DModel(FluxTransformer2DModel):
    """The same stand-in under SD3's class name."""


class QwenImageTransformer2DModel(FluxTransformer2DModel):
    """The stand-in under Qwen-Image's class name."""


class Flux2Transformer2DModel(FluxTransformer2DModel):
    """The stand-in under FLUX.2's class name."""


class WanTransformer3DModel(FluxTransformer2DModel):
    """The stand-in under Wan's class name."""


class WanPipeline:
    """WanPipeline's call, reduced: the latent video [B, C, F, H/8, W/8], Euler over sigmas 1 .. 1/K (then
    0), timestep = 1000 sigma, classifier-free guidance as two transformer calls a step (the prompt's,
    then the negative prompt's: guidance_scale > 1), Wan 2.2 A14B's two experts switched at
    boundary_ratio (transformer above 1000 boundary_ratio, transformer_2 below). The text is the
    prompt's seeded rows (FluxPipeline.encode); output_type "latent": frames = the latent."""

    def __init__(self, transformer, transformer_2=None, boundary_ratio=None, text_tokens: int = 6):
        self.transformer, self.transformer_2, self.boundary_ratio = transformer, transformer_2, boundary_ratio
        self.text_dim, self.channels = transformer.config.text_dim, transformer.config.in_channels
        self.text_tokens = text_tokens

    def encode(self, prompt: str):
        seed = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "little")
        return torch.randn(self.text_tokens, self.text_dim, generator=torch.Generator("cpu").manual_seed(seed))

    def __call__(self, prompt, negative_prompt=None, height: int = 48, width: int = 64, num_frames: int = 9,
                 num_inference_steps: int = 4, guidance_scale: float = 5.0, generator=None, output_type: str = "latent"):
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        B, F = len(prompts), (num_frames - 1) // 4 + 1
        x = torch.randn((B, self.channels, F, height // 8, width // 8), generator=generator)
        pos = torch.stack([self.encode(p) for p in prompts])
        neg = torch.stack([self.encode(negative_prompt or "")] * B)
        sigmas = [1 - k / num_inference_steps for k in range(num_inference_steps)] + [0.0]
        for i in range(num_inference_steps):
            t = torch.full((B,), 1000.0 * sigmas[i])
            model = self.transformer
            if self.boundary_ratio is not None and 1000.0 * sigmas[i] < 1000.0 * self.boundary_ratio:
                model = self.transformer_2
            v = model(hidden_states=x, timestep=t, encoder_hidden_states=pos, attention_kwargs=None, return_dict=False)[0]
            if guidance_scale > 1:
                u = model(hidden_states=x, timestep=t, encoder_hidden_states=neg, attention_kwargs=None,
                          return_dict=False)[0]
                v = u + guidance_scale * (v - u)
            x = x + (sigmas[i + 1] - sigmas[i]) * v
        return SimpleNamespace(frames=x)


class WanImageToVideoPipeline(WanPipeline):
    """WanImageToVideoPipeline's call, reduced as WanPipeline's: each call's hidden_states are the latent,
    then the condition (in_channels - out_channels channels: the frame mask's and the encoded image's,
    here seeded draws from the generator); with an image embedder (image_dim: Wan 2.1 I2V) the image
    context [B, I, image_dim] (the pipeline's CLIP features, here drawn) and 512 text tokens, the
    length diffusers' attention assumes beside an image; Wan 2.2 I2V A14B: no image context."""

    def __init__(self, transformer, transformer_2=None, boundary_ratio=None, image_tokens: int = 6):
        c = transformer.config
        self.image_dim = getattr(c, "image_dim", None)
        super().__init__(transformer, transformer_2, boundary_ratio, text_tokens=512 if self.image_dim else 6)
        self.channels, self.condition = c.out_channels, c.in_channels - c.out_channels
        self.image_tokens = image_tokens

    def __call__(self, prompt, negative_prompt=None, height: int = 48, width: int = 64, num_frames: int = 9,
                 num_inference_steps: int = 4, guidance_scale: float = 5.0, generator=None, output_type: str = "latent"):
        outer = self

        class Conditioned:  # each transformer call gets the condition and the image context
            def __init__(self, model):
                self.model = model

            def __call__(self, hidden_states, **a):
                x = torch.cat([hidden_states, outer.cond.expand(hidden_states.shape[0], -1, -1, -1, -1)], 1)
                if outer.image is not None:
                    a["encoder_hidden_states_image"] = outer.image.expand(hidden_states.shape[0], -1, -1)
                return self.model(hidden_states=x, **a)

        # the condition and the image context come from the generator before the noise (a fixed order)
        F, h, w = (num_frames - 1) // 4 + 1, height // 8, width // 8
        self.cond = torch.randn((1, self.condition, F, h, w), generator=generator)
        self.image = torch.randn((1, self.image_tokens, self.image_dim), generator=generator) if self.image_dim else None
        t1, t2 = self.transformer, self.transformer_2
        self.transformer, self.transformer_2 = Conditioned(t1), Conditioned(t2) if t2 is not None else None
        try:
            return super().__call__(prompt, negative_prompt, height, width, num_frames, num_inference_steps,
                                    guidance_scale, generator, output_type)
        finally:
            self.transformer, self.transformer_2 = t1, t2


class FluxPipeline:
    """FluxPipeline's call, reduced: Euler over sigmas 1 .. 1/T (then 0), FLUX's 2 x 2 packing;
    DIFFCP_STANDIN_TEXT_TOKENS text tokens per prompt (default 8)."""

    transformer_class = FluxTransformer2DModel
    text_tokens = int(os.environ.get("DIFFCP_STANDIN_TEXT_TOKENS", "8"))

    def __init__(self, folder: Path):
        self.transformer = self.transformer_class(folder)
        c = self.transformer.config
        self.text_dim, self.channels = c.joint_attention_dim, c.in_channels
        self.pooled_dim = getattr(c, "pooled_projection_dim", 0)
        self._interrupt = False

    @property
    def interrupt(self) -> bool:
        return self._interrupt

    def tokens(self, prompt: str) -> int:
        return self.text_tokens

    def encode(self, prompt: str):
        """(txt [T, D], pooled [P]) seeded by the prompt."""
        seed = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "little")
        g = torch.Generator("cpu").manual_seed(seed)
        return torch.randn(self.tokens(prompt), self.text_dim, generator=g), torch.randn(max(self.pooled_dim, 1), generator=g)

    def noise(self, gens, gh: int, gw: int):
        """The initial latent, one draw per generator: packed tokens [B, N, C_in]."""
        return torch.cat([torch.randn((1, gh * gw, self.channels), generator=g) for g in gens])

    def tokens_of(self, x, gh: int, gw: int):
        return x  # the latent as packed tokens [B, N, C_in] (the decode's input)

    def velocity(self, x, prompts, negatives, sigma: float, guidance: float, gh: int, gw: int, cfg: float):
        enc = [self.encode(p) for p in prompts]
        B = len(prompts)
        ids = torch.zeros(gh, gw, 3)
        ids[..., 1] = torch.arange(gh)[:, None]
        ids[..., 2] = torch.arange(gw)[None, :]
        return self.transformer(hidden_states=x, encoder_hidden_states=torch.stack([e[0] for e in enc]),
                                pooled_projections=torch.stack([e[1] for e in enc]), timestep=torch.full((B,), sigma),
                                img_ids=ids.reshape(-1, 3), txt_ids=torch.zeros(self.text_tokens, 3),
                                guidance=torch.full((B,), float(guidance)), joint_attention_kwargs=None,
                                return_dict=False)[0]

    def __call__(self, prompt, negative_prompt=None, height: int = 64, width: int = 64, num_inference_steps: int = 4,
                 guidance_scale: float = 3.5, generator=None, output_type: str = "np", callback_on_step_end=None,
                 callback_on_step_end_tensor_inputs=None, true_cfg_scale: float = 1.0):
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        B = len(prompts)
        if "__fail_on_rank_1__" in prompts or "__stall_on_rank_1__" in prompts:  # the server test's failed rank
            from mpi4py import MPI
            if MPI.COMM_WORLD.Get_rank() == 1:
                if "__stall_on_rank_1__" in prompts:
                    while True:
                        time.sleep(1)
                raise RuntimeError("the stand-in pipeline was asked to fail on rank 1")
        gens = generator if isinstance(generator, list) else [generator] * B
        if len(gens) != B:
            raise ValueError(f"{len(gens)} generators for {B} images")
        negatives = [negative_prompt or ""] * B
        self.has_negative = negative_prompt is not None
        gh, gw = height // 16, width // 16
        x = self.noise(gens, gh, gw)
        sigmas = [1 - k / num_inference_steps for k in range(num_inference_steps)] + [0.0]
        self._interrupt = False
        for i in range(num_inference_steps):
            if self.interrupt:
                continue
            v = self.velocity(x, prompts, negatives, sigmas[i], guidance_scale, gh, gw, true_cfg_scale)
            x = x + (sigmas[i + 1] - sigmas[i]) * v
            if callback_on_step_end is not None:
                callback_on_step_end(self, i, sigmas[i], {})
        if output_type == "latent":
            return SimpleNamespace(images=x)
        # "decode": the first three latent channels of each 2 x 2 patch position, 8 x 8 pixels each
        t = self.tokens_of(x, gh, gw)
        lat = t.numpy().reshape(B, gh, gw, self.channels // 4, 2, 2).transpose(0, 3, 1, 4, 2, 5)
        lat = lat.reshape(B, self.channels // 4, 2 * gh, 2 * gw)[:, :3]
        img = 0.5 + 0.5 * np.tanh(lat.transpose(0, 2, 3, 1))
        return SimpleNamespace(images=np.repeat(np.repeat(img, 8, axis=1), 8, axis=2).astype(np.float32))


class Flux2Pipeline(FluxPipeline):
    transformer_class = Flux2Transformer2DModel

    def velocity(self, x, prompts, negatives, sigma, guidance, gh, gw, cfg):
        B, T = len(prompts), self.text_tokens
        img_ids = torch.cartesian_prod(torch.arange(1), torch.arange(gh), torch.arange(gw), torch.arange(1))
        txt_ids = torch.cartesian_prod(torch.arange(1), torch.arange(1), torch.arange(1), torch.arange(T))
        return self.transformer(hidden_states=x, encoder_hidden_states=torch.stack([self.encode(p)[0] for p in prompts]),
                                timestep=torch.full((B,), sigma), img_ids=img_ids[None].repeat(B, 1, 1),
                                txt_ids=txt_ids[None].repeat(B, 1, 1), guidance=torch.full((B,), float(guidance)),
                                joint_attention_kwargs=None, return_dict=False)[0]


class StableDiffusion3Pipeline(FluxPipeline):
    transformer_class = SD3Transformer2DModel

    def __init__(self, folder: Path):
        super().__init__(folder)
        self.channels = 4 * self.transformer.config.in_channels  # packed for the decode

    def noise(self, gens, gh, gw):
        c = self.channels // 4
        return torch.cat([torch.randn((1, c, 2 * gh, 2 * gw), generator=g) for g in gens])

    def tokens_of(self, x, gh, gw):
        B, C = x.shape[0], x.shape[1]
        return x.reshape(B, C, gh, 2, gw, 2).permute(0, 2, 4, 1, 3, 5).reshape(B, gh * gw, 4 * C)

    def velocity(self, x, prompts, negatives, sigma, guidance, gh, gw, cfg):
        cfg_on = guidance > 1
        texts = (negatives + prompts) if cfg_on else prompts
        enc = [self.encode(p) for p in texts]
        xs = torch.cat([x, x]) if cfg_on else x
        v = self.transformer(hidden_states=xs, encoder_hidden_states=torch.stack([e[0] for e in enc]),
                             pooled_projections=torch.stack([e[1] for e in enc]),
                             timestep=torch.full((xs.shape[0],), 1000.0 * sigma), joint_attention_kwargs=None,
                             return_dict=False)[0]
        if not cfg_on:
            return v
        v_neg, v_pos = v.chunk(2)
        return v_neg + guidance * (v_pos - v_neg)


class QwenImagePipeline(FluxPipeline):
    transformer_class = QwenImageTransformer2DModel

    def tokens(self, prompt):
        return 4 + len(prompt) % 5

    def call(self, x, texts, sigma, gh, gw):
        enc = [self.encode(p)[0] for p in texts]
        T = max(e.shape[0] for e in enc)
        txt = torch.zeros(len(texts), T, self.text_dim)
        mask = torch.zeros(len(texts), T, dtype=torch.int64)
        for i, e in enumerate(enc):
            txt[i, :e.shape[0]] = e
            mask[i, :e.shape[0]] = 1
        return self.transformer(hidden_states=x, encoder_hidden_states=txt, encoder_hidden_states_mask=mask,
                                timestep=torch.full((len(texts),), sigma), img_shapes=[[(1, gh, gw)]] * len(texts),
                                guidance=None, attention_kwargs=None, return_dict=False)[0]

    def velocity(self, x, prompts, negatives, sigma, guidance, gh, gw, cfg):
        v = self.call(x, prompts, sigma, gh, gw)
        if cfg <= 1 or not self.has_negative:  # QwenImagePipeline: true CFG needs a negative prompt
            return v
        v_neg = self.call(x, negatives, sigma, gh, gw)
        comb = v_neg + cfg * (v - v_neg)  # QwenImagePipeline keeps the conditional norm
        return comb * (v.norm(dim=-1, keepdim=True) / comb.norm(dim=-1, keepdim=True))


PIPELINES = {c.transformer_class.__name__: c for c in (FluxPipeline, Flux2Pipeline, StableDiffusion3Pipeline,
                                                     QwenImagePipeline)}


def make(args):
    folder = Path(args.pipeline)
    name = json.loads((folder / "transformer" / "config.json").read_text())["_class_name"]
    return PIPELINES[name](folder)
