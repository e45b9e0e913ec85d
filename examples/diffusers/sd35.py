#!/usr/bin/env python3
"""Stable Diffusion 3.5 (large) from a prompt to a PNG: mpirun -np 2 python sd35.py --model DIR (options: text_to_image.py)."""
from text_to_image import main

main("StableDiffusion3Pipeline", {"guidance_scale": 7.0}, negative=True, side=1024, steps=28, doc=__doc__)
