"""Hugging Face folders in and out: `python -m titan_hybrid.hf import|export` (__main__.py),
the families we read and write (families.py), and the conversions (convert.py). The tensor
names of each format live in its state-dict adapter (titan_hybrid/checkpoint/hf_*.py), which
the trainer also uses for `initial_load_in_hf` / `last_save_in_hf`."""
