"""Stand-in for causal-conv1d 1.7 (tests/stand_ins/README.md): only cpp_functions."""

# The version the real package states; this folder has no distribution metadata, so the kernel
# probe reads it here (titan_hybrid.compat.kernel_packages.installed_version).
__version__ = "1.7.0"
