#!/usr/bin/env python3
"""A prompt to a PNG with a diffusers QwenImagePipeline (Qwen-Image), its transformer on diffcp across ranks.

  mpirun -np 2 python examples/diffusers/qwen_image.py --model PIPELINE_DIR --out image.png [--shard-weights]

Not run here: the pipeline's text encoder (Qwen2.5-VL / Mistral) is too large to build at random,
so tools/diffusers_pipeline_check.py checks its transformer one level down (bench/RESULTS.md).

PIPELINE_DIR: a QwenImagePipeline folder (a download of the published model, or a tiny random one). Options:
text_to_image.py.
"""
from text_to_image import main

main("QwenImagePipeline", {"true_cfg_scale": 4.0}, negative=True, side=1328, steps=50, doc=__doc__)
