"""All of titan_hybrid's Hugging Face code: `python -m titan_hybrid.hf import|export`
(__main__.py, convert.py, safetensors_io.py), one registry of the families (families.py), and
one module per family (nemotron_h.py, deepseek.py, bamba.py, qwen3_5.py, qwen3_next.py,
granite.py, olmo_hybrid.py, kimi_linear.py: its FAMILY, a family.py Family, with the tensor
names of its state-dict adapter, which the trainer also uses for `initial_load_in_hf` /
`last_save_in_hf`). adapter.py and engine.py hold what the adapters share; deepseek_v4.py maps
DeepSeek-V4's attention blocks."""
