"""The bottom layer: titan_hybrid's option sections (sections.py), importing nothing of ours."""
