#!/usr/bin/env python3
"""Qwen-Image from a prompt to a PNG: mpirun -np 2 python qwen_image.py --model DIR (options: text_to_image.py).

Not run here: its text encoder is too large to build at random; tools/diffusers_pipeline_check.py
checks its transformer against diffusers' own."""
from text_to_image import main

main("QwenImagePipeline", {"true_cfg_scale": 4.0}, negative=True, side=1328, steps=50, doc=__doc__)
