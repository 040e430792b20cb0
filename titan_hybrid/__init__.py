"""titan_hybrid: hybrid Mamba2 / attention / MoE / gated-DeltaNet models on torchtitan.

Importing the package or any library module changes nothing global. The entry points do:
`titan_hybrid.train` / `titan_hybrid.launch` (titan_hybrid's trainer), and
`titan_hybrid.torchtitan_plugin`, which torchtitan 0.2's own trainer imports through
`--experimental.custom_import` (registers the TrainSpec "hybrid" and the pydoc dataset, and on
machines without an accelerator applies the CPU runtime, titan_hybrid.runtime.cpu).

The package's map, module by module in the order a job reaches a stepping trainer, is
docs/architecture.md, "How the code is organised".
"""
