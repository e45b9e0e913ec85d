"""Wan 2.1 / 2.2 text-to-video and image-to-video on diffcp: a WanPipeline (or, with --image,
WanImageToVideoPipeline) folder, its transformer(s) sequence-parallel across the `mpirun` ranks and
its VAE decoding patch-parallel; rank 0 writes the video as one PNG per frame (and an MP4 when
diffusers' export_to_video finds imageio / OpenCV).

    mpirun -np 2 python examples/diffusers/wan.py --model Wan-AI/Wan2.1-T2V-1.3B-Diffusers \\
        --height 480 --width 832 --frames 81 --out wan_frames
    mpirun -np 2 python examples/diffusers/wan.py --model Wan-AI/Wan2.1-I2V-14B-480P-Diffusers \\
        --image first.png --height 480 --width 832 --frames 81 --out wan_i2v_frames

Every rank runs the script: the text encoder runs on every rank, diffcp runs the transformer (both
experts of Wan 2.2 A14B) and the decode (docs/python.md, "A diffusers pipeline, sequence-parallel").
"""
import argparse
from pathlib import Path

import numpy as np
import torch
from mpi4py import MPI

import diffcp.diffusers


def main() -> None:
    from diffusers import AutoencoderKLWan, WanImageToVideoPipeline, WanPipeline
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="a WanPipeline / WanImageToVideoPipeline folder (from_pretrained)")
    ap.add_argument("--image", help="image-to-video: the first frame (a picture file)")
    ap.add_argument("--last-image", help="FLF2V: the last frame too")
    ap.add_argument("--prompt", default="a lighthouse on a rocky coast at dusk, waves rolling in")
    ap.add_argument("--negative-prompt", default="")
    ap.add_argument("--height", type=int, default=480)
    ap.add_argument("--width", type=int, default=832)
    ap.add_argument("--frames", type=int, default=81, help="video frames (4 k + 1)")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--guidance", type=float, default=5.0, help="the pipeline's guidance_scale")
    ap.add_argument("--mode", default="cocodiff", choices=["flat", "tapa", "vfirst", "cocodiff"])
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "f32"])
    ap.add_argument("--shard-weights", action="store_true", help="1/P of every block's weights per rank")
    ap.add_argument("--cfg-parallel", action="store_true", help="the two guidance calls at once (an even P)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="wan_frames", help="a folder for the frames")
    a = ap.parse_args()

    torch_dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    vae = AutoencoderKLWan.from_pretrained(a.model, subfolder="vae", torch_dtype=torch.float32)  # as Wan's card
    extra = {}
    if a.image:  # image-to-video: the condition from the picture (and CLIP's image context, where the model has one)
        from PIL import Image
        extra["image"] = Image.open(a.image).convert("RGB")
        if a.last_image:
            extra["last_image"] = Image.open(a.last_image).convert("RGB")
    pipe = (WanImageToVideoPipeline if a.image else WanPipeline).from_pretrained(a.model, vae=vae, torch_dtype=torch_dtype)
    pipe = diffcp.diffusers.parallelize(pipe, mode=a.mode, dtype=a.dtype, shard_weights=a.shard_weights,
                                        cfg_parallel=a.cfg_parallel, vae="patch")
    frames = pipe(prompt=a.prompt, negative_prompt=a.negative_prompt, height=a.height, width=a.width,
                  num_frames=a.frames, num_inference_steps=a.steps, guidance_scale=a.guidance,
                  generator=torch.Generator().manual_seed(a.seed), output_type="np", **extra).frames[0]
    if MPI.COMM_WORLD.Get_rank() != 0:
        return
    from PIL import Image
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for i, f in enumerate(frames):
        Image.fromarray((np.clip(f, 0, 1) * 255).round().astype(np.uint8)).save(out / f"frame_{i:04d}.png")
    note = ""
    try:
        from diffusers.utils import export_to_video
        export_to_video(list(frames), str(out / "video.mp4"), fps=16)
        note = f", {out / 'video.mp4'}"
    except Exception as e:  # imageio / OpenCV missing: the PNGs are the output
        note = f" (no MP4: {type(e).__name__})"
    s = pipe.vae_decoder.stats
    print(f"{out}: {len(frames)} frames of {a.width}x{a.height}{note}; P = {MPI.COMM_WORLD.Get_size()} ({a.mode}); "
          f"the decode sent {sum(s.values()) / 1e6:.1f} MB from rank 0")


if __name__ == "__main__":
    main()
