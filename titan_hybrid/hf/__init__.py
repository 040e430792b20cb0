"""All of titan_hybrid's Hugging Face code: `python -m titan_hybrid.hf import|export`
(__main__.py, convert.py, safetensors_io.py), one registry of the families (families.py), and
one module per family (nemotron_h.py, deepseek.py, deepseek_v4.py, bamba.py, qwen3_5.py,
qwen3_next.py, granite.py, olmo_hybrid.py, kimi_linear.py: its FAMILY, a family.py Family,
with the key map that names its tensors). engine.py holds the one state-dict adapter
(KeyMapAdapter), which reads a family's key map, for the conversions and for the trainer's
`initial_load_in_hf` / `last_save_in_hf`; key_map_parts.py and vocabulary.py hold the key-map
entries and names that families share."""
